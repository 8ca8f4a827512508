"""bench/gpu_check.sh --dry-run on this CPU machine: every stage leaves a verdict and $OUT has the layout the
GPU machine's device tool brings back (at most 8 files, no folder deeper than 2, a tarball and summary.json)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGES = ["env", "gpu", "train", "train_fp8", "train_util", "hf_capture", "hf_generate", "specdec", "sglang_capture",
          "sglang_eagle3", "vllm_capture", "vllm_eagle3"]
ENGINE_STAGES = ["sglang_capture", "sglang_eagle3", "vllm_capture", "vllm_eagle3"]
NEEDS_GPU = "is installed, but its stages need a CUDA GPU (dry run or none seen)"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(tmp_path: Path, *args: str, timeout: float, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    python = env.get("PYTHON", sys.executable)
    # the vLLM stages' interpreter is this one too (else .venv-node-vllm, where present, decides what is seen)
    e = {**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(tmp_path / "work"), "PYTHON": python,
         "VLLM_PYTHON": python, **env}
    p = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], capture_output=True, text=True,
                       timeout=timeout, env=e, cwd=tmp_path)
    return p, out


def _layout(out: Path) -> tuple[list[Path], int]:
    files = [p for p in out.rglob("*") if p.is_file()]
    depth = max((len(p.relative_to(out).parts) - 1 for p in out.rglob("*") if p.is_dir()), default=0)
    return files, depth


def test_dry_run_walks_every_stage_and_writes_the_out_layout(tmp_path):
    p, out = _run(tmp_path, "--dry-run", timeout=800)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    files, depth = _layout(out)
    assert len(files) <= 8 and depth <= 2, (files, depth)
    assert {f.name for f in files} == {"summary.json", "results.tar.gz", "log"}, files
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "pass" and summary["dry_run"] is True and summary["pending"] == []
    verdicts = {v["stage"]: v for v in summary["stages"]}
    assert list(verdicts) == STAGES
    assert verdicts["env"]["status"] == "pass"
    for name in STAGES[1:]:
        assert verdicts[name]["status"] == "skipped" and verdicts[name]["reason"], verdicts[name]
    # the GPU stages rehearsed their code on the CPU, and say it is no measurement
    assert verdicts["gpu"]["rehearsal"]["smi_held_names_pid"] is True
    assert verdicts["train"]["rehearsal"]["loss_last"] < verdicts["train"]["rehearsal"]["loss_first"]
    assert verdicts["hf_capture"]["rehearsal"]["worst"]["min_cos"] >= 0.995
    assert all("not a measurement" in verdicts[n]["reason"] for n in ("gpu", "train", "train_fp8", "train_util",
                                                                      "hf_capture", "hf_generate"))
    # the utilisation stage walked both paths and wrote its figures: before and after, against the matmul
    util = verdicts["train_util"]["rehearsal"]
    assert set(util["summary"]) == {"before", "after"} and util["finite"], util
    for side in ("before", "after"):
        s = util["summary"][side]
        assert s["utilisation_vs_matmul"] > 0 and 0 <= s["data_fraction_of_step"] < 1 and s["tokens_per_s"] > 0, s
    assert util["first_loss_rel_diff"] <= 1e-5 and util["flops_a_step"]["total"] > 0
    assert util["goal_fraction_of_peak"] == 0.4 and util["goal_met"] is False   # no device peak on a CPU
    gen = verdicts["hf_generate"]["rehearsal"]
    assert gen["same_ids_for_same_seed"] and gen["greedy_teacher_forced_match"] >= 0.9 and gen["tokens_generated"]
    fp8 = verdicts["train_fp8"]["rehearsal"]
    assert fp8["store_dtype"] == "fp8_e4m3" and fp8["dequant_max_rel_diff_vs_cpu"] <= 1e-2 and fp8["finite"]
    if (REPO / "include" / "eagleflow" / "evaluate" / "decoder.py").is_file():
        rehearsal = verdicts["specdec"]["rehearsal"]["cpu"]
        assert "not a measurement" in verdicts["specdec"]["reason"]
        assert rehearsal["same_as_greedy"] == rehearsal["prompts"] and rehearsal["accept_length"] >= 1.0
    else:
        assert verdicts["specdec"]["reason"] == "evaluation phase not built"
    sglang_absent = verdicts["sglang_capture"]["reason"].startswith("sglang not importable on this machine by ")
    assert sglang_absent or NEEDS_GPU in verdicts["sglang_capture"]["reason"]
    # this venv has no vLLM: both vLLM stages say so, naming the interpreter and the variable that picks another
    for name in ("vllm_capture", "vllm_eagle3"):
        assert verdicts[name]["reason"] == (f"vllm not importable on this machine by {sys.executable} (set "
                                            "VLLM_PYTHON to the python of the venv that has it)"), verdicts[name]
    # deciding to skip an engine's stages costs no engine import
    assert all(verdicts[n]["seconds"] < 1.0 for n in ENGINE_STAGES), [verdicts[n] for n in ENGINE_STAGES]
    with tarfile.open(out / "results.tar.gz") as t:
        names = set(t.getnames())
    assert {f"results/{s}.json" for s in STAGES} <= names, names
    assert not (tmp_path / "work").is_relative_to(out)
    assert "== gpu_check: pass" in (out / "log").read_text()


def test_a_short_deadline_still_leaves_every_verdict_and_the_layout(tmp_path):
    t0 = time.monotonic()
    p, out = _run(tmp_path, "--dry-run", timeout=300, GPU_CHECK_DEADLINE_S="25")
    took = time.monotonic() - t0
    summary = json.loads((out / "summary.json").read_text())
    verdicts = {v["stage"]: v for v in summary["stages"]}
    assert list(verdicts) == STAGES, p.stdout[-4000:]
    cut = [v for v in verdicts.values()
           if v["status"] == "skipped" and v["reason"].startswith("out of time")
           or v["status"] == "fail" and "killed by its time limit" in v["reason"]]
    assert cut, verdicts
    # a stage cut by its limit is a failure; one never started for lack of time is not
    assert p.returncode == (1 if summary["failed"] else 0)
    # the deadline, plus timeout's -k grace and the packing, bounds the whole run
    assert took < 25 + 10 + 20, took
    files, depth = _layout(out)
    assert len(files) <= 8 and depth <= 2 and (out / "results.tar.gz").is_file()


def test_a_stage_that_dies_without_a_verdict_is_recorded_failed(tmp_path):
    # an interpreter that exits 1 at once: no stage writes its own verdict, the script writes each one
    p, out = _run(tmp_path, "--dry-run", timeout=120, PYTHON="/bin/false")
    assert p.returncode == 1
    summary = json.loads((out / "summary.json").read_text())
    verdicts = {v["stage"]: v for v in summary["stages"]}
    assert list(verdicts) == STAGES and summary["status"] == "fail"
    assert verdicts["env"]["status"] == "fail" and verdicts["env"]["reason"].startswith("exited 1 without")
    assert verdicts["env"]["exit_code"] == 1
    assert verdicts["sglang_capture"]["reason"].startswith("sglang not importable on this machine by /bin/false")
    assert verdicts["vllm_capture"]["reason"].startswith("vllm not importable on this machine by /bin/false")
    files, depth = _layout(out)
    assert len(files) <= 8 and depth <= 2 and (out / "results.tar.gz").is_file()


# an engine package whose import takes seconds and leaves a mark, as torch-heavy sglang and vLLM do (the mark)
SLOW_ENGINE = """import os, pathlib, time
pathlib.Path(os.path.dirname(__file__), "imported").write_text(str(os.getpid()))
time.sleep(3)
"""


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "no-gpu"])
def test_installed_engines_without_a_gpu_are_skipped_in_under_a_second_without_an_import(tmp_path, dry):
    site = tmp_path / "site"
    for name in ("sglang", "vllm"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(SLOW_ENGINE)
    # a 1 s deadline: every other stage is skipped for time at once, the engines' decision still runs
    p, out = _run(tmp_path, *(["--dry-run"] if dry else []), timeout=120, GPU_CHECK_DEADLINE_S="1",
                  PYTHONPATH=str(site))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    verdicts = {v["stage"]: v for v in json.loads((out / "summary.json").read_text())["stages"]}
    assert list(verdicts) == STAGES
    for name in ENGINE_STAGES:
        v = verdicts[name]
        assert v["status"] == "skipped" and v["reason"] == name.split("_")[0] + " " + NEEDS_GPU, v
        assert v["dry_run"] is dry and v["seconds"] < 1.0, v
    assert not [f for f in site.rglob("imported")], "the check imported an engine to learn it is installed"
    log = (out / "log").read_text()
    assert "== vllm_capture, vllm_eagle3: skipped, decided in " in log
