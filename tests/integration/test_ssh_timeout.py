"""An SSH command past its timeout is ended on the node, children included (issue 11 item 8), over the real sshd."""
from __future__ import annotations

import sys
import time

import pytest

from eagleflow.nodes import NodeCommandTimeout
from eagleflow.nodes.ssh import SSHNode
from tests.fixtures.processes import IGNORE_TERM, alive
from tests.fixtures.sshd import sshd  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def running(argv: list[str]) -> list[int]:
    """Live PIDs on this machine (the sshd is on loopback: the node is here) whose command line is argv."""
    want = "\0".join(argv).encode() + b"\0"
    found = []
    from pathlib import Path
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (p / "cmdline").read_bytes() == want and alive(int(p.name)):
                    found.append(int(p.name))
            except OSError:
                continue
    return found


def gone_soon(argv: list[str], within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while running(argv):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def node(sshd, monkeypatch):  # noqa: F811
    monkeypatch.setenv("AIRFLOW_CONN_SSH_TIMEOUT_TEST", sshd.airflow_conn())
    with SSHNode("ssh_timeout_test", python=sys.executable) as n:
        yield n


def test_sleep_past_its_timeout_leaves_nothing_running(node):
    t0 = time.monotonic()
    with pytest.raises(NodeCommandTimeout, match="did not finish within 2 s; the node ended it"):
        node.run(["sleep", "37"], timeout=2)
    took = time.monotonic() - t0
    assert 2 <= took < 10, took
    assert gone_soon(["sleep", "37"]), "the remote sleep outlived the command's timeout"
    assert node.run(["echo", "still usable"], timeout=10).stdout == "still usable\n"


def test_children_and_a_term_ignoring_command_are_ended_too(node):
    with pytest.raises(NodeCommandTimeout):
        node.run(["sh", "-c", "sleep 37.5 & sleep 38.5 & wait"], timeout=2)
    assert gone_soon(["sleep", "37.5"]) and gone_soon(["sleep", "38.5"])
    t0 = time.monotonic()
    with pytest.raises(NodeCommandTimeout, match="the node ended it"):
        node.run([sys.executable, "-c", IGNORE_TERM, "ssh-timeout-test"], timeout=2)
    assert 2 + 5 <= time.monotonic() - t0 < 2 + 5 + 5, "TERM ignored: KILL follows 5 s later"
    assert gone_soon([sys.executable, "-c", IGNORE_TERM, "ssh-timeout-test"])


def test_a_command_within_its_timeout_is_untouched(node):
    res = node.run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10)
    assert (res.exit_code, res.stdout, res.stderr) == (3, "out\n", "err\n")
    assert node.run(["cat"], input="from stdin\n", timeout=10).stdout == "from stdin\n"
    assert node.run(["sleep", "0.2"], timeout=None).ok
