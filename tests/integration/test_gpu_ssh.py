"""The GPU probe over a real sshd on 127.0.0.1: the fake node, connection reuse, and clear SSH errors."""
from __future__ import annotations

import getpass
import json
import subprocess
import sys

import pytest

from eagleflow.gpu.errors import NoGpuError
from eagleflow.gpu.smi_probe import SmiProbe
from eagleflow.nodes import NodeCommandTimeout, NodeError
from eagleflow.nodes.ssh import SSHNode
from tests.fixtures.gpu_scenarios import gpu, proc, write_scenario
from tests.fixtures.sshd import keygen, sshd  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def conn(sshd, monkeypatch):  # noqa: F811
    monkeypatch.setenv("AIRFLOW_CONN_GPU_NODE_TEST", sshd.airflow_conn())
    return "gpu_node_test"


@pytest.fixture
def scenario(sshd):  # noqa: F811
    path = sshd.env["FAKE_NVIDIA_SMI_SCENARIO"]
    yield path
    write_scenario(path, {"gpus": [gpu(0)], "processes": []})


def test_smi_probe_reads_the_fake_node_in_one_connection(conn, scenario):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_scenario(scenario, {"gpus": [gpu(i) for i in range(8)],
                                  "processes": [proc(child.pid, 3, 90000, "python3 -m sglang.launch_server, tp 8",
                                                     live=True)]})
        with SSHNode(conn, name="fake-node", python=sys.executable) as node:
            probe = SmiProbe(node)
            snaps = probe.snapshot()
            assert len(snaps) == 8 and snaps[3].memory_used_mib == 90001
            (p,) = snaps[3].processes
            assert p.pid == child.pid and p.name == "python3 -m sglang.launch_server, tp 8"
            assert p.user == getpass.getuser() and p.state in ("S", "R")  # from the node's /proc
            for _ in range(3):
                probe.snapshot()
            assert node.connects == 1  # one SSH connection for every poll
    finally:
        child.kill()
        child.wait()


def test_every_argv_element_is_quoted(conn):
    with SSHNode(conn, python=sys.executable) as node:
        weird = ["a b", "$HOME", "; touch /tmp/eagleflow-pwned", "it's", "`id`", "*"]
        res = node.check(["printf", "%s\\n", *weird])
        assert res.stdout.splitlines() == weird
        assert node.run(["cat"], input="from stdin\n").stdout == "from stdin\n"
        assert node.run(["sh", "-c", "exit 7"]).exit_code == 7
        with pytest.raises(NodeError, match="'no-such-tool' is not on PATH"):
            node.run(["no-such-tool"])


def test_driver_missing_on_the_node_is_a_no_gpu_error(conn, scenario):
    write_scenario(scenario, {"driver": False, "gpus": [gpu(0)]})
    with SSHNode(conn, name="fake-node", python=sys.executable) as node:
        with pytest.raises(NoGpuError, match="on node fake-node: the NVIDIA driver is not loaded"):
            SmiProbe(node).snapshot()


def test_command_timeout(conn, scenario):
    write_scenario(scenario, {"gpus": [gpu(0)], "hang_s": 5})
    with SSHNode(conn, python=sys.executable) as node:
        with pytest.raises(NodeCommandTimeout, match="did not finish within 1"):
            SmiProbe(node, timeout_s=1).snapshot()


def test_bad_credentials_give_a_clear_error(sshd, monkeypatch, tmp_path):  # noqa: F811
    keygen(tmp_path / "stranger")
    monkeypatch.setenv("AIRFLOW_CONN_GPU_BAD_KEY", sshd.airflow_conn(key_file=str(tmp_path / "stranger")))
    with pytest.raises(NodeError) as e:
        SSHNode("gpu_bad_key", name="n1").run(["true"])
    msg = str(e.value)
    assert "SSH authentication failed" in msg and f"127.0.0.1:{sshd.port}" in msg and "gpu_bad_key" in msg
    assert "authorized_keys" in msg


def test_wrong_host_key_is_refused(sshd, monkeypatch, tmp_path):  # noqa: F811
    other = keygen(tmp_path / "impostor_host")
    monkeypatch.setenv("AIRFLOW_CONN_GPU_BAD_HOST", sshd.airflow_conn(host_key=other))
    with pytest.raises(NodeError, match="HOST KEY MISMATCH .* update the connection's host_key"):
        SSHNode("gpu_bad_host", name="n1").run(["true"])


def test_unknown_host_key_is_refused_unless_the_connection_opts_out(sshd, monkeypatch, tmp_path):  # noqa: F811
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/known_hosts
    monkeypatch.setenv("AIRFLOW_CONN_GPU_UNPINNED", sshd.airflow_conn(host_key=None))
    with pytest.raises(NodeError, match="host key of .* is unknown"):
        SSHNode("gpu_unpinned").run(["true"])
    monkeypatch.setenv("AIRFLOW_CONN_GPU_OPTOUT", sshd.airflow_conn(host_key=None, no_host_key_check=True))
    assert SSHNode("gpu_optout").check(["echo", "ok"]).stdout == "ok\n"


def test_missing_connection_is_named(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_NO_SUCH_NODE", raising=False)
    with pytest.raises(NodeError, match="connection 'no_such_node' is not defined"):
        SSHNode("no_such_node").run(["true"])


def test_cli_gpu_status_against_the_fake_node(conn, scenario, capsys):
    from eagleflow.cli import main
    write_scenario(scenario, {"gpus": [gpu(0, 3), gpu(1, 90000)], "processes": [proc(4242, 1, 89990, "python3")]})
    assert main(["gpu", "status", "--node", conn, "--set", f"node.python={sys.executable}",
                 "--set", "gpu.probe=smi"]) == 0
    out = capsys.readouterr().out
    assert "node gpu_node_test: 2 GPU(s)" in out and "90000/81559 MiB" in out and "pid 4242" in out
    assert main(["gpu", "status", "--node", conn, "--set", f"node.python={sys.executable}", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [g["memory_used_mib"] for g in data["gpus"]] == [3, 90000] and data["idle"]["all_idle"] is False
