"""The node tier: tests that import the real sglang (requirements-node.txt) and run in `.venv-node`.

Run with `make test-node`. Nothing here may stand in for a class sglang defines:
batches, results, the hook registry and the server-argument parser are sglang's
own, constructed on the CPU. A missing or different sglang is a failure, not a skip.
"""
from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

import pytest

PINNED = "0.5.23"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_sessionstart(session):
    try:
        have = version("sglang")
    except PackageNotFoundError:
        raise pytest.UsageError("tests/node needs sglang installed (requirements-node.txt): run `make test-node`, "
                                "which builds .venv-node") from None
    if have != PINNED:
        raise pytest.UsageError(f"tests/node proves the capture hook against sglang {PINNED}; this venv has {have}")


@pytest.fixture
def capture_env(tmp_path, monkeypatch):
    """The env the launcher gives sglang's scheduler processes, dumps into tmp_path."""
    from eagleflow.engines.sglang import plugin
    monkeypatch.setenv(plugin.ENV_DUMP_DIR, str(tmp_path / "dumps"))
    monkeypatch.setenv(plugin.ENV_AUX_LAYERS, "[2, 5, 6]")   # not the default of an 8-layer target ([1, 3, 4])
    monkeypatch.setenv(plugin.ENV_MODEL, "tiny-llama")
    monkeypatch.setattr(plugin, "_settings", None)
    return tmp_path / "dumps"


@pytest.fixture
def attn_tp_rank():
    """Set this process's attention-TP rank the way sglang's runtime context holds it."""
    from contextlib import contextmanager

    from sglang.srt.runtime_context import get_parallel

    @contextmanager
    def rank(r: int):
        with get_parallel().override(attn_tp_rank=r):
            yield
    return rank


@pytest.fixture(scope="session")
def sglang_world():
    """sglang's own world-of-one setup for building its layers at tp=1 (sglang.test.layer_ut_utils)."""
    import socket

    from sglang.test.layer_ut_utils import init_single_process_dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_single_process_dist(master_port=port)
    # Without a CUDA device sglang's RotaryEmbedding takes vllm's kernel unless the process runs its CPU
    # engine; the engine flag would also load sgl_kernel (needs libcuda). Only the rope path is switched.
    import sglang.srt.layers.rotary_embedding.base as rope_base
    rope_base._is_cpu = True
    yield


def pytest_collection_modifyitems(session, config, items):
    """Tests that build sglang's process-wide world of one run last: once its groups exist, sglang's
    runtime context refuses any other attention-TP rank, which the hook tests need to set."""
    items.sort(key=lambda item: "sglang_world" in getattr(item, "fixturenames", ()))
