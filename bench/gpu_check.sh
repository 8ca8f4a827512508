#!/usr/bin/env bash
# One prepared check for a machine with a real NVIDIA GPU (run it there, from the repo root or anywhere):
#   bench/gpu_check.sh                 # results under bench/results/gpu_check-<host>-<time>/
#   GPU_CHECK_RESULTS=/some/dir bench/gpu_check.sh
# It records `nvidia-smi` as is, runs NvmlProbe (nvidia-ml-py) and SmiProbe (nvidia-smi) on the real
# driver, writes both snapshots and a per-GPU side-by-side comparison (memory must agree: NVML memory
# info v2 is what nvidia-smi shows), times both probes, then runs the other subsystems' GPU checks
# (bench/gpu_check_capture.py, bench/gpu_check_train.py, bench/gpu_check_eagle3.py: our draft served by
# sglang as EAGLE3, greedy output equal to the target's, acceptance length) with GPU_CHECK_RESULTS set.
# Needs only python3 (>= 3.10) and the package source; nvidia-ml-py from the venv, or a copy of its
# pynvml.py under .cache/device-py/, or installed. Exit code: non-zero when a probe or a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${GPU_CHECK_RESULTS:-bench/results/gpu_check-$(hostname)-$(date +%Y%m%dT%H%M%S)}
mkdir -p "$RESULTS"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  # the node environment (sglang, `make venv-node`) when present: the capture check needs it
  if [ -x .venv-node/bin/python ]; then PY=.venv-node/bin/python
  elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/include:$PWD/.cache/device-py${PYTHONPATH:+:$PYTHONPATH}"
status=0

{ echo "# $(date -u +%FT%TZ) on $(hostname)"; nvidia-smi; echo "exit $?"; } > "$RESULTS/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw,ecc.errors.uncorrected.volatile.total \
  --format=csv > "$RESULTS/query-gpu.csv" 2>&1
nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory,process_name --format=csv > "$RESULTS/query-apps.csv" 2>&1

"$PY" - "$RESULTS" <<'PYEOF' || status=1
import json, statistics, sys, time
from pathlib import Path
out = Path(sys.argv[1])
from eagleflow.gpu.nvml_probe import NvmlProbe
from eagleflow.gpu.probes import _LocalSmiProbe
from eagleflow.nodes import LocalNode

def run(name, probe):
    try:
        t = time.perf_counter(); snaps = probe.snapshot(); first = time.perf_counter() - t
        times = []
        for _ in range(10):
            t = time.perf_counter(); probe.snapshot(); times.append(time.perf_counter() - t)
        (out / f"{name}.json").write_text(json.dumps([s.to_dict() for s in snaps], indent=2))
        return snaps, {"first_s": first, "median_s": statistics.median(times)}, None
    except Exception as e:
        (out / f"{name}.error.txt").write_text(f"{type(e).__name__}: {e}\n")
        return None, None, f"{type(e).__name__}: {e}"

nv, nv_t, nv_err = run("nvml", NvmlProbe())
smi, smi_t, smi_err = run("smi", _LocalSmiProbe(LocalNode()))
lines, ok = [], nv_err is None and smi_err is None
fields = ["index", "name", "memory_used_mib", "memory_total_mib", "utilization_pct", "temperature_c", "power_w",
          "ecc_uncorrected"]
if nv and smi:
    by_uuid = {s.uuid: s for s in smi}
    for a in nv:
        b = by_uuid.get(a.uuid)
        lines.append(f"{a.uuid}")
        if b is None:
            lines.append("  missing from nvidia-smi"); ok = False; continue
        for f in fields:
            va, vb = getattr(a, f), getattr(b, f)
            same = va == vb or (f in ("power_w", "temperature_c", "utilization_pct") and va is not None and vb is not None)
            if f == "memory_used_mib" and va is not None and vb is not None and abs(va - vb) > 2:
                same = False; ok = False  # the number the idle gate uses must agree
            lines.append(f"  {f:<18} nvml={va!s:<28} smi={vb!s:<28} {'' if same else '<- differs'}")
        lines.append(f"  processes          nvml={[p.pid for p in a.processes]} smi={[p.pid for p in b.processes]}")
summary = {"nvml_error": nv_err, "smi_error": smi_err, "nvml_timing": nv_t, "smi_timing": smi_t,
           "gpus": len(nv or smi or []), "memory_agrees": ok}
if nv_t and smi_t:
    summary["smi_over_nvml"] = smi_t["median_s"] / nv_t["median_s"]
(out / "side_by_side.txt").write_text("\n".join(lines) + "\n")
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print("\n".join(lines)); print(json.dumps(summary, indent=2))
sys.exit(0 if ok else 1)
PYEOF

# the capture check keeps its folder (tiny target, stored hidden states) for the EAGLE-3 serving check
WORK="$RESULTS/work"
for extra in "bench/gpu_check_capture.py --keep $WORK --samples 64" bench/gpu_check_train.py "bench/gpu_check_eagle3.py --from $WORK"; do
  script=${extra%% *}
  if [ -f "$script" ]; then
    echo "== $extra"
    # shellcheck disable=SC2086  # the arguments above are meant to split
    GPU_CHECK_RESULTS="$RESULTS" "$PY" $extra > "$RESULTS/$(basename "$script" .py).log" 2>&1 || { status=1; echo "$extra failed"; }
    tail -n 20 "$RESULTS/$(basename "$script" .py).log"
  fi
done
echo "results in $RESULTS (exit $status)"
exit $status
