"""The hidden-state stores as a registry (issue 53): the contract each store keeps, the disk entry over today's
storage (same bytes, same manifest), and no module above the registry branching on a store's name."""
from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torch

from eagleflow.capture.manifest import read_manifest
from eagleflow.capture.storage import SampleWriter, file_sha256
from eagleflow.stores import STORES, StoreSettings, UnknownStore, store_for
from eagleflow.stores.contract import SampleSink, SampleSource
from eagleflow.stores.encoding import encode_sample
from eagleflow.train.data import SAMPLE_KEYS, read_sample_keys
from tests.fixtures.name_branches import name_branches

PKG = Path(__file__).resolve().parents[2] / "include" / "eagleflow"


def _sample(i: int, n: int = 5, h: int = 8, dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(i)
    return dict(index=i, sample_id=f"src:{i}", input_ids=torch.arange(n) + i, loss_mask=[1] * n,
                aux_hidden_states=torch.randn(n, 3 * h, generator=g).to(dtype),
                hidden_states=torch.randn(n, h, generator=g).to(dtype), aux_layers=[1, 2, 3], model="tiny")


def test_unknown_store_is_refused_naming_the_field_and_the_stores():
    with pytest.raises(UnknownStore, match=r"stream\.storage names no registered store; use one of 'disk', 'mooncake'"):
        store_for("nfs")


@pytest.mark.parametrize("store_dtype", ["auto", "fp8_e4m3"])
def test_the_disk_sink_writes_todays_bytes_and_manifest(tmp_path, store_dtype):
    # the same sample through the old writer and through the registry's disk sink: identical files
    old = SampleWriter(tmp_path / "old", fsync=False, store_dtype=store_dtype).write(**_sample(3))
    settings = StoreSettings(run_id="r1", root=str(tmp_path / "hs"), store_dtype=store_dtype, fsync=False)
    sink = store_for("disk").open_sink(settings, 0)
    assert isinstance(sink, SampleSink)
    receipt = sink.put(encode_sample(**_sample(3), store_dtype=store_dtype))
    sink.close()
    new = tmp_path / "hs" / "shard_00000" / "00000003.safetensors"
    assert new.read_bytes() == Path(old.path).read_bytes()
    assert receipt.sha256 == old.sha256 == file_sha256(new) and receipt.bytes == new.stat().st_size
    entry = read_manifest(tmp_path / "hs" / "shard_00000" / "manifest.jsonl").entries[3]
    assert (entry.id, entry.file, entry.tokens, entry.sha256, entry.store_dtype) == (
        "src:3", "00000003.safetensors", 5, old.sha256, store_dtype)
    source = store_for("disk").open_source(settings, log=lambda _m: None)
    assert isinstance(source, SampleSource) and not source.streaming
    (ref,) = source.scan()
    got = read_sample_keys(ref, SAMPLE_KEYS, source=source)
    assert torch.equal(got["input_ids"], torch.arange(5) + 3)


def test_the_encoding_is_the_stores_fp8_included():
    enc = encode_sample(**_sample(1), store_dtype="fp8_e4m3")
    data = enc.to_bytes()
    assert len(data) == enc.size and hashlib.sha256(data).hexdigest() == enc.sha256()
    from eagleflow.safetensors_format import read_header
    h = read_header(io.BytesIO(data), len(data))
    assert h.entries["aux_hidden_states"].dtype == "F8_E4M3" and "aux_hidden_states_scale" in h.entries
    assert h.metadata["store_dtype"] == "fp8_e4m3"


def store_branches(source: str, filename: str = "<src>") -> list[int]:
    """Lines comparing something with a store's name (``x == "mooncake"``, ``x in ("disk", ...)``, ``case``)."""
    return name_branches(source, set(STORES), filename)


def test_no_module_outside_the_registry_branches_on_a_stores_name():
    found = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if rel.startswith("stores/"):
            continue
        found += [f"{rel}:{line}" for line in store_branches(p.read_text(), str(p))]
    assert not found, ("store branches outside eagleflow/stores/ (give the Store a field instead): "
                       + ", ".join(found))


def test_the_store_branch_check_sees_the_shapes_it_guards_against():
    src = ('if cfg.stream.storage == "mooncake":\n    pass\n'
           "ok = storage in ('disk', 'x')\n"
           'match storage:\n    case "disk":\n        pass\n'
           'name = "mooncake"\n')
    assert store_branches(src) == [1, 3, 5]


def _streamed_manifest(tmp_path: Path, lines: list[tuple[int, str]]) -> Path:
    """A Mooncake shard's manifest under a run folder: (index, store_id) per line."""
    from eagleflow.capture.manifest import ManifestEntry, ManifestWriter
    shard = tmp_path / "run" / "hidden_states" / "shard_00000"
    with ManifestWriter(shard / "manifest.jsonl", fsync=False) as w:
        for i, sid in lines:
            w.append(ManifestEntry(id=f"src:{i}", index=i, file=f"r/shard_00000/{i:08d}", tokens=5, bytes=10,
                                   sha256="0" * 64, store_dtype="auto", store_id=sid))
    return shard


def test_a_lost_stores_lines_are_captured_again_unless_the_last_epoch_trained_them(tmp_path, monkeypatch):
    """The Mooncake resume: a line put into the store running now is done; a line of a dead incarnation is
    done only when the ledger's last epoch (its plan) trained it; every other one is redone, naming why."""
    from eagleflow.stores.ledger import EpochLedger
    from eagleflow.stores.mooncake import store as mstore
    from eagleflow.stores.mooncake.master import MooncakeEndpoint
    shard = _streamed_manifest(tmp_path, [(0, "old"), (1, "old"), (2, "old"), (3, "new"), (4, "old")])
    led = EpochLedger(tmp_path / "run" / "draft" / "stream_ledger.jsonl", fsync=False)
    led.plan(2)
    led.taken(0, ["src:0", "src:1", "src:2"])
    led.trained(0, ["src:0", "src:1"], step=1)     # epoch 0 only: epoch 1 still needs them
    led.taken(1, ["src:1"])
    led.trained(1, ["src:1"], step=2)              # the last epoch: needs it no more
    led.close()
    running = MooncakeEndpoint(host="127.0.0.1", rpc_port=1, metadata_port=2, metrics_port=3, segment_bytes=1,
                               store_id="new")
    seen: list[Path] = []
    monkeypatch.setattr(mstore, "running_store", lambda f: seen.append(Path(f)) or running)
    check = STORES["mooncake"].resume_check(str(shard), read_manifest(shard / "manifest.jsonl"))
    assert seen == [tmp_path / "run" / "store_endpoint.json"]
    assert check.done == {1, 3}
    assert sorted(e.index for e, _ in check.broken) == [0, 2, 4]
    assert all("put into store old, lost with it (the store running now is new)" in why for _, why in check.broken)
    # no store running (never started, or down again): nothing is proven lost, every recorded line is kept
    monkeypatch.setattr(mstore, "running_store", lambda f: None)
    check = STORES["mooncake"].resume_check(str(shard), read_manifest(shard / "manifest.jsonl"))
    assert check.done == {0, 1, 2, 3, 4} and not check.broken


def test_a_ledger_without_a_plan_counts_one_epoch_and_a_bad_plan_is_a_bad_line(tmp_path):
    from eagleflow.stores.ledger import EpochLedger, read_ledger
    led = EpochLedger(tmp_path / "l.jsonl", fsync=False)
    led.trained(0, ["a"], step=1)
    led.trained(1, ["b"], step=2)
    led.close()
    assert read_ledger(tmp_path / "l.jsonl").trained_in_last_epoch() == {"a"}
    with open(tmp_path / "l.jsonl", "a") as f:
        f.write('{"event":"plan","epochs":0}\n{"event":"plan","epochs":2}\n')
    state = read_ledger(tmp_path / "l.jsonl")
    assert state.bad_lines == [3] and state.planned_epochs == 2 and state.trained_in_last_epoch() == {"b"}


def test_a_manifest_line_keeps_its_store_incarnation(tmp_path):
    shard = _streamed_manifest(tmp_path, [(0, "s1"), (1, None)])
    text = (shard / "manifest.jsonl").read_text().splitlines()
    assert '"store_id":"s1"' in text[0] and "store_id" not in text[1]      # disk lines stay as they were
    entries = read_manifest(shard / "manifest.jsonl").entries
    assert entries[0].store_id == "s1" and entries[1].store_id is None


def test_an_existing_masters_store_is_judged_by_its_port_and_never_signalled(tmp_path):
    """stream.master: the endpoint names a master the run did not start (no pid record): its health is its port,
    its stop leaves it alone (outcome left_running, no PID), and what the run started (its segment) is stopped."""
    import json
    import socket

    from eagleflow.stores.mooncake.master import MooncakeEndpoint, run_store_health, running_store
    from eagleflow.stores.mooncake.store import stop_run_store
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        rpc = listener.getsockname()[1]
        ep_file = tmp_path / "store_endpoint.json"
        ep = MooncakeEndpoint("127.0.0.1", rpc, 1, 2, 64 << 20, segment_pid_file=str(tmp_path / "pids" / "seg.json"),
                              store_id="20261206T120000-abcd1234", foreign_master=True)
        ep_file.write_text(ep.to_json())
        assert MooncakeEndpoint.read(ep_file).foreign_master
        settings = StoreSettings(run_id="r1", root=str(tmp_path / "hs"), buffer_bytes=1 << 20,
                                 endpoint_file=str(ep_file))
        h = run_store_health(settings)
        # the master answers on its port; the run's segment holder has no record: that alone is down
        assert h["foreign_master"] and h["answering"] and not h["ok"]
        assert "mooncake-segment is not running" in h["detail"] and "mooncake-master" not in h["detail"]
        assert running_store(ep_file) is None
    h = run_store_health(settings)           # the port closed: the master's only evidence is gone
    assert not h["ok"] and not h["answering"]
    assert f"existing master 127.0.0.1:{rpc} (stream.master, not started by the run: judged by its port only" \
        in h["detail"]
    stopped = stop_run_store(settings, grace_s=0.1)
    results = {r["role"]: r for r in stopped}
    assert results["mooncake-master"] == {"role": "mooncake-master", "pid": None, "outcome": "left_running",
                                          "detail": f"the existing master 127.0.0.1:{rpc} (stream.master) is not "
                                                    "the run's: not signalled"}
    assert results["mooncake-keys"]["outcome"] == "not_removed"      # nobody answers: said, not hidden
    # the run's own process (its segment holder) is stopped by its record only: here there is none
    assert stopped[-1]["outcome"] == "not_recorded" and "seg.json" in stopped[-1]["detail"]
    assert len(stopped) == 3 and not ep_file.exists()
    assert json.loads(ep.to_json())["master_pid_file"] == ""
