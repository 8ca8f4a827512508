#!/usr/bin/env bash
# The GPU check, as one command for the GPU machine of ../shared/notes/gpu-machine.md (one H200, no package
# registry, no sglang, a few minutes, no second try). There, from the device tool, with carry [".whl"]
# (bench/fetch_gpu_wheels.sh fills .whl/ here first):
#     OUT=$OUT bash bench/gpu_check.sh
# Here (any CPU machine), to walk every stage without a GPU:
#     bench/gpu_check.sh --dry-run          # OUT defaults to a new temp dir
#
# Stages, in order of value, each under `timeout -k` and each leaving its verdict JSON
# (bench/gpu_check_common.py: pass / fail / skipped with the reason) before the next starts:
#   env            python, torch, CUDA, the carried wheels, eagleflow.config importable
#   gpu            NVML and nvidia-smi side by side (memory, utilisation, processes, ECC, the idle baseline the
#                  driver reports); the idle gate refuses a child holding GPU memory by its PID, and passes
#                  within one poll once it exits (bench/gpu_check_stages.py)
#   train          draft training at Llama-3-8B draft dims: tokens/s, step time, peak memory, loss falling
#                  (bench/gpu_check_train.py)
#   train_fp8      the same at 2048 tokens from an fp8 store (capture.store_dtype fp8_e4m3): the loader's batch
#                  de-quantised on the GPU, checked against the CPU's, and training steps on it
#   train_util     the training step's FLOP/s as a fraction of the device's dense bf16 peak (goal >= 40 %) and of
#                  its own matmul at the draft's shapes, and the data-wait fraction, before (plain step and
#                  loader) and after (fast step, prefetching loader), at Llama-3-8B draft dims on the loader's
#                  stored samples (bench/gpu_check_utilisation.py; issue 49)
#   hf_capture     the hf capture server on the GPU (bf16) and one shard of a tiny local target, verified
#                  against the manifest, compared row by row with a CPU float32 forward
#   specdec        speculative decoding with the evaluation phase's decoder (eagleflow.evaluate) on the GPU: a
#                  draft trained on hf_capture's states, acceptance length on the GPU vs the CPU (float32 target,
#                  same draft and prompts, within 5 %), outputs equal to greedy; skipped while the phase is not built
#   sglang_capture, sglang_eagle3   only where sglang imports (bench/gpu_check_capture.py, gpu_check_eagle3.py
#                  --engine sglang, in SGLANG_PYTHON, default PYTHON's): the live capture server, a shard extracted,
#                  verified and compared with a transformers forward; a draft trained on it served as EAGLE-3 by the
#                  run report's serve command, greedy output equal to the target alone's, drafts accepted
#   vllm_capture, vllm_eagle3       the same through vLLM (--engine vllm, in VLLM_PYTHON, default .venv-node-vllm,
#                  else PYTHON's): capture.backend vllm (`vllm serve` with extract_hidden_states and our connector);
#                  vllm_eagle3 serves the draft the sglang stage exported when there is one (one draft proven on
#                  both engines), else one trained on vllm_capture's states, with the run report's `vllm serve
#                  --speculative-config` command, acceptance from vLLM's own spec-decode counters
#                  Each engine's pair is decided by find_spec (no import): where the engine does not import, or in a
#                  dry run / without a CUDA GPU, both are recorded skipped with the reason in well under a second
# Without a GPU (--dry-run, or torch sees none) the GPU stages rehearse their code path on the CPU at toy size
# and are recorded as skipped; a rehearsal that breaks is a failure.
#
# After every stage the results are packed into $OUT: summary.json (every verdict), results.tar.gz (verdicts,
# logs, side-by-side tables) and log (everything printed): 3 files, nothing in folders. The work folder
# (models, runs, checkpoints) is outside $OUT: GPU_CHECK_WORK, default a new /tmp/eagleflow-gpu-check.XXXXXX,
# removed at the end unless GPU_CHECK_KEEP=1.
# GPU_CHECK_DEADLINE_S (default 330; 990 in a dry run, whose stage limits are 3x) bounds the whole check; a stage
# gets min(its limit, what is left).
# On a node with sglang or vLLM give it more (each engine's two stages alone may take 10 minutes):
# GPU_CHECK_DEADLINE_S=1200 for one engine, 2000 for both.
# PYTHON picks the interpreter (default .venv-node, then .venv, then python3); SGLANG_PYTHON and VLLM_PYTHON the
# engines' (each engine pins its own torch, so each lives in its own venv).
# Exit code: 0 when no stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench/gpu_check.sh: unknown argument '$arg' (only --dry-run)" >&2; exit 2 ;;
  esac
