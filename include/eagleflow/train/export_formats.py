"""The draft formats ``eagleflow export`` writes and where: names only, torch-free, so the control plane's
run report can name them without the node's libraries.

Each format is the one a registered serving engine serves (``eagleflow.engines``: its ``draft_format`` and
``draft_dir``), so a new engine's format is known here without an edit:

- ``sglang``: the export folder itself (``LlamaForCausalLMEagle3``), served by
  ``sglang.launch_server --speculative-algorithm EAGLE3 --speculative-draft-model-path <export>``.
- ``speculators``: ``<export>/speculators/`` (vllm-project/speculators' ``Eagle3Speculator``), served by
  ``vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "<export>/speculators", ...}'``.
"""
from __future__ import annotations

from pathlib import Path

from eagleflow.engines import export_formats, format_dirs

EXPORT_FORMATS = tuple(export_formats())
# each format's folder inside the export (eagleflow.engines names the engine that serves each)
FORMAT_DIRS = format_dirs()
# The chain both serve commands in the run report draft: 3 tokens per round (SGLang: 3 steps, topk 1,
# 4 draft tokens; vLLM: num_speculative_tokens 3), and the speculators config's greedy proposal.
SPECULATIVE_TOKENS = 3


def format_dir(export_dir: str | Path, fmt: str) -> Path:
    """Where export format ``fmt`` lies in the export folder ``export_dir`` (the registry's engines, as now)."""
    return Path(export_dir) / format_dirs()[fmt]
