"""The Mooncake store, real (issue 53): its master and segment holder started from the wheel on 127.0.0.1 free
ports as recorded processes and stopped by PID; samples put and got through the store contract."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from eagleflow.nodes.process_record import load_record, status
from eagleflow.stores import StoreSettings, store_for
from eagleflow.stores.contract import SampleRefused, SampleSink, SampleSource, StoreFull, StoreUnavailable
from eagleflow.stores.encoding import encode_sample
from eagleflow.train.data import SAMPLE_KEYS, read_sample_keys

pytest.importorskip("mooncake.store", reason="the stream extra (mooncake-transfer-engine-non-cuda) is not installed")

from eagleflow.stores.mooncake.master import metrics, start_store, stop_store  # noqa: E402
from eagleflow.stores.mooncake.store import MooncakeClient, MooncakeSource  # noqa: E402

MIB = 1 << 20


def _enc(i: int, n: int = 64, h: int = 256, store_dtype: str = "auto"):
    g = torch.Generator().manual_seed(i)
    return encode_sample(index=i, sample_id=f"src:{i}", input_ids=torch.arange(n) + i, loss_mask=[1] * n,
                         aux_hidden_states=torch.randn(n, 3 * h, generator=g).to(torch.bfloat16),
                         hidden_states=torch.randn(n, h, generator=g).to(torch.bfloat16), aux_layers=[1, 2, 3],
                         model="tiny", store_dtype=store_dtype)


@pytest.fixture
def store(tmp_path):
    ep_file = tmp_path / "state" / "mooncake.json"
    ep = start_store(state_dir=tmp_path / "state", run_id="r1", segment_bytes=64 * MIB, endpoint_file=ep_file)
    yield ep, ep_file
    for res in stop_store(ep, grace_s=2.0):
        assert res.outcome in ("terminated", "killed", "already_gone", "not_recorded"), res.describe()


def _settings(tmp_path, ep_file, buffer_bytes=32 * MIB, **kw) -> StoreSettings:
    return StoreSettings(run_id="r1", root=str(tmp_path / "hs"), fsync=False, buffer_bytes=buffer_bytes,
                         endpoint_file=str(ep_file), **kw)


def _listening_addresses(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket ``pid`` listens on (its fds matched to /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:          # 0A: LISTEN
                addr, port = cols[1].split(":")
                host = ".".join(str(b) for b in reversed(bytes.fromhex(addr))) if len(addr) == 8 else addr
                found.add((host, int(port, 16)))
    return found


def test_the_store_runs_as_recorded_processes_on_loopback(store):
    ep, _ = store
    assert [role for role, _ in ep.recorded()] == ["mooncake-segment", "mooncake-master", "mooncake-metadata"]
    for _, f in ep.recorded():
        assert status(f).alive, status(f).detail
    assert ep.host == "127.0.0.1" and metrics(ep)["master_total_capacity_bytes"] >= 64 * MIB
    # the wheel's master listens on 0.0.0.0 with its metrics/admin server unless told otherwise (-metrics_host), and
    # with its own metadata server whatever it is told (so the run's metadata server is the wheel's Python one)
    listening = {role: _listening_addresses(load_record(f).pid) for role, f in ep.recorded()}
    assert listening["mooncake-master"] == {("127.0.0.1", ep.rpc_port), ("127.0.0.1", ep.metrics_port)}, listening
    assert listening["mooncake-metadata"] == {("127.0.0.1", ep.metadata_port)}, listening
    # the segment holder's transfer engine (its TCP transport and handshake listeners, in Mooncake's 15000-17000
    # range) binds every interface in the 0.3.13 wheel, with no flag or variable to change it: named in
    # docs/streaming.md; its own -port is on the host
    segment = listening["mooncake-segment"]
    assert any(h == "127.0.0.1" for h, _ in segment), segment
    assert all(h == "127.0.0.1" or 15000 <= p <= 17000 for h, p in segment), segment


@pytest.mark.parametrize("store_dtype", ["auto", "fp8_e4m3"])
def test_put_get_round_trip_is_byte_identical_and_digest_checked(tmp_path, store, store_dtype):
    _, ep_file = store
    settings = _settings(tmp_path, ep_file)
    sink = store_for("mooncake").open_sink(settings, 2)
    assert isinstance(sink, SampleSink)
    sent = [_enc(i, store_dtype=store_dtype) for i in (5, 6)]
    receipts = [sink.put(e) for e in sent]
    sink.close()
    assert receipts[0].where == "r1/shard_00002/00000005" and receipts[0].sha256 == sent[0].sha256()
    # nothing of the sample on disk: only the manifest
    assert sorted(p.name for p in (tmp_path / "hs" / "shard_00002").iterdir()) == ["manifest.jsonl"]
    source = store_for("mooncake").open_source(settings)
    assert isinstance(source, SampleSource) and source.streaming
    refs = source.scan()
    assert [(r.index, r.id, r.path, r.store_dtype) for r in refs] == [
        (5, "src:5", "r1/shard_00002/00000005", store_dtype), (6, "src:6", "r1/shard_00002/00000006", store_dtype)]
    for ref, enc in zip(refs, sent):
        assert source.open(ref).read() == enc.to_bytes()
    t = read_sample_keys(refs[0], SAMPLE_KEYS, source=source)
    assert torch.equal(t["input_ids"], torch.arange(64) + 5) and t["hidden_states"].shape == (64, 256)
    source.release(refs[0])
    with pytest.raises(SampleRefused, match="key r1/shard_00002/00000005"):
        source.open(refs[0])
    source.close()


def test_a_corrupted_or_missing_sample_is_refused_naming_the_key(tmp_path, store):
    ep, ep_file = store
    settings = _settings(tmp_path, ep_file)
    sink = store_for("mooncake").open_sink(settings, 0)
    for i in range(2):
        sink.put(_enc(i))
    sink.close()
    source = MooncakeSource(settings)
    a, b = source.scan()
    bad = bytearray(source.open(a).read())
    bad[-1] ^= 0xFF                                   # one flipped byte in the tensors, same size
    source.client.put(a.path, bytes(bad))
    with pytest.raises(SampleRefused, match=r"sample src:0 \(key r1/shard_00000/00000000\).*sha256"):
        source.open(a)
    source.client.remove(b.path)
    with pytest.raises(SampleRefused, match=r"sample src:1 \(key r1/shard_00000/00000001\).*not in the store"):
        source.open(b)
    source.close()


def test_backpressure_holds_the_store_under_its_buffer(tmp_path, store):
    ep, ep_file = store
    one = _enc(0).size
    buffer_bytes = 3 * one + one // 2                 # room for three samples, never four
    settings = _settings(tmp_path, ep_file, buffer_bytes=buffer_bytes)
    sink = store_for("mooncake").open_sink(settings, 0)
    done = threading.Event()
    errors: list[BaseException] = []

    def produce():
        try:
            for i in range(10):
                sink.put(_enc(i))
        except BaseException as e:   # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            done.set()
    th = threading.Thread(target=produce)
    th.start()
    source = MooncakeSource(settings)
    peak, taken = 0, 0
    deadline = time.monotonic() + 120
    while taken < 10 and time.monotonic() < deadline:
        peak = max(peak, int(metrics(ep)["master_allocated_bytes"]))
        refs = [r for r in source.scan() if r.index >= taken]
        if taken == 0 and len(refs) >= 3:
            time.sleep(1.0)                           # a slow consumer: the producer must wait, not grow the store
            assert not done.is_set() and len(source.scan()) == 3
        if refs:
            source.open(refs[0]).read()
            source.release(refs[0])
            taken += 1
        else:
            time.sleep(0.02)
    th.join(30)
    sink.close()
    assert not errors, errors
    assert taken == 10 and peak <= buffer_bytes, (taken, peak, buffer_bytes)
    assert sink.waited_s > 0.5
    # nobody consuming: a put gives up past its timeout, naming the store, instead of hanging
    full = store_for("mooncake").open_sink(_settings(tmp_path, ep_file, buffer_bytes=one + 10, put_timeout_s=0.5), 1)
    full.put(_enc(100))
    with pytest.raises(StoreFull, match=r"Mooncake store \(master 127\.0\.0\.1:\d+\).*nobody is taking samples"):
        full.put(_enc(101))
    full.close()
    source.close()


def test_a_second_writer_behind_the_node_lock_of_a_put_waiting_for_room_says_it_is_held_back(tmp_path, store):
    """Two shards' sinks on one node, the buffer full: the first's put waits for room holding the node's put lock,
    the second's waits for that lock. Both are held back by the consumer, and both say so (on_wait, the worker's
    heartbeat): the second had said nothing, and its watch read it as stalled with no request in flight."""
    ep, ep_file = store
    one = _enc(0).size
    settings = _settings(tmp_path, ep_file, buffer_bytes=one + one // 2)     # room for one sample
    first, second = (store_for("mooncake").open_sink(settings, shard) for shard in (0, 1))
    said: dict[int, list] = {0: [], 1: []}
    first.on_wait = lambda since: said[0].append(since)
    second.on_wait = lambda since: said[1].append(since)
    first.put(_enc(0))                                    # the buffer is full
    t0 = time.time()
    waiting = [threading.Thread(target=first.put, args=(_enc(1),))]
    waiting[0].start()
    deadline = time.monotonic() + 30
    while not said[0] and time.monotonic() < deadline:
        time.sleep(0.02)
    waiting.append(threading.Thread(target=second.put, args=(_enc(2, n=32),)))
    waiting[1].start()
    while not said[1] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert said[0] and said[1], said                      # both held back, said within LOCK_WAIT_SAID_S
    assert all(t0 - 1 <= s[0] <= time.time() for s in said.values()), said
    source = MooncakeSource(settings)
    taken: set[tuple[int, int]] = set()                   # the consumer takes them: both puts go through
    deadline = time.monotonic() + 60
    while len(taken) < 3 and time.monotonic() < deadline:
        refs = [r for r in source.scan() if (r.shard, r.index) not in taken]
        for ref in refs[:1]:
            source.open(ref).read()
            source.release(ref)
            taken.add((ref.shard, ref.index))
        time.sleep(0.02)
    assert len(taken) == 3, taken
    for t in waiting:
        t.join(30)
        assert not t.is_alive()
    assert said[0][-1] is None and said[1][-1] is None, said     # each wait's end said too
    first.close()
    second.close()
    source.close()


def test_the_master_killed_is_a_clear_error_naming_the_store(tmp_path, store):
    ep, ep_file = store
    settings = _settings(tmp_path, ep_file)
    sink = store_for("mooncake").open_sink(settings, 0)
    sink.put(_enc(0))
    source = MooncakeSource(settings)
    (ref,) = source.scan()
    os.kill(load_record(ep.master_pid_file).pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"Mooncake store \(master 127\.0\.0\.1:\d+\): get r1/shard_00000/"
                                               r"00000000: the master does not answer"):
        source.open(ref)
    with pytest.raises(StoreUnavailable, match="Mooncake store"):
        sink.put(_enc(1))
    with pytest.raises(StoreUnavailable, match="cannot connect"):
        MooncakeClient(source.ep)                      # a new client: refused at once, not after setup's 90 s
    assert time.monotonic() - t0 < 20
    sink.close()


@pytest.mark.parametrize("role", ["mooncake-master", "mooncake-metadata"])
def test_the_watch_sees_the_master_killed_as_the_stores_failure_within_seconds(tmp_path, store, role):
    """The trainer's watch (Store.server_health, read by watchdog.signals for the training job): a store that runs
    is healthy and answering; the master (or the metadata server) SIGKILLed by its PID is the store's failure on the
    next look, naming the process and its record, before any trainer would have to fail on it."""
    ep, ep_file = store
    pid_file = dict(ep.recorded())[role]
    settings = _settings(tmp_path, ep_file)
    mooncake = store_for("mooncake")
    up = mooncake.server_health(settings)
    assert up["ok"] and up["answering"] and up["label"] == ep.label
    assert store_for("disk").server_health(settings) is None
    os.kill(load_record(pid_file).pid, signal.SIGKILL)
    t0 = time.monotonic()
    while mooncake.server_health(settings)["ok"] and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    down = mooncake.server_health(settings)
    assert not down["ok"] and f"{role} is not running" in down["detail"]
    assert pid_file in down["detail"] and time.monotonic() - t0 < 10
    gone = store_for("mooncake").server_health(_settings(tmp_path, tmp_path / "no-endpoint.json"))
    assert not gone["ok"] and "not running" in gone["detail"]


TRAINER = r'''
import os, signal, sys, time
from eagleflow.stores import StoreSettings, store_for
from eagleflow.stores.ledger import EpochLedger
from eagleflow.train.data import StreamLoader
root, ep_file, ledger_file, kill_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
settings = StoreSettings(run_id="r1", root=root, fsync=False, buffer_bytes=32 << 20, endpoint_file=ep_file)
loader = StreamLoader(store_for("mooncake").open_source(settings), EpochLedger(ledger_file), batch_size=2,
                      corpus_size=12, shuffle_window=4, starve_after_s=60)
step = 0
while not loader.finished:
    batch, refs = loader.next_batch()
    if step == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)         # killed mid-epoch: this batch taken, never trained
    time.sleep(0.05)                                 # the step
    step += 1
    loader.commit(step)
print("done", step)
'''


def test_a_trainer_killed_mid_epoch_resumes_with_none_lost_and_none_twice(tmp_path, store):
    import subprocess
    import sys

    from eagleflow.stores.ledger import read_ledger, require_exactly_once
    ep, ep_file = store
    settings = _settings(tmp_path, ep_file)
    sink = store_for("mooncake").open_sink(settings, 0)
    produced = threading.Thread(target=lambda: [sink.put(_enc(i)) for i in range(12)])
    produced.start()                                 # capture writes while the trainer draws
    ledger = tmp_path / "ledger.jsonl"
    args = [sys.executable, "-c", TRAINER, str(tmp_path / "hs"), str(ep_file), str(ledger)]
    killed = subprocess.run(args + ["3"], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    state = read_ledger(ledger)
    assert len(state.epoch(0).pending) == 2 and sum(state.epoch(0).trained.values()) == 6
    resumed = subprocess.run(args + ["-1"], capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0 and "done" in resumed.stdout, resumed.stderr[-2000:]
    produced.join(30)
    sink.close()
    require_exactly_once(ledger, {f"src:{i}" for i in range(12)}, epochs=1)     # 0 lost, 0 twice
    assert int(metrics(ep)["master_key_count"]) == 0                             # each removed after its epoch
