"""EAGLE-3 draft training: model, draft vocabulary, data streaming, TTT loss, trainer, export.

Never imports Airflow: it runs on the GPU node under the CLI (`eagleflow train`, `eagleflow export`).
"""
import os as _os
import sys as _sys

# The reader's ~470 MB buffers (a real-size sample; a few, then reused): with 4 KiB pages the first touch of
# one cost as much CPU as the read itself (bench/train.py --real-size). Transparent huge pages for torch's large CPU
# allocations (PyTorch's own knob, read once at its first allocation, so only before torch is imported).
if "torch" not in _sys.modules:
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