done
T0=$SECONDS
# the limits are sized for the GPU machine; a dry run on a slow shared CPU gets 3x the time (same mechanism)
if [ "$DRY" = 1 ]; then SCALE=${GPU_CHECK_LIMIT_SCALE:-3}; else SCALE=${GPU_CHECK_LIMIT_SCALE:-1}; fi
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-$((330 * SCALE))}
STAGES=(env gpu train train_fp8 train_util hf_capture hf_generate specdec sglang_capture sglang_eagle3 vllm_capture vllm_eagle3)

if [ -z "${OUT:-}" ]; then OUT=$(mktemp -d "${TMPDIR:-/tmp}/eagleflow-gpu-check-out.XXXXXX"); fi
mkdir -p "$OUT" || { echo "bench/gpu_check.sh: cannot create OUT=$OUT" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
created_work=0
if [ -n "${GPU_CHECK_WORK:-}" ]; then WORK=$GPU_CHECK_WORK; mkdir -p "$WORK"
else WORK=$(mktemp -d "${TMPDIR:-/tmp}/eagleflow-gpu-check.XXXXXX"); created_work=1; fi
WORK=$(cd "$WORK" && pwd)
case "$WORK/" in "$OUT/"*)
  echo "bench/gpu_check.sh: GPU_CHECK_WORK=$WORK is inside OUT=$OUT; only the packed results may go there" >&2
  exit 2 ;;
esac
RESULTS=$WORK/results
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
# everything printed also goes to $OUT/log, so it comes back even when the command is killed
exec > >(tee -a "$OUT/log") 2>&1
TEE_PID=$!

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv-node/bin/python ]; then PY=.venv-node/bin/python
  elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
SGLANG_PY=${SGLANG_PYTHON:-$PY}
VLLM_PY=${VLLM_PYTHON:-}
if [ -z "$VLLM_PY" ]; then
  if [ -x .venv-node-vllm/bin/python ]; then VLLM_PY=.venv-node-vllm/bin/python; else VLLM_PY=$PY; fi
fi
# the verdict writer needs only the standard library
VPY=$(command -v python3 || echo "$PY")
export GPU_CHECK_RESULTS=$RESULTS GPU_CHECK_DRY_RUN=$DRY GPU_CHECK_DEADLINE_S=$DEADLINE_S PYTHONUNBUFFERED=1
echo "# bench/gpu_check.sh $(date -u +%FT%TZ) on $(hostname): dry run $DRY, python $PY, OUT $OUT, work $WORK," \
     "deadline ${DEADLINE_S} s"

verdict() {  # STAGE STATUS REASON [KEY=JSON ...]
  "$VPY" bench/gpu_check_common.py "$@" || echo "bench/gpu_check.sh: could not write the verdict of $1"
}

