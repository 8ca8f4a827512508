"""The FakeNode itself: the base class's own methods (tests/fixtures/fake_node.py) get the answers the real node
commands give, a command nobody expected is loud, and a node that is down is down for files too."""
from __future__ import annotations

import pytest

from eagleflow.nodes import JobAlreadyRunning, NodeError, NodeUnreachable
from tests.fixtures.fake_node import FakeNode, Reply, UnexpectedCommand, command_key


def test_the_base_class_reads_writes_and_measures_through_the_fakes_commands():
    node = FakeNode("n1", free_space={"/": 5, "/data": 7_000})
    assert node.read_text("/data/run/x.json") is None                        # cat: No such file -> None
    node.write_text("/data/run/x.json", '{"a": 1}')                          # python -m eagleflow.durable
    assert node.read_text("/data/run/x.json") == '{"a": 1}'
    assert node.commands("eagleflow.durable")[0].input == '{"a": 1}'
    assert node.free_bytes("/data/run/not-yet/deeper") == 7_000 and node.free_bytes("/tmp") == 5
    node.makedirs("/data/copy")
    with node.open_file("/data/copy/f.bin", "wb") as f:
        f.write(b"abc")
    with node.open_file("/data/copy/f.bin", "ab") as f:
        f.write(b"def")
    node.rename("/data/copy/f.bin", "/data/copy/g.bin")
    with node.open_file("/data/copy/g.bin", "rb") as f:
        assert f.read() == b"abcdef"
    with pytest.raises(NodeError, match="open /data/copy/f.bin"):
        node.open_file("/data/copy/f.bin", "rb")


def test_process_records_start_once_per_lock_and_stop():
    node = FakeNode()
    rec = node.spawn_detached(["python", "-m", "worker"], role="w", pid_file="/s/pids/r.w.json",
                              log_file="/s/logs/r.w.log", lock_file="/s/locks/r.w.lock", env={"A": "1"})
    assert node.spawned == [rec] and rec.argv == ("python", "-m", "worker")
    assert node.live_record("/s/pids/r.w.json") == rec
    with pytest.raises(JobAlreadyRunning) as e:
        node.spawn_detached(["python"], role="w", pid_file="/s/pids/r.w.json", log_file="/s/logs/r.w.log",
                            lock_file="/s/locks/r.w.lock")
    assert e.value.holder_pid == rec.pid and "already running as pid" in str(e.value)
    assert node.stop_recorded("/s/pids/r.w.json").outcome == "terminated"
    assert node.live_record("/s/pids/r.w.json") is None
    assert node.stop_recorded("/s/pids/r.w.json").outcome == "already_gone"
    assert node.process_status("/s/pids/none.json").recorded is False


def test_an_unexpected_command_is_loud_and_answers_come_in_turn():
    node = FakeNode()
    with pytest.raises(UnexpectedCommand, match=r"no answer registered for \('train', 'run'\)"):
        node.run(node.eagleflow_argv("train", "run", "--json"))
    node.on(("train", "run"), {"step": 1}, Reply("oops\n", exit_code=1), NodeUnreachable("gone"))
    assert node.run_json(node.eagleflow_argv("train", "run"), dict) == {"step": 1}
    assert node.run(node.eagleflow_argv("train", "run")).exit_code == 1
    for _ in range(2):   # the last answer repeats
        with pytest.raises(NodeUnreachable, match="gone"):
            node.run(node.eagleflow_argv("train", "run"))


def test_a_node_that_is_down_refuses_commands_and_files_and_comes_back():
    node = FakeNode("n2", conn_id="gpu_node_2")
    node.put("/f", "x")
    node.go_down("Connection refused")
    for call in (lambda: node.read_text("/f"), lambda: node.open_file("/f", "rb"), lambda: node.makedirs("/d"),
                 lambda: node.rename("/f", "/g")):
        with pytest.raises(NodeUnreachable, match="node n2: SSH to gpu_node_2 failed: Connection refused"):
            call()
    node.come_back()
    assert node.read_text("/f") == "x"


@pytest.mark.parametrize("argv, key", [
    (["py", "-m", "eagleflow.cli", "reconcile", "hand-over", "--phase", "extract"], ("reconcile", "hand-over")),
    (["py", "-m", "eagleflow.cli", "watch", "--shard", "3", "--json"], ("watch",)),
    (["py", "-m", "eagleflow.gpu.node_report", "--probe", "nvml"], ("eagleflow.gpu.node_report",)),
    (["cat", "--", "/x"], ("cat",)),
])
def test_command_keys(argv, key):
    assert command_key(argv) == key


def test_the_base_classs_own_helper_commands_have_their_keys():
    node = FakeNode()
    assert command_key(node.process_record_argv("status", "--pid-file", "/p")) == ("process_record", "status")
    assert node.process_status("/p").detail == "no pid record at /p"
    assert command_key(node.calls[-1].argv) == ("process_record", "status")
    node.free_bytes("/")
    assert node.calls[-1].key == ("free_bytes",)
