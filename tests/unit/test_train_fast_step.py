"""The training step's fast path (issue 49: ``TrainingTimeTest(fast=True)``, ``train.fast_step``) trains as the
plain one: the same loss, per-step losses, metrics (top-1 agreement, simulated acceptance) and gradients to
float32 rounding; the head's loss chunked into many pieces gives the same; the same matmul FLOPs as counted;
``compile`` falls back to the eager layer when compiling fails; and over a few optimizer steps of the demo
draft the losses stay together."""
from __future__ import annotations

import pytest
import torch

from eagleflow.train.flops import draft_step_flops
from eagleflow.train.loss import TargetHead, TrainingTimeTest, load_target_head_and_embedding, summarize, target_batch
from eagleflow.train.model import DraftConfig, Eagle3Draft

TINY = DraftConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                   vocab_size=60, draft_vocab_size=24)


def _inputs(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY.vocab_size, (B, T), generator=g)
    aux = torch.randn(B, T, TINY.aux_width, generator=g)
    probs = torch.softmax(3 * torch.randn(B, T, TINY.draft_vocab_size, generator=g), -1)
    valid = torch.rand(B, T, generator=g) > 0.2
    return ids, aux, probs, probs.argmax(-1), valid


def _run(fast: bool, K: int, normalization: str, B: int, T: int, **kw):
    torch.manual_seed(0)
    draft = Eagle3Draft(TINY)
    ttt = TrainingTimeTest(draft, K, normalization, fast=fast, **kw)
    loss, stats = ttt(*_inputs(B, T))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ttt.named_parameters() if p.requires_grad}
    return loss.detach(), stats, grads


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    """Within ``rtol`` of the larger magnitude of the two (relative to the tensor's scale, not elementwise)."""
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() <= rtol * scale


@pytest.mark.parametrize("K,normalization,T", [(7, "all_positions", 12), (3, "loss_positions", 9),
                                               (7, "all_positions", 5)])   # T 5 < K + 1: later steps have no rows
def test_fast_path_gives_the_plain_loss_metrics_and_gradients(K, normalization, T):
    B = 3
    loss_p, stats_p, grads_p = _run(False, K, normalization, B, T)
    loss_f, stats_f, grads_f = _run(True, K, normalization, B, T)
    assert torch.allclose(loss_f, loss_p, rtol=1e-5, atol=0)
    assert _close(stats_f, stats_p)
    mp, mf = summarize(stats_p, K, 1), summarize(stats_f, K, 1)
    assert mf.acc == mp.acc and mf.accept_length == mp.accept_length and mf.positions == mp.positions
    assert mf.step_losses == pytest.approx(mp.step_losses, rel=1e-5, abs=1e-7)
    assert set(grads_f) == set(grads_p)
    for name in grads_p:
        assert _close(grads_f[name], grads_p[name]), name


def test_the_head_loss_in_many_small_chunks_is_the_same():
    K, B, T = 4, 2, 10
    loss_p, stats_p, grads_p = _run(False, K, "all_positions", B, T)
    # 3 rows a chunk: each step's rows split across chunks
    loss_c, stats_c, grads_c = _run(True, K, "all_positions", B, T, head_chunk_elements=3 * TINY.draft_vocab_size)
    assert torch.allclose(loss_c, loss_p, rtol=1e-5, atol=0)
    assert _close(stats_c, stats_p)
    for name in grads_p:
        assert _close(grads_c[name], grads_p[name]), name


def test_fast_path_without_gradients_scores_as_the_plain_one():
    ttt = TrainingTimeTest(Eagle3Draft(TINY), 3)
    with torch.no_grad():
        loss_p, stats_p = ttt(*_inputs(2, 8))
        ttt.fast = True
        ttt.draft.midlayer.self_attn.fast = True
        loss_f, stats_f = ttt(*_inputs(2, 8))
    assert torch.allclose(loss_f, loss_p, rtol=1e-5) and _close(stats_f, stats_p)


def test_fast_path_does_the_counted_matmul_flops():
    from torch.utils.flop_counter import FlopCounterMode
    B, T, K = 2, 9, 3
    ttt = TrainingTimeTest(Eagle3Draft(TINY), K, fast=True)
    counter = FlopCounterMode(display=False)
    with counter:
        loss, _ = ttt(*_inputs(B, T))
        loss.backward()
    assert counter.get_total_flops() == draft_step_flops(TINY, B, T, K).draft_matmul


