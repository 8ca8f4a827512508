"""Stages of bench/gpu_check.sh that need no stage script of their own: env, gpu, hf_capture, specdec.

    python bench/gpu_check_stages.py env|gpu|hf_capture|specdec --work DIR

Each writes its verdict (bench/gpu_check_common.py) under $GPU_CHECK_RESULTS
and its small outputs beside it. With GPU_CHECK_DRY_RUN=1, or where torch sees
no CUDA GPU, a GPU stage is ``skipped`` with its reason after rehearsing its
code path on the CPU at toy size (a fake nvidia-smi for the gate); a rehearsal
that breaks is a ``fail``, so the one run on the GPU machine does not find the
bug.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_check_common import dry_run, results_dir, write_verdict  # noqa: E402


def _out(name: str) -> Path:
    d = results_dir() or Path(".")
    d.mkdir(parents=True, exist_ok=True)
    return d / name


def _cuda() -> tuple[bool, str]:
    """(use the GPU, why not)."""
    try:
        import torch
    except Exception as e:
        return False, f"torch does not import: {type(e).__name__}: {e}"
    if dry_run():
        return False, "dry run"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA GPU here"
    return True, ""


# --- env --------------------------------------------------------------------------------

def stage_env(a) -> int:
    """What this machine is, and whether eagleflow's config (pydantic) imports with the carried wheels."""
    info: dict = {"python": platform.python_version(), "executable": sys.executable, "host": platform.node(),
                  "pythonpath": os.environ.get("PYTHONPATH", "")}
    for mod in ("torch", "transformers", "safetensors", "pyarrow", "yaml", "pynvml", "pydantic", "pydantic_core"):
        try:
            m = __import__(mod)
            info[mod] = {"version": getattr(m, "__version__", getattr(m, "VERSION", "?")),
                         "from": str(Path(m.__file__).parent) if getattr(m, "__file__", None) else None}
        except Exception as e:
            info[mod] = {"error": f"{type(e).__name__}: {e}"[:300]}
    info["sglang_spec"] = importlib.util.find_spec("sglang") is not None
    info["nvidia_smi"] = shutil.which("nvidia-smi")
    problems = []
    try:
        import torch
        info["cuda_available"] = torch.cuda.is_available()
        if info["cuda_available"]:
            info["cuda"] = torch.version.cuda
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        elif not dry_run():
            problems.append(f"torch {torch.__version__} sees no CUDA GPU (the GPU stages will be skipped)")
    except Exception as e:
        problems.append(f"torch does not import: {e}")
    try:
        from eagleflow.config import load_config
        load_config(data={"target_model": "unused"})
        info["eagleflow_config"] = "imports and validates"
    except Exception as e:
        info["eagleflow_config"] = f"{type(e).__name__}: {e}"[:500]
        problems.append("eagleflow.config does not import: every CLI stage fails; run bench/fetch_gpu_wheels.sh "
                        "where PyPI is reachable and carry .whl")
    print(json.dumps(info, indent=2))
    fatal = [p for p in problems if "eagleflow.config" in p or "torch does not import" in p]
    return write_verdict("env", "fail" if fatal else "pass", "; ".join(problems) or None, **info)


# --- gpu: NVML vs nvidia-smi, the idle gate driven by a child holding GPU memory ---------------

def _timed_snapshots(probe) -> tuple[list, dict]:
    t = time.perf_counter()
    snaps = probe.snapshot()
    first = time.perf_counter() - t
    times = []
    for _ in range(5):
        t = time.perf_counter()
        probe.snapshot()
        times.append(time.perf_counter() - t)
    return snaps, {"first_s": round(first, 4), "median_s": round(statistics.median(times), 4)}


def _side_by_side(nv: list, smi: list) -> tuple[list[str], bool]:
    fields = ["index", "name", "memory_used_mib", "memory_total_mib", "utilization_pct", "temperature_c",
              "power_w", "ecc_uncorrected"]
    lines, agree = [], True
    by_uuid = {s.uuid: s for s in smi}
    for a in nv:
        b = by_uuid.get(a.uuid)
        lines.append(a.uuid)
        if b is None:
            lines.append("  missing from nvidia-smi")
            agree = False
            continue
        for f in fields:
            va, vb = getattr(a, f), getattr(b, f)
            differs = va != vb and f not in ("power_w", "temperature_c", "utilization_pct")
            if f == "memory_used_mib" and va is not None and vb is not None:
                differs = abs(va - vb) > 2   # the number the idle gate reads must agree
            agree &= not (f == "memory_used_mib" and differs)
            lines.append(f"  {f:<18} nvml={va!s:<28} smi={vb!s:<28} {'<- differs' if differs else ''}")
        lines.append(f"  processes          nvml={[p.pid for p in a.processes]} smi={[p.pid for p in b.processes]}")
    return lines, agree


