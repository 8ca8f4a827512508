"""`capture.backend: vllm` (issue 40, item 2) in the control plane's venv, which has no vLLM.

The config accepts it on a GPU node (and refuses it on a CPU one, as sglang), the registry's capture server is
the vLLM launcher, and `eagleflow capture serve` routes there and fails fast, naming what to install, when
vLLM is not installed: a real `eagleflow` process, before any port, dump folder or key is touched. What the
launcher starts and the connector writes is proven against vLLM's own classes in tests/node_vllm.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from eagleflow.config import ConfigError, load_config
from eagleflow.engines import engine_for, names_for
from tests.fixtures.pipeline_config import write_short_config


def test_the_config_takes_capture_backend_vllm_on_a_gpu_node_only(monkeypatch):
    cfg = load_config(data={"target_model": "/models/t", "node": {"has_gpu": True}, "capture": {"backend": "vllm"}})
    assert cfg.capture.backend == "vllm"
    # the registered capture server is the vLLM launcher's launch (the engine's role imports it when called)
    from eagleflow.engines.vllm import launcher
    monkeypatch.setattr(launcher, "launch", lambda c, lay: 41 if (c, lay) == (cfg, "layout") else -1)
    assert engine_for("vllm", "capture_server").serve_capture(cfg, "layout") == 41
    assert "vllm" in names_for("capture_server")
    with pytest.raises(ConfigError, match=r"capture\.backend 'vllm' needs a GPU node, but node\.has_gpu is false"):
        load_config(data={"target_model": "/models/t", "node": {"has_gpu": False}, "capture": {"backend": "vllm"}})


@pytest.mark.timeout(120)
def test_capture_serve_routes_to_the_vllm_launcher_and_names_what_to_install_without_vllm(tmp_path, demo_assets):
    import importlib.util
    assert importlib.util.find_spec("vllm") is None, "this test proves the control plane's venv, without vLLM"
    cfgp = write_short_config(tmp_path, demo_assets, node={"has_gpu": True},
                              capture={"backend": "vllm"}, generate={"backend": "hf"})
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "serve", "--config", str(cfgp),
                          "--run-id", "r1"], capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    assert out.returncode == 2, out.stderr[-2000:]
    assert "eagleflow capture serve (vllm): vLLM is not installed in this interpreter" in out.stderr, out.stderr
    assert "requirements-node-vllm.txt" in out.stderr, out.stderr
    assert took < 60, f"failing took {took:.1f} s"
    # fast means before anything was made: no dump folder, no key, no server info
    assert not (tmp_path / "dumps").exists() and not list(tmp_path.rglob("capture_server.json"))
