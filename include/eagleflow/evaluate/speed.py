"""The speed-up figure: the target alone and with the draft timed in pairs, the median ratio and its spread.

A draft can make decoding faster only by letting one target forward produce
several tokens: the acceptance length (tokens per verify pass) bounds the
speed-up, since each verify pass costs at least one target forward and the
target alone pays one forward a token. A median above it is timing noise (or a
reference that paid a cost the draft's decode did not); the figure is kept as
measured and carries a note that says so.
"""
from __future__ import annotations

import statistics
from typing import Any


def speed_figures(tokens: list[int], alone_s: list[float], draft_s: list[float], accept_length: float,
                  method: str) -> dict:
    """``tokens[i]`` decoded in ``alone_s[i]`` by the target alone and ``draft_s[i]`` with the draft (pair i)."""
    total = sum(tokens)
    ratios = sorted(a / d for a, d in zip(alone_s, draft_s) if a > 0 and d > 0)
    speedup = round(statistics.median(ratios), 3) if ratios else None
    out: dict[str, Any] = {"tokens_per_s": round(total / sum(draft_s), 2) if sum(draft_s) else 0.0,
                          "target_tokens_per_s": round(total / sum(alone_s), 2) if sum(alone_s) else 0.0,
                          "speedup": speedup,
                          "speedup_spread": [round(ratios[0], 3), round(ratios[-1], 3)] if ratios else None,
                          "speedup_pairs": len(ratios), "speedup_method": method, "speedup_note": None}
    if speedup is not None and speedup > accept_length:
        out["speedup_note"] = (
            f"speed-up {speedup:.2f} is above the acceptance length {accept_length:.3f}, which bounds it "
            f"(a verify pass costs at least one target forward, the target alone one forward a token): timing "
            f"noise over {len(ratios)} pair(s) (spread {ratios[0]:.2f}-{ratios[-1]:.2f}); more prompts or "
            "eval.max_new_tokens narrow it")
    return out
