"""The run's Mooncake master SIGKILLed mid-epoch (issue 53): detected, mailed, the store restarted as a new
incarnation, what it lost captured again, and every sample trained exactly once.

The node side as tests/integration/test_stream_run.py drives it: `eagleflow store start` (the real master and
segment holder from the wheel, 127.0.0.1 free ports, recorded processes), the tiny hf capture server, two
`eagleflow capture run` workers putting into the store, `eagleflow train` streaming from it. The trainer's control
plane is the real one, as tests/integration/test_stream_faults.py runs it: `TrainDraftOperator` (non-deferrable:
the triggerer's watch in this process) at the watch's real-run defaults (poll_interval_s 20, stall_after_s 15),
Airflow's retry mail (`EagleflowNotifier("retry")`) to a real SMTP server (aiosmtpd), the retry the same operator
with try_number 2: it restarts the store and reruns, through `eagleflow reconcile claim`, the extraction shards
left without a worker (here both: their workers failed on the dead store). Run twice: with the watch's own
recoveries (`watchdog.train_recoveries_in_watch`, default 2) the same recovery (`TrainDraftOperator._recover`)
runs inside the first try, which ends green with no retry; with them set to 0 the try fails and the retry, the
last resort, recovers. The master is killed by the PID its record names; only what the test started (and
recorded) is stopped.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from eagleflow.airflow.runtime import RunContext
from eagleflow.engines.hf.server import DELAY_ENV
from eagleflow.local_run import LocalRun
from eagleflow.nodes.process_record import load_record, status
from eagleflow.phases.extract.lifecycle import stop_capture_server
from eagleflow.stores.ledger import read_ledger, require_exactly_once
from tests.fixtures.capture_corpus import write_corpus, write_run_config
from tests.fixtures.processes import kill_recorded
from tests.fixtures.smtp import body_text
from tests.fixtures.stream_run import (InThread, airflow_smtp, kill_workers, retry_mail, run_cli as _run, start_server,
                                       start_workers, store_start, wait_until as _wait)
from tests.integration.test_stream_run import BUFFER_BYTES

pytest.importorskip("mooncake.store", reason="the stream extra (mooncake-transfer-engine-non-cuda) is not installed")

from eagleflow.stores.mooncake.master import MooncakeEndpoint, metrics  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SAMPLES = 32
BOUND_S = 60.0               # issue 53: detected and mailed within 60 s
CONN = "smtp_stream_master"


def _manifest_lines(hs: Path) -> dict[str, dict]:
    """Every shard's manifest lines by sample id."""
    out: dict[str, dict] = {}
    for m in sorted(hs.glob("shard_*/manifest.jsonl")):
        for x in m.read_text().splitlines():
            if x.strip():
                d = json.loads(x)
                out[d["id"]] = d
    return out


class Run:
    def __init__(self, tmp: Path, assets: dict, in_watch: bool):
        cfgp = write_run_config(tmp, assets["target_model"], shards=2)
        data = yaml.safe_load(cfgp.read_text())
        data["stream"] = {"storage": "mooncake", "buffer_gib": BUFFER_BYTES / (1 << 30), "shuffle_window": 4}
        data["train"] = {"device": "cpu", "max_steps": SAMPLES // 2, "batch_size": 2, "ttt_length": 2,
                         "draft_vocab_size": 64, "checkpoint_every": 4, "log_every": 1, "warmup_steps": 1}
        data["watchdog"] = {"alert_emails": ["oncall@example.test"], "smtp_conn_id": CONN,
                            **({} if in_watch else {"train_recoveries_in_watch": 0})}   # 0: the retry path
        cfgp.write_text(yaml.safe_dump(data))
        self.ctx = RunContext.from_params({"config_path": str(cfgp)}, "master-killed")
        self.ctx.write_run_config()
        assert self.ctx.cfg.watchdog.poll_interval_s == 20 and self.ctx.cfg.stream.store_down_timeout_s == 120
        self.local = LocalRun(cfg=self.ctx.cfg, layout=self.ctx.layout, config_path=str(cfgp))
        self.args = ["--config", str(cfgp), "--run-id", self.ctx.layout.run_id]
        rows = write_corpus(Path(self.ctx.layout.corpus_dir) / "corpus.parquet", SAMPLES, 300)
        self.ids = {r["id"] for r in rows}
        self.ledger = Path(self.ctx.layout.stream_ledger_file)
        self.hs = Path(self.ctx.layout.hidden_states_dir)
        self.workers: list[subprocess.Popen] = []

    def endpoint(self) -> MooncakeEndpoint:
        return MooncakeEndpoint.read(self.ctx.layout.store_endpoint_file)

    def start(self) -> "Run":
        store_start(self.args)
        start_server(self.local)
        return self

    def start_workers(self) -> None:
        self.workers = start_workers(self.args)

    def end_workers(self, timeout: float = 400) -> list[tuple[int, str]]:
        out = []
        for w in self.workers:
            o, e = w.communicate(timeout=timeout)
            out.append((w.returncode, o + e))
        return out

    def context(self, try_number: int) -> dict:
        from types import SimpleNamespace
        ti = SimpleNamespace(dag_id="eagle3_pipeline", run_id=self.ctx.layout.run_id, task_id="train_draft",
                             map_index=-1, try_number=try_number, max_tries=2)
        return {"ti": ti, "params": {"config_path": self.local.config_path}, "run_id": self.ctx.layout.run_id}

    def stop(self) -> None:
        from eagleflow.train.job import stop_trainer
        kill_workers(self.workers)
        stop_trainer(self.ctx, grace_s=5)
        stop_capture_server(self.local, grace_s=10)
        stopped = _run("store", "stop", *self.args, "--grace", "5")
        kill_recorded(Path(self.ctx.cfg.node.state_dir))   # the trainer's sentinel and anything else recorded
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr


