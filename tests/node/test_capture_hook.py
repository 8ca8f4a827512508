"""The capture hook on sglang 0.5.23's own objects: ScheduleBatch, Req, ForwardBatch, results, HookRegistry."""
from __future__ import annotations

import pytest
import torch
from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
from sglang.srt.sampling.sampling_params import SamplingParams

from eagleflow.engines.sglang import plugin
from eagleflow.serving.dump_protocol import read_dump, request_id

H, K = 8, 3   # hidden size, aux layers


def _req(rid: str, n: int) -> Req:
    return Req(rid=rid, origin_input_text="", origin_input_ids=list(range(n)),
               sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))


def _prefill(parts: list[tuple[str, int, int]]) -> tuple[ScheduleBatch, torch.Tensor]:
    """A ScheduleBatch as prepare_for_extend leaves it: parts are (rid, extend_len, prefix_len)."""
    reqs = [_req(rid, n + p) for rid, n, p in parts]
    extend = [n for _, n, _ in parts]
    ids = torch.arange(1000, 1000 + sum(extend), dtype=torch.int64)
    batch = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND, extend_lens=extend,
                          prefix_lens=[p for _, _, p in parts], input_ids=ids, device="cpu")
    return batch, ids


def _result(rows: int) -> tuple[GenerationBatchResult, torch.Tensor, torch.Tensor]:
    aux = torch.randn(rows, K * H, dtype=torch.bfloat16)       # packed, as pack_aux_hidden_states returns it
    last = torch.randn(rows, H, dtype=torch.bfloat16)
    out = LogitsProcessorOutput(next_token_logits=torch.zeros(1, 16), hidden_states=aux, last_hidden_states=last)
    return GenerationBatchResult(logits_output=out), aux, last


def _hooked(result: GenerationBatchResult):
    """TpModelWorker.forward_batch_generation as HookRegistry wraps it with our AFTER hook."""
    def original(self, batch, forward_batch=None, pp_proxy_tensors=None, is_verify=False, **kw):
        return result
    return _wrap_fn(original, plugin.after_forward_batch_generation, HookType.AFTER)


def _worker() -> TpModelWorker:
    return object.__new__(TpModelWorker)   # the real class; its GPU-bound __init__ is not needed by the hook


def test_batched_prefill_is_dumped_row_by_row_per_request(capture_env, attn_tp_rank):
    a, b, c = request_id("run1", 0, 0), request_id("run1", 0, 1), request_id("run1", 3, 7)
    health = f"{HEALTH_CHECK_RID_PREFIX}_5f2e"
    parts = [(a, 5, 0), (health, 3, 0), (b, 2, 4), (c, 7, 0)]   # b hit 4 cached tokens: only 2 rows computed
    batch, ids = _prefill(parts)
    result, aux, last = _result(sum(n for _, n, _ in parts))
    with attn_tp_rank(0):
        assert _hooked(result)(_worker(), batch) is result
    stored = sorted(p.name for p in capture_env.iterdir())
    assert stored == sorted([f"{a}.safetensors", f"{c}.safetensors"]), \
        "sglang's own request and the cache hit get no dump"
    for rid, start, n in ((a, 0, 5), (c, 10, 7)):
        d = read_dump(capture_env / f"{rid}.safetensors")
        assert d.rid == rid and d.aux_layers == [2, 5, 6] and d.model == "tiny-llama"
        assert d.input_ids.tolist() == ids[start:start + n].tolist()
        got_aux, got_last = d.aux_hidden_states.to_torch(), d.hidden_states.to_torch()
        assert got_aux.dtype == torch.bfloat16 and got_aux.shape == (n, K * H)
        for row in range(n):
            assert torch.equal(got_aux[row], aux[start + row])
            assert torch.equal(got_last[row], last[start + row])


def test_other_attention_tp_ranks_write_nothing(capture_env, attn_tp_rank):
    batch, _ = _prefill([(request_id("r", 0, 0), 4, 0)])
    result, _, _ = _result(4)
    with attn_tp_rank(1):
        _hooked(result)(_worker(), batch)
    assert not capture_env.exists() or not list(capture_env.iterdir())


def test_decode_batches_are_ignored(capture_env, attn_tp_rank):
    batch, _ = _prefill([(request_id("r", 0, 0), 1, 6)])
    batch.forward_mode = ForwardMode.DECODE
    out = LogitsProcessorOutput(next_token_logits=torch.zeros(1, 16), hidden_states=None, last_hidden_states=None)
    with attn_tp_rank(0):
        _hooked(GenerationBatchResult(logits_output=out))(_worker(), batch)
    assert not capture_env.exists() or not list(capture_env.iterdir())


def test_forward_batch_only_call(capture_env, attn_tp_rank):
    a, b = request_id("r", 1, 0), request_id("r", 1, 1)
    lens = [3, 4]
    ids = torch.arange(50, 57)
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=ids,
                      req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor(lens),
                      out_cache_loc=torch.arange(7), seq_lens_sum=7, rids=[a, b],
                      extend_seq_lens=torch.tensor(lens), extend_prefix_lens=torch.tensor([0, 0]),
                      extend_start_loc=torch.tensor([0, 3]), extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=[0, 0])
    result, aux, last = _result(7)
    with attn_tp_rank(0):
        _hooked(result)(_worker(), None, forward_batch=fb)
    d = read_dump(capture_env / f"{b}.safetensors")
    assert d.input_ids.tolist() == [53, 54, 55, 56]
    assert torch.equal(d.aux_hidden_states.to_torch(), aux[3:7]) and torch.equal(d.hidden_states.to_torch(), last[3:7])


def test_a_server_without_aux_capture_is_named(capture_env, attn_tp_rank):
    import pytest
    batch, _ = _prefill([(request_id("r", 0, 0), 2, 0)])
    out = LogitsProcessorOutput(next_token_logits=torch.zeros(1, 16), hidden_states=None, last_hidden_states=None)
    with attn_tp_rank(0), pytest.raises(plugin.CaptureHookError, match="--enable-return-aux-hidden-states"):
        _hooked(GenerationBatchResult(logits_output=out))(_worker(), batch)


def test_dumps_carry_the_key_s_mac_and_stay_private(capture_env, attn_tp_rank, monkeypatch):
    """Issue 26 item 4 in the real hook: bf16 dumps 0600 in a 0700 folder, each verifying under the key the
    launcher hands the schedulers; without the key a dump carries no MAC and the worker would refuse it."""
    import os
    import secrets
    import stat

    from eagleflow.serving.dump_protocol import ENV_DUMP_KEY, DumpTrustError, verify_dump
    key = secrets.token_bytes(32)
    monkeypatch.setenv(ENV_DUMP_KEY, key.hex())
    a = request_id("run1", 0, 0)
    batch, _ = _prefill([(a, 6, 0)])
    result, _, _ = _result(6)
    with attn_tp_rank(0):
        _hooked(result)(_worker(), batch)
    p = capture_env / f"{a}.safetensors"
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600 and stat.S_IMODE(os.stat(capture_env).st_mode) == 0o700
    d = read_dump(p)
    assert d.aux_hidden_states.to_torch().dtype == torch.bfloat16
    verify_dump(d, key, p, a)
    with pytest.raises(DumpTrustError, match="does not match"):
        verify_dump(d, secrets.token_bytes(32), p, a)
    monkeypatch.delenv(ENV_DUMP_KEY)
    with attn_tp_rank(0):
        _hooked(result)(_worker(), batch)
    with pytest.raises(DumpTrustError, match="carries no MAC"):
        verify_dump(read_dump(p), key, p, a)
