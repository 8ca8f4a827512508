"""The console app (GPU view, JSON, metrics) through FastAPI's TestClient, behind Airflow's real auth manager."""
from __future__ import annotations

import re
import time

import pytest
from fastapi.testclient import TestClient

from eagleflow.gpu.snapshot import GpuProcess, GpuSnapshot
from eagleflow.health.node_activity import NodeActivity, OurProcess
from eagleflow.health.rules import HealthAlert
from eagleflow.health.status_store import StatusStore

pytestmark = pytest.mark.slow  # migrates Airflow's metadata DB (about a minute on 2 cores)

SECRETS = ("sk-SECRET-TOKEN", "/home/alice/private", "--api-key", "10.1.2.3", "train@", ".ssh/id", "--model-path")


@pytest.fixture(scope="module")
def auth(airflow_db):
    """Airflow's configured auth manager (SimpleAuthManager here) and tokens it signed."""
    from airflow.api_fastapi.app import create_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    am = create_auth_manager()
    am.init()
    return {"admin": am.generate_jwt(SimpleAuthManagerUser(username="admin", role="admin")),
            "expired": am.generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"),
                                       expiration_time_in_seconds=-60)}


def _gpu(i, used, util, procs=(), **kw):
    return GpuSnapshot(index=i, uuid=f"GPU-{i}", name=kw.pop("name", "NVIDIA H100"), memory_used_mib=used,
                       memory_total_mib=97887, utilization_pct=util, processes=tuple(procs), **kw)


@pytest.fixture
def store(tmp_path):
    st = StatusStore(tmp_path)
    act = NodeActivity(processes=[OurProcess(pid=5000, pgid=5000, run_id="manual__2026", role="worker_shard_00003")])
    t0 = time.time() - 1800
    for k in range(5):  # half an hour of history: GPU 1 busy, GPU 3 held at 0 %
        st.save("gpu-node-1", [
            _gpu(1, 40000, 80 + k, [GpuProcess(5000, "python3 -m eagleflow.cli capture run --shard 3", 39000, user="eagle")],
                 temperature_c=60, power_w=350.5),
            _gpu(3, 90000, 0, [GpuProcess(4242, "/opt/venv/bin/python3 -m sglang --api-key sk-SECRET-TOKEN "
                                                "--model-path /home/alice/private", 89990, user="alice", state="D")],
                 name="<script>alert(1)</script>", power_w=None)],
            {}, [HealthAlert("gpu-node-1", "GPU-3", 3, "memory_held_idle", "node gpu-node-1 GPU 3: pid 4242 --api-key")],
            activity=act, now=t0 + 420 * k, interval_s=60, held_threshold_mib=1024)
    st.save("cpu-box", [], None, [], has_gpu=False, activity=NodeActivity(), interval_s=60)
    st.save("gpu-node-2", [_gpu(0, 10, 0)], {}, [], now=time.time() - 900, interval_s=60)
    st.save("gpu-node-2", error="SSH authentication failed for train@10.1.2.3:22 key /home/me/.ssh/id", interval_s=60)
    return st


def client(store, dag=None, **kw):
    from eagleflow.airflow.console_app import create_app
    return TestClient(create_app(store, dag_state=lambda: dag if dag is not None else {"is_paused": False}),
                      follow_redirects=False, **kw)


def test_every_route_needs_an_airflow_login(store, auth):
    c = client(store)
    for path in ("/panel", "/api/status", "/metrics"):
        assert c.get(path).status_code == 401
        assert c.get(path, headers={"Authorization": "Bearer forged.jwt.value"}).status_code == 403
        assert c.get(path, headers={"Authorization": f"Bearer {auth['expired']}"}).status_code == 401
        assert c.get(path, headers={"Authorization": f"Bearer {auth['admin']}"}).status_code == 200
        assert c.get(path, cookies={"_token": auth["admin"]}).status_code == 200  # what the UI's iframe sends
    page = c.get("/")
    assert page.status_code == 303 and "/auth/" in page.headers["location"] and "next=" in page.headers["location"]
    assert c.get("/", cookies={"_token": auth["admin"]}).status_code == 200
    assert c.get("/docs").status_code == 404 and c.get("/openapi.json").status_code == 404


