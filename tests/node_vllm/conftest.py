"""The vLLM node tier: tests that import the real vllm and speculators (requirements-node-vllm.txt) and run in
`.venv-node-vllm`, apart from the sglang tier (each engine pins its own torch and transformers).

Run with `make test-node-vllm`. Nothing here stands in for a class vLLM or speculators defines: configs,
argument parser, model classes, weight loaders and the speculators model are theirs, built on the CPU through
vLLM's own CPU platform (``VLLM_TARGET_DEVICE=cpu``). The one thing the CUDA wheel cannot run on a CPU is its
paged-attention kernel (``Attention.forward``, vllm._C): tests that run a vLLM forward swap exactly that call
for plain causal attention over the q, k, v vLLM computed, and say so. A missing or different vllm or
speculators is a failure, not a skip.
"""
from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

import pytest

PINNED = {"vllm": "0.33.0", "speculators": "0.9.0"}

# vLLM picks its platform once, at its first use: its own CPU platform, not the CUDA one the wheel is built for.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_sessionstart(session):
    for name, pinned in PINNED.items():
        try:
            have = version(name)
        except PackageNotFoundError:
            raise pytest.UsageError(f"tests/node_vllm needs {name} installed (requirements-node-vllm.txt): run "
                                    "`make test-node-vllm`, which builds .venv-node-vllm") from None
        if have != pinned:
            raise pytest.UsageError(f"tests/node_vllm proves the export against {name} {pinned}; this venv has {have}")
    import speculators  # noqa: F401  (an install that does not import fails here, by name)
    import vllm  # noqa: F401


@pytest.fixture(scope="session")
def vllm_world():
    """vLLM's own world of one (gloo on loopback) for building its layers at tp=1 on the CPU."""
    import socket

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):   # vLLM reads it here
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
    yield
