"""Unreachable is not stalled: partitions of the node host while a shard extracts, under Airflow's dag.test().

The shard's worker and the capture server run detached inside the node's
namespace; the shard watch (ShardWatchTrigger, deferred) polls them over SSH.
Then, mid-shard:
- the cable is pulled (veth down) for longer than the unreachable bound, or
  the node's sshd is killed and started again later: the watch says
  "UNREACHABLE ... since T" (never STALLED), one mail goes out, nothing on the
  node is restarted, the worker goes on storing samples while nobody can see
  it; when the node answers again the watch finds that progress and the shard
  completes with every sample stored exactly once, in the same task try;
- the SSH connection is dropped while a watch command runs (twice): the watch
  reconnects with its backoff, no mail, no verdict, the shard completes.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.fixtures.capture_corpus import write_run_config
from tests.fixtures.dag_bundle import load_bundle_dag
from tests.fixtures.node_host import node_host_fixture  # noqa: F401  (fixture)
from tests.fixtures.processes import alive, kill_recorded
from tests.fixtures.smtp import SmtpSink, body_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
N = 36
WATCH = {"poll_interval_s": 1.0, "stall_after_s": 4.0, "health_timeout_s": 2.0, "startup_grace_s": 60.0,
         "gpu_window_s": 4.0, "d_state_after_s": 4.0, "recoveries_in_watch": 1,
         "alert_emails": ["oncall@example.test"], "smtp_conn_id": "smtp_node_host_test",
         "airflow_base_url": "http://airflow.test:8080"}
OUTAGE_S = 22.0      # longer than the unreachable bound (stall_after + 2 x poll = 6 s) plus dead-link detection
DELAY_S = "0.7"      # per forward: the shard (N samples) takes ~25 s, so it spans the outage

DAG_FILE = """
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, Param

from eagleflow.airflow.alerts import pipeline_failure_callbacks
from eagleflow.airflow.base import RunOperator
from eagleflow.airflow.shard_operators import ServerReadySensor, ShardOperator, StartServerOperator, StopServerOperator
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator
from tests.fixtures.capture_corpus import write_corpus


class WriteTestCorpus(RunOperator):
    def run(self, ctx, context):
        write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", N, 300, seed=5)


with DAG("node_host_partition", schedule=None, catchup=False,
         default_args={"retry_delay": timedelta(seconds=1), **pipeline_failure_callbacks()},
         params={"config_path": Param(CONFIG, type="string")}) as dag:
    start = StartServerOperator(phase="extract", task_id="start_capture_server")
    extract = ShardOperator(phase="extract", task_id="extract_shard", shard=0, retries=1)
    (WriteRunConfigOperator(task_id="write_run_config") >> WriteTestCorpus(task_id="write_corpus") >> start
     >> ServerReadySensor(phase="extract", task_id="capture_server_ready", deferrable=False, poke_interval=0.3)
     >> extract >> StopServerOperator(phase="extract", task_id="stop_capture_server").as_teardown(setups=start))
