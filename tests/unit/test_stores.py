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
