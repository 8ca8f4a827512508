"""Training parity with SpecForge, the reference EAGLE-3 trainer (specforge 0.2.0 on PyPI).

SpecForge's loss code imports triton and compiles with torch.compile, so it does not
run in this CPU venv. Its EAGLE-3 loss plumbing is transcribed below (``SF`` functions,
each naming the file and function it copies) and run on the same tensors as our
``target_batch`` / ``TrainingTimeTest``, with our draft as the backbone for both, so
only the alignment, masking, normalisation and step weighting are compared. The
transcription itself was checked against the real specforge 0.2.0 functions
(``check_against_specforge`` at the bottom, run with specforge importable).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eagleflow.config import TrainConfig
from eagleflow.train.data import Batch
from eagleflow.train.loss import STEP_WEIGHT_DECAY, TargetHead, TrainingTimeTest, target_batch
from eagleflow.train.model import DraftConfig, Eagle3Draft
from eagleflow.train.trainer import lr_at


# ---- SpecForge's EAGLE-3 loss path, transcribed (torch.compile dropped; the code is eager-equivalent) ----

def sf_padding(tensor, left=True):
    """specforge/utils.py padding"""
    zeropadding = torch.zeros_like(tensor[:, -1:])
    if left:
        return torch.cat((zeropadding, tensor[:, :-1]), dim=1)
    return torch.cat((tensor[:, 1:], zeropadding), dim=1)


def sf_compute_target_p(target, t2d, loss_mask):
    """specforge/algorithms/eagle3/model.py _compute_target_p"""
    target_head = target.float()
    target_token_ids = target_head.argmax(-1)
    target_mask = t2d[target_token_ids]
    target_mask = target_mask[..., None].int()
    position_mask = target_mask * loss_mask
    draft_target_head = target_head[..., t2d]
    target_p = torch.nn.Softmax(dim=2)(draft_target_head)
    return target_p, target_token_ids, position_mask


def sf_compute_target_p_padded(target, t2d, loss_mask, length):
    """specforge/algorithms/eagle3/model.py _compute_target_p_padded (the parts the KL loss uses)"""
    target_p, target_token_ids, position_mask = sf_compute_target_p(target, t2d, loss_mask)
    target_p_padded = F.pad(target_p, pad=(0, 0, 0, length), mode="constant", value=1 / target_p.shape[-1])
    return target_p_padded, position_mask


def sf_compute_loss(logits, target_p, position_mask):
    """specforge/core/loss.py _compute_loss (the reference of its triton LogSoftmaxLoss)"""
    logits = logits.float()
    out_logp = torch.nn.LogSoftmax(dim=2)(logits)
    plogp = target_p * out_logp
    return -torch.sum(position_mask * plogp, 2).mean()


SF = {"padding": sf_padding, "compute_target_p_padded": sf_compute_target_p_padded, "compute_loss": sf_compute_loss}


def specforge_loss(draft: Eagle3Draft, input_ids, aux, loss_mask, target_hidden, head_weight, ttt: int, fns=SF):
    """(weighted loss, per-step losses) the way SpecForge computes them for one offline batch.

    modeling/target/target_head.py TargetHead.preprocess + forward; algorithms/eagle3/model.py
    OnlineEagle3Model.forward (Step 5) with eagle3_adapters.py SdpaLikeAdapter.step_view;
    training/strategies/base.py Eagle3TrainStrategy.forward_loss (ploss_decay 0.8).
    """
    pad = fns["padding"]
    target = pad(target_hidden, left=False)           # TargetHead.preprocess
    input_ids = pad(input_ids, left=False)
    loss_mask = loss_mask[..., None]
    target = target.float() @ head_weight.float().T    # TargetHead.forward (lm_head, no bias)
    target_p_padded, position_mask = fns["compute_target_p_padded"](target, draft.t2d, loss_mask, ttt)
    seq_length = input_ids.shape[1]
    hidden = draft.fc(aux)                             # project_hidden_states
    cache: list = []
    plosses = []
    for idx in range(ttt):
        target_p = target_p_padded[:, idx: idx + seq_length, :]          # step_view
        hidden = draft.step(input_ids, hidden, idx, cache)                # backbone, rope at position + idx
        logits = draft.logits(hidden)
        plosses.append(fns["compute_loss"](logits, target_p, position_mask))
        if idx != ttt - 1:                                                # Step 5.7
            input_ids = pad(input_ids, left=False)
            position_mask = pad(position_mask, left=False)
            loss_mask = pad(loss_mask, left=False)
    return sum((0.8 ** i) * p for i, p in enumerate(plosses)), plosses


# ---- shared tensors ----

V, VD, H = 40, 12, 32


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=V, draft_vocab_size=VD)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg).eval()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:VD]] = True
    draft_ids = t2d.nonzero().flatten()                # ascending, as SpecForge's boolean column pick
    with torch.no_grad():
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(draft_ids - torch.arange(VD))
    head_w = torch.randn(V, H, generator=g)
    # two samples, the second padded: lengths 10 and 7; prompts of 3 and 2 tokens outside the loss
    lengths, t = [10, 7], 10
    ids = torch.randint(1, V, (2, t), generator=g)
    real = torch.zeros(2, t, dtype=torch.bool)
    lm = torch.zeros(2, t, dtype=torch.bool)
    for b, (n, prompt) in enumerate(zip(lengths, [3, 2])):
        real[b, :n] = True
        lm[b, prompt:n] = True
        ids[b, n:] = 0
    hidden = torch.randn(2, t, H, generator=g) * 3
    hidden[~real] = 0
    aux = torch.randn(2, t, 3 * H, generator=g)
    aux[~real] = 0
    # the target's top token must sometimes fall outside the draft vocabulary (a masked position)
    batch = Batch(input_ids=ids, loss_mask=lm, attention_mask=real, aux_hidden_states=aux, hidden_states=hidden)
    head = TargetHead(head_w, draft_ids, t2d)
    # SpecForge's offline normaliser zeroes each sample's last loss-mask entry (algorithms/eagle3/data.py
    # normalize_offline_sample) and its collator pads the mask with zeros
    lm_sf = lm.clone().long()
    for b, n in enumerate(lengths):
        lm_sf[b, n - 1] = 0
    return draft, batch, head, head_w, lm_sf


def _sf(draft, batch, lm_sf, head_w, ttt, fns=SF):
    return specforge_loss(draft, batch.input_ids, batch.aux_hidden_states, lm_sf, batch.hidden_states, head_w, ttt, fns)


def _ours(draft, batch, head, ttt, alignment="specforge", normalization="all_positions"):
    tb = target_batch(head, batch, alignment)
    loss, stats = TrainingTimeTest(draft, ttt, normalization)(batch.input_ids, batch.aux_hidden_states, tb.probs,
                                                              tb.top, tb.valid)
    return loss, stats[:ttt], tb


@pytest.mark.parametrize("ttt", [1, 3, 7])
def test_loss_equals_specforge_on_the_same_tensors(ttt):
    draft, batch, head, head_w, lm_sf = _case()
    with torch.no_grad():
        ours, ours_steps, tb = _ours(draft, batch, head, ttt)
        theirs, theirs_steps = _sf(draft, batch, lm_sf, head_w, ttt)
    assert 0 < int(tb.valid.sum()) < int(batch.attention_mask.sum()) - 2, "some positions must not count"
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_steps, torch.stack(theirs_steps), rtol=1e-5, atol=1e-6)


def test_gradients_equal_specforge():
    draft, batch, head, head_w, lm_sf = _case(seed=3)
    ours, _, _ = _ours(draft, batch, head, 3)
    ours.backward()
    g_ours = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    theirs, _ = _sf(draft, batch, lm_sf, head_w, 3)
    theirs.backward()
    for n, p in draft.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(g_ours[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)
    assert "fc.weight" in g_ours and "midlayer.self_attn.q_proj.weight" in g_ours


def test_the_other_choices_really_differ_from_specforge():
    draft, batch, head, head_w, lm_sf = _case()
    with torch.no_grad():
        theirs, _ = _sf(draft, batch, lm_sf, head_w, 3)
        other_mask, _, tb_other = _ours(draft, batch, head, 3, alignment="predicted_token")
        other_norm, _, _ = _ours(draft, batch, head, 3, normalization="loss_positions")
        _, _, tb = _ours(draft, batch, head, 3)
    assert not torch.equal(tb.valid, tb_other.valid)
    assert abs(float(other_mask - theirs)) > 1e-3 and abs(float(other_norm - theirs)) > 1e-3


def test_mask_alignment_by_hand():
    """Sample x_0..x_5, loss mask on x_2..x_5 (prompt x_0, x_1), every target top token in the draft vocab.

    target_j (from the last hidden state at j) predicts x_{j+1}. SpecForge counts target_j when
    loss_mask[j-1] (and j is real): j = 3, 4, 5. The predicted-token choice: loss_mask[j+1]: j = 1..4.
    """
    lm = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    real = torch.ones(1, 6, dtype=torch.bool)
    head = TargetHead(torch.eye(4, 3), torch.arange(4), torch.ones(4, dtype=torch.bool))
    batch = Batch(input_ids=torch.zeros(1, 6, dtype=torch.int64), loss_mask=lm, attention_mask=real,
                  aux_hidden_states=torch.zeros(1, 6, 9), hidden_states=torch.randn(1, 6, 3))
    assert target_batch(head, batch, "specforge").valid[0].nonzero().flatten().tolist() == [3, 4, 5]
    assert target_batch(head, batch, "predicted_token").valid[0].nonzero().flatten().tolist() == [1, 2, 3, 4]
    # SpecForge's own pipeline on the same sample: step k at t uses target_{t+k+1} with mask lm_sf[t+k]
    lm_sf = lm.long().clone()
    lm_sf[0, -1] = 0                                    # normalize_offline_sample
    _, pm = sf_compute_target_p_padded(torch.randn(1, 6, 4), torch.ones(4, dtype=torch.bool), lm_sf[..., None], 1)
    # pm[t] scores target_{t+1}: t = 2, 3, 4 -> target_j for j = 3, 4, 5
    assert pm[0, :, 0].nonzero().flatten().tolist() == [2, 3, 4]
    with pytest.raises(ValueError, match="loss_mask_alignment 'sideways'"):
        target_batch(head, batch, "sideways")


def test_normalisation_by_hand():
    """Uniform draft logits over Vd = 4: every counted position costs ln 4 (any target distribution).

    B x T = 2 x 5 = 10 positions; step 0 counts 3 of them, step 1 counts 2.
    all_positions (SpecForge): step 0 = 3 ln4 / 10, step 1 = 2 ln4 / 10; loss_positions: ln 4 each.
    """
    cfg = DraftConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=4, vocab_size=10, draft_vocab_size=4)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        draft.lm_head.weight.zero_()                     # logits 0 -> log_softmax = -ln 4 everywhere
    ids = torch.randint(0, 10, (2, 5))
    probs = torch.softmax(torch.randn(2, 5, 4), -1)
    valid = torch.zeros(2, 5, dtype=torch.bool)
    valid[0, 1] = valid[0, 2] = valid[1, 3] = True        # step 0 reads valid[:, 1:]: 3 positions
    # step 1 reads valid[:, 2:]: (0, 2) and (1, 3): 2 positions
    ln4 = math.log(4)
    for norm, want in (("all_positions", [3 * ln4 / 10, 2 * ln4 / 10]), ("loss_positions", [ln4, ln4])):
        loss, stats = TrainingTimeTest(draft, 2, norm)(ids, torch.randn(2, 5, 24), probs, probs.argmax(-1), valid)
        torch.testing.assert_close(stats[:2], torch.tensor(want), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss, torch.tensor(want[0] + STEP_WEIGHT_DECAY * want[1]), rtol=1e-5, atol=1e-6)
    # SpecForge's _compute_loss on the same step-0 numbers
    pm = torch.zeros(2, 5, 1)
    pm[0, 0] = pm[0, 1] = pm[1, 2] = 1                    # valid[:, 1:] laid out at t
    got = sf_compute_loss(torch.zeros(2, 5, 4), F.pad(probs[:, 1:], (0, 0, 0, 1), value=0.25), pm)
    assert got.item() == pytest.approx(3 * ln4 / 10, rel=1e-6)
    with pytest.raises(ValueError, match="loss_normalization 'per_token'"):
        TrainingTimeTest(draft, 2, "per_token")


def test_loss_per_scored_position_is_the_same_under_either_normalisation():
    """The curves' comparable figure: ln 4 + 0.8 ln 4 per scored position, whatever divides the loss (the
    by-hand batch above: SpecForge's B x T loss is 3 ln4 / 10 + 0.8 x 2 ln4 / 10, and would move with padding)."""
    from eagleflow.train.loss import summarize
    cfg = DraftConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=4, vocab_size=10, draft_vocab_size=4)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        draft.lm_head.weight.zero_()
    ids = torch.randint(0, 10, (2, 5))
    probs = torch.softmax(torch.randn(2, 5, 4), -1)
    valid = torch.zeros(2, 5, dtype=torch.bool)
    valid[0, 1] = valid[0, 2] = valid[1, 3] = True
    ln4 = math.log(4)
    for norm, loss_want in (("all_positions", 3 * ln4 / 10 + STEP_WEIGHT_DECAY * 2 * ln4 / 10),
                            ("loss_positions", ln4 + STEP_WEIGHT_DECAY * ln4)):
        _, stats = TrainingTimeTest(draft, 2, norm)(ids, torch.randn(2, 5, 24), probs, probs.argmax(-1), valid)
        sm = summarize(stats, 2, 1)
        assert sm.loss == pytest.approx(loss_want, rel=1e-5)
        assert sm.loss_per_position == pytest.approx(ln4 + STEP_WEIGHT_DECAY * ln4, rel=1e-5)
        assert sm.as_dict()["loss_per_position"] == sm.loss_per_position
    # two micro-batches summed (as the trainer sums them): still per scored position
    assert summarize(stats + stats, 2, 2).loss_per_position == pytest.approx(ln4 + STEP_WEIGHT_DECAY * ln4, rel=1e-5)


