"""The command that serves the target with an exported draft in SGLang (the run report prints it)."""
from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagleflow.config import PipelineConfig


def serve_command(cfg: PipelineConfig, export_dir: str) -> str:
    """The SGLang command that serves the target with this draft (the TP the capture used)."""
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", str(cfg.target_model),
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", export_dir,
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
            "--tp-size", str(cfg.server.tp)]  # --tp is only an argparse abbreviation
    if cfg.server.dtype != "auto":
        argv += ["--dtype", cfg.server.dtype]
    return shlex.join(argv)
