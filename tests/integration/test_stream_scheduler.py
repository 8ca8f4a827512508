"""A streaming run under Airflow's scheduler (issue 53): training takes samples while the extraction shards still
put them, which dag.test() (one task at a time, a deferred task's watch in line) cannot show.

`airflow standalone` as `make airflow` runs it (eagleflow's supervisor: scheduler, DAG processor, API server,
triggerer; LocalExecutor, parallelism 4) on free 127.0.0.1 ports in the test's own home, stopped by its process
group at the end (with the node jobs its run detached). The run is triggered as a user would through the REST API,
with the conf the trigger form sends: ``{"config_path": ..., "storage": "mooncake"}`` on a config that says disk.

The overlap is forced, not a matter of timing: the corpus's hidden states are several times ``stream.buffer_gib``,
and a put waits while the store holds the buffer, so the shards' last samples can be put only after the trainer
has taken, trained and released at least (corpus - buffer) bytes; a scheduler that ran train_draft only after
the shards would leave capture waiting until StoreFull fails the run. The test reads it from the run's records:
the ledger's ``taken`` and ``trained`` times against the time each shard's manifest was last written (its
mtime: the last line's append), and Airflow's own task times.
"""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
from pathlib import Path
from urllib.parse import quote

import pytest

from eagleflow.airflow.deploy import standalone
from eagleflow.phases.descriptor import HEARTBEAT
from eagleflow.phases.extract.worker import HELD_BACK
from eagleflow.watchdog.incidents import history
from tests.fixtures.api_server import rest, trigger_run, wait_for
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.processes import kill_recorded

pytest.importorskip("mooncake.store", reason="the stream extra (mooncake-transfer-engine-non-cuda) is not installed")

pytestmark = [pytest.mark.slow]

# samples of about 1 KiB a token here (max_length 128: up to ~135 KiB): a step's 4 and one more fit, the corpus
# (about 65 samples, 2.5 MiB) is several buffers
BUFFER_BYTES = 704 << 10


