"""The streaming demo (`make demo-stream`, configs/stream-demo.yaml) as a newcomer runs it (issue 53): the demo's
own runner, `python -m eagleflow.demo`, which runs eagle3_pipeline through `airflow dags test`. The run is green;
the trainer's exactly-once record (stream_verified.json) is; no hidden-state file is on disk, only the shards'
manifests; the held-out gate's eval.json is written and passed, under the offline demo's very gate.

The config is the repository's, copied into the test's folder so that its relative paths put the run there
(its ``../.cache`` a link to the checkout's, where the demo builds its inputs once). The test's own overrides
(``OVERRIDES``) shorten the run (no generation phase, two epochs instead of four, no report-only prompt sets);
the store, the shards, the trainer's draws and the gate are the demo's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagleflow.config import load_config, set_dotted
from eagleflow.nodes.process_record import scan_records, status

pytest.importorskip("mooncake.store", reason="the stream extra (mooncake-transfer-engine-non-cuda) is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
REPO = Path(__file__).resolve().parents[2]
OVERRIDES: dict[str, object] = {
    # the generation phase runs before capture and has nothing to do with the store: the sources as they are
    "generate.enabled": False,
    # two epochs (70 steps) instead of four: the draft is scored by the same gate all the same
    "train.max_steps": 70,
    # the MT-Bench, GSM8K and HumanEval-shaped rows are reported beside the gate, never judged by it
    # (eval.gate_sets: [held_out]): the held-out set alone decides, as in the offline demo
    "eval.prompt_sets": [],
}


def test_the_streaming_demo_runs_green_with_no_hidden_state_on_disk(tmp_path):
    src = REPO / "configs" / "stream-demo.yaml"
    # only stream: differs from the offline demo: the same corpus, training and held-out gate
    offline, streaming = load_config(REPO / "configs" / "local-demo.yaml"), load_config(src)
    assert {k for k, v in offline.model_dump().items() if streaming.model_dump()[k] != v} == {"stream"}
    assert streaming.stream.storage == "mooncake"
    assert streaming.train.max_steps == 150 and streaming.train.batch_size == 4   # the docs' figures are from these

    data = yaml.safe_load(src.read_text())
    for key, value in OVERRIDES.items():
        set_dotted(data, key, value)
    (tmp_path / "configs").mkdir()
    cfg = tmp_path / "configs" / "stream-demo.yaml"
    cfg.write_text(yaml.safe_dump(data))
    (REPO / ".cache").mkdir(exist_ok=True)
    (tmp_path / ".cache").symlink_to(REPO / ".cache")
    gate = load_config(cfg).eval
    assert (gate.gate_sets, gate.min_accept_length, gate.max_prompts) == (
        offline.eval.gate_sets, offline.eval.min_accept_length, offline.eval.max_prompts)

    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "eagleflow.demo", "--config", str(cfg), "--run-id", "streamed"],
                         capture_output=True, text=True, env=os.environ.copy(), timeout=1400)
    wall = time.time() - t0
    out = res.stdout + res.stderr
    run_dir = tmp_path / "runs" / "streamed"
    print(f"[stream-demo] exit {res.returncode} after {wall:.0f} s")
    assert res.returncode == 0, out[-6000:]

    frozen = json.loads((run_dir / "run-config.json").read_text())
    assert frozen["stream"]["storage"] == "mooncake"
    # every sample trained exactly once per epoch, by the trainer's own record of its ledger
    rec = json.loads((run_dir / "hidden_states" / "stream_verified.json").read_text())
    assert rec["ok"] and rec["kind"] == "stream" and rec["store"] == "mooncake", rec
    assert all(n == rec["samples"] for n in rec["trained_per_epoch"].values()) and rec["epochs"] == 2
    # no hidden state on disk: the shards' manifests only (the held-out records are captured apart, on disk)
    hs = run_dir / "hidden_states"
    manifests = sorted(hs.glob("shard_*/manifest.jsonl"))
    assert len(manifests) == 2 and not list(hs.rglob("*.safetensors"))
    assert sum(len(m.read_text().splitlines()) for m in manifests) == rec["samples"]
    # the held-out gate decided, and passed, on the offline demo's terms
    ev = json.loads((run_dir / "eval.json").read_text())
    assert ev["passed"] is True, ev.get("refused")
    assert (run_dir / "draft" / "export" / "model.safetensors").stat().st_size > 0
    # the store ran for the run only: its endpoint removed, none of its processes left
    assert not (run_dir / "store_endpoint.json").exists()
    recs, _ = scan_records(Path(str(load_config(cfg).node_state_dir())) / "pids")
    assert not [r.role for r in recs if r.role.startswith("mooncake") and status(r.pid_file).alive]
    # the demo's own summary says what streamed
    assert (f"streamed, not stored: {rec['samples']} samples x {rec['epochs']} epoch(s) through the run's mooncake "
            "store, each trained exactly once per epoch") in res.stdout, res.stdout[-3000:]
    assert "0 hidden-state files on disk" in res.stdout and "passed the gate" in res.stdout
