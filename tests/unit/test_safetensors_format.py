"""The torch-free safetensors reader and writer (eagleflow.safetensors_format) against safetensors' own."""
from __future__ import annotations

import json
import secrets

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagleflow.serving.dump_protocol import DumpTrustError, dump_mac, read_dump, verify_dump, write_dump
from eagleflow.safetensors_format import RawTensor, file_parts, read_raw

TENSORS = {"ids": torch.arange(9, dtype=torch.int64), "i32": torch.arange(4, dtype=torch.int32),
           "mask": torch.tensor([0, 1, 1], dtype=torch.uint8), "flag": torch.tensor([True, False]),
           "bf16": torch.randn(5, 6).to(torch.bfloat16), "f16": torch.randn(2, 3).to(torch.float16),
           "f32": torch.randn(3, 2), "f64": torch.randn(2).double(),
           "fp8": torch.randn(4, 4).to(torch.float8_e4m3fn), "empty": torch.empty(0, 7)}


def test_reads_what_safetensors_writes_byte_for_byte(tmp_path):
    p = tmp_path / "a.safetensors"
    save_file(TENSORS, str(p), metadata={"id": "x"})
    meta, raw = read_raw(p)
    assert meta == {"id": "x"} and set(raw) == set(TENSORS)
    for k, t in TENSORS.items():
        r = raw[k]
        assert r.shape == tuple(t.shape) and r.torch_name == str(t.dtype)
        want = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert bytes(r.data) == want
        back = r.to_torch()
        assert back.dtype == t.dtype and back.shape == t.shape
        assert back.reshape(-1).view(torch.uint8).numpy().tobytes() == want
    assert raw["ids"].tolist() == list(range(9)) and raw["i32"].as_int64().tolist() == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="BF16"):
        raw["bf16"].tolist()
    _meta, some = read_raw(p, ("ids", "nope"))
    assert list(some) == ["ids"]


def test_writes_what_safetensors_reads(tmp_path):
    p = tmp_path / "b.safetensors"
    p.write_bytes(b"".join(bytes(x) for x in file_parts({k: RawTensor.from_torch(v) for k, v in TENSORS.items()},
                                                        {"m": "1"})))
    with safe_open(str(p), framework="pt") as f:
        assert f.metadata() == {"m": "1"}
        for k, t in TENSORS.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and bytes(got.reshape(-1).view(torch.uint8).numpy()) == \
                bytes(t.reshape(-1).view(torch.uint8).numpy())


def _with_header(tmp_path, header: dict, data: bytes = b"\0" * 16):
    h = json.dumps(header).encode()
    p = tmp_path / "bad.safetensors"
    p.write_bytes(len(h).to_bytes(8, "little") + h + data)
    return p


@pytest.mark.parametrize("header, why", [
    ({"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, "dtype 'Q4' is not one of"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "do not hold shape"),
    ({"t": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, "do not hold shape"),   # past the file
    ({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "not non-negative integers"),
    ({"t": {"dtype": "F32", "shape": [1]}}, "lacks dtype, shape or two data_offsets"),
    ({"__metadata__": {"n": 1}}, "not a map of strings"),
])
def test_a_bad_header_is_refused_naming_the_tensor(tmp_path, header, why):
    with pytest.raises(ValueError, match=why):
        read_raw(_with_header(tmp_path, header))


def test_a_header_longer_than_the_file_is_refused(tmp_path):
    p = tmp_path / "short.safetensors"
    p.write_bytes((10 ** 6).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header length 1000000 does not fit a 10-byte file"):
        read_raw(p)


def test_the_dump_mac_is_the_same_over_raw_bytes_and_torch_tensors(tmp_path):
    """The server computes the MAC over torch tensors, the worker over the bytes it read: one MAC."""
    key = secrets.token_bytes(32)
    t = {"input_ids": torch.arange(4), "aux_hidden_states": torch.randn(4, 6).to(torch.bfloat16),
         "hidden_states": torch.randn(4, 2).to(torch.bfloat16)}
    raw = {k: RawTensor.from_torch(v) for k, v in t.items()}
    assert dump_mac(key, {"rid": "r"}, t) == dump_mac(key, {"rid": "r"}, raw)
    rid = "r.s00000.00000001"
    p = write_dump(tmp_path, rid, **t, aux_layers=[1, 2, 3], model="m", key=key)
    d = read_dump(p)
    verify_dump(d, key, p, rid)
    assert d.aux_hidden_states.dtype == "BF16" and d.input_ids.tolist() == [0, 1, 2, 3]
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 1                                   # one bit of the last hidden state flipped
    p.write_bytes(bytes(raw))
    with pytest.raises(DumpTrustError, match="does not match"):
        verify_dump(read_dump(p), key, p, rid)


def test_a_dump_that_is_no_safetensors_file_is_named(tmp_path):
    p = tmp_path / "r.s00000.00000002.safetensors"
    p.write_bytes(b"\xff" * 40)
    with pytest.raises(DumpTrustError, match=f"the dump {p} is not a readable safetensors file"):
        read_dump(p)
    save_file({"input_ids": torch.arange(2)}, str(p))
    with pytest.raises(DumpTrustError, match="lacks aux_hidden_states, hidden_states"):
        read_dump(p)