"""


def _load_dag(tmp_path: Path, cfgp: Path, monkeypatch):
    return load_bundle_dag(monkeypatch, tmp_path / "dags", "node_host_partition.py",
                           f"CONFIG = {str(cfgp)!r}\nN = {N}\n" + DAG_FILE)


def _stored(run_root: Path) -> int:
    m = list(run_root.glob("*/hidden_states/shard_00000/manifest.jsonl"))
    return len([x for x in m[0].read_text().splitlines() if x.strip()]) if m else 0


def _pid_of(state_dir: Path, role_suffix: str) -> int | None:
    recs = list((state_dir / "pids").glob(f"*.{role_suffix}.json"))
    return json.loads(recs[0].read_text())["pid"] if recs else None


class _Partition(threading.Thread):
    """Once shard 0 has stored ``after`` samples: cut the node off (link or sshd) for OUTAGE_S, then restore it."""

    def __init__(self, host, fault: str, state_dir: Path, run_root: Path, after: int = 3):
        super().__init__(daemon=True)
        self.host, self.fault, self.state_dir, self.run_root, self.after = host, fault, state_dir, run_root, after
        self.done = threading.Event()
        self.cut_at = self.restored_at = self.reconnected_at = None
        self.stored_at_cut = self.stored_at_restore = None
        self.server_pid = self.worker_pid = None
        self.pids_after: tuple | None = None     # (server, worker) once the node is back
        self.drops: list[float] = []
        self.error: BaseException | None = None

    def _watch_running(self) -> bool:
        for pid in self.host.pids():
            try:
                if b"\0watch\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                pass
        return False

    def run(self):
        try:
            while not self.done.is_set() and _stored(self.run_root) < self.after:
                time.sleep(0.05)
            if self.done.is_set():
                return
            self.server_pid = _pid_of(self.state_dir, "capture_server")
            self.worker_pid = _pid_of(self.state_dir, "worker_shard_00000")
            if self.fault == "drop":
                for _ in range(2):      # kill the connection while an `eagleflow watch` runs on the node
                    while not self._watch_running() and not self.done.is_set():
                        time.sleep(0.01)
                    self.drops.append(time.time())
                    self.host.drop_connections()
                    time.sleep(4.0)     # a good look in between: each drop is a blip of its own
                self.pids_after = (_pid_of(self.state_dir, "capture_server"),
                                   _pid_of(self.state_dir, "worker_shard_00000"))
                return
            self.stored_at_cut, self.cut_at = _stored(self.run_root), time.time()
            if self.fault == "link":
                self.host.link_down()
            else:
                self.host.kill_sshd()
            time.sleep(OUTAGE_S)
            self.stored_at_restore = _stored(self.run_root)
            self.pids_after = (_pid_of(self.state_dir, "capture_server"), _pid_of(self.state_dir, "worker_shard_00000"))
            if self.fault == "link":
                self.host.link_up()
            else:
                self.host.start_sshd()
            self.restored_at = time.time()
            while not self.done.is_set() and time.time() - self.restored_at < 60:   # the watch's first look back
                if self._watch_running():
                    self.reconnected_at = time.time()
                    return
                time.sleep(0.02)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


@pytest.mark.parametrize("fault", ["link", "sshd", "drop"])
def test_partition_mid_shard_is_unreachable_not_stalled_and_the_shard_completes_exactly(
        fault, airflow_db, demo_assets, node_host_fixture, tmp_path, monkeypatch):  # noqa: F811
    host = node_host_fixture
    from eagleflow.engines.hf.server import DELAY_FILE_ENV
    Path(host.env[DELAY_FILE_ENV]).write_text(DELAY_S)
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=1, in_flight=2,
                            request_timeout_base_s=120)
    data = yaml.safe_load(cfgp.read_text())
    data["watchdog"] = WATCH
    data["corpus"] = {"sources": demo_assets["sources"]}   # checked by the run's preflight (the DAG writes its own)
    data["node"] = {"name": "gpu-node-ns", "conn_id": "node_host_part", "python": sys.executable,
                    "has_gpu": False, "state_dir": str(tmp_path / "state")}
    cfgp.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("AIRFLOW_CONN_NODE_HOST_PART", host.airflow_conn())
    state_dir, run_root = tmp_path / "state", tmp_path / "runs"
    dag = _load_dag(tmp_path, cfgp, monkeypatch)

    part = _Partition(host, fault, state_dir, run_root)
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env(WATCH["smtp_conn_id"]).items():
            monkeypatch.setenv(k, v)
        part.start()
        try:
            dr = dag.test()
        finally:
            part.done.set()
            part.join(OUTAGE_S + 15)
            Path(host.env[DELAY_FILE_ENV]).write_text("")
            if fault == "link":
                host.link_up()
            host.start_sshd()
            kill_recorded(state_dir)
    assert part.error is None, part.error
    assert part.worker_pid, "the partition never started: the shard finished before 3 samples?"
    run_dir = next(run_root.iterdir())
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    assert tis["extract_shard"].state == "success", {k: t.state for k, t in tis.items()}
    assert tis["extract_shard"].try_number == 1, "a partition must not cost a task try"

    subjects = [m["Subject"] for m in smtp.messages]
    assert not [s for s in subjects if "STALLED" in s or "DEAD" in s or "FAILED" in s], subjects
    # no recovery action on the node: the same server and worker processes, no incident opened
    assert not (state_dir / "incidents" / "incidents.jsonl").exists()
    assert not list((state_dir / "locks").glob("*.restarts.jsonl")) if (state_dir / "locks").exists() else True
    assert part.pids_after == (part.server_pid, part.worker_pid)

    if fault == "drop":
        assert len(part.drops) == 2 and not subjects, subjects   # a blip within the bound: no verdict, no mail
    else:
        # one mail, after the bound: the node is unreachable since the cut, not the job stalled; and one
        # more, in the same thread, once the watch reaches the node again
        assert len(subjects) == 2 and subjects[0] == "[eagleflow] UNREACHABLE shard 0/1 on gpu-node-ns", subjects
        assert subjects[1].startswith("[eagleflow] REACHABLE again: shard 0/1 on gpu-node-ns, "), subjects
        assert smtp.messages[1]["In-Reply-To"] == smtp.messages[0]["Message-ID"]
        assert part.restored_at <= smtp.received_at[1] <= part.restored_at + 30, (smtp.received_at[1], part.restored_at)
        body = body_text(smtp.messages[0])
        assert "has not answered since" in body and "not a verdict on the job" in body
        assert "nothing is restarted" in body
        since_txt = body.split("has not answered since ")[1][:8]
        since = time.mktime(time.strptime(time.strftime("%Y-%m-%d ", time.localtime(part.cut_at)) + since_txt,
                                          "%Y-%m-%d %H:%M:%S"))
        # "since" is the node's last answer before the cut (a look runs every poll_interval_s, ~1 s here)
        assert part.cut_at - 5 <= since <= part.cut_at + 1, (since_txt, part.cut_at)
        from eagleflow.config import load_config
        from eagleflow.nodes.ssh import DEAD_LINK_S, KEEPALIVE_S
        w = load_config(cfgp).watchdog
        bound = w.stall_after_s + 2 * w.poll_interval_s
        assert smtp.received_at[0] - since >= bound - 1, (smtp.received_at[0] - since, bound)
        mailed = smtp.received_at[0] - part.cut_at   # the bound, or the dead link's detection if that is longer
        assert mailed <= bound + KEEPALIVE_S + DEAD_LINK_S + 8, (mailed, bound)
        print(f"{fault}: cut at {part.cut_at:.1f}, last answer {since_txt}, mail {mailed:.1f} s after the cut; "
              f"{part.stored_at_restore - part.stored_at_cut} samples stored while unreachable")
        assert smtp.received_at[0] < part.restored_at, "the mail must come during the outage"
        # the watch reconnected soon after the node came back (backoff capped at the poll interval / 5 s)
        assert part.reconnected_at is not None and part.reconnected_at - part.restored_at < 8, \
            (part.reconnected_at, part.restored_at)
        # the detached worker kept storing samples while nobody could see it
        assert part.stored_at_restore > part.stored_at_cut, (part.stored_at_cut, part.stored_at_restore)

    # exactly the shard's samples, each once, no partial file
    shard_dir = run_dir / "hidden_states" / "shard_00000"
    entries = [json.loads(x) for x in (shard_dir / "manifest.jsonl").read_text().splitlines() if x.strip()]
    assert sorted(e["index"] for e in entries) == list(range(N))
    assert sorted(p.name for p in shard_dir.glob("*.safetensors")) == [f"{i:08d}.safetensors" for i in range(N)]
    assert not list(shard_dir.glob(".tmp-*"))
    assert not alive(part.worker_pid)
