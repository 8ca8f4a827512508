"""The draft scored on held-out records during training, so overfitting shows in the curves.

The capture phase stores the first ``train.held_out_samples`` records of the
corpus's evaluation split (never trained on) in their own store,
``<run>/hidden_states_held_out`` (`eagleflow capture held-out`). Every
``train.eval_every`` steps the trainer runs the training-time-test objective
on them without gradients: the loss per scored position (comparable across
batches), top-1 agreement with the target per TTT step, and the simulated
acceptance length, written to metrics.jsonl as ``eval_*`` beside the training
figures of the same step. The real measure, speculative decoding with the
exported draft, is the evaluate phase (eagleflow.evaluate); this one is cheap
enough to run while training.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from eagleflow.capture.verify import RECORD_FILE, require_verified

from .data import SAMPLE_KEYS, SampleRef, collate, read_sample_keys, scan_samples
from .loss import TargetHead, TrainingTimeTest, summarize, target_batch

VERIFY_HINT = "`eagleflow capture held-out --config <run config> --run-id <run>`"


def held_out_refs(held_out_dir: str | os.PathLike[str], *, eval_every: int,
                  log: Callable[[str], None]) -> list[SampleRef]:
    """The verified held-out samples, or [] (with the reason logged) when there is nothing to score on.

    A store that exists but has not passed verification is refused like the training store: scores from
    damaged files would mislead more than no scores."""
    root = Path(held_out_dir)
    if eval_every <= 0:
        return []
    if not (root / RECORD_FILE).exists() and not any(root.glob("shard_*")):
        log(f"no held-out hidden states at {root} (captured by {VERIFY_HINT}); training without the "
            "held-out evaluation")
        return []
    verified = require_verified(root, VERIFY_HINT)
    if verified.samples == 0:
        log(f"the held-out store {root} holds 0 samples (corpus.eval_fraction or train.held_out_samples is 0); "
            "training without the held-out evaluation")
        return []
    return scan_samples(root, on_bad="raise", verify_sha256=False, log=log, verified=verified)


def evaluate_held_out(ttt: TrainingTimeTest, head: TargetHead, refs: Sequence[SampleRef], *, batch_size: int,
                      device: torch.device, dtype: torch.dtype, mask_alignment: str,
                      autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                      ) -> dict[str, float]:
    """``eval_*`` figures of the draft as it is now, over every held-out sample (no gradient, weights untouched)."""
    order = sorted(range(len(refs)), key=lambda i: (-refs[i].tokens, refs[i].index))  # less padding
    was_training = ttt.training
    ttt.eval()
    total, batches = None, 0
    try:
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                members = [refs[i] for i in order[start:start + batch_size]]
                batch = collate([read_sample_keys(r, SAMPLE_KEYS) for r in members]).to(device, dtype)
                tb = target_batch(head, batch, mask_alignment)
                with autocast():
                    _loss, stats = ttt(batch.input_ids, batch.aux_hidden_states, tb.probs, tb.top, tb.valid)
                total = stats if total is None else total + stats
                batches += 1
    finally:
        ttt.train(was_training)
    if total is None:
        raise ValueError("evaluate_held_out needs at least one held-out sample; call it only when "
                         "held_out_refs found some")
    sm = summarize(total, ttt.ttt_length, batches)
    return {f"eval_{k}": v for k, v in sm.as_dict().items()} | {"eval_samples": len(refs)}
