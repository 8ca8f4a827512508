"""The generation phase: the target writes the assistant turns of the corpus itself (see regenerate.py)."""