def test_defaults_are_specforges():
    tc = TrainConfig()
    assert tc.lr == 1e-4                                   # config/schema.py TrainingConfig.learning_rate
    assert tc.warmup_ratio == 0.015 and tc.warmup_steps is None
    assert tc.warmup == int(0.015 * tc.max_steps)          # optimizer.py: int(warmup_ratio * total_steps)
    assert TrainConfig(max_steps=10_000).warmup == 150
    assert TrainConfig(max_steps=10_000, warmup_steps=7).warmup == 7
    assert tuple(tc.adam_betas) == (0.9, 0.999)            # optimizer.py: torch.optim.AdamW defaults
    assert tc.max_grad_norm == 0.5 and tc.ttt_length == 7
    assert (tc.loss_normalization, tc.loss_mask_alignment) == ("all_positions", "specforge")
    with pytest.raises(ValueError, match=r"adam_betas \[0.9, 1.0\]: each must be in \[0, 1\)"):
        TrainConfig(adam_betas=(0.9, 1.0))


def test_schedule_is_specforges_warmup_then_cosine():
    """lr_scheduler.py CosineAnnealingWarmupLR: (i + 1) / w x lr while warming up, then cosine to 0.

    Compared with the real specforge 0.2.0 scheduler stepping an AdamW (check_against_specforge):
    at most 1.2e-8 apart at lr 1e-4 (SpecForge's recursive cosine lags ours by one step).
    """
    total, w, lr = 200, 3, 1e-4
    assert [lr_at(i, lr, w, total) for i in range(w)] == pytest.approx([lr / 3, 2 * lr / 3, lr])
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr),
                                                     T_max=total - w)
    for i in range(w, total):
        assert lr_at(i, lr, w, total) == pytest.approx(cos._get_closed_form_lr()[0], rel=1e-9, abs=1e-15)
        cos.optimizer.step()
        cos.step()