def test_view_shows_every_node_held_gpus_and_owners(store, auth):
    html = client(store).get("/", cookies={"_token": auth["admin"]}).text
    nodes = re.findall(r"data-node='([^']+)'", html)
    assert nodes == ["cpu-box", "gpu-node-1", "gpu-node-2"]
    assert "CPU-only node" in html
    assert "unreachable (SSH login refused)" in html and "last seen" in html
    held = re.findall(r"<tr class='gpu held' data-uuid='([^']+)'", html)
    assert held == ["GPU-3"]
    assert "held since" in html and "holds memory at 0 % since" in html
    assert "ours: run manual__2026 · extract_shard[3]" in html
    assert "not eagleflow's</span> python3 · user alice · pid 4242" in html
    assert html.count("<svg class='spark'") == 6  # memory + utilisation for 3 GPUs (gpu-node-2's last readings too)
    assert "setInterval(reload" in html and "data-ts=" in html and 'PANEL_URL = "/panel"' in html


def test_nothing_sensitive_leaks_and_values_are_escaped(store, auth):
    c = client(store)
    for path in ("/", "/panel", "/api/status", "/metrics"):
        body = c.get(path, cookies={"_token": auth["admin"]}).text
        for secret in SECRETS:
            assert secret not in body, (path, secret)
        if path in ("/", "/panel"):  # JSON and the text format carry the value as data, not markup
            assert "<script>alert(1)</script>" not in body
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in c.get("/panel", cookies={"_token": auth["admin"]}).text


def test_paused_late_and_missing_health_dag_are_warned(store, auth, tmp_path):
    token = {"_token": auth["admin"]}
    assert "gpu_node_health is paused" in client(store, {"is_paused": True}).get("/panel", cookies=token).text
    from eagleflow.airflow.console_app import create_app
    missing = TestClient(create_app(store, dag_state=lambda: None)).get("/panel", cookies=token).text
    assert "not loaded in Airflow" in missing
    late = StatusStore(tmp_path / "late")
    late.save("n", [_gpu(0, 1, 0)], {}, [], now=time.time() - 600, interval_s=60)
    assert "gpu_node_health is late" in client(late).get("/panel", cookies=token).text
    empty = client(StatusStore(tmp_path / "none")).get("/panel", cookies=token).text
    assert "no reading yet" in empty
    assert "late" not in client(store).get("/panel", cookies=token).text


def test_json_has_history_and_no_private_fields(store, auth):
    data = client(store).get("/api/status", headers={"Authorization": f"Bearer {auth['admin']}"}).json()
    n1 = next(n for n in data["nodes"] if n["node"] == "gpu-node-1")
    assert len(n1["history"]["t"]) == 5 and n1["history"]["gpus"]["GPU-1"]["util"] == [80, 81, 82, 83, 84]
    assert set(n1["held_since"]) == {"GPU-3"}
    assert "config_path" not in n1 and "state" not in n1
    (p,) = n1["gpus"][1]["processes"]
    assert p == {"pid": 4242, "program": "python3", "user": "alice", "state": "D", "used_mib": 89990, "ours": False,
                 "run_id": None, "role": None, "task": None, "shard": None}


def test_metrics_use_dcgm_names_and_omit_unknown(store, auth):
    text = client(store).get("/metrics", headers={"Authorization": f"Bearer {auth['admin']}"}).text
    assert '# TYPE DCGM_FI_DEV_FB_USED gauge' in text
    assert ('DCGM_FI_DEV_FB_USED{gpu="3",UUID="GPU-3",device="nvidia3",modelName="<script>alert(1)</script>",'
            'Hostname="gpu-node-1"} 90000') in text
    assert 'DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-1",device="nvidia1",modelName="NVIDIA H100",Hostname="gpu-node-1"} 57887' in text
    assert 'DCGM_FI_DEV_POWER_USAGE{gpu="1"' in text and 'DCGM_FI_DEV_POWER_USAGE{gpu="3"' not in text  # unknown: absent
    assert 'DCGM_FI_DEV_GPU_TEMP{gpu="3"' not in text
    assert 'Hostname="gpu-node-2"} ' not in text.split("eagleflow_node_up")[0]  # unreachable: no stale readings
    assert 'eagleflow_node_up{Hostname="gpu-node-2"} 0' in text and 'eagleflow_node_up{Hostname="cpu-box"} 1' in text
    assert re.search(r'eagleflow_gpu_held_idle_seconds\{gpu="3",.*\} \d+', text)
    assert 'eagleflow_node_health_verdict{Hostname="gpu-node-1",verdict="memory_held_idle"} 1' in text



