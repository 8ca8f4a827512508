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
from typing import Any, Callable

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


# the fast path's logits at once, rows x draft vocabulary: 128 MiB in float32 on a GPU (large matmuls); 4 MiB on
# a CPU, where a chunk that stays in cache beats one large pass (bench/train_utilisation.py)
HEAD_CHUNK_ELEMENTS = 1 << 25
CPU_HEAD_CHUNK_ELEMENTS = 1 << 20


class _ChunkedHeadLoss(torch.autograd.Function):
    """The draft's ``lm_head`` and its soft cross-entropy over the rows of every TTT step, a chunk at a time.

    ``x`` [R, H] holds the steps' rows one after another: step (s, n) has B x n rows, sample by sample, row
    (i, p) scored against ``probs[i, s + p]`` (a view: no gather). Per chunk (one step, or part of its
    positions): logits = x W^T, ce = -sum_v p_v log_softmax(logits)_v, total += sum w ce, and the top draft
    token. The gradient is taken in the same pass (d ce / d logits = softmax(logits) sum_v p_v - p, computed in
    place over the chunk's log-probabilities), so the chunk's logits are dropped at once: only one chunk's
    exist at a time, never those of all rows of all steps (issue 49); ``backward`` scales the stored gradients
    by the incoming one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor, w: torch.Tensor,
                steps: list[tuple[int, int]], chunk_elements: int, need_grad: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, hid = x.shape
        b, v = probs.shape[0], weight.shape[0]
        ce = torch.empty(rows, dtype=torch.float32, device=x.device)
        top = torch.empty(rows, dtype=torch.long, device=x.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        gx = torch.empty_like(x) if need_grad else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        psum = probs.sum(-1) if need_grad else None    # [B, T]: the target rows' mass (1 up to rounding)
        at = 0
        for s, n in steps:
            xs, ws = x[at:at + b * n].view(b, n, hid), w[at:at + b * n].view(b, n)
            ces, tops = ce[at:at + b * n].view(b, n), top[at:at + b * n].view(b, n)
            gxs = gx[at:at + b * n].view(b, n, hid) if gx is not None else None
            span = max(1, chunk_elements // max(1, b * v))    # positions a chunk
            for p0 in range(0, n, span):
                p1 = min(p0 + span, n)
                xc, wc = xs[:, p0:p1], ws[:, p0:p1]
                pt = probs[:, s + p0:s + p1]                   # [B, c, V], a view
                logits = (xc @ weight.T).float()
                logp = F.log_softmax(logits, dim=-1)
                tops[:, p0:p1] = logits.argmax(-1)
                del logits
                ce_c = -(pt * logp).sum(-1)
                ces[:, p0:p1] = ce_c
                total += (ce_c * wc).sum()
                if gxs is not None and gw is not None and psum is not None:
                    # w (softmax sum(p) - p), in place over the chunk's log-probabilities
                    g = logp.exp_().mul_((psum[:, s + p0:s + p1] * wc)[..., None])
                    g = g.addcmul_(pt, wc[..., None], value=-1.0).to(x.dtype)
                    gxs[:, p0:p1] = g @ weight
                    g2, x2 = g.reshape(-1, v), xc.reshape(-1, hid)
                    gw += (g2.T @ x2).float()
            at += b * n
        ctx.save_for_backward(gx, gw)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(ce, top)
        return total, ce, top

    @staticmethod
    def backward(ctx: Any, g_total: torch.Tensor, _g_ce: Any, _g_top: Any) -> tuple[Any, ...]:
        gx, gw = ctx.saved_tensors
        if gx is None or gw is None:
            raise RuntimeError("the chunked head loss ran without gradients (need_grad False) and was differentiated")
        return (gx * g_total.to(gx.dtype), (gw * g_total).to(ctx.weight_dtype), None, None, None, None, None)


def chunked_head_loss(x: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor, w: torch.Tensor,
                      steps: list[tuple[int, int]], chunk_elements: int = HEAD_CHUNK_ELEMENTS
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum_r w_r ce_r with its gradient to ``x`` [R, H] and ``weight`` [V, H], ce [R], top [R]): the head's
    soft cross-entropy of the rows of ``steps`` ((s, n): B x n rows scored against ``probs[:, s:s + n]``, probs
    [B, T, V]) without all R x V logits at once (see ``_ChunkedHeadLoss``). Under autocast the head's matmuls
    run in its dtype, as ``nn.Linear``'s would; the log-softmax in float32."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        ac = torch.get_autocast_dtype(dev)
        x, weight = x.to(ac), weight.to(ac)
    elif x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    out = _ChunkedHeadLoss.apply(x, weight, probs, w.float(), steps, chunk_elements, need_grad)
    return out[0], out[1], out[2]


class TrainingTimeTest(nn.Module):
    """The draft plus its TTT objective: one module so DDP sees a single forward.

    ``fast`` (``train.fast_step``; issue 49): the same loss, gradients and metrics (to float32 rounding,
    tests/unit/test_train_fast_step.py) with the draft's attention in fewer kernels
    (``DraftAttention._explicit_fast``) and the head's loss over every TTT step's rows in one chunked pass
    (:func:`chunked_head_loss`: no step's logits kept for the backward). ``compile`` (``train.compile``):
    the decoder layer through ``torch.compile``; if compiling fails (no compiler, an unsupported op), the
    layer runs eagerly from then on and ``compile_error`` says why."""

    def __init__(self, draft: Eagle3Draft, ttt_length: int, normalization: str = "all_positions", *,
                 fast: bool = False, compile: bool = False, head_chunk_elements: int = 0):
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"train.loss_normalization {normalization!r}: use one of {', '.join(NORMALIZATIONS)}")
        self.draft = draft
        self.ttt_length = ttt_length
        self.normalization = normalization
        self.fast = fast
        self.head_chunk_elements = head_chunk_elements
        draft.midlayer.self_attn.fast = fast
        self.compile_error: str | None = None
        # a plain attribute (a list, not a module), so the compiled wrapper adds no parameter names
        self._compiled: list[Callable[..., torch.Tensor]] = []
        if compile:
            try:
                self._compiled.append(torch.compile(draft.midlayer.forward, dynamic=True))
            except Exception as e:   # noqa: BLE001 - any failure to set compiling up falls back to eager
                self.compile_error = f"{type(e).__name__}: {e}"

    def _step(self, input_ids: torch.Tensor, hidden: torch.Tensor, offset: int,
              cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if not self._compiled:
            return self.draft.step(input_ids, hidden, offset, cache)
        embeds = self.draft.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.draft.rope(input_ids.shape[1], offset, hidden.device, hidden.dtype)
        try:
            return self._compiled[0](embeds, hidden, cos, sin, cache)
        except Exception as e:   # noqa: BLE001 - a compiler that fails on first use: eager from now on
            self.compile_error = f"{type(e).__name__}: {e}"
            self._compiled.clear()
            del cache[offset:]   # a failed call may have appended this step's keys
            return self.draft.step(input_ids, hidden, offset, cache)

    def forward(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, probs: torch.Tensor,
                top: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted loss, stats) where stats = [loss_k..., correct_k..., count_k..., accept_sum, accept_n]."""
        if self.fast or self._compiled:
            return self._forward_fast(input_ids, aux_hidden_states, probs, top, valid)
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


    def _forward_fast(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, probs: torch.Tensor,
                      top: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s objective with the head's loss over all steps' rows at the end, chunked."""
        b, t = input_ids.shape
        k_steps = self.ttt_length
        dev = input_ids.device
        hidden = self.draft.fc(aux_hidden_states)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        xs, ws, steps = [], [], []   # steps: (k, n, mask, cnt, denom) of the steps with rows
        for k in range(k_steps):
            s = k + 1
            tok = torch.zeros_like(input_ids)
            if s < t:
                tok[:, :t - s] = input_ids[:, s:]
            hidden = self._step(tok, hidden, k, cache)
            n = max(t - s, 0)
            if n == 0:
                continue
            mask = valid[:, s:]
            m = mask.float()
            cnt = m.sum()
            denom = float(b * t) if self.normalization == "all_positions" else cnt.clamp(min=1.0)
            xs.append(self.draft.norm(hidden[:, :n]).reshape(b * n, -1))
            ws.append(((STEP_WEIGHT_DECAY ** k) * m / denom).reshape(-1))
            steps.append((k, n, mask, cnt, denom))
        total = hidden.new_zeros((), dtype=torch.float32)
        zero = total.new_zeros(())
        losses, corrects, counts, sums = [zero] * k_steps, [zero] * k_steps, [zero] * k_steps, [zero] * k_steps
        run = torch.ones(b, t, dtype=torch.bool, device=dev)
        accept = torch.zeros(b, t, dtype=torch.float32, device=dev)
        first_valid = None
        if xs:
            chunk = self.head_chunk_elements or (HEAD_CHUNK_ELEMENTS if dev.type == "cuda" else CPU_HEAD_CHUNK_ELEMENTS)
            head_total, ce, top_draft = chunked_head_loss(torch.cat(xs), self.draft.lm_head.weight, probs,
                                                          torch.cat(ws), [(k + 1, n) for k, n, *_ in steps], chunk)
            total = total + head_total
            at = 0
            for k, n, mask, cnt, denom in steps:
                ce_k = ce[at:at + b * n].view(b, n)
                am_k = top_draft[at:at + b * n].view(b, n)
                at += b * n
                masked_sum = (ce_k * mask.float()).sum()
                hit = (am_k == top[:, k + 1:]) & mask
                losses[k] = masked_sum / denom
                corrects[k] = hit.sum().float()
                counts[k] = cnt
                sums[k] = masked_sum
                step_ok = torch.zeros(b, t, dtype=torch.bool, device=dev)
                step_ok[:, :n] = hit
                run = run & step_ok
                accept += run.float()
                if k == 0:
                    first_valid = torch.zeros(b, t, dtype=torch.bool, device=dev)
                    first_valid[:, :n] = mask
        total = total + 0.0 * self.draft.logits(hidden[:, :1]).float().sum()
        fv = first_valid if first_valid is not None else torch.zeros(b, t, dtype=torch.bool, device=dev)
        accept_sum = (accept * fv.float()).sum() + fv.float().sum()
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