def iso(t: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()


def _streamed_run(tmp_path: Path, demo_assets: dict, *, watchdog: dict | None = None, extra_env: dict | None = None,
                  while_running=None) -> tuple[str, dict, Path]:
    """The streaming pipeline under `airflow standalone`, triggered over REST as a user would; ``while_running()``
    is asked every 0.2 s (its own thread) until the run ends (a fault's moment). The run's state, its task instances, the Airflow home.
    The deployment is stopped by its process group, the node jobs by their records."""
    cfg = write_short_config(tmp_path, demo_assets,
                             stream={"storage": "disk", "buffer_gib": BUFFER_BYTES / (1 << 30), "put_timeout_s": 300},
                             train={"max_steps": 12, "batch_size": 4, "checkpoint_every": 6, "log_every": 1},
                             **({"watchdog": watchdog} if watchdog else {}))
    home, port = tmp_path / "airflow_home", standalone.free_port()
    info = None
    t0 = time.time()
    try:
        info = standalone.start(home, port, wait_s=300, extra_env={"EAGLEFLOW_CONFIG": str(cfg), **(extra_env or {})})
        base = f"http://127.0.0.1:{port}"
        token = rest(base, "/auth/token", method="POST",
                     body={"username": "admin", "password": info["password"]})["access_token"]

        def parsed():
            try:
                return rest(base, "/api/v2/dags/eagle3_pipeline", token)
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise
                return None
        wait_for("the DAG processor parsed eagle3_pipeline", parsed, 240)
        rest(base, "/api/v2/dags/eagle3_pipeline", token, "PATCH", {"is_paused": False})
        run_id = trigger_run(base, token, "eagle3_pipeline", {
            "logical_date": None,
            "conf": {"config_path": str(cfg), "storage": "mooncake", "run_name": "streamed"}})["dag_run_id"]
        runs = f"/api/v2/dags/eagle3_pipeline/dagRuns/{quote(run_id)}"

        done = threading.Event()

        def watch() -> None:
            while while_running is not None and not done.wait(0.2):
                while_running()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            state = wait_for("the run to finish", lambda: (s := rest(base, runs, token)["state"])
                             in ("success", "failed") and s, 1200, 5)
        finally:
            done.set()
            watcher.join(10)
        tis = {(t["task_id"], t["map_index"]): t
               for t in rest(base, f"{runs}/taskInstances?limit=100", token)["task_instances"]}
    finally:
        stopped = standalone.stop(home, grace_s=20)
        kill_recorded(tmp_path / "node-state")
    print(f"[stream-scheduler] the run ended {state} {time.time() - t0:.0f} s after the test began")
    states = {k: t["state"] for k, t in tis.items()}
    log = tmp_path / "runs" / "streamed" / "logs" / "trainer.log"
    assert state == "success", (states, log.read_text()[-3000:] if log.exists() else "no trainer log")
    assert stopped and info is not None and not standalone._group_alive(info["pgid"])
    return state, tis, home


def _exactly_once(run_dir: Path) -> dict[str, int]:
    """Every sample of the run's manifests taken and trained once (the ledger, stream_verified.json): their sizes."""
    manifests = sorted((run_dir / "hidden_states").glob("shard_*/manifest.jsonl"))
    size = {e["id"]: int(e["bytes"]) for m in manifests for line in m.read_text().splitlines() if line.strip()
            for e in [json.loads(line)]}
    events = [json.loads(line) for line in (run_dir / "draft" / "stream_ledger.jsonl").read_text().splitlines()
              if line.strip()]
    taken = sorted(i for e in events if e.get("event") == "taken" for i in e["ids"])
    trained = sorted(i for e in events if e.get("event") == "trained" for i in e["ids"])
    assert sorted(set(trained)) == trained == sorted(size) and set(taken) == set(size), "not exactly once"
    rec = json.loads((run_dir / "hidden_states" / "stream_verified.json").read_text())
    assert rec["ok"] and rec["epochs"] == 1 and rec["trained_per_epoch"] == {"0": len(size)}, rec
    return size


@pytest.mark.timeout(1500)
def test_training_takes_samples_while_the_shards_still_put_them(tmp_path, demo_assets):
    state, tis, home = _streamed_run(tmp_path, demo_assets)
    states = {k: t["state"] for k, t in tis.items()}
    run_dir = tmp_path / "runs" / "streamed"

    # the Param made it a streaming run, which trained beside the shards, not behind the verification
    assert json.loads((run_dir / "run-config.json").read_text())["stream"]["storage"] == "mooncake"
    assert states[("train_from_stream", -1)] == "success" and states[("gpus_idle_after_capture", -1)] == "skipped"
    shards = sorted(k[1] for k in states if k[0] == "extract_shard")
    assert shards == [0, 1] and all(states[("extract_shard", s)] == "success" for s in shards), states
    # a healthy run retries nothing: no gate resumed right after its deferral and failed by the scheduler's
    # stale report of the deferral (eagleflow.airflow.defer_settle; was capture_server_ready in 2 runs of 3)
    retried = {k: t["try_number"] for k, t in tis.items() if (t.get("try_number") or 1) > 1}
    assert not retried, retried

    # what the capture wrote: manifests only, the corpus several buffers
    manifests = sorted((run_dir / "hidden_states").glob("shard_*/manifest.jsonl"))
    assert len(manifests) == 2 and not list((run_dir / "hidden_states").rglob("*.safetensors"))
    lines = [json.loads(line) for m in manifests for line in m.read_text().splitlines() if line.strip()]
    size = {e["id"]: int(e["bytes"]) for e in lines}
    corpus_bytes = sum(size.values())
    assert len(size) == len(lines) and corpus_bytes > 2 * BUFFER_BYTES, (len(lines), corpus_bytes)
    last_line_at = max(m.stat().st_mtime for m in manifests)   # the last shard's last line (appended, then closed)

    # the ledger: exactly once, and when each sample was taken and trained
    events = [json.loads(line) for line in (run_dir / "draft" / "stream_ledger.jsonl").read_text().splitlines()
              if line.strip()]
    taken = [(e["at"], i) for e in events if e.get("event") == "taken" for i in e["ids"]]
    trained = [(e["at"], i) for e in events if e.get("event") == "trained" for i in e["ids"]]
    assert sorted(i for _, i in taken) == sorted(i for _, i in trained) == sorted(size), "not exactly once"
    rec = json.loads((run_dir / "hidden_states" / "stream_verified.json").read_text())
    assert rec["ok"] and rec["epochs"] == 1 and rec["trained_per_epoch"] == {"0": len(size)}, rec

    first_taken = min(t for t, _ in taken)
    taken_before = sum(1 for t, _ in taken if t < last_line_at)
    # released before the last put: trained (the ledger's line comes first), and at least what the buffer could
    # not hold. 10 ms: a file's mtime comes from the kernel's coarse clock, a few ms behind time.time()
    trained_before = sum(size[i] for t, i in trained if t < last_line_at + 0.01)
    print(f"[stream-scheduler] corpus {len(size)} samples, {corpus_bytes:,} bytes through a {BUFFER_BYTES:,}-byte "
          f"buffer; first sample taken {last_line_at - first_taken:.1f} s before the last manifest line; "
          f"{taken_before} samples taken and {trained_before:,} bytes trained before it")
    assert first_taken < last_line_at, (first_taken, last_line_at)
    assert trained_before >= corpus_bytes - BUFFER_BYTES, (trained_before, corpus_bytes, BUFFER_BYTES)

    # Airflow's own records say the same: train_draft ran while the extraction shards ran
    train_start = iso(tis[("train_draft", -1)]["start_date"])
    assert train_start < min(iso(tis[("extract_shard", s)]["end_date"]) for s in shards)
    assert train_start < first_taken
    # the store was stopped by the run: no endpoint left
    assert not (run_dir / "store_endpoint.json").exists()

    # the shards were held back by the full store, and the watch never took that for a stall: no incident, no
    # restart of the capture server or a worker, each shard done in its first try. That they were held back is
    # the workers' own record (each wait for room, ended, added to the heartbeat, whose last write keeps it), not a
    # look's: whether one of the watch's looks (every poll_interval_s, 1 s here) falls while a put waits is timing
    assert all(tis[("extract_shard", s)]["try_number"] == 1 for s in shards), tis
    held = [json.loads((m.parent / HEARTBEAT).read_text()) for m in manifests]
    assert all(h["state"] == "complete" for h in held), held
    held = [h["extra"][HELD_BACK] for h in held if HELD_BACK in h["extra"]]
    print(f"[stream-scheduler] held back: {held}")
    assert sum(h["waits"] for h in held) >= 1 and sum(h["seconds"] for h in held) > 0, held
    watch = "".join(p.read_text(errors="replace") for p in (home / "logs").rglob("task_id=extract_shard/**/*.log*"))
    # the watch's looks (every poll_interval_s) judged the shards: a wait shorter than the stall bound reads
    # HEALTHY (progress is recent), a longer one "held back" (SLOW, the consumer's pace); whether a look falls
    # in a long wait is timing, so the test asks that every look's verdict was one of these, never another
    looks = [e for line in watch.splitlines() if line.startswith("{")
             for e in [json.loads(line).get("event", "")] if " shard " in e and e.split(" ", 1)[0].isupper()]
    odd = [e for e in looks if e.split(" ", 1)[0] not in ("STARTING", "HEALTHY", "COMPLETE")
           and not (e.startswith("SLOW ") and "held back: waiting" in e
                    and "for room in the run's hidden-state store" in e)]
    print(f"[stream-scheduler] {len(looks)} looks, {sum('held back: waiting' in e for e in looks)} said held back")
    assert looks and not odd, odd[:5]
    assert "STALLED" not in watch and "restarted" not in watch, \
        [watch[max(0, i - 600):i + 600] for w in ("STALLED", "restarted") if (i := watch.find(w)) >= 0]
    assert not [e for e in history(tmp_path / "node-state") if e.get("event") == "opened"]


@pytest.mark.timeout(1500)
def test_a_trainer_hung_inside_a_step_is_recovered_by_the_deferred_watch_in_the_same_try(tmp_path, demo_assets):
    """The trainer's in-watch recovery under the scheduler (issue 53): train_draft deferred to the triggerer, whose
    TrainWatchTrigger sees a step hung past its limit (eagleflow.train.trainer's HANG_FILE_ENV: the first trainer to
    take the file hangs inside its step, its heartbeat thread running on); the task resumes on a worker, mails
    STALLED, starts the trainer again from its checkpoint and defers again: one try, a RECOVERED mail as a reply,
    the run green, every sample trained once."""
    from eagleflow.heartbeat import STEP_TIMES
    from eagleflow.train.trainer import HANG_FILE_ENV
    from tests.fixtures.smtp import SmtpSink, body_text
    hang = tmp_path / "hang-a-step"
    heartbeat = tmp_path / "runs" / "streamed" / "draft" / "heartbeat.json"
    hung: dict[str, float] = {}

    def hang_once_paced() -> None:
        """Once the trainer has its pace (3 steps), its next step hangs; once only (the file taken: renamed)."""
        taken = Path(f"{hang}.taken")
        if taken.exists():
            hung.setdefault("at", taken.stat().st_ctime)      # the rename's time
            return
        if hang.exists():
            return
        try:
            extra = json.loads(heartbeat.read_text()).get("extra") or {}
        except (OSError, ValueError):
            return
        if len(extra.get(STEP_TIMES) or []) >= 3:
            hang.write_text("")

    with SmtpSink() as smtp:
        _, tis, home = _streamed_run(
            tmp_path, demo_assets, watchdog={"alert_emails": ["oncall@example.test"], "smtp_conn_id": "smtp_sched"},
            extra_env={HANG_FILE_ENV: str(hang), **smtp.airflow_conn_env("smtp_sched")}, while_running=hang_once_paced)
        assert hung, "the trainer never took the hang file (training ended first)"
        stalled = smtp.wait_for(lambda m: "STALLED training" in m["Subject"], timeout_s=30)
        recovered = smtp.wait_for(lambda m: "RECOVERED training" in m["Subject"], timeout_s=30)
    # the shards, held back by the full store behind the hung trainer, are never called stalled (the second shard
    # waits for the node's put lock, not for room: its heartbeat says held back all the same)
    # (a task's RETRYING mail may come from elsewhere: once, capture_server_ready's resume from its deferral was
    # killed by Airflow, "Server indicated the task shouldn't be running anymore", and retried green)
    subjects = [m["Subject"] for m in smtp.messages]
    watched = [s for s in subjects if " shard " in s or " training " in s]
    assert watched == [stalled["Subject"], recovered["Subject"]], subjects
    body = body_text(stalled)
    assert "stuck inside the step" in body and "in the same task try (no Airflow retry)" in body, body
    assert recovered["In-Reply-To"] == stalled["Message-ID"]
    mailed_s = smtp.received_at[smtp.messages.index(stalled)] - hung["at"]
    assert tis[("train_draft", -1)]["try_number"] == 1 and tis[("train_draft", -1)]["state"] == "success", tis
    log = (tmp_path / "runs" / "streamed" / "logs" / "trainer.log").read_text()
    assert "resuming from" in log, log[-3000:]
    _exactly_once(tmp_path / "runs" / "streamed")
    watch = "".join(p.read_text(errors="replace") for p in (home / "logs").rglob("task_id=train_draft/**/*.log*"))
    assert "recovering in the watch" in watch, watch[-3000:]
    print(f"[stream-scheduler] a step hung -> STALLED mailed {mailed_s:.1f} s after (stall_after_s 20: limit 40 s); "
          f"mails: {[m['Subject'] for m in smtp.messages]}")