pack() {  # summary.json and results.tar.gz into $OUT, each replaced by a rename
  export GPU_CHECK_ELAPSED_S=$((SECONDS - T0))
  local f
  for f in "$RESULTS"/*.log; do   # 16 MiB a file comes back: keep each log's tail
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 2097152 ] && { tail -c 2097152 "$f" > "$f.tail" && mv "$f.tail" "$f"; }
  done
  "$VPY" bench/gpu_check_common.py --summary "$RESULTS" "$OUT/summary.json" "${STAGES[@]}"
  tar -czf "$OUT/.results.tar.gz.part" -C "$WORK" results && mv -f "$OUT/.results.tar.gz.part" "$OUT/results.tar.gz"
}

status_of() { "$VPY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get(sys.argv[2], ""))' "$RESULTS/$1.json" "${2:-status}" 2>/dev/null; }

run_stage() {  # STAGE LIMIT_S COMMAND...: the verdict exists when this returns, whatever the command did
  local name=$1 limit=$(($2 * SCALE)); shift 2
  local left=$((DEADLINE_S - (SECONDS - T0) - 5))
  if [ "$left" -lt 15 ]; then
    verdict "$name" skipped "out of time: ${left} s left of the check's ${DEADLINE_S} s (GPU_CHECK_DEADLINE_S)"
    pack; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== stage $name (limit ${limit} s; $((SECONDS - T0)) s into the check)"
  local s0=$SECONDS rc
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then   # killed by its limit: whatever it wrote before is not the end
    verdict "$name" fail "killed by its time limit of ${limit} s" exit_code="$rc" seconds=$((SECONDS - s0))
  elif [ ! -f "$RESULTS/$name.json" ]; then
    verdict "$name" fail "exited $rc without writing a verdict (see $name.log)" exit_code="$rc" seconds=$((SECONDS - s0))
  fi
  echo "== $name: $(status_of "$name") in $((SECONDS - s0)) s"
  pack
}

stop_capture_server() {  # DIR [PYTHON]: by its process record: a stage killed by its limit leaves the detached
  local dir=$1 py=${2:-$PY}  # capture server (hf, sglang or vLLM) behind, holding GPU memory
  if [ -f "$dir/config.yaml" ] && [ -d "$dir/state" ]; then
    timeout -k 5 30 "$py" -m eagleflow.cli capture stop --config "$dir/config.yaml" \
      --run-id gpucheck --grace 5 >/dev/null 2>&1 || true
  fi
}

finish() {
  stop_capture_server "$WORK/hf_capture"
  stop_capture_server "$WORK/sglang" "$SGLANG_PY"
  stop_capture_server "$WORK/vllm" "$VLLM_PY"
  [ "$created_work" = 1 ] && [ "${GPU_CHECK_KEEP:-0}" != 1 ] && rm -rf "$WORK"
}
trap finish EXIT

# --- the wheels the image lacks (pydantic and its dependencies), carried in .whl/ -------------------
SITE=$WORK/site
export PYTHONPATH="$REPO/include${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import pydantic" 2>/dev/null; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    echo "pydantic is not installed: installing the carried wheels into $SITE"
    { "$PY" -m pip install --no-index --no-deps --target "$SITE" .whl/*.whl ||
      # no pip: a wheel is a zip of the files to put on the path
      "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" .whl/*.whl
    } > "$RESULTS/wheels.txt" 2>&1 || echo "installing the wheels failed: see wheels.txt"
    export PYTHONPATH="$REPO/include:$SITE${PYTHONPATH#"$REPO/include"}"
  else
    echo "pydantic is not installed and .whl/ holds no wheels: run bench/fetch_gpu_wheels.sh where PyPI is" \
         "reachable and carry .whl; the env stage will say what fails"
  fi
fi
pack

run_stage env 45 "$PY" bench/gpu_check_stages.py env --work "$WORK"
run_stage gpu 75 "$PY" bench/gpu_check_stages.py gpu --work "$WORK"
if [ "$DRY" = 0 ] && [ "$(status_of env cuda_available)" = True ]; then
  run_stage train 120 "$PY" bench/gpu_check_train.py --device cuda --dims llama3-8b --seq 2048 --steps 10 \
    --long-seq 8192 --data-samples 4
  run_stage train_fp8 60 "$PY" bench/gpu_check_train.py --device cuda --dims llama3-8b --seq 2048 --steps 3 \
    --long-seq 0 --data-samples 2 --store-dtype fp8_e4m3 --stage train_fp8
  run_stage train_util 120 "$PY" bench/gpu_check_utilisation.py --device cuda --dims llama3-8b --seq 2048 \
    --samples 4 --steps 6 --rounds 2
else   # the same code on the CPU at toy dims
  run_stage train 120 "$PY" bench/gpu_check_train.py --device cpu --dims tiny --seq 64 --steps 2 --long-seq 0 \
    --data-samples 1
  run_stage train_fp8 60 "$PY" bench/gpu_check_train.py --device cpu --dims tiny --seq 64 --steps 2 --long-seq 0 \
    --data-samples 1 --store-dtype fp8_e4m3 --stage train_fp8
  run_stage train_util 120 "$PY" bench/gpu_check_utilisation.py --device cpu --dims tiny --seq 64 --samples 2 \
    --steps 2 --warmup 1 --rounds 1 --probe-s 0.05
fi
run_stage hf_capture 120 "$PY" bench/gpu_check_stages.py hf_capture --work "$WORK" --samples 16
stop_capture_server "$WORK/hf_capture"
# the generation phase's serving mode (in-process server): same seed same ids, greedy vs teacher-forced, tokens/s
run_stage hf_generate 60 "$PY" bench/gpu_check_generate.py --work "$WORK" --prompts 16 --max-new-tokens 64

if [ -e include/eagleflow/evaluate/decoder.py ]; then
  run_stage specdec 120 "$PY" bench/gpu_check_stages.py specdec --work "$WORK" --train-steps 300 --prompts 8
else   # no interpreter start just to learn that
  verdict specdec skipped "evaluation phase not built"
  pack
fi

# microseconds, in the shell itself (no interpreter start inside what is timed); EPOCHREALTIME is bash 5's
now_us() { if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME//[!0-9]/}"; else date +%s%6N; fi; }
since() { local us=$(($(now_us) - $1)); printf '%d.%03d' $((us / 1000000)) $((us % 1000000 / 1000)); }

engine_stages() {  # ENGINE PYTHON ENV_VAR: <engine>_capture, then <engine>_eagle3, in that engine's interpreter
  local eng=$1 py=$2 var=$3 t0 why="" src other
  t0=$(now_us)
  # find_spec reads the path only: no engine (or torch) import just to learn it is absent
  if ! timeout 10 "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)' \
      "$eng" 2>/dev/null; then
    why="$eng not importable on this machine by $py (set $var to the python of the venv that has it)"
  elif [ "$DRY" = 1 ] || [ "$(status_of env cuda_available)" != True ]; then
    why="$eng is installed, but its stages need a CUDA GPU (dry run or none seen)"
  fi
  if [ -n "$why" ]; then   # seconds: how long deciding took (the check promises well under one)
    local took; took=$(since "$t0")
    verdict "${eng}_capture" skipped "$why" seconds="$took"
    verdict "${eng}_eagle3" skipped "$why" seconds="$took"
    echo "== ${eng}_capture, ${eng}_eagle3: skipped, decided in $took s, both verdicts written in $(since "$t0") s"
    pack; return
  fi
  run_stage "${eng}_capture" 300 "$py" bench/gpu_check_capture.py --engine "$eng" --keep "$WORK/$eng" --samples 64
  stop_capture_server "$WORK/$eng" "$py"
  src=""
  # the draft an earlier engine's eagle3 stage exported in this run (its verdict names it): one draft proven on
  # both engines
  for other in "${ENGINES_RUN[@]}"; do
    if [ -n "$(status_of "${other}_eagle3" draft)" ] && [ -f "$WORK/$other/eagle3_export.json" ]; then
      src=$WORK/$other; break
    fi
  done
  [ -z "$src" ] && [ "$(status_of "${eng}_capture")" = pass ] && src=$WORK/$eng
  ENGINES_RUN+=("$eng")
  if [ -n "$src" ]; then
    run_stage "${eng}_eagle3" 420 "$py" bench/gpu_check_eagle3.py --engine "$eng" --from "$src"
  else   # a failed capture is never re-run: it would fail the same way, on the same clock
    verdict "${eng}_eagle3" skipped \
      "the $eng capture stage did not pass and no other engine's stage exported a draft; not re-run"
    pack
  fi
}

ENGINES_RUN=()

engine_stages sglang "$SGLANG_PY" SGLANG_PYTHON
engine_stages vllm "$VLLM_PY" VLLM_PYTHON

overall=$("$VPY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["status"])' "$OUT/summary.json")
echo "== gpu_check: $overall in $((SECONDS - T0)) s; $OUT holds: $(cd "$OUT" && ls | tr '\n' ' ')"
rc=0
[ "$overall" = fail ] && rc=1
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null
exit $rc
