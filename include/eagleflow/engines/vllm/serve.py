"""The command that serves the target with the speculators-format draft in vLLM (the run report prints it)."""
from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING

from eagleflow.train.export_formats import SPECULATIVE_TOKENS

if TYPE_CHECKING:
    from eagleflow.config import PipelineConfig


def vllm_serve_command(cfg: PipelineConfig, speculators_dir: str) -> str:
    """The vLLM command that serves the target with the speculators-format draft: the same chain as
    SGLang's (``eagleflow.engines.sglang.serve``) (3 draft tokens per round), the same TP and dtype."""
    spec = {"method": "eagle3", "model": speculators_dir, "num_speculative_tokens": SPECULATIVE_TOKENS}
    argv = ["vllm", "serve", str(cfg.target_model), "--speculative-config", json.dumps(spec),
            "--tensor-parallel-size", str(cfg.server.tp)]
    if cfg.server.dtype != "auto":
        argv += ["--dtype", cfg.server.dtype]
    return shlex.join(argv)
