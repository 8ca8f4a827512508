"""The draft vocabulary: the target tokens the draft may propose, and the maps SGLang reads.

The draft's ``lm_head`` covers only the ``draft_vocab_size`` target tokens that
occur most often at loss positions of the stored samples (the tokens a draft
is actually asked to predict). SGLang reads two maps:

- ``d2t`` [Vd] int64: target id minus draft id (SGLang adds ``arange`` back);
- ``t2d`` [V] bool: which target ids are in the draft vocabulary.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from eagleflow.durable import atomic_replace

from .data import SampleRef, read_sample_keys


@dataclass(frozen=True)
class DraftVocab:
    draft_ids: torch.Tensor      # [Vd] int64, ascending target ids
    target_vocab_size: int
    counts: torch.Tensor         # [V] int64 loss-position frequency of each target id

    @property
    def size(self) -> int:
        return int(self.draft_ids.shape[0])

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft_ids - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        m = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        m[self.draft_ids] = True
        return m

    @property
    def coverage(self) -> float:
        """Share of loss-position tokens that the draft vocabulary can express."""
        total = int(self.counts.sum())
        return float(self.counts[self.draft_ids].sum()) / total if total else 0.0

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file
        with atomic_replace(path) as tmp:
            save_file({"draft_ids": self.draft_ids.contiguous(), "d2t": self.d2t.contiguous(),
                       "t2d": self.t2d.contiguous(), "counts": self.counts.contiguous()}, str(tmp),
                      metadata={"target_vocab_size": str(self.target_vocab_size),
                                "coverage": json.dumps(self.coverage)})

    @classmethod
    def load(cls, path: str | Path) -> "DraftVocab":
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return cls(draft_ids=f.get_tensor("draft_ids"), target_vocab_size=int(meta["target_vocab_size"]),
                       counts=f.get_tensor("counts"))


def count_loss_tokens(samples: Iterable[SampleRef], vocab_size: int) -> torch.Tensor:
    """How often each target id appears at a loss-mask position (reads only ids and masks)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ref in samples:
        t = read_sample_keys(ref, ("input_ids", "loss_mask"))
        ids = t["input_ids"][t["loss_mask"].bool()]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"{ref.path}: token id {int(ids.max())} is outside the target vocabulary "
                             f"({vocab_size}); the hidden states were captured with another model")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int,
                      log: Callable[[str], None] = print) -> DraftVocab:
    """The ``draft_vocab_size`` most frequent ids (ties: lower id first), capped at the target vocabulary."""
    v = int(counts.shape[0])
    n = min(draft_vocab_size, v)
    if n < draft_vocab_size:
        log(f"train.draft_vocab_size {draft_vocab_size} exceeds the target vocabulary ({v}); using {v}")
    # A stable sort on -count keeps ascending ids among equal counts: deterministic everywhere.
    order = torch.sort(-counts, stable=True).indices
    ids = torch.sort(order[:n]).values.to(torch.int64)
    vocab = DraftVocab(draft_ids=ids, target_vocab_size=v, counts=counts.to(torch.int64))
    seen = int((counts > 0).sum())
    log(f"draft vocabulary: {n} of {v} target ids; {seen} ids occur at loss positions; "
        f"coverage of loss tokens {100 * vocab.coverage:.2f} %")
    return vocab