def test_airflow_loads_the_plugin_with_its_menu_entry():
    from airflow import plugins_manager
    plugins, errors = plugins_manager._get_plugins()
    assert not {k: v for k, v in errors.items() if "eagleflow_gpu" in k}
    apps, _ = plugins_manager.get_fastapi_plugins()
    assert any(a.get("url_prefix") == "/eagleflow-gpu" for a in apps)
    (plugin,) = [p for p in plugins if p.name == "eagleflow_gpu"]
    assert plugin.external_views[0]["href"] == "/eagleflow-gpu/" and plugin.external_views[0]["category"] == "browse"


def test_page_reloads_its_panel_under_the_mount_prefix(store, auth):
    from fastapi import FastAPI

    from eagleflow.airflow.console_app import create_app
    parent = FastAPI()  # the API server mounts plugin apps like this
    parent.mount("/eagleflow-gpu", create_app(store, dag_state=lambda: {"is_paused": False}))
    c = TestClient(parent, cookies={"_token": auth["admin"]})
    assert 'PANEL_URL = "/eagleflow-gpu/panel"' in c.get("/eagleflow-gpu/").text
    assert c.get("/eagleflow-gpu/panel").status_code == 200


def test_a_bad_refresh_setting_is_named(monkeypatch, store):
    from eagleflow.airflow.console_app import create_app
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv("EAGLEFLOW_GPU_VIEW_REFRESH_S", bad)
        with pytest.raises(ValueError, match=f"EAGLEFLOW_GPU_VIEW_REFRESH_S='{bad}' is not allowed: it must be a number > 0"):
            create_app(store)


def test_open_incidents_are_listed_first_with_their_mail_count_in_json_and_metrics(store, auth):
    from eagleflow.health import incidents as hi
    t0 = time.time() - 3600
    held = hi.Finding(key="gpu-node-1:memory_held_idle", scope="gpus:gpu-node-1", node="gpu-node-1",
                      kind="memory_held_idle", topic="gpu-node-1: GPU memory held at 0 % with no eagleflow job",
                      subject="gpu-node-1: 1 GPU holds 88 GiB at 0 % for 60 min", detail="pid 4242 `python3` (alice)")
    book = {}
    for minute in range(0, 61):   # an hour of checks: opened, one reminder after 30 min
        book, _ = hi.step(book, [held], observed={"gpus:gpu-node-1"}, now=t0 + 60 * minute, remind_after_s=1800)
    store.save_incidents(book)
    c = client(store)
    html = c.get("/panel", cookies={"_token": auth["admin"]}).text
    assert "Open incidents (1)" in html
    item = re.search(r"<li class='incident open' data-node='gpu-node-1' data-kind='memory_held_idle'>(.*?)</li>", html)
    assert item and "gpu-node-1: 1 GPU holds 88 GiB at 0 % for 60 min: open since" in item.group(1)
    assert re.search(r"mailed 2 time\(s\); next reminder in (29|30) min", item.group(1)), item.group(1)
    status = c.get("/api/status", headers={"Authorization": f"Bearer {auth['admin']}"}).json()
    assert [(i["node"], i["kind"], i["reminders"]) for i in status["incidents"]] == [("gpu-node-1", "memory_held_idle", 1)]
    assert "detail" not in status["incidents"][0]     # the evidence (pids, users) stays in the mail
    text = c.get("/metrics", headers={"Authorization": f"Bearer {auth['admin']}"}).text
    assert re.search(r'eagleflow_health_incident_open_seconds\{Hostname="gpu-node-1",kind="memory_held_idle",'
                     r'incident="[0-9a-f]{12}"\} 36\d\d', text)
    store.save_incidents({})
    assert "no open incident" in c.get("/panel", cookies={"_token": auth["admin"]}).text
