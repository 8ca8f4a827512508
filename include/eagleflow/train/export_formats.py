"""The draft formats ``eagleflow export`` writes and where: names only, torch-free, so the control plane's
run report can name them without the node's libraries.

- ``sglang``: the export folder itself (``LlamaForCausalLMEagle3``), served by
  ``sglang.launch_server --speculative-algorithm EAGLE3 --speculative-draft-model-path <export>``.
- ``speculators``: ``<export>/speculators/`` (vllm-project/speculators' ``Eagle3Speculator``), served by
  ``vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "<export>/speculators", ...}'``.
"""
from __future__ import annotations

from pathlib import Path

EXPORT_FORMATS = ("sglang", "speculators")
SPECULATORS_DIR = "speculators"
# each format's folder inside the export (eagleflow.engines names the engine that serves each)
FORMAT_DIRS = {"sglang": "", "speculators": SPECULATORS_DIR}
# The chain both serve commands in the run report draft: 3 tokens per round (SGLang: 3 steps, topk 1,
# 4 draft tokens; vLLM: num_speculative_tokens 3), and the speculators config's greedy proposal.
SPECULATIVE_TOKENS = 3


def format_dir(export_dir: str | Path, fmt: str) -> Path:
    """Where export format ``fmt`` lies in the export folder ``export_dir``."""
    return Path(export_dir) / FORMAT_DIRS[fmt]