@pytest.fixture
def smtp(monkeypatch):
    with airflow_smtp(monkeypatch, CONN) as sink:
        yield sink


def _train_try(run: Run, try_number: int) -> InThread:
    from eagleflow.airflow.train_operators import TrainDraftOperator
    op = TrainDraftOperator(task_id="train_draft", deferrable=False)
    return InThread(lambda: op.run(run.ctx, run.context(try_number)))


def _retry_mail(run: Run, error: BaseException) -> None:
    retry_mail(run.context(1), error)


def _gone(pid: int, binary: str) -> bool:
    try:
        return binary not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return True


def _in_watch(run: Run, smtp, try1: InThread, killed_at: float) -> tuple[float, float, list]:
    """The watch's own recovery: mailed, the store restarted and the shards rerun inside the first try, which
    ends green; then the end of the fault is mailed as a reply."""
    mail = smtp.wait_for(lambda m: "training" in m["Subject"], timeout_s=BOUND_S + 30)
    mailed_s = smtp.received_at[0] - killed_at
    assert mail["Subject"] == "[eagleflow] STALLED training on local", mail["Subject"]
    body = body_text(mail)
    assert "hidden-state store is down" in body and "mooncake-master is not running" in body, body
    assert mailed_s <= BOUND_S, mailed_s
    _wait(lambda: _store_id(run) not in ("", run.first.store_id), 120, "the store restarted by the watch")
    restarted_s = time.time() - killed_at
    assert try1.ended_at is None, try1.error                  # the same try: no retry
    ended = run.end_workers()
    try1.join(400)
    assert try1.error is None and try1.result["status"] == "complete", try1.error
    over = smtp.wait_for(lambda m: "RECOVERED" in m["Subject"], timeout_s=30)
    assert over["Subject"].startswith("[eagleflow] RECOVERED training on local"), over["Subject"]
    assert over["In-Reply-To"] == mail["Message-ID"]
    return mailed_s, restarted_s, ended


def _store_id(run: Run) -> str:
    try:
        return run.endpoint().store_id
    except (OSError, ValueError, KeyError):
        return ""                  # between the dead store's cleanup and the new endpoint


