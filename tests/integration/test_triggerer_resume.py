"""A killed triggerer's watches resume within a minute (issue 52 item 7), for real.

`make airflow`'s supervisor (eagleflow.airflow.deploy.standalone, with the deployment's own Airflow settings: no
override here) runs Airflow's parts; two extraction shards extract under deferred ShardWatchTriggers. The test
SIGKILLs the triggerer mid-extraction (it started this Airflow, so it may). The supervisor starts a new one within
seconds, but Airflow hands it the dead one's triggers only once that one's last heartbeat is older than
``[triggerer] triggerer_health_check_threshold``: with Airflow's 5 s heartbeat and 30 s threshold the drill's
watch stayed blind for 111.6 s under load. With the deployment's 3 s / 15 s (``deploy.home.TRIGGERER_SETTINGS``)
every shard's watch looks again (its look lands in the node's look log) within ``WATCH_RESUME_BOUND_S`` (60 s)
of the kill, and both shards complete with every sample once.
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from eagleflow.airflow.deploy import standalone
from eagleflow.airflow.deploy.home import TRIGGERER_SETTINGS, WATCH_RESUME_BOUND_S
from tests.fixtures.capture_corpus import write_run_config
from tests.fixtures.processes import kill_recorded

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
N = 160   # two shards of 80 at ~0.3 s a sample on one serial server: both still run a minute after the kill
WATCH = {"poll_interval_s": 2.0, "stall_after_s": 10.0, "health_timeout_s": 2.0, "startup_grace_s": 60.0}

DAG_FILE = """
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, Param

from eagleflow.airflow.base import RunOperator
from eagleflow.airflow.shard_operators import ServerReadySensor, ShardOperator, StartServerOperator, StopServerOperator
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator
from tests.fixtures.capture_corpus import write_corpus


class WriteTestCorpus(RunOperator):
    def run(self, ctx, context):
        write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", N, 300, seed=5)


with DAG("triggerer_resume", schedule=None, catchup=False, default_args={"retry_delay": timedelta(seconds=1)},
         params={"config_path": Param(CONFIG, type="string")}) as dag:
    start = StartServerOperator(phase="extract", task_id="start_capture_server")
    ready = ServerReadySensor(phase="extract", task_id="capture_server_ready", deferrable=False, poke_interval=0.3)
    shards = [ShardOperator(phase="extract", task_id=f"extract_shard_{i}", shard=i) for i in (0, 1)]
    (WriteRunConfigOperator(task_id="write_run_config") >> WriteTestCorpus(task_id="write_corpus") >> start >> ready
     >> shards >> StopServerOperator(phase="extract", task_id="stop_capture_server").as_teardown(setups=start))
