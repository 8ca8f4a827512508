"""The prefetching loader (a background thread reads the next batch while the step runs) trains exactly as
the plain one: the first steps' losses and the final parameters equal, across an epoch boundary (issue 49;
bench/train_utilisation.py checks the same at benchmark size)."""
from __future__ import annotations

import torch

from eagleflow.train.data import HiddenStateLoader, scan_samples
from eagleflow.train.loss import TargetHead, TrainingTimeTest, load_target_head_and_embedding, target_batch
from eagleflow.train.model import DraftConfig
from eagleflow.train.trainer import build_draft
from eagleflow.train.vocab import build_draft_vocab, count_loss_tokens
from tests.fixtures.train_hidden_states import write_synthetic_hidden_states


def _losses(refs, target, prefetch: bool, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    dcfg = DraftConfig.from_target(target, 64)
    vocab = build_draft_vocab(count_loss_tokens(refs, dcfg.vocab_size), 64, log=lambda _m: None)
    head, embed = load_target_head_and_embedding(target)
    ttt = TrainingTimeTest(build_draft(dcfg, vocab, head, embed, seed=0), 3)
    params = [p for p in ttt.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    th = TargetHead(head, vocab.draft_ids, vocab.t2d)
    loader = HiddenStateLoader(refs, batch_size=4, seed=0, prefetch=prefetch)
    out = []
    try:
        for _ in range(steps):
            b = loader.next_batch().to(torch.device("cpu"), torch.float32)
            tb = target_batch(th, b)
            loss, _ = ttt(b.input_ids, b.aux_hidden_states, tb.probs, tb.top, tb.valid)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(float(loss.detach()))
    finally:
        loader.close()
    return out, [p.detach().clone() for p in params]


def test_prefetching_loader_trains_exactly_as_the_plain_one(tmp_path, demo_assets):
    target = demo_assets["target_model"]
    write_synthetic_hidden_states(tmp_path / "hs", target, samples=16)
    refs = scan_samples(tmp_path / "hs", log=lambda _m: None)
    steps = 6   # 4 batches an epoch: crosses into the second epoch
    plain, p_params = _losses(refs, target, False, steps)
    ahead, a_params = _losses(refs, target, True, steps)
    assert plain == ahead
    assert all(torch.equal(x, y) for x, y in zip(p_params, a_params))