@pytest.mark.parametrize("in_watch", [True, False], ids=["in_watch", "retry"])
def test_the_master_killed_mid_epoch_is_mailed_restarted_and_loses_no_sample(tmp_path, demo_assets, smtp,
                                                                              monkeypatch, in_watch):
    from eagleflow.watchdog.diagnosis import StallDetected
    monkeypatch.setenv(DELAY_ENV, "0.1")   # capture a little slower than training: the trainer streams
    run = Run(tmp_path, demo_assets, in_watch)
    try:
        run.start()
        first = run.first = run.endpoint()
        try1 = _train_try(run, 1)
        _wait(lambda: Path(run.ctx.layout.train_heartbeat_file).exists(), 120, "the trainer started")
        run.start_workers()

        def mid_epoch() -> bool:
            """Some trained, and samples in the store not taken yet: they cannot be trained once it is gone."""
            e0 = read_ledger(run.ledger).epoch(0) if run.ledger.exists() else None
            waiting = set(_manifest_lines(run.hs)) - (e0.taken if e0 else set())
            return bool(e0 and e0.trained and len(waiting) >= 2 and len(e0.trained) < SAMPLES // 2)
        _wait(lambda: mid_epoch() or try1.ended_at is not None, 300, "a commit with later batches taken")
        assert try1.ended_at is None, try1.error
        master_pid, segment_pid = load_record(first.master_pid_file).pid, load_record(first.segment_pid_file).pid
        os.kill(master_pid, signal.SIGKILL)          # the PID its record names
        killed_at = time.time()
        at_kill = read_ledger(run.ledger).epoch(0)
        if in_watch:
            mailed_s, restarted_s, ended = _in_watch(run, smtp, try1, killed_at)
            second = run.endpoint()
            assert all(status(f).alive for _, f in second.recorded()), second
            assert load_record(second.master_pid_file).pid != master_pid and _gone(segment_pid, "mooncake_client")
            log = Path(run.ctx.layout.log_file("trainer")).read_text()
            assert "back as a new incarnation" in log and "resuming from" not in log, log[-3000:]
            require_exactly_once(run.ledger, run.ids, epochs=1)      # 0 lost, 0 trained twice
            record = json.loads(Path(run.ctx.layout.stream_verified_file).read_text())
            assert record["ok"] and record["trained_per_epoch"] == {"0": SAMPLES}
            assert int(metrics(second)["master_key_count"]) == 0 and not list(run.hs.rglob("*.safetensors"))
            print(f"\nmaster SIGKILL -> mailed by the watch {mailed_s:.1f} s -> store restarted by the watch "
                  f"{restarted_s:.1f} s -> the same try green {try1.ended_at - killed_at:.1f} s; at the kill "
                  f"{len(at_kill.trained)} trained, {len(at_kill.pending)} taken; workers at the kill: "
                  f"{[rc for rc, _ in ended]}")
            return
        # the watch: the store is down, not the trainer; the try fails with it
        try1.join(120)
        assert isinstance(try1.error, StallDetected), try1.error
        detected_s = try1.ended_at - killed_at
        assert try1.error.subject == "[eagleflow] STALLED training on local", try1.error.subject
        assert "the run's hidden-state store is down, not the trainer" in try1.error.diagnosis
        assert "mooncake-master is not running" in try1.error.diagnosis, try1.error.diagnosis
        _retry_mail(run, try1.error)
        mail = smtp.wait_for(lambda m: "training" in m["Subject"], timeout_s=30)
        mailed_s = smtp.received_at[0] - killed_at
        assert mail["Subject"] == "[eagleflow] STALLED training on local" and mailed_s <= BOUND_S, mailed_s
        assert "hidden-state store is down" in body_text(mail)
        assert detected_s <= BOUND_S, detected_s
        # the trainer waits for its store (its heartbeat says so)
        _wait(lambda: json.loads(Path(run.ctx.layout.train_heartbeat_file).read_text())["extra"].get(
            "waiting_for_store_since"), 30, "the trainer's heartbeat says it waits for the store", every=0.5)
        # the capture workers fail on the dead store, naming it (a shard's try fails; its retry re-runs it)
        ended = run.end_workers()
        before = _manifest_lines(run.hs)
        assert {d.get("store_id") for d in before.values()} == {first.store_id}
        # the retry: its look says the store is down; it restarts the store and keeps the trainer
        try2 = _train_try(run, 2)
        _wait(lambda: run.endpoint().store_id != first.store_id, 120, "the store restarted")
        restarted_s = time.time() - killed_at
        second = run.endpoint()
        # a new master and segment holder, recorded; the dead store's segment holder stopped by its record
        assert status(second.master_pid_file).alive and status(second.segment_pid_file).alive
        assert load_record(second.master_pid_file).pid != master_pid and _gone(segment_pid, "mooncake_client")
        trained_at_restart = set(read_ledger(run.ledger).epoch(0).trained)
        # the shards' workers failed on the dead store: the retry's reconcile claims rerun them (recorded workers)
        try2.join(400)
        assert try2.error is None and try2.result["status"] == "complete", try2.error
        recovered_s = try2.ended_at - killed_at
        log = Path(run.ctx.layout.log_file("trainer")).read_text()
        assert "back as a new incarnation" in log and "resuming from" not in log, log[-3000:]
        after = _manifest_lines(run.hs)
        # lost: lines of the dead store the shards' resume dropped (not trained in the last epoch);
        # re-captured: samples recorded in the dead store and now in the new one
        lost = {i for i, d in before.items() if after[i].get("store_id") != first.store_id}
        recaptured = {i for i, d in after.items() if i in before and d.get("store_id") == second.store_id}
        kept = {i for i, d in after.items() if d.get("store_id") == first.store_id}
        assert lost and lost == recaptured, (sorted(lost), sorted(recaptured))
        assert kept <= set(read_ledger(run.ledger).epoch(0).trained) and kept >= trained_at_restart & set(before)
        logs = [Path(run.ctx.layout.log_file(f"worker_shard_{s:05d}")).read_text() for s in (0, 1)]
        redone = sum(int(o.split(" stored sample(s) will be redone")[0].rsplit("; ", 1)[-1])
                     for o in logs if " stored sample(s) will be redone" in o)
        assert redone == len(lost), [o[-2000:] for o in logs]
        # 0 lost, 0 trained twice; none left in the new store; no hidden state on disk
        require_exactly_once(run.ledger, run.ids, epochs=1)
        record = json.loads(Path(run.ctx.layout.stream_verified_file).read_text())
        assert record["ok"] and record["trained_per_epoch"] == {"0": SAMPLES}
        assert int(metrics(second)["master_key_count"]) == 0
        assert not list(run.hs.rglob("*.safetensors"))
        print(f"\nmaster SIGKILL -> detected (try failed) {detected_s:.1f} s -> mailed {mailed_s:.1f} s -> store "
              f"restarted {restarted_s:.1f} s -> training complete {recovered_s:.1f} s; at the kill "
              f"{len(at_kill.trained)} trained, {len(at_kill.pending)} taken; {len(before)} recorded, "
              f"{len(lost)} lost and re-captured, {len(kept)} kept (trained); workers at the kill: "
              f"{[rc for rc, _ in ended]}")
    finally:
        run.stop()
