"""gpu_node_health's rules (memory held at 0 % with nobody of ours on it; rising ECC) and its store."""
from __future__ import annotations

import json

from eagleflow.gpu.snapshot import GpuProcess, GpuSnapshot
from eagleflow.health.rules import HealthRules, assess
from eagleflow.health.status_store import StatusStore

RULES = HealthRules(memory_threshold_mib=1024, window_s=600)


def snap(used, util=0, procs=(), ecc=0, index=0):
    return GpuSnapshot(index=index, uuid=f"GPU-{index}", name="NVIDIA RTX PRO 6000", memory_used_mib=used,
                       memory_total_mib=97887, utilization_pct=util, ecc_uncorrected=ecc, processes=tuple(procs))


def run(snaps_over_time, **kw):
    state, alerts = {}, []
    for t, snaps in snaps_over_time:
        alerts, state = assess("n1", snaps, state, now=t, rules=RULES, **kw)
    return alerts, state


def test_seeds_incident_alerts_after_the_window_not_before():
    held = [snap(90000, 0, [GpuProcess(4242, "python3", 89990, user="bob", state="D", wchan="nv_wait")])]
    alerts, _ = run([(0, held), (599, held)])
    assert alerts == []
    alerts, state = run([(0, held), (300, held), (600, held)])
    (a,) = alerts
    assert a.kind == "memory_held_idle" and "90000 MiB held at 0 % utilisation for 600 s" in a.message
    assert "pid 4242 (bob" in a.message and state["GPU-0"]["held_idle_since"] == 0


def test_any_utilisation_or_low_memory_resets_the_window():
    held = [snap(90000, 0)]
    alerts, _ = run([(0, held), (400, [snap(90000, 35)]), (700, held), (1000, held)])
    assert alerts == []  # held again only since 700
    alerts, _ = run([(0, held), (400, [snap(3, 0)]), (700, held)])
    assert alerts == []


def test_a_registered_eagleflow_job_is_the_watchdogs_business():
    held = [snap(90000, 0, [GpuProcess(5000, "python3", 89990, pgid=4990)])]
    assert run([(0, held), (900, held)], job_pids={4990}, any_job_alive=True)[0] == []
    assert len(run([(0, held), (900, held)], job_pids={1234}, any_job_alive=True)[0]) == 1
    # no process visible (container) but a live job is registered: no alert
    hidden = [snap(90000, 0)]
    assert run([(0, hidden), (900, hidden)], any_job_alive=True)[0] == []


def test_ecc_rise_alerts_once_per_rise_and_unknown_util_is_not_idle():
    alerts, state = run([(0, [snap(3, 0, ecc=0)]), (300, [snap(3, 0, ecc=2)])])
    (a,) = alerts
    assert a.kind == "ecc_rising" and "from 0 to 2" in a.message
    alerts, _ = assess("n1", [snap(3, 0, ecc=2)], state, now=600, rules=RULES)
    assert alerts == []
    none_util = [snap(90000, None)]
    assert run([(0, none_util), (900, none_util)])[0] == []


def test_store_keeps_only_the_program_name(tmp_path):
    store = StatusStore(tmp_path)
    store.save("gpu-node/1", [snap(90000, 0, [GpuProcess(7, "/usr/bin/python3 serve.py --api-key sk-SECRET", 10)])],
               {"GPU-0": {"held_idle_since": 1.0}}, [])
    (path,) = tmp_path.glob("*.json")
    assert path.name == "eagleflow.gpu_status.gpu-node_1.json"
    doc = json.loads(path.read_text())
    assert doc["gpus"][0]["processes"][0]["program"] == "python3" and "sk-SECRET" not in path.read_text()
    assert store.load("gpu-node/1")["state"] == {"GPU-0": {"held_idle_since": 1.0}}