def _gate_config(baseline_file: str, probe: str):
    from eagleflow.config import load_config
    return load_config(data={"target_model": "unused", "node": {"name": "gpu-check", "has_gpu": True},
                             "gpu": {"probe": probe, "baseline_file": baseline_file, "poll_interval_s": 1.0,
                                     "idle_threshold_mib": 16}})


class _Holder:
    """A child process that holds GPU memory until its stdin closes (on the CPU: holds nothing)."""

    def __init__(self, mib: int, on_gpu: bool):
        code = ("import sys, torch\n"
                f"x = torch.empty({mib} << 20, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()\n"
                "print('holding', flush=True); sys.stdin.read()\n") if on_gpu else \
               "import sys\nprint('holding', flush=True); sys.stdin.read()\n"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()   # CUDA initialises first: seconds
        if line.strip() != "holding":
            self.proc.kill()
            raise RuntimeError(f"the memory-holding child exited ({self.proc.wait()}) before holding memory")
        self.pid = self.proc.pid

    def release(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def _drive_gate(probes: list[str], baseline_file: str, hold, release) -> dict:
    """Gate before, while a child holds memory (must refuse, naming its PID), and after (within one poll)."""
    from eagleflow.gpu.idle_gate import IdleGate
    from eagleflow.nodes import LocalNode
    gates = {p: IdleGate(LocalNode("gpu-check"), _gate_config(baseline_file, p)) for p in probes}
    res: dict = {}
    for p, g in gates.items():
        r = g.check()
        res[f"{p}_before_idle"] = r.all_idle
        if not r.all_idle:
            res[f"{p}_before_message"] = r.message()
    holder = hold()
    try:
        time.sleep(0.5)
        for p, g in gates.items():
            r = g.check()
            pids = [proc.pid for v in r.busy for proc in v.snapshot.processes]
            res[f"{p}_held_refused"] = not r.all_idle
            res[f"{p}_held_names_pid"] = holder.pid in pids
            res[f"{p}_held_pids"] = pids
            res[f"{p}_held_message"] = r.message()
            print(f"[{p}] while pid {holder.pid} holds memory: {r.message()}")
    finally:
        release(holder)
    t0 = time.monotonic()
    for p, g in gates.items():
        polls = []
        report = g.wait(timeout_s=3.0, poll_s=1.0, log=print, sleep=lambda s: (polls.append(s), time.sleep(s)))
        res[f"{p}_after_idle"] = report.all_idle
        res[f"{p}_after_polls"] = len(polls)
        res[f"{p}_after_s"] = round(time.monotonic() - t0, 2)
        if not report.all_idle:
            res[f"{p}_after_message"] = report.message()
        print(f"[{p}] after the child exited: {'idle' if report.all_idle else 'NOT idle'} after {len(polls)} "
              f"poll interval(s), {res[f'{p}_after_s']} s")
    res["ok"] = all(res[f"{p}_before_idle"] and res[f"{p}_held_refused"] and res[f"{p}_held_names_pid"]
                    and res[f"{p}_after_idle"] and res[f"{p}_after_polls"] <= 1 for p in probes)
    return res


def stage_gpu(a) -> int:
    from eagleflow.gpu.idle_policy import baseline_document
    from eagleflow.gpu.nvml_probe import NvmlProbe
    from eagleflow.gpu.probes import _LocalSmiProbe
    from eagleflow.nodes import LocalNode
    work = Path(a.work) / "gpu"
    work.mkdir(parents=True, exist_ok=True)
    on_gpu, why = _cuda()
    if not on_gpu:
        return _rehearse_gpu(work, why)
    raw = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    _out("nvidia-smi.txt").write_text(raw.stdout + raw.stderr)
    errors, snaps, timing = {}, {}, {}
    for name, probe in (("nvml", NvmlProbe()), ("smi", _LocalSmiProbe(LocalNode()))):
        try:
            snaps[name], timing[name] = _timed_snapshots(probe)
            _out(f"gpu_{name}.json").write_text(json.dumps([s.to_dict() for s in snaps[name]], indent=2))
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"[:500]
    if errors:
        return write_verdict("gpu", "fail", f"probe errors: {errors}", timing=timing)
    lines, agree = _side_by_side(snaps["nvml"], snaps["smi"])
    _out("gpu_side_by_side.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    # the real driver's idle baseline, recorded as `eagleflow gpu baseline` does; the gate then uses it
    try:
        doc = baseline_document(snaps["nvml"], "gpu-check")
    except ValueError as e:
        return write_verdict("gpu", "fail", f"not idle at start, no baseline: {e}", timing=timing,
                             memory_agrees=agree)
    base = work / "baseline.json"
    base.write_text(json.dumps(doc))
    _out("gpu_baseline.json").write_text(json.dumps(doc, indent=2))
    gate = _drive_gate(["nvml", "smi"], str(base), lambda: _Holder(a.hold_mib, True), lambda h: h.release())
    figures = {"gpus": len(snaps["nvml"]), "memory_agrees": agree, "timing": timing,
               "smi_over_nvml": round(timing["smi"]["median_s"] / max(timing["nvml"]["median_s"], 1e-9), 1),
               "idle_baseline_mib": {s.uuid: s.memory_used_mib for s in snaps["nvml"]},
               "ecc_uncorrected": {s.uuid: s.ecc_uncorrected for s in snaps["nvml"]},
               "hold_mib": a.hold_mib, "gate": gate}
    ok = agree and gate["ok"]
    reason = None if ok else ("NVML and nvidia-smi memory differ" if not agree else "the gate did not refuse the "
                              "holder by PID or did not pass within one poll after it exited (see gate)")
    return write_verdict("gpu", "pass" if ok else "fail", reason, **figures)


def _rehearse_gpu(work: Path, why: str) -> int:
    """The same gate code against the fake nvidia-smi (tests/fixtures/bin): the child is listed while it lives."""
    from tests.fixtures.gpu_scenarios import fake_smi_env, gpu, proc, write_scenario

    from eagleflow.gpu.idle_policy import baseline_document
    from eagleflow.gpu.probes import _LocalSmiProbe
    from eagleflow.nodes import LocalNode
    scenario = work / "scenario.json"
    write_scenario(scenario, {"gpus": [gpu(0, used=3)], "processes": []})
    os.environ.update(fake_smi_env(scenario, sys.executable))
    try:
        snaps = _LocalSmiProbe(LocalNode()).snapshot()
        base = work / "baseline.json"
        base.write_text(json.dumps(baseline_document(snaps, "gpu-check")))

        def hold():
            h = _Holder(0, False)
            write_scenario(scenario, {"gpus": [gpu(0, used=1027)], "processes": [proc(h.pid, 0, 1024, live=True)]})
            return h

        def release(h):
            h.release()
            write_scenario(scenario, {"gpus": [gpu(0, used=3)], "processes": []})   # what the driver does
        gate = _drive_gate(["smi"], str(base), hold, release)
    except Exception as e:
        return write_verdict("gpu", "fail", f"rehearsal on the fake nvidia-smi broke: {type(e).__name__}: {e}")
    if not gate["ok"]:
        return write_verdict("gpu", "fail", "rehearsal on the fake nvidia-smi: the gate did not behave", gate=gate)
    return write_verdict("gpu", "skipped", f"{why}: needs the real driver; the gate's code path was rehearsed "
                         "on the fake nvidia-smi (not a measurement)", rehearsal=gate)


# --- hf capture on the GPU vs a CPU float32 forward -------------------------------------------

def _tiny_target(root: Path, layers: int, hidden: int) -> Path:
    """A random Llama saved in bf16 (no tokenizer: the capture path takes token ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128 or 1, num_key_value_heads=max(1, hidden // 256),
                      head_dim=min(128, hidden), max_position_embeddings=4096, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    out = root / "tiny-llama"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    return out


def _compare(run_dir: Path, model: Path, rows: list[dict]) -> tuple[dict, list[str]]:
    """Every stored sample against a CPU float32 forward of the same (bf16-saved) weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagleflow.capture.storage import read_sample
    ref = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    worst = {"max_abs": 0.0, "max_rel": 0.0, "max_row_rel_l2": 0.0, "min_cos": 1.0}
    lines, ids_ok = [], True
    for row in rows:
        t, meta = read_sample(run_dir / "hidden_states" / "shard_00000" / f"{row['index']:08d}.safetensors")
        with torch.inference_mode():
            hs = ref(torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states
        parts = {"aux": (t["aux_hidden_states"].float(),
                         torch.cat([hs[i + 1][0] for i in json.loads(meta["aux_layers"])], -1)),
                 "last": (t["hidden_states"].float(), hs[-1][0])}
        ids_ok &= t["input_ids"].tolist() == row["input_ids"]
        cells = []
        for name, (got, want) in parts.items():
            if got.shape != want.shape:
                raise RuntimeError(f"sample {row['index']} {name}: stored {tuple(got.shape)} vs forward "
                                   f"{tuple(want.shape)}")
            d = (got - want).abs()
            m = {"max_abs": d.max().item(), "max_rel": (d.max() / want.abs().max()).item(),
                 "max_row_rel_l2": ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item(),
                 "min_cos": torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()}
            for k in ("max_abs", "max_rel", "max_row_rel_l2"):
                worst[k] = max(worst[k], m[k])
            worst["min_cos"] = min(worst["min_cos"], m["min_cos"])
            cells.append(f"{name} max|d| {m['max_abs']:.4g} rel {m['max_rel']:.3g} row-rel-L2 "
                         f"{m['max_row_rel_l2']:.3g} min cos {m['min_cos']:.5f}")
        lines.append(f"sample {row['index']} ({len(row['input_ids'])} tokens): " + "; ".join(cells))
    worst["input_ids_equal"] = ids_ok
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in worst.items()}, lines


def stage_hf_capture(a) -> int:
    on_gpu, why = _cuda()
    t0 = time.time()
    root = Path(a.work) / "hf_capture"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    # on the GPU the check's size; rehearsed on the CPU at toy size
    samples, max_len, layers, hidden = (a.samples, 300, 8, 512) if on_gpu else (4, 40, 8, 128)
    try:
        figures = _run_hf_capture(root, on_gpu, samples, max_len, layers, hidden)
    except Exception as e:
        import traceback
        traceback.print_exc()
        return write_verdict("hf_capture", "fail", f"{type(e).__name__}: {e}"[:2000],
                             device="cuda" if on_gpu else "cpu", seconds=round(time.time() - t0, 1))
    figures["seconds"] = round(time.time() - t0, 1)
    w = figures["worst"]
    # bf16 against float32 through a handful of layers: about 1 % per row; a wrong layer or position is ~100 %
    ok = w["input_ids_equal"] and w["min_cos"] >= 0.995 and w["max_row_rel_l2"] <= 0.1
    reason = None if ok else (f"stored states differ from the CPU float32 forward beyond bf16 tolerance "
                              f"(min cos {w['min_cos']}, max row relative L2 {w['max_row_rel_l2']}; "
                              f"need >= 0.995 and <= 0.1)")
    if ok and not on_gpu:
        return write_verdict("hf_capture", "skipped", f"{why}: needs a CUDA GPU; the capture path was rehearsed "
                             "on the CPU in bf16 at toy size (not a measurement)", rehearsal=figures)
    return write_verdict("hf_capture", "pass" if ok else "fail", reason, **figures)


def _run_hf_capture(root: Path, on_gpu: bool, samples: int, max_len: int, layers: int, hidden: int) -> dict:
    import yaml

    from eagleflow.phases.extract.lifecycle import start_capture_server, stop_capture_server, wait_capture_server_ready
    from eagleflow.local_run import LocalRun
    from eagleflow.config import load_config
    from eagleflow.layout import RunLayout
    from tests.fixtures.capture_corpus import write_corpus
    model = _tiny_target(root, layers, hidden)
    source = root / "source.jsonl"   # the pre-flight wants a real source; the corpus below is written directly
    source.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                    {"from": "gpt", "value": "hello"}]}) + "\n")
    cfgp = root / "config.yaml"
    cfgp.write_text(yaml.safe_dump({
        "run_root": str(root / "runs"), "target_model": str(model),
        "node": {"name": "gpu-check", "has_gpu": on_gpu, "state_dir": str(root / "state")},
        "corpus": {"sources": [{"name": "fixture", "path": str(source)}]},
        "server": {"device": "cuda" if on_gpu else "cpu", "dtype": "bfloat16", "port": 0,
                   "dump_dir": str(root / "dumps"), "ready_timeout_s": 90},
        "capture": {"backend": "hf", "shards": 1, "in_flight": 4, "heartbeat_interval_s": 1,
                    "request_timeout_base_s": 30}}))
    cfg = load_config(cfgp)
    lay = RunLayout.for_run(cfg, "gpucheck")
    rows = write_corpus(Path(lay.corpus_dir) / "corpus.parquet", samples, 512, seed=3, min_len=8, max_len=max_len)
    ctx = LocalRun(cfg=cfg, layout=lay, config_path=str(cfgp))
    cli = [sys.executable, "-m", "eagleflow.cli"]
    t_start = time.time()
    start_capture_server(ctx, log=print)
    try:
        try:
            info = wait_capture_server_ready(ctx, log=print)
        except Exception:
            print(Path(lay.log_file("capture_server")).read_text()[-4000:])
            raise
        t_ready = time.time()
        w = subprocess.run(cli + ["capture", "run", "--config", str(cfgp), "--run-id", "gpucheck", "--shard", "0"],
                           capture_output=True, text=True, timeout=120)
        t_run = time.time()
        print(w.stdout[-2000:], w.stderr[-2000:])
        v = subprocess.run(cli + ["capture", "verify", "--config", str(cfgp), "--run-id", "gpucheck", "--json"],
                           capture_output=True, text=True, timeout=60)
        print(v.stdout[-2000:], v.stderr[-2000:])
        if w.returncode != 0 or v.returncode != 0:
            print(Path(lay.log_file("capture_server")).read_text()[-4000:])
            raise RuntimeError(f"`capture run` exit {w.returncode}, `capture verify` exit {v.returncode}: "
                               f"{(w.stderr or v.stderr)[-800:]}")
    finally:
        print(stop_capture_server(ctx, grace_s=15, log=print))
    worst, lines = _compare(Path(lay.run_dir), model, rows)
    _out("hf_capture_compare.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("worst over all samples:", json.dumps(worst))
    tokens = sum(len(r["input_ids"]) for r in rows)
    return {"device": info.get("device"), "dtype": info.get("dtype"), "samples": len(rows), "tokens": tokens,
            "aux_layers": info.get("aux_layers"), "server_ready_s": round(t_ready - t_start, 1),
            "capture_s": round(t_run - t_ready, 2), "capture_tokens_per_s": round(tokens / max(t_run - t_ready, 1e-9)),
            "reference": "CPU float32 forward of the same weights", "worst": worst}


# --- speculative decoding with the hf backend's decoder: GPU figure against the CPU figure ----------

SPECDEC_TOLERANCE = 0.05   # relative: the same draft, prompts and float32 target on both devices


def stage_specdec(a) -> int:
    if importlib.util.find_spec("eagleflow.evaluate") is None or \
            importlib.util.find_spec("eagleflow.evaluate.decoder") is None:
        return write_verdict("specdec", "skipped", "evaluation phase not built")
    root = Path(a.work) / "hf_capture"
    if not (root / "config.yaml").is_file():
        return write_verdict("specdec", "skipped", "the hf_capture stage left no stored hidden states to train "
                             "a draft on")
    on_gpu, why = _cuda()
    t0 = time.time()
    try:
        figures = _run_specdec(root, on_gpu, a)
    except Exception as e:
        import traceback
        traceback.print_exc()
        return write_verdict("specdec", "fail", f"{type(e).__name__}: {e}"[:2000], seconds=round(time.time() - t0, 1))
    figures["seconds"] = round(time.time() - t0, 1)
    cpu, other = figures["cpu"], figures.get("cuda")
    problems = [f"{d}: {r['same_as_greedy']} of {r['prompts']} outputs equal the target's greedy decoding"
                for d, r in (("cpu", cpu), ("cuda", other)) if r and r["same_as_greedy"] != r["prompts"]]
    if other:
        gap = abs(other["accept_length"] - cpu["accept_length"])
        figures["accept_length_gap"] = round(gap, 4)
        if gap > SPECDEC_TOLERANCE * cpu["accept_length"]:
            problems.append(f"acceptance length on the GPU {other['accept_length']:.4f} vs the CPU "
                            f"{cpu['accept_length']:.4f}: more than {SPECDEC_TOLERANCE:.0%} apart")
    if problems:
        return write_verdict("specdec", "fail", "; ".join(problems), **figures)
    if not on_gpu:
        return write_verdict("specdec", "skipped", f"{why}: needs a CUDA GPU; train, export and decoding were "
                             "rehearsed on the CPU at toy size (not a measurement)", rehearsal=figures)
    return write_verdict("specdec", "pass", None, tolerance=SPECDEC_TOLERANCE, **figures)


def _run_specdec(root: Path, on_gpu: bool, a) -> dict:
    import yaml

    from eagleflow.evaluate.decoder import DraftProposer, Target, greedy, load_draft, speculative
    from tests.fixtures.capture_corpus import write_corpus
    steps = a.train_steps if on_gpu else 4
    cfg = yaml.safe_load((root / "config.yaml").read_text())
    cfg["train"] = {"device": "cuda" if on_gpu else "cpu", "max_steps": steps, "batch_size": 4,
                    "draft_vocab_size": 256, "ttt_length": 7 if on_gpu else 3, "checkpoint_every": steps,
                    "log_every": max(1, steps // 4), "lr": 1e-3}   # a short run that learns something to accept
    cfgp = root / "config-specdec.yaml"
    cfgp.write_text(yaml.safe_dump(cfg))
    cli = [sys.executable, "-m", "eagleflow.cli"]
    for cmd in (["train"], ["export", "--json"]):
        p = subprocess.run(cli + cmd + ["--config", str(cfgp), "--run-id", "gpucheck"], capture_output=True,
                           text=True, timeout=150)
        print(p.stdout[-2000:], p.stderr[-2000:])
        if p.returncode != 0:
            raise RuntimeError(f"`eagleflow {cmd[0]}` exit {p.returncode}: {p.stderr[-800:]}")
    export = json.loads(p.stdout.strip().splitlines()[-1])["export_dir"]
    model = cfg["target_model"]
    n, new_tokens = (a.prompts, 32) if on_gpu else (1, 6)
    prompts = [r["input_ids"][:32] for r in write_corpus(root / "heldout.parquet", n, 512, seed=99, min_len=16,
                                                          max_len=64)]   # a seed the draft never saw
    out = {"train_steps": steps, "prompts": n, "new_tokens": new_tokens, "draft_steps": 3, "export": export}
    for device in (["cuda", "cpu"] if on_gpu else ["cpu"]):
        target = Target(model, device=device, dtype="float32")
        draft, aux = load_draft(export, model)
        proposer = DraftProposer(draft, target.aux_layers(aux), target.device)
        t = time.perf_counter()
        spec = [speculative(target, proposer, ids, new_tokens, 3) for ids in prompts]
        spec_s = time.perf_counter() - t
        ref = [greedy(target, ids, new_tokens) for ids in prompts]
        passes = sum(d.verify_passes for d in spec)
        out[device] = {"prompts": n, "verify_passes": passes,
                       "accept_length": sum(a_ + 1 for d in spec for a_ in d.accepted) / max(passes, 1),
                       "same_as_greedy": sum(d.tokens == r.tokens for d, r in zip(spec, ref)),
                       "speculative_s": round(spec_s, 3), "greedy_s": round(sum(r.seconds for r in ref), 3)}
        print(f"{device}: {json.dumps(out[device])}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["env", "gpu", "hf_capture", "specdec"])
    ap.add_argument("--work", required=True, help="work folder (models, runs), outside $OUT")
    ap.add_argument("--hold-mib", type=int, default=1024, help="gpu: memory the child holds")
    ap.add_argument("--samples", type=int, default=16, help="hf_capture: corpus samples")
    ap.add_argument("--train-steps", type=int, default=300, help="specdec: draft training steps on the GPU")
    ap.add_argument("--prompts", type=int, default=8, help="specdec: held-out prompts")
    a = ap.parse_args()
    return {"env": stage_env, "gpu": stage_gpu, "hf_capture": stage_hf_capture, "specdec": stage_specdec}[a.stage](a)


if __name__ == "__main__":
    sys.exit(main())