"""


def _call(url, method="GET", body=None, token=None):
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def _wait(pred, timeout_s: float, what: str, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def _parts(home: Path) -> dict:
    try:
        return json.loads(standalone.parts_file(home).read_text())["parts"]
    except (OSError, ValueError, KeyError):
        return {}


def _triggerer_jobs(home: Path) -> list[tuple[float, float]]:
    """(start, latest heartbeat) of each TriggererJob in the metadata DB, as unix times, oldest first."""
    from datetime import datetime, timezone

    def unix(text: str) -> float:
        return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()
    with sqlite3.connect(f"file:{home / 'airflow.db'}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT start_date, latest_heartbeat FROM job WHERE job_type = 'TriggererJob' "
                          "ORDER BY id").fetchall()
    return [(unix(a), unix(b)) for a, b in rows if a and b]


def _looks(state_dir: Path, shard: int) -> list[dict]:
    out = []
    for f in (state_dir / "watch").glob(f"*.worker_shard_{shard:05d}.looks.jsonl"):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return [x for x in out if x.get("by") == "watch"]


@pytest.mark.timeout(900)
def test_a_killed_triggerer_resumes_every_watch_within_a_minute(tmp_path, demo_assets):
    from eagleflow.engines.hf.server import DELAY_ENV

    home = tmp_path / "airflow_home"
    port = standalone.free_port()
    dags = tmp_path / "dags"
    dags.mkdir()
    state_dir, run_root = tmp_path / "state", tmp_path / "runs"
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=2, request_timeout_base_s=120)
    data = yaml.safe_load(cfgp.read_text())
    data["watchdog"] = WATCH
    data.setdefault("corpus", {})["sources"] = demo_assets["sources"][:1]
    cfgp.write_text(yaml.safe_dump(data))
    (dags / "triggerer_resume.py").write_text(f"CONFIG = {str(cfgp)!r}\nN = {N}\n" + DAG_FILE)
    # the deployment's triggerer settings as `make airflow` sets them: nothing about the triggerer overridden
    extra = {"AIRFLOW__CORE__DAGS_FOLDER": str(dags), "PYTHONPATH": str(REPO), DELAY_ENV: "0.3"}
    assert not [k for k in os.environ if k.startswith("AIRFLOW__TRIGGERER__")]
    try:
        info = standalone.start(home, port, wait_s=300, extra_env=extra)
        base = f"http://127.0.0.1:{port}"
        token = _call(f"{base}/auth/token", "POST", {"username": "admin", "password": info["password"]})[
            "access_token"]

        def dag_loaded():
            try:
                return _call(f"{base}/api/v2/dags/triggerer_resume", token=token)
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise
                return None
        _wait(dag_loaded, 180, "the DAG processor parsed the test DAG", every_s=2)
        _call(f"{base}/api/v2/dags/triggerer_resume", "PATCH", {"is_paused": False}, token)
        run_id = _call(f"{base}/api/v2/dags/triggerer_resume/dagRuns", "POST",
                       {"logical_date": None, "conf": {}}, token)["dag_run_id"]

        # both shards extract under the triggerer's watch: their looks land in the node's look logs
        _wait(lambda: all(len(_looks(state_dir, s)) >= 3 for s in (0, 1)), 400, "three looks of each deferred watch")
        old = _parts(home)["triggerer"]
        os.kill(old["pid"], signal.SIGKILL)
        killed_at = time.time()
        # each look names the process that ran its command (the killed triggerer's trigger runner): a look by
        # another one is the new triggerer's
        old_lookers = {x["pid"] for s in (0, 1) for x in _looks(state_dir, s)}

        new = _wait(lambda: (p := _parts(home)["triggerer"]) and p["pid"] not in (None, old["pid"]) and p, 60,
                    "the supervisor restarted the triggerer")
        restarted_s = new["started_at"] - killed_at
        resumed = {}
        for s in (0, 1):
            first = _wait(lambda: [x for x in _looks(state_dir, s) if x["at"] > killed_at
                                   and x["pid"] not in old_lookers], WATCH_RESUME_BOUND_S + 120,
                          f"shard {s}'s watch looked again")
            resumed[s] = first[0]["at"] - killed_at
        # where the time went: the dead one's last beat (its triggers are handed over once it is older than the
        # threshold) and the new one's own start (its first row in the metadata DB)
        jobs = _triggerer_jobs(home)
        last_beat = max(b for a, b in jobs if a < killed_at)
        new_start = min(a for a, b in jobs if a > killed_at)
        threshold = float({**TRIGGERER_SETTINGS, **extra}["AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD"])
        print(f"triggerer SIGKILLed at +0 s (its last heartbeat at {last_beat - killed_at:+.1f} s, so its triggers "
              f"were free from {last_beat + threshold - killed_at:+.1f} s); restarted by the supervisor at "
              f"+{restarted_s:.1f} s, its job in the DB from +{new_start - killed_at:.1f} s; watches looked again at "
              + ", ".join(f"shard {s}: +{t:.1f} s" for s, t in resumed.items()))
        assert all(t <= WATCH_RESUME_BOUND_S for t in resumed.values()), resumed

        def run_state():
            return _call(f"{base}/api/v2/dags/triggerer_resume/dagRuns/{run_id}", token=token)["state"]
        state = _wait(lambda: (st := run_state()) in ("success", "failed") and st, 400, "the run finished", every_s=2)
        assert state == "success"
        for s in (0, 1):
            manifest = next(run_root.glob(f"*/hidden_states/shard_{s:05d}/manifest.jsonl")).read_text()
            ids = [json.loads(line)["id"] for line in manifest.splitlines() if line.strip()]
            assert len(ids) == N // 2 == len(set(ids))
    finally:
        standalone.stop(home)
        kill_recorded(state_dir)
