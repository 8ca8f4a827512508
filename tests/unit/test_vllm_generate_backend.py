"""`generate.backend: vllm` (issue 40, item 3) in the control plane's venv, which has no vLLM.

The config accepts it on a GPU node and refuses it on a CPU one (as sglang), the registry's generation server
is the vLLM one, and `eagleflow generate serve` routes there and fails fast, naming what to install, when
vLLM is not installed: a real `eagleflow` process, before a port or the server's info file is touched. What
`vllm serve` is started with and how the worker's requests and vLLM's answers map is proven against vLLM's
own classes in tests/node_vllm/test_vllm_generate.py.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from eagleflow.config import ConfigError, load_config
from eagleflow.engines import engine_for, generation_engine, names_for
from tests.fixtures.pipeline_config import write_short_config


def test_the_config_takes_generate_backend_vllm_on_a_gpu_node_only(monkeypatch):
    cfg = load_config(data={"target_model": "/models/t", "node": {"has_gpu": True}, "generate": {"backend": "vllm"}})
    assert generation_engine(cfg).name == "vllm"
    # the registered generation server is generate_server's launch_generate (imported when called)
    from eagleflow.engines.vllm import generate_server
    monkeypatch.setattr(generate_server, "launch_generate", lambda c, lay: 42 if (c, lay) == (cfg, "layout") else -1)
    assert engine_for("vllm", "generate_server").serve_generation(cfg, "layout") == 42
    assert "vllm" in names_for("generate_server")
    # generation follows a vllm capture backend when generate.backend is unset
    cfg = load_config(data={"target_model": "/models/t", "node": {"has_gpu": True}, "capture": {"backend": "vllm"}})
    assert generation_engine(cfg).name == "vllm"
    with pytest.raises(ConfigError, match=r"generate\.backend 'vllm' needs a GPU node, but node\.has_gpu is false"):
        load_config(data={"target_model": "/models/t", "node": {"has_gpu": False}, "capture": {"backend": "hf"},
                          "generate": {"backend": "vllm"}})


@pytest.mark.timeout(120)
def test_generate_serve_routes_to_vllm_and_names_what_to_install_without_vllm(tmp_path, demo_assets):
    import importlib.util
    assert importlib.util.find_spec("vllm") is None, "this test proves the control plane's venv, without vLLM"
    cfgp = write_short_config(tmp_path, demo_assets, node={"has_gpu": True},
                              capture={"backend": "hf"}, generate={"backend": "vllm"})
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "eagleflow.cli", "generate", "serve", "--config", str(cfgp),
                          "--run-id", "r1"], capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    assert out.returncode == 2, out.stderr[-2000:]
    assert "eagleflow generate serve (vllm): vLLM is not installed in this interpreter" in out.stderr, out.stderr
    assert "requirements-node-vllm.txt" in out.stderr and "generate.backend hf or sglang" in out.stderr, out.stderr
    assert took < 60, f"failing took {took:.1f} s"
    # fast means before anything was made: no server info for the watch or the worker to find
    assert not list(tmp_path.rglob("generate_server.json"))
