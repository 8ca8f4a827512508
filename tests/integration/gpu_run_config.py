"""A pipeline config YAML whose node is the test sshd (shared by the GPU integration tests)."""
from __future__ import annotations

import sys
from pathlib import Path

import yaml


def write_gpu_config(path: Path, *, conn_id: str | None, run_root: Path, **gpu) -> Path:
    cfg = {"run_root": str(run_root), "target_model": "unused-by-gpu-tests",
           "node": {"name": "fake-gpu-node", "conn_id": conn_id, "python": sys.executable,
                    "state_dir": str(run_root / "node-state"), "has_gpu": True},
           "gpu": {"probe": "smi", "poll_interval_s": 0.5, "idle_timeout_s": 20, "kill_grace_s": 1.0, **gpu}}
    path.write_text(yaml.safe_dump(cfg))
    return path
