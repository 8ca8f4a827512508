"""copy_dir over a real sshd (SFTP): LocalNode -> SSHNode and back, resumed after the connection drops."""
from __future__ import annotations

import os
import sys

import pytest

from eagleflow.fleet.transfer import PARTIAL, copy_dir
from eagleflow.nodes.base import NodeError, NodeUnreachable
from eagleflow.nodes.local import LocalNode
from eagleflow.nodes.ssh import SSHNode
from tests.fixtures.sshd import sshd  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CHUNK = 64 << 10
NAMES = ["s0.safetensors", "s1.safetensors", "manifest.jsonl"]


@pytest.fixture
def conn(sshd, monkeypatch):  # noqa: F811
    monkeypatch.setenv("AIRFLOW_CONN_FLEET_NODE_TEST", sshd.airflow_conn())
    return "fleet_node_test"


def make_dir(d):
    d.mkdir(parents=True)
    (d / "s0.safetensors").write_bytes(os.urandom(10 * CHUNK + 123))
    (d / "s1.safetensors").write_bytes(os.urandom(CHUNK // 3))
    (d / "manifest.jsonl").write_text('{"id": "s0"}\n{"id": "s1"}\n')
    (d / "heartbeat.json").write_text("{}")
    return d


def identical(a, b) -> bool:
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in NAMES) and not (b / "heartbeat.json").exists()


class _Dropping:
    """A file of an SSHNode whose connection is closed under it at the ``after``-th read or write."""

    def __init__(self, node, f, after: int):
        self._node, self._f, self._left = node, f, after

    def _tick(self):
        self._left -= 1
        if self._left == 0:
            self._node._hook.client.get_transport().close()   # the link goes, as a node reboot would

    def read(self, n=-1):
        self._tick()
        return self._f.read(n)

    def write(self, data):
        self._tick()
        return self._f.write(data)

    def seek(self, *a):
        return self._f.seek(*a)

    def tell(self):
        return self._f.tell()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


class DroppingSSHNode(SSHNode):
    """Drops its connection once, while streaming ``name``."""

    def __init__(self, conn_id, name: str, after: int):
        super().__init__(conn_id, name="remote", python=sys.executable)
        self.drop_name, self.after = name, after

    def open_file(self, path, mode):
        f = super().open_file(path, mode)
        if self.drop_name and path.endswith("/" + self.drop_name):
            self.drop_name = None
            return _Dropping(self, f, self.after)
        return f


# paramiko's read-ahead thread (readv) dies with the link and leaves a traceback: expected here
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("direction", ["to_ssh", "from_ssh"])
def test_copy_over_sftp_resumes_after_the_connection_drops(conn, tmp_path, direction):
    src = make_dir(tmp_path / "src" / "shard_00001")
    dst = tmp_path / "dst" / "shard_00001"   # the "remote" node is this machine behind sshd: same paths
    remote = DroppingSSHNode(conn, "s0.safetensors", after=4)
    local = LocalNode("local")
    pair = (local, remote) if direction == "to_ssh" else (remote, local)
    with remote:
        with pytest.raises(NodeUnreachable, match="dropped while"):
            copy_dir(pair[0], str(src), pair[1], str(dst), chunk_bytes=CHUNK)
        part = dst / PARTIAL / "s0.safetensors"
        kept = part.stat().st_size if part.exists() else 0
        # written locally, the chunks read before the drop are there; over SFTP, pipelined writes the server
        # had not acknowledged are lost with the link (the partial may even be empty)
        assert kept < (src / "s0.safetensors").stat().st_size and (kept > 0 or direction == "to_ssh")
        assert not (dst / "manifest.jsonl").exists()
        rep = copy_dir(pair[0], str(src), pair[1], str(dst), chunk_bytes=CHUNK)   # reconnects
        # what the server wrote after the drop counts too: at least what was there when we looked
        assert kept <= rep.bytes_resumed <= (src / "s0.safetensors").stat().st_size
        assert rep.files_copied + rep.files_kept == 3
        assert identical(src, dst)
        assert remote.connects == 2
        again = copy_dir(pair[0], str(src), pair[1], str(dst), chunk_bytes=CHUNK)
        assert (again.files_copied, again.files_kept, again.bytes_copied) == (0, 3, 0)


def test_a_full_copy_both_ways_and_sftp_errors(conn, tmp_path):
    src = make_dir(tmp_path / "a")
    with SSHNode(conn, name="remote", python=sys.executable) as remote:
        rep = copy_dir(LocalNode(), str(src), remote, str(tmp_path / "b" / "deep"))
        assert rep.files_copied == 3 and rep.bytes_resumed == 0
        back = copy_dir(remote, str(tmp_path / "b" / "deep"), LocalNode(), str(tmp_path / "c"))
        assert back.files_copied == 3
        assert identical(src, tmp_path / "c")
        with pytest.raises(NodeError, match=f"on node remote: opening {tmp_path}/nope"):
            remote.open_file(str(tmp_path / "nope"), "rb")
        (tmp_path / "afile").write_text("x")
        with pytest.raises(NodeError, match="is not a folder"):
            remote.makedirs(str(tmp_path / "afile" / "sub"))
        sftp = remote._sftp
        remote.rename(str(tmp_path / "afile"), str(tmp_path / "bfile"))
        assert (tmp_path / "bfile").read_text() == "x" and remote._sftp is sftp   # one SFTP client reused
        assert remote.connects == 1
    assert remote._sftp is None   # closed with the connection


def test_reading_a_file_opened_for_writing_says_so(conn, tmp_path):
    """Only an "rb" file has the size seen at open (found by mypy: it was None, and read() a TypeError)."""
    with SSHNode(conn, name="remote", python=sys.executable) as remote:
        with remote.open_file(str(tmp_path / "out"), "wb") as f:
            f.write(b"abc")
            with pytest.raises(NodeError, match=f"on node remote: {tmp_path}/out is open for 'wb', not for reading"):
                f.read()
    assert (tmp_path / "out").read_bytes() == b"abc"
