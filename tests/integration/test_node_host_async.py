"""AsyncSSHNode (the SSH provider's SSHHookAsync) on the node host: one held connection, host key checked,
the node-enforced time limit, and a dropped or partitioned connection turned into NodeUnreachable."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from eagleflow.nodes import NodeCommandTimeout, NodeError, NodeUnreachable
from eagleflow.nodes.ssh_async import AsyncSSHNode
from tests.fixtures.node_host import node_host_fixture  # noqa: F401  (fixture)
from tests.fixtures.processes import alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def conn_id(node_host_fixture, monkeypatch):  # noqa: F811
    monkeypatch.setenv("AIRFLOW_CONN_NODE_HOST_ASYNC", node_host_fixture.airflow_conn())
    return "node_host_async"


def accepted(host) -> int:
    return host.log.read_text().count("Accepted publickey")


def test_many_commands_one_held_connection(node_host_fixture, conn_id):  # noqa: F811
    from pydantic import BaseModel

    class Answer(BaseModel):
        n: int

    async def go():
        node = AsyncSSHNode(conn_id, name="gpu-node-ns")
        try:
            outs = [(await node.run(["echo", f"poll {i}"], timeout=20)).stdout for i in range(5)]
            ans = await node.run_json([sys.executable, "-c", "import json; print('noise'); print(json.dumps({'n': 7}))"],
                                      Answer, timeout=30)
            res = await node.run(["sh", "-c", "cat; echo err >&2; exit 3"], input="from stdin\n", timeout=20)
            return node.connects, outs, ans, res
        finally:
            node.close()
    before = accepted(node_host_fixture)
    connects, outs, ans, res = asyncio.run(go())
    assert outs == [f"poll {i}\n" for i in range(5)] and ans.n == 7
    assert (res.exit_code, res.stdout, res.stderr) == (3, "from stdin\n", "err\n")
    assert connects == 1
    deadline = time.monotonic() + 5
    while accepted(node_host_fixture) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert accepted(node_host_fixture) - before == 1, "the node saw more than one login for one node object"


def test_the_pinned_host_key_is_checked(node_host_fixture, monkeypatch, tmp_path):  # noqa: F811
    from tests.fixtures.sshd import keygen
    monkeypatch.setenv("AIRFLOW_CONN_NODE_HOST_ASYNC_BAD",
                       node_host_fixture.airflow_conn(host_key=keygen(tmp_path / "impostor")))
    node = AsyncSSHNode("node_host_async_bad", name="gpu-node-ns")
    with pytest.raises(NodeError, match="HOST KEY"):
        asyncio.run(node.run(["true"], timeout=10))


def test_timeout_ends_the_remote_work_over_the_link(node_host_fixture, conn_id):  # noqa: F811
    argv = ["sh", "-c", "sleep 45.5 & sleep 46.5 & wait"]
    node = AsyncSSHNode(conn_id, name="gpu-node-ns")
    with pytest.raises(NodeCommandTimeout, match="the node ended it"):
        asyncio.run(node.run(argv, timeout=2))
    node.close()
    deadline = time.monotonic() + 3
    while (node_host_fixture.running(["sleep", "45.5"]) or node_host_fixture.running(["sleep", "46.5"])) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not node_host_fixture.running(["sleep", "45.5"])
    assert not node_host_fixture.running(["sleep", "46.5"])


@pytest.mark.parametrize("fault", ["drop", "link"])
def test_a_lost_connection_is_unreachable_and_the_next_call_reconnects(fault, node_host_fixture, conn_id):  # noqa: F811
    from eagleflow.nodes.ssh import DEAD_LINK_S, KEEPALIVE_S
    h = node_host_fixture
    argv = ["sleep", "47.25" if fault == "drop" else "48.25"]

    async def go():
        node = AsyncSSHNode(conn_id, name="gpu-node-ns")
        assert (await node.run(["true"], timeout=10)).ok
        task = asyncio.ensure_future(node.run(argv, timeout=120))
        while not h.running(argv):
            await asyncio.sleep(0.05)
        (pid,) = h.running(argv)
        t0 = time.monotonic()
        if fault == "drop":
            await asyncio.to_thread(h.drop_connections)
        else:
            await asyncio.to_thread(h.link_down)
        try:
            with pytest.raises(NodeUnreachable, match="dropped while"):
                await asyncio.wait_for(task, KEEPALIVE_S * 4 + DEAD_LINK_S)
            took = time.monotonic() - t0
            if fault == "link":
                assert alive(pid), "the node's work must not depend on the control plane's connection"
                with pytest.raises(NodeUnreachable):
                    await node.run(["true"], timeout=10)
        finally:
            if fault == "link":
                await asyncio.to_thread(h.link_up)
        again = await node.run(["echo", "back"], timeout=20)
        connects = node.connects
        node.close()
        return took, again, connects, pid
    took, again, connects, pid = asyncio.run(go())
    assert again.stdout == "back\n" and connects == 2
    assert took < (3 if fault == "drop" else KEEPALIVE_S * 4 + DEAD_LINK_S), took
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
