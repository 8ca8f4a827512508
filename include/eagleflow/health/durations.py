"""How long, as a person says it: one wording for the GPU view, the health mails and the watch mails."""
from __future__ import annotations

import math


def duration(seconds: float) -> str:
    """45 s, 11 min, 2 h 05 min: how long, as a person says it ("an unknown time" for inf or nan)."""
    if not math.isfinite(seconds):
        return "an unknown time"
    s = max(0, int(round(seconds)))
    if s < 120:
        return f"{s} s"
    m = s // 60
    if m < 120:
        return f"{m} min"
    return f"{m // 60} h {m % 60:02d} min"
