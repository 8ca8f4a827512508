"""The node host itself: its own address and stack, a pinned host key, teardown by name and PID, and
SSHNode over the link (commands, a timeout that ends the remote work there, partitions and reconnects)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from eagleflow.nodes import NodeCommandTimeout, NodeError
from eagleflow.nodes.ssh import SSHNode
from tests.fixtures.gpu_scenarios import gpu, write_scenario
from tests.fixtures.node_host import _ip, node_host, node_host_fixture  # noqa: F401  (fixture)
from tests.fixtures.processes import IGNORE_TERM, alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def node(node_host_fixture, monkeypatch):  # noqa: F811
    monkeypatch.setenv("AIRFLOW_CONN_NODE_HOST_TEST", node_host_fixture.airflow_conn())
    with SSHNode("node_host_test", name="gpu-node-ns", python=sys.executable) as n:
        yield n


def test_the_node_is_another_host_with_its_own_stack(node_host_fixture, node):  # noqa: F811
    h = node_host_fixture
    res = node.run(["sh", "-c", 'echo "$SSH_CONNECTION"; cat /proc/net/dev'], timeout=20)
    client_ip, _, server_ip, server_port = res.stdout.splitlines()[0].split()
    assert (client_ip, server_ip, int(server_port)) == (h.host_ip, h.node_ip, h.port)
    assert h.veth_node in res.stdout and h.veth_host not in res.stdout   # the node sees only its end of the link
    # the sessions find the fake nvidia-smi first on PATH and the package's CLI on the venv's python
    write_scenario(h.env["FAKE_NVIDIA_SMI_SCENARIO"], {"gpus": [gpu(0, 5), gpu(1, 7)], "processes": []})
    smi = node.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"], timeout=20)
    assert smi.stdout == "0, 5\n1, 7\n"
    assert node.run(node.eagleflow_argv("--help"), timeout=60).ok
    # unreachable from outside its link: nothing listens on loopback for it
    assert _ip("-n", h.netns, "-4", "addr", "show").stdout.count("inet ") == 2   # 127.0.0.1 and its veth address


def test_host_key_is_checked(node_host_fixture, monkeypatch, tmp_path):  # noqa: F811
    from tests.fixtures.sshd import keygen
    other = keygen(tmp_path / "impostor")
    monkeypatch.setenv("AIRFLOW_CONN_NODE_HOST_WRONG_KEY", node_host_fixture.airflow_conn(host_key=other))
    with SSHNode("node_host_wrong_key", name="gpu-node-ns") as n:
        with pytest.raises(NodeError, match="HOST KEY MISMATCH"):
            n.run(["true"], timeout=10)


def test_teardown_removes_namespace_link_and_processes(tmp_path):
    from tests.fixtures.gpu_scenarios import fake_smi_env
    scenario = write_scenario(tmp_path / "sc.json", {"gpus": [gpu(0)], "processes": []})
    with node_host(tmp_path / "node", fake_smi_env(scenario, sys.executable)) as h:
        sshd_pid = h.sshd_pid
        # a process that outlives its SSH session on the node (setsid, as detached jobs are)
        h.exec_in(["sh", "-c", "setsid -f sleep 3600 </dev/null >/dev/null 2>&1"])
        deadline = time.monotonic() + 20   # setsid -f returns once it forked: the sleep is exec'd a moment later
        while not h.running(["sleep", "3600"]):
            assert time.monotonic() < deadline, "the detached sleep never appeared on the node"
            time.sleep(0.05)
        ns, vh, vn, host_ip = h.netns, h.veth_host, h.veth_node, h.host_ip
        sleeper = h.running(["sleep", "3600"])
    assert ns not in _ip("netns", "list").stdout.split()
    links = _ip("-o", "link", "show").stdout
    assert f" {vh}@" not in links and f" {vn}@" not in links
    assert "blackhole" not in _ip("-4", "route", "show", "match", host_ip).stdout
    assert not alive(sshd_pid)
    assert sleeper and not any(alive(p) for p in sleeper), "teardown left a process of the node running"


def test_a_command_that_times_out_over_the_link_leaves_nothing_on_the_node(node_host_fixture, node):  # noqa: F811
    h = node_host_fixture
    with pytest.raises(NodeCommandTimeout, match="the node ended it"):
        node.run(["sh", "-c", "sleep 41.5 & sleep 42.5 & wait"], timeout=2)
    deadline = time.monotonic() + 3
    while (h.running(["sleep", "41.5"]) or h.running(["sleep", "42.5"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not h.running(["sleep", "41.5"]) and not h.running(["sleep", "42.5"])
    with pytest.raises(NodeCommandTimeout):
        node.run([sys.executable, "-c", IGNORE_TERM, "over-the-link"], timeout=2)
    deadline = time.monotonic() + 3
    while h.running([sys.executable, "-c", IGNORE_TERM, "over-the-link"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not h.running([sys.executable, "-c", IGNORE_TERM, "over-the-link"])
    assert node.run(["echo", "ok"], timeout=10).stdout == "ok\n"


# -- partitions at the SSHNode level: the link, sshd, a dropped connection ------------------------------
def _run_in_thread(node, argv, timeout):
    import threading
    out: dict = {}

    def go():
        t0 = time.monotonic()
        try:
            out["result"] = node.run(argv, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e
        out["took"] = time.monotonic() - t0
    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th, out


def _wait_running(host, argv, within_s=10.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        pids = host.running(argv)
        if pids:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"{argv} never ran on the node")


def test_link_down_mid_command_is_unreachable_within_the_dead_link_bound_and_the_work_goes_on(
        node_host_fixture, node):  # noqa: F811
    from eagleflow.nodes import NodeUnreachable
    from eagleflow.nodes.ssh import DEAD_LINK_S, KEEPALIVE_S
    h = node_host_fixture
    assert node.run(["true"], timeout=10).ok
    connects = node.connects
    argv = ["sleep", "43.25"]
    th, out = _run_in_thread(node, argv, timeout=120)
    (pid,) = _wait_running(h, argv)
    h.link_down()
    try:
        # nothing for the node may leave by the default route while the cable is out
        routes = _ip("-4", "route", "show", "match", h.node_ip).stdout
        assert "blackhole" in routes and h.veth_host not in routes, routes
        th.join(KEEPALIVE_S + DEAD_LINK_S + 10)
        assert not th.is_alive(), "a command on a dead link hung past keepalive + TCP_USER_TIMEOUT"
        assert isinstance(out.get("error"), NodeUnreachable), out
        assert "dropped while" in str(out["error"])
        assert alive(pid), "the node's work must not depend on the control plane's connection"
        # while the cable is out, a new command fails at once, naming the node, not after a long timeout
        t0 = time.monotonic()
        with pytest.raises(NodeUnreachable, match="gpu-node-ns"):
            node.run(["true"], timeout=10)
        assert time.monotonic() - t0 < h_conn_timeout() + 2
    finally:
        h.link_up()
    assert node.run(["echo", "back"], timeout=20).stdout == "back\n"
    assert node.connects == connects + 1
    import os
    import signal
    os.kill(pid, signal.SIGKILL)


def h_conn_timeout() -> float:
    return 5.0   # the fixture's conn_timeout extra


def test_a_connection_dropped_mid_command_is_unreachable_at_once_and_the_next_call_reconnects(
        node_host_fixture, node):  # noqa: F811
    from eagleflow.nodes import NodeUnreachable
    h = node_host_fixture
    argv = ["sleep", "44.25"]
    th, out = _run_in_thread(node, argv, timeout=120)
    _wait_running(h, argv)
    connects = node.connects
    assert h.drop_connections()
    th.join(10)
    assert not th.is_alive() and isinstance(out.get("error"), NodeUnreachable), out
    assert out["took"] < 5
    assert node.run(["echo", "again"], timeout=20).stdout == "again\n" and node.connects == connects + 1


def test_sshd_killed_then_restarted(node_host_fixture, node):  # noqa: F811
    from eagleflow.nodes import NodeUnreachable
    h = node_host_fixture
    assert node.run(["true"], timeout=10).ok
    h.kill_sshd()
    try:
        with pytest.raises(NodeUnreachable):
            node.run(["true"], timeout=10)
        with pytest.raises(NodeUnreachable, match="cannot reach|refused"):
            node.run(["true"], timeout=10)
    finally:
        h.start_sshd()
    assert node.run(["echo", "restarted"], timeout=20).stdout == "restarted\n"
