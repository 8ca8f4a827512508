"""A fleet on the scale-out deployment: CeleryExecutor on PostgreSQL and Redis, one Celery worker per node
queue, so the two nodes really work at once (under dag.test() their tasks run one after another).

n1 is this machine (the training node), n2 the node host in its own network namespace behind its sshd
(tests/fixtures/node_host.py). The pipeline is triggered through the REST API as the web UI does. n2's
cable is pulled while one of its shards extracts: n1's worker, n1's shards and the triggerer's watch of
them must go on as if nothing happened, n2's shard must complete in its first try once the cable is back,
and the training node must hold every sample once. And n2 refusing its GPU gate: its shards are handed over
from n2's worker and extracted by the training node's.

Both runs go through one deployment (Postgres, Redis, the Airflow parts and a worker per node queue started
once), one after the other, as a deployment serves run after run: the DAG's node groups are parsed from the
first run's config, and each run brings its own config (same nodes, own folders) in its trigger's conf.
Both end at verification: right after each trigger, training is marked skipped through the REST API (as a
person marks a task's state in the UI), so the scheduler skips what waits on it. Training, export and
evaluation are proven by the whole runs (test_node_host_pipeline, the two-node-hosts run, the browser's).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from eagleflow.airflow.deploy.scaleout import GpuNodeRoute
from eagleflow.engines.hf.server import DELAY_FILE_ENV
from tests.fixtures.fleet_run import manifest_ids, stored, two_node_fleet, wait_for_stored, wait_for_watch
from tests.fixtures.gpu_scenarios import gpu, write_scenario
from tests.fixtures.node_host import node_host_fixture  # noqa: F401  (fixture)
from tests.fixtures.processes import kill_recorded
from tests.fixtures.scaleout import celery_deployment, when
from tests.fixtures.smtp import SmtpSink

pytestmark = [pytest.mark.slow]

ROUTES = [GpuNodeRoute(queue="fleet-n1", pool="fleet-n1", pool_slots=1),
          GpuNodeRoute(queue="fleet-n2", pool="fleet-n2", pool_slots=1)]
OUTAGE_S = 25.0        # longer than the unreachable bound (stall_after 8 + 2 x poll 1 = 10 s) plus dead-link detection
N1_CRAWL_S = "2.0"     # n1's forwards until the cable is pulled: n1 is mid-shard when it happens
N1_PACE_S = "0.3"      # and after: what n1 stores during the outage is n1 not held up by n2
THROUGH_VERIFIED_SKIPS = "train_draft"   # marked skipped at the trigger: the runs end at verification


def by_state(tis: list[dict], task_id: str) -> list[str]:
    return [t["state"] for t in tis if t["task_id"] == task_id]


def _n1_stored(run_dir: Path) -> int:
    return sum(stored(run_dir / "hidden_states" / f"shard_{k:05d}") for k in (0, 1))


@pytest.mark.timeout(2400)
def test_one_scaleout_deployment_survives_a_partition_then_hands_a_gated_nodes_shards_over(tmp_path, demo_assets,
                                                                                          node_host_fixture):  # noqa: F811
    host = node_host_fixture
    part, gate = tmp_path / "part", tmp_path / "gate"
    part.mkdir()
    gate.mkdir()
    part_cfg = _partition_config(part, demo_assets)
    gate_cfg = two_node_fleet(gate, demo_assets, "node_host_celery", idle_timeout_s=3, routed=True)
    n1_delay = tmp_path / "n1_forward_delay_s"
    n1_delay.write_text("")
    try:
        with SmtpSink() as smtp, celery_deployment(
                tmp_path / "deploy", ROUTES, part_cfg,
                env={"AIRFLOW_CONN_NODE_HOST_CELERY": host.airflow_conn(),
                     **smtp.airflow_conn_env("smtp_fleet_celery")},
                # n1's capture server starts from n1's worker and reads its pace from this file
                worker_env={"fleet-n1": {DELAY_FILE_ENV: str(n1_delay)}}) as deploy:
            _partition_run(deploy, part, part_cfg, host, smtp, n1_delay)
            _gate_run(deploy, gate, gate_cfg, host)
    finally:
        for run in (part, gate):
            kill_recorded(run / "state-n2")
            kill_recorded(run / "state-n1")


def _partition_config(tmp_path: Path, demo_assets) -> Path:
    cfg_path = two_node_fleet(tmp_path, demo_assets, "node_host_celery", idle_timeout_s=30, routed=True)
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["watchdog"] = {"poll_interval_s": 1.0, "stall_after_s": 8.0, "health_timeout_s": 2.0,
                       "startup_grace_s": 90.0, "alert_emails": ["oncall@example.test"],
                       "smtp_conn_id": "smtp_fleet_celery"}
    cfg_path.write_text(yaml.safe_dump(cfg))
    return cfg_path


def _partition_run(deploy, tmp_path: Path, cfg_path: Path, host, smtp, n1_delay: Path) -> None:
    """n2's cable pulled while one of its shards extracts: n1, its shards and their watch go on as if nothing
    happened; n2's shard completes in its first try once the cable is back; every sample once."""
    write_scenario(host.env["FAKE_NVIDIA_SMI_SCENARIO"], {"gpus": [gpu(i, 3) for i in range(8)], "processes": []})
    home, other = tmp_path / "runs" / "celery-part", tmp_path / "runs-n2" / "celery-part"
    n2_delay = Path(host.env[DELAY_FILE_ENV])
    n1_delay.write_text(N1_CRAWL_S)
    n2_delay.write_text("0.7")   # n2's shard spans the outage
    cut: dict = {}
    done = threading.Event()

    def partition():
        try:
            k = wait_for_stored(other, (2, 3), 3, done)
            if k is None or not wait_for_watch(tmp_path / "state-n2", k, done):
                return
            host.link_down()
            cut.update(shard=k, at=time.time(), stored=stored(other / "hidden_states" / f"shard_{k:05d}"),
                       n1_stored=_n1_stored(home))
            n1_delay.write_text(N1_PACE_S)
            time.sleep(OUTAGE_S)
            cut["n1_stored_at_restore"] = _n1_stored(home)
            cut["stored_at_restore"] = stored(other / "hidden_states" / f"shard_{k:05d}")
            host.link_up()
            cut["restored_at"] = time.time()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            cut["error"] = e

    thread = threading.Thread(target=partition, daemon=True)
    try:
        thread.start()
        run_id = deploy.trigger("eagle3_pipeline", {"config_path": str(cfg_path), "run_name": "celery-part"})
        deploy.skip("eagle3_pipeline", run_id, THROUGH_VERIFIED_SKIPS)
        state = deploy.wait("eagle3_pipeline", run_id, timeout_s=1500)
        done.set()
        thread.join(OUTAGE_S + 10)
        tis = deploy.task_instances("eagle3_pipeline", run_id)
        summary = {(t["task_id"], t["map_index"]): (t["state"], t["try_number"], t["queue"], t["hostname"])
                   for t in tis}
        assert state == "success", f"{summary}\n" + deploy.tails()
    finally:
        done.set()
        n1_delay.write_text("")
        n2_delay.write_text("")
        host.link_up()
    assert "error" not in cut, cut
    print(f"partition of n2: {cut}")   # pytest -s: what each node stored around the outage
    assert cut.get("shard") in (2, 3), "the partition never started: n2's shards finished before 3 samples?"

    # each node's tasks went to its queue and ran on its worker; the run's own tasks on the training node's
    for t in tis:
        node = t["task_id"].split(".", 1)[0] if t["task_id"].startswith(("n1.", "n2.")) else "n1"
        assert t["queue"] == f"fleet-{node}", summary
        if t["state"] == "skipped" and not t["hostname"]:
            continue   # skipped by the scheduler without running (take_over_shard mapped over no shard)
        assert t["hostname"] == f"airflow-worker-fleet-{node}", summary
    assert by_state(tis, "take_over_shards") == ["success"], summary   # it looked, and found nothing to take
    # each node's GPU work held its node's pool (what the single-node scale-out test checked): one slot, deferred
    # waits included, so n1's two shards ran one after the other while n2's ran beside them
    pools = {(t["task_id"], t["map_index"]): t["pool"] for t in tis}
    for node in ("n1", "n2"):
        for task in ("gpus_idle", "start_capture_server", "extract_shard"):
            assert {p for (tid, _), p in pools.items() if tid == f"{node}.{task}"} == {f"fleet-{node}"}, pools
    assert pools[("train_draft", -1)] == "fleet-n1", pools
    n1_shards = sorted((t for t in tis if t["task_id"] == "n1.extract_shard"), key=lambda t: when(t["start_date"]))
    assert len(n1_shards) == 2 and when(n1_shards[1]["start_date"]) >= when(n1_shards[0]["end_date"]) - 1, n1_shards
    # n1 was not held up: it stored on at its own pace while n2 could not be seen
    assert cut["n1_stored_at_restore"] >= cut["n1_stored"] + 10, cut
    by_key = {(t["task_id"], t["map_index"]): t for t in tis}
    hit = by_key[("n2.extract_shard", cut["shard"] - 2)]
    assert hit["try_number"] == 1, "a partition must not cost a task try"
    for k in (0, 1):
        assert by_key[("n1.extract_shard", k)]["try_number"] == 1, summary
    # the shard n2 was extracting overlapped n1's work in time: the nodes ran at once
    n1_window = [when(by_key[("n1.extract_shard", k)]["start_date"]) for k in (0, 1)] + \
        [when(by_key[("n1.extract_shard", k)]["end_date"]) for k in (0, 1)]
    assert when(hit["start_date"]) < max(n1_window) and min(n1_window) < when(hit["end_date"]), summary
    assert cut["stored_at_restore"] > cut["stored"], cut   # n2's worker stored on while nobody could see it

    subjects = [m["Subject"] for m in smtp.messages]
    assert not [s for s in subjects if "STALLED" in s or "DEAD" in s or "FAILED" in s], subjects
    assert not [s for s in subjects if " on n1" in s], subjects      # no alarm about the node that was fine
    assert f"[eagleflow] UNREACHABLE shard {cut['shard']}/4 on n2" in subjects, subjects
    assert [s for s in subjects if s.startswith(f"[eagleflow] REACHABLE again: shard {cut['shard']}/4 on n2, ")], \
        subjects
    stats = json.loads((home / "corpus" / "stats.json").read_text())
    ids = manifest_ids(home, range(4))
    assert len(ids) == len(set(ids)) == stats["records"]   # 0 lost, 0 duplicated, on the training node
    assert by_state(tis, "verify_hidden_states") == ["success"] and by_state(tis, "train_draft") == ["skipped"]


