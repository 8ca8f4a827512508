"""Final-format storage, manifest, verification and the capture protocol helpers."""
from __future__ import annotations

import json
import os

import pytest
import torch

from eagleflow.capture.manifest import ManifestEntry, ManifestWriter, completed_indexes, read_manifest
from eagleflow.serving.dump_protocol import (check_rid, default_aux_layers, parse_request_id, read_dump, request_id,
                                        resolve_aux_layers, write_dump)
from eagleflow.capture.storage import SampleWriter, read_sample, remove_temp_files, sample_file_name
from eagleflow.capture.verify import verify_shard


def _store(writer: SampleWriter, index: int, L: int = 5, H: int = 4):
    g = torch.Generator().manual_seed(index)
    return writer.write(index=index, sample_id=f"s:{index}", input_ids=torch.arange(L),
                        loss_mask=torch.tensor([0, 1] * (L // 2) + [1] * (L % 2)),
                        aux_hidden_states=torch.randn(L, 3 * H, generator=g, dtype=torch.bfloat16),
                        hidden_states=torch.randn(L, H, generator=g, dtype=torch.bfloat16),
                        aux_layers=[1, 3, 4], model="tiny")


def test_sample_file_has_contract_keys_dtypes_and_metadata(tmp_path):
    st = _store(SampleWriter(tmp_path), 57)
    assert st.path.name == "00000057.safetensors"
    tensors, meta = read_sample(st.path)
    assert tensors["input_ids"].dtype == torch.int64
    assert tensors["loss_mask"].dtype == torch.uint8
    assert tensors["aux_hidden_states"].shape == (5, 12) and tensors["aux_hidden_states"].dtype == torch.bfloat16
    assert tensors["hidden_states"].shape == (5, 4)
    assert meta == {"id": "s:57", "index": "57", "aux_layers": "[1, 3, 4]", "model": "tiny", "store_dtype": "auto"}
    assert st.bytes == os.path.getsize(st.path)
    assert not list(tmp_path.glob(".tmp-*"))


def test_rows_must_agree(tmp_path):
    with pytest.raises(ValueError, match="loss_mask has 3 rows but input_ids has 5"):
        SampleWriter(tmp_path).write(index=1, sample_id="a:1", input_ids=torch.arange(5), loss_mask=torch.ones(3),
                                     aux_hidden_states=torch.zeros(5, 6), hidden_states=torch.zeros(5, 2),
                                     aux_layers=[1], model="m")


def test_manifest_ignores_partial_tail_and_seals_it(tmp_path):
    p = tmp_path / "manifest.jsonl"
    with ManifestWriter(p) as w:
        w.append(ManifestEntry("a:0", 0, "00000000.safetensors", 5, 10, "x"))
    with open(p, "ab") as f:
        f.write(b'{"id": "a:2", "index": 2, "fi')          # crash mid-append
    scan = read_manifest(p)
    assert list(scan.entries) == [0] and scan.partial_tail
    with ManifestWriter(p) as w:                              # the next append starts a fresh line
        w.append(ManifestEntry("a:4", 4, "00000004.safetensors", 5, 10, "y"))
    scan = read_manifest(p)
    assert sorted(scan.entries) == [0, 4] and scan.bad_lines == [2] and not scan.partial_tail


def test_resume_check_requires_file_with_recorded_size(tmp_path):
    w = SampleWriter(tmp_path)
    entries = []
    for i in (0, 2, 4):
        st = _store(w, i)
        entries.append(ManifestEntry(f"s:{i}", i, st.path.name, 5, st.bytes, st.sha256))
    with ManifestWriter(tmp_path / "manifest.jsonl") as m:
        for e in entries:
            m.append(e)
    os.truncate(tmp_path / sample_file_name(2), 10)
    os.unlink(tmp_path / sample_file_name(4))
    check = completed_indexes(tmp_path, read_manifest(tmp_path / "manifest.jsonl"))
    assert check.done == {0} and sorted(e.index for e, _ in check.broken) == [2, 4]


def test_verify_reports_missing_extra_truncated_mismatched(tmp_path):
    w = SampleWriter(tmp_path)
    with ManifestWriter(tmp_path / "manifest.jsonl") as m:
        for i in (0, 2, 4, 6):
            st = _store(w, i)
            m.append(ManifestEntry(f"s:{i}", i, st.path.name, 5, st.bytes, st.sha256))
    _store(w, 10)                                         # stored but never recorded
    os.truncate(tmp_path / sample_file_name(2), 10)
    data = bytearray((tmp_path / sample_file_name(4)).read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / sample_file_name(4)).write_bytes(bytes(data))
    rep = verify_shard(tmp_path, 0, [0, 2, 4, 6, 8])
    assert not rep.ok
    assert rep.stored == 2 and rep.missing == [8] and rep.extra == [sample_file_name(10)]
    assert rep.truncated == [sample_file_name(2)] and rep.mismatched == [sample_file_name(4)]
    assert "FAILED" in rep.line()
    assert verify_shard(tmp_path, 0, [0, 6], check_digest=True).extra  # 2, 4, 10 not expected: extra


def test_temp_files_are_removed(tmp_path):
    (tmp_path / ".tmp-00000003.safetensors.123").write_bytes(b"partial")
    assert len(remove_temp_files(tmp_path)) == 1 and not list(tmp_path.iterdir())


def test_fault_hook_pauses_before_rename(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEFLOW_CAPTURE_FAULT_BEFORE_RENAME", "pause:0.01")
    monkeypatch.setenv("EAGLEFLOW_CAPTURE_FAULT_AFTER_N", "1")
    w = SampleWriter(tmp_path)
    _store(w, 0)
    _store(w, 1)
    assert w.stored == 2


def test_default_aux_layers_and_validation():
    assert default_aux_layers(8) == [1, 3, 4]
    assert default_aux_layers(61) == [1, 29, 57]     # sglang's [2, 30, 58] minus the +1 of "input of layer"
    assert resolve_aux_layers(None, 32) == [1, 15, 28]
    assert resolve_aux_layers([0, 2, 6], 8) == [0, 2, 6]
    with pytest.raises(ValueError, match=r"layer\(s\) \[7\] are outside 0..6"):
        resolve_aux_layers([1, 3, 7], 8)
    with pytest.raises(ValueError, match="at least 5"):
        default_aux_layers(4)


def test_request_ids_round_trip_and_are_safe():
    rid = request_id("manual", 3, 57)
    assert rid == "manual.s00003.00000057" and parse_request_id(rid) == ("manual", 3, 57)
    for bad in ("../x", "", ".hidden", "a/b", 5):
        with pytest.raises(ValueError):
            check_rid(bad)


def test_dump_round_trip(tmp_path):
    p = write_dump(tmp_path, "r.s00000.00000001", input_ids=torch.arange(3), aux_hidden_states=torch.ones(3, 6),
                   hidden_states=torch.zeros(3, 2), aux_layers=[1, 2, 3], model="m")
    d = read_dump(p)
    assert d.rid == "r.s00000.00000001" and d.aux_layers == [1, 2, 3] and d.input_ids.tolist() == [0, 1, 2]
    assert [x.name for x in tmp_path.iterdir()] == ["r.s00000.00000001.safetensors"]


def test_zero_copy_serialisation_is_valid_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load

    from eagleflow.capture.storage import file_sha256
    from eagleflow.safetensors_format import RawTensor, file_parts
    t = {"input_ids": torch.arange(7), "loss_mask": torch.tensor([0, 1, 1, 0, 1, 1, 1], dtype=torch.uint8),
         "aux_hidden_states": torch.randn(7, 12).to(torch.bfloat16), "hidden_states": torch.randn(7, 4),
         "half": torch.randn(3, 5).to(torch.float16)[:, 1:4]}          # non-contiguous input
    data = b"".join(bytes(p) for p in file_parts({k: RawTensor.from_torch(v) for k, v in t.items()}, {"id": "x:1"}))
    back = load(data)
    for k, v in t.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    (tmp_path / "f.safetensors").write_bytes(data)
    with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as f:
        assert f.metadata() == {"id": "x:1"}
    st = _store(SampleWriter(tmp_path), 3)
    assert st.sha256 == file_sha256(st.path), "the digest is of the bytes on disk"
