"""Training-time test (TTT): the EAGLE-3 objective over ``ttt_length`` chained draft steps.

Alignment (position t of a sample with tokens x_0..x_{L-1}), as SpecForge's
(the reference trainer; its files cited below are those of specforge 0.2.0):
- the target's stored last hidden state at j gives, through its frozen
  ``lm_head``, the distribution of x_{j+1}; call it target_j;
- draft step k (k = 0..K-1) at t reads the token x_{t+k+1} and its own
  previous output (step 0: ``fc`` of the aux states at t) and is scored
  against target_{t+k+1} (SpecForge: ``TargetHead.preprocess`` shifts target
  and input ids left by one, ``OnlineEagle3Model.forward`` shifts input ids,
  loss mask and position mask left by one more per step, and
  ``SdpaLikeAdapter.step_view`` takes target rows ``[k, k + T)``);
- target_j counts when the target's top token is in the draft vocabulary and
  the loss mask holds (``train.loss_mask_alignment``): ``specforge`` (default)
  reads the mask at j-1, as SpecForge's ``_compute_target_p`` does
  (``position_mask = t2d[argmax] * loss_mask`` on the shifted target, so step k
  at t uses loss_mask[t+k]); ``predicted_token`` reads it at j+1, the token
  target_j predicts.
Loss: soft cross-entropy against the target renormalised over the draft
vocabulary, step k weighted 0.8^k (SpecForge: ``Eagle3TrainStrategy``
``ploss_decay=0.8``), each step's sum divided by ``train.loss_normalization``:
``all_positions`` (default) = B x T of the padded batch, as SpecForge's
``core/loss.py`` ``_compute_loss`` (``-sum(position_mask * plogp, 2).mean()``);
``loss_positions`` = the positions that count. Metrics: ``acc_k`` (top-1
agreement at step k over the positions that count) and the simulated
acceptance length (1 + the run of consecutive correct steps from each
position, averaged).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .data import Batch
from .model import Eagle3Draft

STEP_WEIGHT_DECAY = 0.8   # SpecForge: training/strategies/base.py Eagle3TrainStrategy(ploss_decay=0.8)
MASK_ALIGNMENTS = ("specforge", "predicted_token")
NORMALIZATIONS = ("all_positions", "loss_positions")


def load_target_tensors(target_dir: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Named tensors from a target checkpoint's safetensors (single or sharded), nothing else."""
    import json

    from safetensors import safe_open
    d = Path(target_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        single = d / "model.safetensors"
        if not single.is_file():
            raise FileNotFoundError(f"{d} has neither model.safetensors nor model.safetensors.index.json; the draft "
                                    "trainer reads the target's lm_head and embeddings from safetensors only")
        with safe_open(str(single), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name not in weight_map:
            continue
        with safe_open(str(d / weight_map[name]), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def load_target_head_and_embedding(target_dir: str | Path, tie_word_embeddings: bool | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lm_head [V, H], embed_tokens [V, H]) of the target; a tied head is the embedding."""
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.language_model.embed_tokens.weight",
             "language_model.lm_head.weight"]
    got = load_target_tensors(target_dir, names)
    embed = got.get("model.embed_tokens.weight", got.get("model.language_model.embed_tokens.weight"))
    head = got.get("lm_head.weight", got.get("language_model.lm_head.weight"))
    if embed is None:
        raise KeyError(f"target {target_dir}: no model.embed_tokens.weight in its safetensors")
    if head is None:
        if tie_word_embeddings is False:
            raise KeyError(f"target {target_dir}: no lm_head.weight and tie_word_embeddings is false")
        head = embed
    return head, embed


class TargetHead:
    """The target's frozen ``lm_head``, reduced to what the loss needs per position."""

    def __init__(self, weight: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor, chunk_rows: int = 2048):
        self.weight = weight
        self.draft_ids = draft_ids
        self.t2d = t2d
        self.chunk_rows = chunk_rows

    def to(self, device: torch.device, dtype: torch.dtype) -> "TargetHead":
        return TargetHead(self.weight.to(device, dtype), self.draft_ids.to(device), self.t2d.to(device),
                          self.chunk_rows)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the draft vocab [B, T, Vd] float32, top token in draft vocab [B, T] bool).

        Full-vocabulary logits exist only one chunk of rows at a time (128k x rows floats).
        """
        b, t, h = hidden.shape
        flat = hidden.reshape(-1, h).to(self.weight.dtype)
        restricted, top_in = [], []
        for s in range(0, flat.shape[0], self.chunk_rows):
            full = flat[s:s + self.chunk_rows] @ self.weight.T
            top_in.append(self.t2d[full.argmax(-1)])
            restricted.append(full[:, self.draft_ids].float())
        return torch.cat(restricted).view(b, t, -1), torch.cat(top_in).view(b, t)


@dataclass
class TargetBatch:
    """What the target says about a batch, computed without gradients."""
    probs: torch.Tensor      # [B, T, Vd] target distribution over the draft vocab at each position
    top: torch.Tensor        # [B, T] its argmax (draft ids)
    valid: torch.Tensor      # [B, T] target_j counts


def target_batch(head: TargetHead, batch: Batch, mask_alignment: str = "specforge") -> TargetBatch:
    logits, top_in = head(batch.hidden_states)
    valid = torch.zeros_like(batch.loss_mask)
    lm, real = batch.loss_mask, batch.attention_mask
    if mask_alignment == "specforge":
        # SpecForge (algorithms/eagle3/model.py _compute_target_p on TargetHead.preprocess's shifted
        # target): the row for target_j carries loss_mask[j-1]; its normaliser zeroes the last
        # real position's mask (algorithms/eagle3/data.py), i.e. target_j must be a real position.
        valid[:, 1:] = lm[:, :-1] & real[:, 1:] & top_in[:, 1:]
    elif mask_alignment == "predicted_token":
        # target_j predicts x_{j+1}: it counts when x_{j+1} is a real loss token
        valid[:, :-1] = lm[:, 1:] & real[:, 1:] & top_in[:, :-1]
    else:
        raise ValueError(f"train.loss_mask_alignment {mask_alignment!r}: use one of {', '.join(MASK_ALIGNMENTS)}")
    # SpecForge: softmax over the draft-vocabulary columns only (_compute_target_p's target_p)
    probs = torch.softmax(logits, dim=-1)
    return TargetBatch(probs=probs, top=probs.argmax(-1), valid=valid)


class TrainingTimeTest(nn.Module):
    """The draft plus its TTT objective: one module so DDP sees a single forward."""

    def __init__(self, draft: Eagle3Draft, ttt_length: int, normalization: str = "all_positions"):
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"train.loss_normalization {normalization!r}: use one of {', '.join(NORMALIZATIONS)}")
        self.draft = draft
        self.ttt_length = ttt_length
        self.normalization = normalization

    def forward(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, probs: torch.Tensor,
                top: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted loss, stats) where stats = [loss_k..., correct_k..., count_k..., accept_sum, accept_n]."""
        b, t = input_ids.shape
        k_steps = self.ttt_length
        hidden = self.draft.fc(aux_hidden_states)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        total = hidden.new_zeros((), dtype=torch.float32)
        losses, corrects, counts, sums = [], [], [], []
        run = torch.ones(b, t, dtype=torch.bool, device=input_ids.device)   # chain still unbroken at t
        accept = torch.zeros(b, t, dtype=torch.float32, device=input_ids.device)
        first_valid = None
        for k in range(k_steps):
            s = k + 1
            tok = torch.zeros_like(input_ids)
            if s < t:
                tok[:, :t - s] = input_ids[:, s:]
            hidden = self.draft.step(tok, hidden, k, cache)
            n = max(t - s, 0)   # positions whose target_{t+s} exists
            mask = valid[:, s:]
            if n == 0:
                losses.append(total.new_zeros(()))
                corrects.append(total.new_zeros(()))
                counts.append(total.new_zeros(()))
                sums.append(total.new_zeros(()))
                run = run & False
                continue
            logits = self.draft.logits(hidden[:, :n]).float()
            logp = F.log_softmax(logits, dim=-1)
            per_pos = -(probs[:, s:] * logp).sum(-1)
            m = mask.float()
            cnt = m.sum()
            # SpecForge divides every step by B x T of the padded batch (core/loss.py _compute_loss's
            # .mean() over [B, T]; its mask is zero past the end), not by the positions that count.
            denom = float(b * t) if self.normalization == "all_positions" else cnt.clamp(min=1.0)
            loss_k = (per_pos * m).sum() / denom
            total = total + (STEP_WEIGHT_DECAY ** k) * loss_k
            hit = (logits.argmax(-1) == top[:, s:]) & mask
            losses.append(loss_k.detach())
            corrects.append(hit.sum().float())
            counts.append(cnt)
            sums.append((per_pos * m).sum().detach())   # unnormalised: the loss per scored position
            step_ok = torch.zeros(b, t, dtype=torch.bool, device=input_ids.device)
            step_ok[:, :n] = hit
            run = run & step_ok
            accept += run.float()
            if k == 0:
                first_valid = torch.zeros(b, t, dtype=torch.bool, device=input_ids.device)
                first_valid[:, :n] = mask
        # A zero that reaches every parameter: a batch too short for any step must not leave
        # DDP waiting for gradients that never come.
        total = total + 0.0 * self.draft.logits(hidden[:, :1]).float().sum()
        fv = first_valid if first_valid is not None else torch.zeros(b, t, dtype=torch.bool, device=input_ids.device)
        accept_sum = (accept * fv.float()).sum() + fv.float().sum()   # 1 + run length per position
        stats = torch.stack([*losses, *corrects, *counts, accept_sum, fv.float().sum(), *sums]).detach().float()
        return total, stats


@dataclass
class StepMetrics:
    loss: float
    step_losses: list[float]
    acc: list[float]
    accept_length: float
    positions: int
    # the same weighted loss with each step divided by the positions that count, whatever
    # train.loss_normalization: comparable across batches of any padding (SpecForge's B x T is not)
    loss_per_position: float | None = None

    def as_dict(self) -> dict[str, float]:
        d = {"loss": self.loss, "accept_length": self.accept_length, "positions": self.positions}
        if self.loss_per_position is not None:
            d["loss_per_position"] = self.loss_per_position
        for i, a in enumerate(self.acc):
            d[f"acc_{i}"] = a
        for i, x in enumerate(self.step_losses):
            d[f"loss_{i}"] = x
        return d


def summarize(stats: torch.Tensor, ttt_length: int, micro_batches: int) -> StepMetrics:
    """Metrics from summed ``stats`` (summed over micro-batches and processes)."""
    k = ttt_length
    s = stats.double().cpu().tolist()
    step_losses = [x / micro_batches for x in s[:k]]
    corrects, counts = s[k:2 * k], s[2 * k:3 * k]
    acc = [c / n if n else 0.0 for c, n in zip(corrects, counts)]
    loss = sum((STEP_WEIGHT_DECAY ** i) * x for i, x in enumerate(step_losses))
    accept = s[3 * k] / s[3 * k + 1] if s[3 * k + 1] else 1.0
    sums = s[3 * k + 2:4 * k + 2]
    per_position = (sum((STEP_WEIGHT_DECAY ** i) * (x / n if n else 0.0) for i, (x, n) in enumerate(zip(sums, counts)))
                    if len(sums) == k else None)
    return StepMetrics(loss=loss, step_losses=step_losses, acc=acc, accept_length=accept, positions=int(counts[0]),
                       loss_per_position=per_position)
