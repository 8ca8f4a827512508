"""Fault matrix (issue 11): each fault injected through the real Airflow or CLI path, each case asserting the
run's final state, 0 samples lost, 0 duplicated, 0 corrupt trained on.

| fault                                         | path                        | expected                                  |
|-----------------------------------------------|-----------------------------|-------------------------------------------|
| a shard fails all its tries                   | eagle3_pipeline, dag.test() | run failed; verify names shard + counts in|
|                                               |                             | the alert; GPU teardown ran; no training  |
| prepare_corpus fails                          | dag.test()                  | run failed; nothing trains; one alert     |
| missing target model / unknown conf key       | dag.test()                  | write_run_config fails on try 1, seconds, |
| run_name ".."                                 |                             | naming the field (no retry)               |
| manifest: garbage, cut-off, duplicated lines; | capture run / verify /      | verify reports each; train refuses; a     |
| a same-size byte flip in a sample             | train CLI                   | re-run repairs: one clean line per sample |
| a sample changed after verification           | train CLI                   | refused, the file named                   |
| newest checkpoint zeroed; leftover .tmp-step_ | train CLI                   | falls back naming the skipped one; temp   |
|                                               |                             | dirs removed; exact step sequence         |
| --run-id '..', '.', '/abs', 'a/b'             | CLI                         | refused naming --run-id; nothing outside  |
| dump_dir full; shard dir full (ENOSPC)        | capture run CLI (tmpfs)     | clear error in log and heartbeat; resume  |
|                                               |                             | after space is freed: exact shard         |
| checkpoint disk full (ENOSPC)                 | train CLI (tmpfs)           | clear error, no half checkpoint; resume   |
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagleflow.phases.extract.lifecycle import start_capture_server, stop_capture_server, wait_capture_server_ready
from eagleflow.local_run import LocalRun
from eagleflow.capture.verify import RECORD_FILE
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from tests.fixtures.capture_corpus import write_corpus, write_run_config
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.pipeline_run import pipeline_dag
from tests.fixtures.processes import kill_recorded
from tests.fixtures.smtp import SmtpSink, body_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
N = 16
TRAIN = {"device": "cpu", "max_steps": 8, "batch_size": 4, "ttt_length": 2, "draft_vocab_size": 128,
         "checkpoint_every": 3, "log_every": 4, "warmup_steps": 1}


# ---------------------------------------------------------------------------------------------- helpers
def _cli(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagleflow.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _lines(manifest: Path) -> list[str]:
    return [x for x in manifest.read_text().split("\n") if x] if manifest.exists() else []


def _captured_run(tmp: Path, assets: dict, run_id: str, min_len: int = 4, **capture) -> LocalRun:
    cfgp = write_run_config(tmp, assets["target_model"], shards=2, **capture)
    data = yaml.safe_load(cfgp.read_text())
    data["train"] = TRAIN
    cfgp.write_text(yaml.safe_dump(data))
    cfg = load_config(cfgp)
    run = LocalRun(cfg=cfg, layout=RunLayout.for_run(cfg, run_id), config_path=str(cfgp))
    write_corpus(Path(run.layout.corpus_dir) / "corpus.parquet", N, 300, seed=11, min_len=min_len)
    return run


def _args(run: LocalRun) -> list[str]:
    return ["--config", run.config_path, "--run-id", run.layout.run_id]


def _capture(run: LocalRun, *shards: int) -> list[subprocess.CompletedProcess]:
    start_capture_server(run)
    try:
        wait_capture_server_ready(run, timeout_s=120, poll_s=0.3)
        return [_cli("capture", "run", *_args(run), "--shard", str(s)) for s in shards]
    finally:
        stop_capture_server(run, grace_s=10)


def _assert_exact(run: LocalRun) -> None:
    """Every sample of every shard stored once: one manifest line each, each file matching its digest."""
    seen: list[int] = []
    for shard in range(run.cfg.capture.shards):
        d = Path(run.layout.shard_dir(shard))
        recs = [json.loads(x) for x in _lines(d / "manifest.jsonl")]
        assert sorted(r["index"] for r in recs) == [i for i in range(N) if i % 2 == shard], shard
        for r in recs:
            assert _sha(d / r["file"]) == r["sha256"], r
        seen += [r["index"] for r in recs]
        assert not list(d.glob(".tmp-*")), "no temp file left"
    assert sorted(seen) == list(range(N)), "0 lost, 0 duplicated"


# ------------------------------------------------------------------------------------ Airflow, dag.test()
def _tis(dr) -> dict:
    return {(ti.task_id, ti.map_index): ti for ti in dr.get_task_instances()}


def _mailing_config(tmp_path: Path, demo_assets: dict, smtp: SmtpSink, monkeypatch, **sections) -> Path:
    for k, v in smtp.airflow_conn_env("smtp_faults").items():
        monkeypatch.setenv(k, v)
    watchdog = {"poll_interval_s": 1, "stall_after_s": 20, "startup_grace_s": 20,
                "alert_emails": ["ops@example.test"], "smtp_conn_id": "smtp_faults"}
    return write_short_config(tmp_path, demo_assets, watchdog=watchdog, **sections)


def test_a_shard_failing_all_its_tries_fails_the_run_and_nothing_trains(tmp_path, airflow_db, demo_assets,
                                                                         monkeypatch):
    dag = pipeline_dag()
    run_dir = tmp_path / "runs" / "halfdata"
    # shard 1 cannot store anything, on every try: its directory's name is taken by a file
    (run_dir / "hidden_states").mkdir(parents=True)
    (run_dir / "hidden_states" / "shard_00001").write_text("not a directory\n")
    with SmtpSink() as smtp:
        cfgp = _mailing_config(tmp_path, demo_assets, smtp, monkeypatch)
        try:
            dr = dag.test(run_conf={"config_path": str(cfgp), "run_name": "halfdata"})
        finally:
            kill_recorded(tmp_path / "node-state")
        tis = _tis(dr)
        states = {k: ti.state for k, ti in tis.items()}
        assert dr.state == "failed", states
        assert states[("extract_shard", 0)] == "success"
        failed_shard = tis[("extract_shard", 1)]
        assert failed_shard.state == "failed" and failed_shard.try_number == 3, "all its tries"
        assert states[("verify_hidden_states", -1)] == "failed"
        # GPU cleanup after capture still ran (teardowns), without letting training through
        assert states[("stop_capture_server", -1)] == "success"
        assert states[("free_gpus_after_capture", -1)] == "success"
        for t in ("gpus_idle_after_capture", "train_draft", "export_draft", "evaluate_draft"):
            assert states[(t, -1)] == "upstream_failed", (t, states)
        assert not (run_dir / "draft").exists(), "nothing trained or exported on partial data"
        assert not (run_dir / "hidden_states" / RECORD_FILE).exists()
        # the alert of the failed verification names the shard and the counts
        mail = smtp.wait_for(lambda m: "verify_hidden_states" in m["Subject"])
        body = body_text(mail)
    stats = json.loads((run_dir / "corpus" / "stats.json").read_text())
    half = len([1 for r in range(stats["records"]) if r % 2 == 0])
    assert f"{half}/{stats['records']} samples verified" in body, body
    assert "failed shard(s) 1" in body and f"shard 1: 0/{stats['records'] - half} stored" in body, body
    # shard 0's samples are all there, once each (nothing lost from the shard that worked)
    lines = _lines(run_dir / "hidden_states" / "shard_00000" / "manifest.jsonl")
    assert len(lines) == len({json.loads(x)["index"] for x in lines}) == half


def test_prepare_corpus_failure_lets_nothing_train_and_alerts_once(tmp_path, airflow_db, demo_assets, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n{not json\n')
    dag = pipeline_dag()
    with SmtpSink() as smtp:
        cfgp = _mailing_config(tmp_path, demo_assets, smtp, monkeypatch,
                               corpus={"sources": [{"name": "bad", "path": str(bad)}], "max_length": 128})
        dr = dag.test(run_conf={"config_path": str(cfgp), "run_name": "badcorpus"})
        states = {k[0]: ti.state for k, ti in _tis(dr).items()}
        assert dr.state == "failed", states
        assert states["prepare_corpus"] == "failed"
        for t in ("gpus_idle_after_capture", "train_draft", "export_draft", "evaluate_draft"):
            assert states[t] == "upstream_failed", (t, states)
        # no capture server was started, so its teardowns never ran
        assert states["free_gpus_after_capture"] in ("skipped", "upstream_failed"), states
        assert states["stop_capture_server"] in ("skipped", "upstream_failed"), states
        assert states["verify_hidden_states"] == "failed"
        smtp.wait_for(lambda m: "prepare_corpus" in m["Subject"])
        time.sleep(2)
        subjects = [m["Subject"] for m in smtp.messages]
    assert not any("verify_hidden_states" in s for s in subjects), subjects   # a consequence, not mailed again
    assert not (tmp_path / "runs" / "badcorpus" / "draft").exists()


@pytest.mark.parametrize("case", ["missing_model", "unknown_conf_key", "missing_source", "bad_field",
                                  "missing_config"])
def test_input_errors_fail_the_first_task_at_once_naming_the_field(case, tmp_path, airflow_db, demo_assets,
                                                                   monkeypatch, capfd):
    dag = pipeline_dag()
    with SmtpSink() as smtp:
        overrides: dict = {}
        conf_extra: dict = {}
        if case == "missing_model":
            overrides = {"target_model": str(tmp_path / "no-such-model")}
        elif case == "unknown_conf_key":
            conf_extra = {"shardz": 4}
        elif case == "missing_source":
            overrides = {"corpus": {"sources": [{"name": "gone", "path": str(tmp_path / "gone.jsonl")}]}}
        elif case == "bad_field":
            overrides = {"capture": {"backend": "hf", "shards": 0}}
        cfgp = _mailing_config(tmp_path, demo_assets, smtp, monkeypatch, **overrides)
        if case == "missing_config":
            cfgp = tmp_path / "no-such-config.yaml"
        t0 = time.monotonic()
        dr = dag.test(run_conf={"config_path": str(cfgp), "run_name": f"bad-{case}", **conf_extra})
        elapsed = time.monotonic() - t0
        tis = _tis(dr)
        first = tis[("write_run_config", -1)]
        assert dr.state == "failed"
        assert first.state == "failed" and first.try_number == 1, "an input error is not retried"
        assert tis[("prepare_corpus", -1)].state == "upstream_failed"
        assert tis[("train_draft", -1)].state == "upstream_failed"
        if case in ("missing_config", "bad_field"):   # no readable config, so no recipients: the log says it
            time.sleep(2)
            assert not smtp.messages, [m["Subject"] for m in smtp.messages]
            body, mails = capfd.readouterr().out, 1
        else:
            mail = smtp.wait_for(lambda m: "write_run_config" in m["Subject"])
            body = body_text(mail)
            mails = len(smtp.messages)
    assert elapsed < 120, f"failing took {elapsed:.0f} s"
    if case == "missing_model":
        assert "target_model" in body and "no-such-model" in body and "does not exist" in body, body
    elif case == "unknown_conf_key":
        assert "'shardz'" in body, body
        assert "valid keys are" in body and "shards" in body, body
    elif case == "missing_source":
        assert "corpus.sources[0].path (gone)" in body and "does not exist" in body, body
    elif case == "bad_field":
        # the field and what it expects, never the value (docs/safety.md: a wrongly typed value may be a secret)
        assert "capture.shards: Input should be greater than or equal to 1" in body, body[-3000:]
        assert "AirflowFailException" in body and "not shown" in body, body[-3000:]
    else:
        assert "no-such-config.yaml" in body and "AirflowFailException" in body, body[-3000:]
    assert mails == 1, "one alert"
    assert not (tmp_path / "runs" / f"bad-{case}" / "corpus").exists()


def test_run_name_dot_dot_is_refused_by_the_params(tmp_path, airflow_db, demo_assets):
    from airflow.sdk.definitions.param import ParamValidationError
    cfgp = write_short_config(tmp_path, demo_assets)
    dag = pipeline_dag()
    for bad in ("..", "."):
        with pytest.raises(ParamValidationError, match="run_name"):
            dag.test(run_conf={"config_path": str(cfgp), "run_name": bad})
    assert not (tmp_path / "runs").exists() and not (tmp_path / "run-config.json").exists(), "nothing written"


# ---------------------------------------------------------------------------------------- CLI: data
def test_damaged_manifest_and_flipped_sample_are_reported_refused_and_repaired(tmp_path, demo_assets):
    run = _captured_run(tmp_path, demo_assets, "damage")
    assert all(r.returncode == 0 for r in _capture(run, 0, 1))
    assert _cli("capture", "verify", *_args(run)).returncode == 0
    _assert_exact(run)

    m0 = Path(run.layout.manifest_file(0))
    first_line = _lines(m0)[0]
    with open(m0, "a") as f:          # garbage, a repeated line, then a line cut off mid-append
        f.write("{this is not json\n" + first_line + "\n" + '{"id":"src0:0","index":0,"fi')
    d1 = Path(run.layout.shard_dir(1))
    flipped = json.loads(_lines(Path(run.layout.manifest_file(1)))[2])["file"]
    raw = bytearray((d1 / flipped).read_bytes())
    raw[-3] ^= 0xFF                   # same size, different content
    (d1 / flipped).write_bytes(bytes(raw))

    verify = _cli("capture", "verify", *_args(run))
    assert verify.returncode == 1
    out = verify.stdout
    repeated = json.loads(first_line)["index"]   # the first sample stored: requests in flight finish in any order
    assert "damaged manifest line(s)" in out and f"duplicates: index {repeated}" in out and "cut-off line" in out, out
    assert f"mismatched: {flipped}" in out and "failed shard(s) 0, 1" in out, out
    assert not (Path(run.layout.hidden_states_dir) / RECORD_FILE).exists()

    refused = _cli("train", *_args(run))
    assert refused.returncode == 1 and "have not passed verification" in refused.stderr, refused.stderr
    assert not (Path(run.layout.draft_dir) / "checkpoints").exists(), "0 corrupt trained on"

    again = _capture(run, 0, 1)         # the repair: a re-run of each shard resumes from its manifest
    assert all(r.returncode == 0 for r in again), [r.stderr for r in again]
    assert "manifest rewritten without 2 damaged and 1 repeated line(s)" in again[0].stdout, again[0].stdout
    assert f"1 stored sample(s) will be redone ({flipped}: sha256 differs" in again[1].stdout, again[1].stdout
    _assert_exact(run)
    assert len(_lines(m0)) == N // 2, "one clean line per sample"
    ok = _cli("capture", "verify", *_args(run))
    assert ok.returncode == 0 and f"OK: {N}/{N} samples verified" in ok.stdout, ok.stdout

    # changed after verification: refused, the file named
    other = json.loads(_lines(m0)[1])["file"]
    d0 = Path(run.layout.shard_dir(0))
    time.sleep(0.02)
    raw = bytearray((d0 / other).read_bytes())
    raw[-2] ^= 0x01
    (d0 / other).write_bytes(bytes(raw))
    late = _cli("train", *_args(run))
    assert late.returncode != 0 and other in late.stderr and "written after `capture verify` passed" in late.stderr
    assert not (Path(run.layout.draft_dir) / "checkpoints").exists()

    # repaired and verified again: training takes all N samples, every one intact
    assert all(r.returncode == 0 for r in _capture(run, 0))
    assert _cli("capture", "verify", *_args(run)).returncode == 0
    _assert_exact(run)
    trained = _cli("train", *_args(run))
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert f"{N} samples" in trained.stdout


def test_damaged_newest_checkpoint_falls_back_and_temp_dirs_are_cleaned(tmp_path, demo_assets):
    from tests.fixtures.train_hidden_states import write_synthetic_hidden_states
    data = {"run_root": str(tmp_path / "runs"), "target_model": demo_assets["target_model"],
            "node": {"name": "local", "has_gpu": False, "state_dir": str(tmp_path / "state")}, "train": TRAIN}
    cfgp = tmp_path / "config.yaml"
    cfgp.write_text(yaml.safe_dump(data))
    lay = RunLayout.for_run(load_config(cfgp), "ckpt")
    write_synthetic_hidden_states(lay.hidden_states_dir, demo_assets["target_model"], samples=24)
    args = ["--config", str(cfgp), "--run-id", "ckpt"]
    first = _cli("train", *args, "--stop-after-steps", "7")
    assert first.returncode == 0, first.stdout + first.stderr
    ckpts = Path(lay.draft_dir) / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000006", "step_00000007"]
    model = ckpts / "step_00000007" / "model.safetensors"
    model.write_bytes(b"\0" * model.stat().st_size)             # the newest checkpoint zeroed
    (ckpts / ".tmp-step_00000009-4242").mkdir()                  # a writer killed mid-checkpoint
    (ckpts / ".tmp-step_00000009-4242" / "model.safetensors").write_bytes(b"partial")

    second = _cli("train", *args)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    assert "skipping damaged checkpoint step_00000007" in out and "model.safetensors" in out, out
    assert "resuming from" in out and "at step 6" in out, out
    assert "removed 1 leftover temporary checkpoint dir(s)" in out and ".tmp-step_00000009-4242" in out, out
    assert not list(ckpts.glob(".tmp-*"))
    rows = [json.loads(x) for x in (Path(lay.draft_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, TRAIN["max_steps"] + 1)), "exact resume, no step twice"
    assert "Traceback" not in out

    # export refuses a damaged checkpoint by name (never a raw SafetensorError)
    final = ckpts / "step_00000008" / "model.safetensors"
    final.write_bytes(b"\0" * final.stat().st_size)
    exp = _cli("export", *args)
    assert exp.returncode == 1 and "step_00000008" in exp.stderr and "sha256" in exp.stderr, exp.stderr


@pytest.mark.parametrize("bad", ["..", ".", "/tmp/elsewhere", "a/b", ""])
def test_run_ids_outside_run_root_are_refused_by_the_cli(bad, tmp_path, demo_assets):
    cfgp = write_run_config(tmp_path, demo_assets["target_model"])
    before = sorted(p.name for p in tmp_path.iterdir())
    for cmd in (["capture", "verify"], ["train"], ["corpus", "prepare"]):
        res = _cli(*cmd, "--config", str(cfgp), "--run-id", bad, timeout=60)
        assert res.returncode == 2, (cmd, res.stdout, res.stderr)
        assert f"--run-id = {bad!r}" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "nothing written anywhere"


# ------------------------------------------------------------------------------------- CLI: full disks
class _Tmpfs:
    """A small tmpfs of our own (root only): a disk that really fills up, grown again with a remount."""

    def __init__(self, path: Path, size: str):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}): the disk-full cases need root")

    def grow(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def test_full_dump_dir_is_named_not_reported_as_a_dead_server(tmp_path, demo_assets):
    fs = _Tmpfs(tmp_path / "dumps", "16k")    # smaller than any dump: 30+ tokens x 1 KiB a token
    try:
        run = _captured_run(tmp_path, demo_assets, "fulldump", min_len=30)
        res = _capture(run, 0)[0]
        hb = json.loads(Path(run.layout.heartbeat_file(0)).read_text())
    finally:
        fs.close()
    assert res.returncode == 3, res.stdout + res.stderr
    assert "server.dump_dir" in res.stderr and "is full" in res.stderr, res.stderr
    assert "dead, hung" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert hb["state"] == "failed" and "server.dump_dir" in hb["error"] and "is full" in hb["error"], hb


def test_full_shard_disk_is_a_clear_error_and_resume_loses_nothing(tmp_path, demo_assets):
    run = _captured_run(tmp_path, demo_assets, "fullshard", min_len=30)
    shard_dir = Path(run.layout.shard_dir(0))
    fs = _Tmpfs(shard_dir, "128k")              # room for a few samples of the shard (30-40 KiB each), not all
    try:
        res = _capture(run, 0)[0]
        hb = json.loads(Path(run.layout.heartbeat_file(0)).read_text())
        stored = len(_lines(shard_dir / "manifest.jsonl"))
        assert res.returncode == 3, res.stdout + res.stderr
        assert "disk full (ENOSPC)" in res.stderr and str(shard_dir) in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
        assert hb["state"] == "failed" and "disk full (ENOSPC)" in hb["error"], hb
        assert 0 < stored < N // 2
        fs.grow("64m")                           # space freed: the re-run resumes, loses and repeats nothing
        again = _capture(run, 0, 1)
        assert all(r.returncode == 0 for r in again), [r.stderr for r in again]
        assert f"{stored} already stored" in again[0].stdout, again[0].stdout
        _assert_exact(run)
        assert _cli("capture", "verify", *_args(run)).returncode == 0
    finally:
        fs.close()


def test_full_checkpoint_disk_is_a_clear_error_and_training_resumes(tmp_path, demo_assets):
    from tests.fixtures.train_hidden_states import write_synthetic_hidden_states
    data = {"run_root": str(tmp_path / "runs"), "target_model": demo_assets["target_model"],
            "node": {"name": "local", "has_gpu": False, "state_dir": str(tmp_path / "state")}, "train": TRAIN}
    cfgp = tmp_path / "config.yaml"
    cfgp.write_text(yaml.safe_dump(data))
    lay = RunLayout.for_run(load_config(cfgp), "ckptfull")
    write_synthetic_hidden_states(lay.hidden_states_dir, demo_assets["target_model"], samples=24)
    args = ["--config", str(cfgp), "--run-id", "ckptfull"]
    ckpts = Path(lay.draft_dir) / "checkpoints"
    fs = _Tmpfs(ckpts, "8k")                          # smaller than one checkpoint of the tiny draft
    try:
        full = _cli("train", *args)
        hb = json.loads((Path(lay.draft_dir) / "heartbeat.json").read_text())
        assert full.returncode == 1, full.stdout + full.stderr
        assert "disk full (ENOSPC) writing checkpoint step 3" in full.stderr and "Traceback" not in full.stderr
        assert hb["state"] == "failed" and "disk full (ENOSPC)" in hb["error"], hb
        assert not list(ckpts.iterdir()), "no half checkpoint left behind"
        fs.grow("64m")
        done = _cli("train", *args)
        assert done.returncode == 0, done.stdout + done.stderr
        rows = [json.loads(x) for x in (Path(lay.draft_dir) / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, TRAIN["max_steps"] + 1))
    finally:
        fs.close()
