"""A fresh deployment starts with no failed run (issue 50): `make airflow`'s supervisor starts the API server first and
the scheduler only once the API server answers, so the first gpu_node_health run (unpaused on creation, due at once)
is never handed to a task supervisor that cannot reach the execution API (it killed the task: "Pre Execute" was its
log's last line). A real HTTP server that answers only after a delay stands for the loading API server."""
from __future__ import annotations

import http.server
import threading
import time

import pytest

from eagleflow.airflow.deploy.standalone import PARTS, api_answers, start_parts
from tests.fixtures.smtp import free_port


class _FakeProc:
    pid = 4242

    def __init__(self, dies: bool = False):
        self.dies = dies

    def poll(self):
        return 1 if self.dies else None


class _FakePart:
    def __init__(self, name, started, dies=False):
        self.name, self.started, self.dies, self.proc = name, started, dies, None

    def start(self, env):
        self.started.append((self.name, time.time()))
        self.proc = _FakeProc(self.dies)
        return self.proc


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/api/v2/monitor/health" else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *a):
        pass


@pytest.mark.timeout(60)
def test_the_scheduler_starts_only_once_the_api_server_answers():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    assert not api_answers(base)
    servers = []

    def answer_later():
        time.sleep(2.0)
        srv = http.server.HTTPServer(("127.0.0.1", port), _Health)
        servers.append(srv)
        srv.serve_forever(poll_interval=0.1)

    started: list[tuple[str, float]] = []
    parts = {n: _FakePart(n, started) for n in PARTS}
    t = threading.Thread(target=answer_later, daemon=True)
    t0 = time.time()
    t.start()
    lines: list[str] = []
    try:
        assert start_parts(parts, {"AIRFLOW__API__BASE_URL": base}, lines.append, threading.Event(), poll_s=0.2)
    finally:
        while not servers:
            time.sleep(0.05)
        servers[0].shutdown()
    names = [n for n, _ in started]
    assert names[0] == "api-server" and sorted(names[1:]) == sorted(set(PARTS) - {"api-server"})
    first_other = min(at for n, at in started if n != "api-server")
    assert first_other >= t0 + 2.0, "the scheduler started before the API server answered"
    assert any("answers at" in line for line in lines), lines


@pytest.mark.timeout(30)
def test_an_api_server_that_never_answers_or_dies_does_not_hold_the_others_forever():
    base = f"http://127.0.0.1:{free_port()}"   # nothing listens
    started: list[tuple[str, float]] = []
    lines: list[str] = []
    parts = {n: _FakePart(n, started) for n in PARTS}
    assert not start_parts(parts, {"AIRFLOW__API__BASE_URL": base}, lines.append, threading.Event(), wait_s=1.0,
                           poll_s=0.2)
    assert len(started) == len(PARTS) and "starting the other parts anyway" in lines[-len(PARTS)]
    # it died at once: no waiting for the bound, the supervisor's loop restarts it
    started.clear()
    parts = {n: _FakePart(n, started, dies=n == "api-server") for n in PARTS}
    t0 = time.time()
    assert not start_parts(parts, {"AIRFLOW__API__BASE_URL": base}, lines.append, threading.Event(), wait_s=20.0)
    assert time.time() - t0 < 5 and len(started) == len(PARTS)
    # told to stop while waiting: nothing else starts
    started.clear()
    stop = threading.Event()
    stop.set()
    parts = {n: _FakePart(n, started) for n in PARTS}
    start_parts(parts, {"AIRFLOW__API__BASE_URL": base}, lines.append, stop, wait_s=20.0)
    assert [n for n, _ in started] == ["api-server"]