def test_compile_that_fails_falls_back_to_the_eager_layer(monkeypatch):
    def broken(*_a, **_k):
        def fn(*_x, **_y):
            raise RuntimeError("no C++ compiler here")
        return fn
    monkeypatch.setattr(torch, "compile", broken)
    loss_p, stats_p, grads_p = _run(False, 3, "all_positions", 2, 8)
    loss_c, stats_c, grads_c = _run(False, 3, "all_positions", 2, 8, compile=True)
    assert torch.allclose(loss_c, loss_p, rtol=1e-5) and _close(stats_c, stats_p)
    for name in grads_p:
        assert _close(grads_c[name], grads_p[name]), name

    def unavailable(*_a, **_k):
        raise RuntimeError("torch.compile is not supported on this Python")
    monkeypatch.setattr(torch, "compile", unavailable)
    ttt = TrainingTimeTest(Eagle3Draft(TINY), 3, compile=True)
    assert ttt.compile_error is not None and "not supported" in ttt.compile_error
    loss_u, _ = ttt(*_inputs(2, 8))
    assert torch.isfinite(loss_u)


def test_the_layer_through_dynamo_gives_the_plain_results(monkeypatch):
    """torch.compile really tracing the layer (TorchDynamo; the "eager" backend, so no C++ compiler is needed):
    the TTT cache list it appends to, two lengths (dynamic shapes), the same loss and gradients."""
    import functools
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    loss_p, stats_p, grads_p = _run(False, 3, "all_positions", 2, 8)
    torch.manual_seed(0)
    ttt = TrainingTimeTest(Eagle3Draft(TINY), 3, compile=True)
    loss_c, stats_c = ttt(*_inputs(2, 8))
    loss_c.backward()
    assert ttt.compile_error is None and ttt._compiled, ttt.compile_error
    assert torch.allclose(loss_c.detach(), loss_p, rtol=1e-5) and _close(stats_c, stats_p)
    for name, p in ttt.named_parameters():
        if p.requires_grad:
            assert _close(p.grad, grads_p[name]), name
    loss_11, _ = ttt(*_inputs(2, 11))
    assert torch.isfinite(loss_11) and ttt.compile_error is None


def test_compiled_layer_keeps_the_parameter_names():
    ttt = TrainingTimeTest(Eagle3Draft(TINY), 2, compile=True)
    assert set(ttt.state_dict()) == set(TrainingTimeTest(Eagle3Draft(TINY), 2).state_dict())


def test_demo_draft_trains_alike_over_steps(tmp_path, demo_assets):
    """A few AdamW steps of the demo draft on synthetic hidden states: the losses stay together."""
    from eagleflow.train.data import HiddenStateLoader, scan_samples
    from eagleflow.train.trainer import build_draft
    from eagleflow.train.vocab import build_draft_vocab, count_loss_tokens
    from tests.fixtures.train_hidden_states import write_synthetic_hidden_states
    target = demo_assets["target_model"]
    write_synthetic_hidden_states(tmp_path / "hs", target, samples=8)
    refs = scan_samples(tmp_path / "hs", log=lambda _m: None)
    dcfg = DraftConfig.from_target(target, 64)
    vocab = build_draft_vocab(count_loss_tokens(refs, dcfg.vocab_size), 64, log=lambda _m: None)
    head, embed = load_target_head_and_embedding(target)
    th = TargetHead(head, vocab.draft_ids, vocab.t2d)
    out = {}
    for fast in (False, True):
        ttt = TrainingTimeTest(build_draft(dcfg, vocab, head, embed, seed=0), 4, fast=fast)
        params = [p for p in ttt.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3)
        loader = HiddenStateLoader(refs, batch_size=4, seed=0, prefetch=False)
        losses = []
        try:
            for _ in range(3):
                b = loader.next_batch()
                tb = target_batch(th, b)
                loss, stats = ttt(b.input_ids, b.aux_hidden_states, tb.probs, tb.top, tb.valid)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append((float(loss.detach()), summarize(stats, 4, 1)))
        finally:
            loader.close()
        out[fast] = losses
    for (lp, mp), (lf, mf) in zip(out[False], out[True]):
        assert lf == pytest.approx(lp, rel=1e-4)
        assert mf.positions == mp.positions