def _gate_run(deploy, tmp_path: Path, cfg_path: Path, host) -> None:
    """The takeover on the same deployment: a foreign process holds n2's GPU 0, so n2's gate fails naming
    it (never signalled); n2's own worker then proves n2's shards free (reconcile hand-over on n2) and the
    training node's worker checks its GPUs idle again and extracts them: green, every sample once, no worker of
    those shards ever started on n2, each task on its node's queue and worker."""
    import subprocess
    import sys

    from tests.fixtures.gpu_scenarios import proc
    scenario = host.env["FAKE_NVIDIA_SMI_SCENARIO"]
    home, other = tmp_path / "runs" / "celery-gate", tmp_path / "runs-n2" / "celery-gate"
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])
    try:
        write_scenario(scenario, {"gpus": [gpu(0, 90000, util=0)] + [gpu(i, 3) for i in range(1, 8)],
                                  "processes": [proc(foreign.pid, 0, 89990, "python3 -m vllm.entrypoints", live=True)]})
        run_id = deploy.trigger("eagle3_pipeline", {"config_path": str(cfg_path), "run_name": "celery-gate"})
        deploy.skip("eagle3_pipeline", run_id, THROUGH_VERIFIED_SKIPS)
        state = deploy.wait("eagle3_pipeline", run_id, timeout_s=1500)
        tis = deploy.task_instances("eagle3_pipeline", run_id)
        summary = {(t["task_id"], t["map_index"]): (t["state"], t["try_number"], t["queue"], t["hostname"])
                   for t in tis}
        assert state == "success", f"{summary}\n" + deploy.tails()
        assert foreign.poll() is None   # a gate never kills, and free_gpus only kills what we recorded
    finally:
        foreign.kill()
        foreign.wait()
        write_scenario(scenario, {"gpus": [gpu(0)], "processes": []})
    by_key = {(t["task_id"], t["map_index"]): t for t in tis}
    assert "failed" in (by_key[("n2.free_gpus", -1)]["state"], by_key[("n2.gpus_idle", -1)]["state"]), summary
    assert not [k for k, t in by_key.items() if k[0] == "n2.extract_shard" and t["state"] == "success"], summary
    for task_id, map_index in (("gpus_idle_before_takeover", -1), ("take_over_shard", 0), ("take_over_shard", 1),
                               ("release_takeover_server", -1)):
        t = by_key[(task_id, map_index)]
        assert (t["state"], t["queue"], t["hostname"]) == ("success", "fleet-n1", "airflow-worker-fleet-n1"), summary
    assert json.loads((home / "takeover.json").read_text()) == {"shards": {"2": "n2", "3": "n2"}}
    for k in (2, 3):   # handed over on n2, and no worker of them ever started there
        mark = tmp_path / "state-n2" / "locks" / f"celery-gate.worker_shard_{k:05d}.handed-over"
        assert json.loads(mark.read_text())["to"] == "n1", k
        assert not (other / "logs" / "n2" / f"worker_shard_{k:05d}.log").exists(), k
    stats = json.loads((home / "corpus" / "stats.json").read_text())
    ids = manifest_ids(home, range(4))
    assert len(ids) == len(set(ids)) == stats["records"]   # 0 lost, 0 duplicated, on the training node
    assert by_state(tis, "verify_hidden_states") == ["success"] and by_state(tis, "train_draft") == ["skipped"]