def check_against_specforge() -> None:  # pragma: no cover - needs specforge 0.2.0 + triton importable
    """The transcription above must equal SpecForge's own functions on these tensors.

    specforge pins torch 2.11 and sglang 0.5.14, so it is not installed anywhere; its wheel, unpacked,
    imports in .venv-node (torch + triton). Its loss functions are torch.compile'd: TORCHDYNAMO_DISABLE
    runs them as written::

        .venv/bin/pip download specforge==0.2.0 --no-deps -d /tmp/sf
        python3 -m zipfile -e /tmp/sf/specforge-0.2.0-py3-none-any.whl /tmp/sf/pkgs
        TORCHDYNAMO_DISABLE=1 PYTHONPATH=/tmp/sf/pkgs:include:. .venv-node/bin/python \
            tests/unit/test_train_specforge_parity.py

    Result (2026-12-01): 9 cases (3 seeds x ttt 1, 3, 7): transcription == specforge exactly, eagleflow's
    TrainingTimeTest within 1e-6 (e.g. seed 0, ttt 7: 1.318784 all three).
    """
    from specforge.algorithms.eagle3 import model as sf_model
    from specforge.core.loss import _compute_loss
    from specforge.utils import padding

    def real_padded(target, t2d, loss_mask, length):
        target_p_padded, _, _, position_mask = sf_model._compute_target_p_padded(target, t2d, loss_mask, length)
        return target_p_padded, position_mask

    real = {"padding": padding, "compute_target_p_padded": real_padded, "compute_loss": _compute_loss}
    for seed in range(3):
        for ttt in (1, 3, 7):
            draft, batch, head, head_w, lm_sf = _case(seed)
            with torch.no_grad():
                a, a_steps = _sf(draft, batch, lm_sf, head_w, ttt)
                b, b_steps = _sf(draft, batch, lm_sf, head_w, ttt, real)
                ours, ours_steps, _ = _ours(draft, batch, head, ttt)
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(ours, b, rtol=1e-5, atol=1e-6)
            print(f"seed {seed} ttt {ttt}: specforge {b.item():.6f} transcription {a.item():.6f} "
                  f"eagleflow {ours.item():.6f}")


if __name__ == "__main__":  # pragma: no cover
    check_against_specforge()
