"""The one lossless rule both evaluation backends apply: judged on the token the draft path emitted.

A greedy speculative decode is lossless when every token it emits is the
target's own greedy token. At the first position where the two differ, the
difference is excused only as a numerical tie: the *emitted* token's logit, in
the target's own distribution at that position (the reference forward), is
within ``NEAR_TIE_ULPS`` units in the last place of the top logit, in the
target's dtype, of the top logit. Two forwards of the same prefix (one token
at a time, or a verify pass over several) round differently, by a few ulps of
the values they produce; a token further below the top than that was not the
target's choice, whatever the gap between the target's first and second
choices was.

Numbers (ulp at |top| = eps x 2^floor(log2 max(1, |top|))):

- bfloat16 (eps 2^-7): |top| 10 -> ulp 0.0625, tolerance 0.25 logit; |top| 40 -> 0.25, tolerance 1.0
- float16 (eps 2^-10): |top| 10 -> tolerance 0.03125
- float32 (eps 2^-23): |top| 10 -> tolerance about 3.8e-6

A server backend answers log-probabilities: the difference of two
log-probabilities at one position is the difference of their logits, so the
same rule applies with the top logit's magnitude unknown; ``SERVER_TOP_LOGIT``
stands for it (a bound larger than typical LLM top logits, stated in
docs/evaluation.md). ``eval.near_tie_logit_gap`` replaces the tolerance by an
absolute one.
"""
from __future__ import annotations

import math

# units in the last place of the top logit a genuine tie may differ by between two forwards
NEAR_TIE_ULPS = 4
# machine epsilon per dtype name (torch.finfo(dtype).eps), without importing torch
DTYPE_EPS = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -23, "float64": 2.0 ** -52}
# sglang answers log-probabilities only: the top logit's magnitude the tolerance assumes there
SERVER_TOP_LOGIT = 32.0
# how many of the reference's candidates per position are kept (the emitted token's logit is read there;
# one ranked below them is far from a tie)
TOP_CANDIDATES = 32


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16'; 'auto' and unknown names read as bfloat16 (the widest)."""
    name = str(dtype).replace("torch.", "")
    return name if name in DTYPE_EPS else "bfloat16"


def ulp(dtype, magnitude: float) -> float:
    """The spacing of ``dtype``'s floats at ``magnitude`` (at least that at 1.0)."""
    m = max(1.0, abs(float(magnitude)))
    return DTYPE_EPS[dtype_name(dtype)] * 2.0 ** math.floor(math.log2(m))


def tie_tolerance(dtype, top_logit: float, absolute: float | None = None) -> float:
    """How far below the top logit an emitted token's logit may be and still count as a tie."""
    if absolute is not None:
        return float(absolute)
    return NEAR_TIE_ULPS * ulp(dtype, top_logit)


def first_difference(ref_tokens: list[int], got_tokens: list[int], candidates, tolerance) -> dict | None:
    """The first position where ``got_tokens`` leaves ``ref_tokens``, judged; None when they are equal.

    ``candidates(i)``: the reference's best (token, logit or log-probability) pairs at position i, best first
    (empty when not known); ``tolerance(top)``: the tie tolerance at a top value."""
    for i, (a, b) in enumerate(zip(ref_tokens, got_tokens)):
        if a != b:
            return {"position": i, "target": a, "with_draft": b, **judge(b, candidates(i), tolerance)}
    if len(ref_tokens) != len(got_tokens):
        i = min(len(ref_tokens), len(got_tokens))
        return {"position": i, "target": ref_tokens[i] if i < len(ref_tokens) else None,
                "with_draft": got_tokens[i] if i < len(got_tokens) else None, "emitted_rank": None,
                "emitted_logit_gap": None, "tie_tolerance": None, "near_tie": False}
    return None


def judge(emitted: int, cands: list[tuple[int, float]], tolerance) -> dict:
    """The emitted token against the reference's candidates at its position: its rank, its gap, a tie or not."""
    if not cands:
        return {"emitted_rank": None, "emitted_logit_gap": None, "tie_tolerance": None, "near_tie": False}
    top = cands[0][1]
    tol = tolerance(top)
    rank = next((r for r, (t, _) in enumerate(cands, 1) if t == emitted), None)
    if rank is None:   # below every candidate kept: at least as far below the top as the last of them
        return {"emitted_rank": f">{len(cands)}", "emitted_logit_gap": round(top - cands[-1][1], 6),
                "gap_is_lower_bound": True, "tie_tolerance": round(tol, 6), "near_tie": False}
    gap = top - cands[rank - 1][1]
    return {"emitted_rank": rank, "emitted_logit_gap": round(gap, 6), "tie_tolerance": round(tol, 6),
            "near_tie": gap <= tol}
