"""A node's bound on the Mooncake master's allocated bytes (issue 53: the streaming producer's put read the master's
/metrics at every put): the sink asks the master only when the bound leaves no room, never admits a put the master's
own figure would refuse, and reads at every put where the bound cannot hold (a fleet, an existing master)."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from eagleflow.stores import StoreSettings
from eagleflow.stores.contract import StoreFull
from eagleflow.stores.encoding import EncodedSample
from eagleflow.stores.mooncake.master import MooncakeEndpoint
from eagleflow.stores.mooncake.store import MooncakeSink, NodeBound, charged_bytes

SIZE = 10_000


class FakeClient:
    """The master's allocated bytes as the puts and removes change them; counts its reads."""
    label = "fake store"

    def __init__(self, overhead: int = 0):
        self.allocated, self.reads, self.overhead = 0, 0, overhead
        self.objects: dict[str, int] = {}

    def allocated_bytes(self) -> int:
        self.reads += 1
        return self.allocated

    def put(self, key: str, data: bytes) -> None:
        self.allocated += len(data) + self.overhead - self.objects.get(key, 0)
        self.objects[key] = len(data) + self.overhead

    def remove(self, key: str) -> None:
        self.allocated -= self.objects.pop(key)


def _sample(i: int) -> EncodedSample:
    return EncodedSample(index=i, sample_id=f"s{i}", tokens=1, store_dtype="auto", parts=(bytes(SIZE),), size=SIZE)


def _sink(tmp_path, client, *, buffer_bytes, shard=0, store_id="inc1", foreign=False, **kw) -> MooncakeSink:
    ep_file = tmp_path / "store_endpoint.json"
    ep_file.write_text(json.dumps({"host": "127.0.0.1", "rpc_port": 1, "metadata_port": 2, "metrics_port": 3,
                                   "segment_bytes": 1 << 30, "store_id": store_id, "foreign_master": foreign}))
    settings = StoreSettings(run_id="r", root=str(tmp_path / "hs"), fsync=False, buffer_bytes=buffer_bytes,
                             endpoint_file=str(ep_file), put_timeout_s=0.3, **kw)
    return MooncakeSink(settings, shard, client=client)


def test_the_master_is_read_only_when_the_bound_leaves_no_room_and_never_passed(tmp_path):
    c = FakeClient()
    size = len(_sample(0).to_bytes())
    sink = _sink(tmp_path, c, buffer_bytes=10 * charged_bytes(size))
    for i in range(10):                 # ten charges fit the bound: one read (the first: no bound yet)
        sink.put(_sample(i))
        assert c.allocated <= sink.settings.buffer_bytes
    assert c.reads == 1
    for i in range(5):                  # the trainer takes five: the bound does not know it until it reads
        c.remove(f"r/shard_00000/{i:08d}")
    sink.put(_sample(10))               # the bound is full: the master is read, and says there is room
    assert c.reads == 2
    sink.put(_sample(11))               # the bound is the figure read plus that put: room again without a read
    assert c.reads == 2
    # a second sink of the node (another worker: its own shard) shares the bound through the lock file
    other = _sink(tmp_path, c, buffer_bytes=10 * charged_bytes(size), shard=1)
    other.put(_sample(0))
    assert c.reads == 2
    for i in range(12, 30):             # nobody takes more: room for exactly what the buffer holds, then StoreFull
        try:
            sink.put(_sample(i))
        except Exception as e:          # noqa: BLE001 - checked below
            assert "nobody is taking samples" in str(e)
            break
    assert c.allocated <= sink.settings.buffer_bytes < c.allocated + size
    sink.close()
    other.close()


def test_a_figure_above_the_bound_turns_it_off_for_the_incarnation(tmp_path):
    c = FakeClient(overhead=3 * charged_bytes(SIZE))    # an allocator counting far more than charged_bytes
    sink = _sink(tmp_path, c, buffer_bytes=6 * charged_bytes(SIZE))
    for i in range(6):                  # six charges fit the bound: one read, the master's figure far above it
        sink.put(_sample(i))
    assert c.reads == 1
    for i in range(3):
        c.remove(f"r/shard_00000/{i:08d}")
    with pytest.raises(StoreFull):      # the read finds the master above the bound (and no room)
        sink.put(_sample(6))
    reads = c.reads
    for i in range(3, 6):
        c.remove(f"r/shard_00000/{i:08d}")
    for i in range(6, 12):              # from now on the master is read at every put
        sink.put(_sample(i))
        c.remove(f"r/shard_00000/{i:08d}")
        assert c.reads == reads + i - 5
    lock = os.open(sink._budget_lock, os.O_RDONLY)
    try:
        b = NodeBound(lock, sink.ep)
        assert b.read() is None and b.off
    finally:
        os.close(lock)
    # a new incarnation of the store (restarted: another store id) starts with a bound again
    c2 = FakeClient()
    again = _sink(tmp_path, c2, buffer_bytes=100 * charged_bytes(SIZE), store_id="inc2")
    for i in range(5):
        again.put(_sample(i))
    assert c2.reads == 1
    sink.close()
    again.close()


@pytest.mark.parametrize("kw", [{"writer_nodes": 2, "max_sample_bytes": 2 * SIZE}, {"foreign": True}],
                         ids=["fleet", "existing-master"])
def test_where_others_put_unseen_the_master_is_read_at_every_put(tmp_path, kw):
    c = FakeClient()
    sink = _sink(tmp_path, c, buffer_bytes=100 * charged_bytes(SIZE), **kw)
    for i in range(6):
        sink.put(_sample(i))
    assert c.reads == 6
    sink.close()


def test_a_record_of_another_incarnation_or_torn_is_no_bound(tmp_path):
    ep = MooncakeEndpoint(host="127.0.0.1", rpc_port=1, metadata_port=2, metrics_port=3, segment_bytes=1,
                          store_id="a")
    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        b = NodeBound(fd, ep)
        assert b.read() is None and not b.off        # empty file
        b.write(12345)
        assert b.read() == 12345
        assert NodeBound(fd, replace(ep, store_id="b")).read() is None
        assert NodeBound(fd, replace(ep, rpc_port=9)).read() is None
        raw = bytearray(os.pread(fd, NodeBound.SIZE, 0))
        raw[raw.index(b"12345")] = ord("0")                # 02345: a lower bound, but its crc says torn
        os.pwrite(fd, bytes(raw), 0)
        assert b.read() is None
        b.write(None)
        assert b.read() is None and b.off
        assert os.fstat(fd).st_size == NodeBound.SIZE
    finally:
        os.close(fd)
    assert charged_bytes(1) == 8192 and charged_bytes(4096) == 8192 and charged_bytes(4097) == 12288
