"""FP8 hidden-state store (capture.store_dtype: fp8_e4m3): error bounds on adversarial rows, the stored
bytes, digests over the fp8 bytes, the training reader's de-quantisation, and the refusal of mixed stores."""
from __future__ import annotations

import json
import os

import pytest
import torch

from eagleflow.capture.manifest import ManifestEntry, ManifestWriter, read_manifest
from eagleflow.capture.storage import (FP8_MAX, FP8_SCALING, SampleWriter, dequantise_fp8, quantise_fp8,
                                       read_sample)
from eagleflow.capture.verify import quantisation_stats, stats_lines, verify_shard
from eagleflow.phases.extract.worker import ExtractionError, ShardWorker, WorkerSettings
from eagleflow.train.data import (SAMPLE_KEYS, BadSampleError, MixedStoreError, collate, read_sample_keys,
                                  scan_samples)
from tests.fixtures.train_hidden_states import write_synthetic_hidden_states


def _adversarial(L: int = 64, H: int = 256) -> torch.Tensor:
    """[L, 3H] bf16 rows a per-tensor scale would ruin: outlier channels and tokens, zeros, subnormals."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(L, 3 * H, generator=g)
    x[:, 5] *= 2000.0                  # a massive-activation channel in every token
    x[3] *= 1e5                        # an outlier token
    x[4] *= 1e-5                       # a tiny token
    x[6] = 0.0                         # an all-zero token
    x[7, :H] = 0.0                     # one captured layer of a token is zero, the others are not
    x[8] = 1e-40 * torch.sign(x[8])    # bf16 subnormals
    x[9, H:2 * H] = 3e-39              # one layer's block entirely subnormal in bf16
    x[10, 0] = 3e4                     # one huge entry, the rest of the row near zero
    x[10, 1:] *= 1e-6
    return x.to(torch.bfloat16)


def test_round_trip_error_is_bounded_on_every_adversarial_row():
    x = _adversarial()
    q, scale, err = quantise_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (64, 3)
    xf = x.float()
    d = dequantise_fp8(q, scale)
    s = scale.repeat_interleave(256, dim=1)
    # e4m3: 3 mantissa bits (rounding <= 1/16 relative) down to 2^-6 of the scaled range, then subnormal steps
    # of 2^-9 (<= 2^-10 absolute, times the block's scale); a little float32 slack on top
    bound = xf.abs() / 16 + s * 2.0 ** -10 + 1e-6 * xf.abs()
    assert bool(((d - xf).abs() <= bound).all()), float(((d - xf).abs() - bound).max())
    # no block loses its range: the stored absmax comes back (448 is exact in e4m3); a bf16-subnormal block's
    # scale is itself a float32 subnormal (a few significant bits), so its absmax comes back to 0.5 %
    blocks = xf.reshape(64, 3, 256).abs().amax(-1)
    normal = scale >= torch.finfo(torch.float32).tiny
    back = d.reshape(64, 3, 256).abs().amax(-1)
    assert torch.allclose(back[normal], blocks[normal], rtol=1e-6, atol=0)
    assert torch.allclose(back[~normal], blocks[~normal], rtol=5e-3, atol=0) and int((~normal).sum()) >= 5
    assert bool((d[6] == 0).all()) and bool((d[7, :256] == 0).all()) and scale[6].eq(0).all()
    assert bool((d[8] != 0).all())                                 # subnormal inputs survive, not flushed
    assert torch.allclose(d[8], xf[8], rtol=1 / 16) and torch.allclose(d[9, 256:512], xf[9, 256:512], rtol=1 / 16)
    assert float(d[10, 0]) == pytest.approx(3e4, rel=1 / 16) and float(d[3].abs().max()) > 1e5
    # the writer's figures: per-block relative L2 error; e4m3 gives ~2-3 % on Gaussian-like rows
    # in float64: squares of bf16 subnormals underflow in float32 and would hide those blocks' error
    rel = (d.double() - xf.double()).reshape(64, 3, 256).norm(dim=-1) / xf.double().reshape(64, 3, 256).norm(dim=-1)
    rel = torch.where(blocks > 0, rel, torch.zeros_like(rel))
    assert err["max_rel"] == pytest.approx(float(rel.max()), rel=1e-3) and err["max_rel"] < 0.04
    assert err["mean_rel"] == pytest.approx(float(rel.mean()), rel=1e-3)


def test_non_finite_hidden_states_are_refused_naming_the_sample(tmp_path):
    bad = torch.randn(4, 12)
    bad[2, 3] = float("inf")
    with pytest.raises(ValueError, match=r"sample s:1 \(index 1\): aux_hidden_states: holds inf or NaN"):
        SampleWriter(tmp_path, store_dtype="fp8_e4m3").write(
            index=1, sample_id="s:1", input_ids=torch.arange(4), loss_mask=torch.ones(4), aux_hidden_states=bad,
            hidden_states=torch.randn(4, 4), aux_layers=[1, 2, 3], model="m")
    with pytest.raises(ValueError, match="capture.store_dtype = 'fp4'"):
        SampleWriter(tmp_path, store_dtype="fp4")


def _write(tmp_path, store_dtype: str, L: int, H: int, index: int = 0, fsync: bool = False):
    g = torch.Generator().manual_seed(index)
    ids = torch.randint(0, 50_000, (L,), generator=g)
    mask = (torch.rand(L, generator=g) > 0.3).to(torch.uint8)
    aux = (torch.randn(L, 3 * H, generator=g) * 3).to(torch.bfloat16)
    hid = torch.randn(L, H, generator=g).to(torch.bfloat16)
    st = SampleWriter(tmp_path / store_dtype, fsync=fsync, store_dtype=store_dtype).write(
        index=index, sample_id=f"s:{index}", input_ids=ids, loss_mask=mask, aux_hidden_states=aux,
        hidden_states=hid, aux_layers=[2, 30, 57], model="/models/k")
    return st, ids, mask, aux, hid


def test_fp8_file_keys_metadata_exact_ids_and_half_the_bytes_at_h7168(tmp_path):
    L, H = 64, 7168
    st8, ids, mask, aux, hid = _write(tmp_path, "fp8_e4m3", L, H)
    st16 = _write(tmp_path, "auto", L, H)[0]
    raw, meta = read_sample(st8.path, raw=True)
    assert {k: str(v.dtype) for k, v in raw.items()} == {
        "input_ids": "torch.int64", "loss_mask": "torch.uint8", "aux_hidden_states": "torch.float8_e4m3fn",
        "hidden_states": "torch.float8_e4m3fn", "aux_hidden_states_scale": "torch.float32",
        "hidden_states_scale": "torch.float32"}
    assert raw["aux_hidden_states_scale"].shape == (L, 3) and raw["hidden_states_scale"].shape == (L, 1)
    assert meta["store_dtype"] == "fp8_e4m3" and meta["scaling"] == FP8_SCALING and meta["orig_dtype"] == "bfloat16"
    assert set(json.loads(meta["quant_error"])) == {"aux_hidden_states", "hidden_states"}
    assert torch.equal(raw["input_ids"], ids) and torch.equal(raw["loss_mask"], mask)
    back, _ = read_sample(st8.path)            # de-quantised to the target's dtype
    assert back["aux_hidden_states"].dtype == torch.bfloat16 and "hidden_states_scale" not in back
    assert torch.allclose(back["hidden_states"].float(), hid.float(), rtol=1 / 8, atol=hid.float().abs().max() / 448)
    # measured: the whole file, header and scales included, against the bf16 store of the same sample
    ratio = os.path.getsize(st8.path) / os.path.getsize(st16.path)
    assert ratio <= 0.51, ratio
    # by arithmetic, per token: 4 x 7168 + 4 float32 scales + 9 against 4 x 7168 x 2 + 9
    assert (4 * H + 16 + 9) / (4 * H * 2 + 9) == pytest.approx(0.50036, abs=1e-5)


def test_a_flipped_fp8_byte_fails_the_digest(tmp_path):
    st, *_ = _write(tmp_path, "fp8_e4m3", 16, 64, index=3)
    d = st.path.parent
    with ManifestWriter(d / "manifest.jsonl", fsync=False) as m:
        m.append(ManifestEntry("s:3", 3, st.path.name, 16, st.bytes, st.sha256, os.stat(st.path).st_mtime_ns,
                               st.store_dtype))
    ok = verify_shard(d, 0, [3])
    assert ok.ok and ok.store_dtypes == {"fp8_e4m3": 1} and "(1 fp8_e4m3)" in ok.line()
    # flip one byte of the aux fp8 payload (its offset from the header), same size
    header_len = int.from_bytes(st.path.read_bytes()[:8], "little")
    header = json.loads(st.path.read_bytes()[8:8 + header_len])
    at = 8 + header_len + header["aux_hidden_states"]["data_offsets"][0] + 17
    data = bytearray(st.path.read_bytes())
    data[at] ^= 0x01
    st.path.write_bytes(bytes(data))
    bad = verify_shard(d, 0, [3])
    assert not bad.ok and bad.mismatched == [st.path.name]


def test_flipped_byte_is_caught_by_the_training_scan_too(tmp_path, demo_assets):
    hs = tmp_path / "hs"
    write_synthetic_hidden_states(hs, demo_assets["target_model"], samples=4, shards=1, store_dtype="fp8_e4m3")
    p = hs / "shard_00000" / "00000002.safetensors"
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x80                                       # in the hidden_states scale, the last tensor
    p.write_bytes(bytes(data))
    with pytest.raises(BadSampleError, match=r"00000002.safetensors: sha256 differs"):
        scan_samples(hs, verify_sha256=True)


def test_reader_carries_fp8_and_dequantises_on_the_device(tmp_path, demo_assets):
    hs = tmp_path / "hs"
    write_synthetic_hidden_states(hs, demo_assets["target_model"], samples=6, shards=2, store_dtype="fp8_e4m3")
    refs = scan_samples(hs, verify_sha256=True)
    assert {r.store_dtype for r in refs} == {"fp8_e4m3"}
    assert all(e.store_dtype == "fp8_e4m3" for e in read_manifest(hs / "shard_00000" / "manifest.jsonl").entries.values())
    samples = [read_sample_keys(r, SAMPLE_KEYS) for r in refs[:3]]
    assert samples[0]["aux_hidden_states"].dtype == torch.float8_e4m3fn and "aux_hidden_states_scale" in samples[0]
    batch = collate(samples)
    assert batch.aux_hidden_states.dtype == torch.float8_e4m3fn and batch.aux_scale.shape[-1] == 3
    on = batch.to(torch.device("cpu"), torch.float32)
    assert on.aux_hidden_states.dtype == torch.float32 and on.aux_scale is None
    for i, r in enumerate(refs[:3]):
        want, _ = read_sample(r.path)
        n = r.tokens
        assert torch.equal(on.aux_hidden_states[i, :n], want["aux_hidden_states"].float())
        assert torch.equal(on.hidden_states[i, :n], want["hidden_states"].float())
        assert bool((on.aux_hidden_states[i, n:] == 0).all())          # padding de-quantises to zeros
        assert torch.equal(on.input_ids[i, :n], want["input_ids"])


def test_training_refuses_mixed_store_dtypes_naming_the_shards(tmp_path, demo_assets):
    hs = tmp_path / "hs"
    write_synthetic_hidden_states(hs, demo_assets["target_model"], samples=6, shards=3,
                                  store_dtype={0: "auto", 1: "fp8_e4m3", 2: "fp8_e4m3"})
    with pytest.raises(MixedStoreError) as e:
        scan_samples(hs)
    msg = str(e.value)
    assert "mix store dtypes (auto: shard_00000 (2 samples); fp8_e4m3: shard_00001 (2 samples), shard_00002" in msg
    assert "re-capture" in msg


def test_metadata_that_contradicts_the_manifest_is_a_bad_sample(tmp_path, demo_assets):
    hs = tmp_path / "hs"
    write_synthetic_hidden_states(hs, demo_assets["target_model"], samples=2, shards=1, store_dtype="fp8_e4m3")
    m = hs / "shard_00000" / "manifest.jsonl"
    m.write_text(m.read_text().replace(',"store_dtype":"fp8_e4m3"', ""))
    ref = scan_samples(hs)[0]
    assert ref.store_dtype == "auto"
    with pytest.raises(BadSampleError, match="metadata says store_dtype fp8_e4m3, its manifest line says auto"):
        read_sample_keys(ref, SAMPLE_KEYS)


def test_a_shard_stored_in_one_dtype_is_not_resumed_in_another(tmp_path):
    st, *_ = _write(tmp_path, "fp8_e4m3", 8, 16, index=0)
    d = st.path.parent
    with ManifestWriter(d / "manifest.jsonl", fsync=False) as m:
        m.append(ManifestEntry("s:0", 0, st.path.name, 8, st.bytes, st.sha256, os.stat(st.path).st_mtime_ns,
                               "fp8_e4m3"))
    s = WorkerSettings(run_id="r", shard=0, num_shards=1, corpus_file=str(tmp_path / "none.parquet"),
                       shard_dir=str(d), dump_dir=str(tmp_path / "dumps"), server_url="http://127.0.0.1:9",
                       heartbeat_interval_s=0.2, store_dtype="auto")
    with pytest.raises(ExtractionError, match=r"1 sample\(s\) .* stored with capture.store_dtype fp8_e4m3 .* "
                                              r"config now says auto; set capture.store_dtype back to fp8_e4m3"):
        ShardWorker(s, log=lambda _m: None).run()


def test_verify_stats_reports_the_error_per_tensor(tmp_path, demo_assets):
    hs = tmp_path / "hs"
    write_synthetic_hidden_states(hs, demo_assets["target_model"], samples=8, shards=2, store_dtype="fp8_e4m3")
    st = quantisation_stats(hs, sample=4)
    assert st["files"] == 4 and st["of"] == 8 and st["store_dtypes"] == {"fp8_e4m3": 4}
    assert set(st["tensors"]) == {"aux_hidden_states", "hidden_states"}
    for t in st["tensors"].values():
        assert 0 < t["mean_rel"] <= t["max_rel"] < 0.05
    lines = stats_lines(st)
    assert "over 4 of 8 stored file(s) (4 fp8_e4m3)" in lines[0] and lines[1].lstrip().startswith("aux_hidden_states")
    hs2 = tmp_path / "hs2"
    write_synthetic_hidden_states(hs2, demo_assets["target_model"], samples=2, shards=1)
    exact = quantisation_stats(hs2)
    assert exact["store_dtypes"] == {"auto": 2} and exact["tensors"]["hidden_states"]["max_rel"] == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantising_leaves_the_callers_tensor_alone(dtype):
    x = torch.randn(1500, 24).to(dtype)       # more rows than one quantisation chunk
    before = x.clone()
    quantise_fp8(x, 3)
    assert torch.equal(x, before)


def test_train_refuses_a_run_whose_shards_mix_store_dtypes(tmp_path, demo_assets):
    from eagleflow.config import load_config
    from eagleflow.layout import RunLayout
    from eagleflow.train.trainer import train
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": demo_assets["target_model"],
                            "train": {"device": "cpu", "max_steps": 2, "batch_size": 2, "draft_vocab_size": 64},
                            "capture": {"heartbeat_interval_s": 0.5}})
    layout = RunLayout.for_run(cfg, "mixed")
    write_synthetic_hidden_states(layout.hidden_states_dir, demo_assets["target_model"], samples=4, shards=2,
                                  store_dtype={0: "fp8_e4m3", 1: "auto"})
    with pytest.raises(MixedStoreError, match=r"auto: shard_00001 \(2 samples\); fp8_e4m3: shard_00000"):
        train(cfg, layout, log=lambda _m: None)
