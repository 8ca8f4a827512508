"""The sglang backend's pure parts, without sglang: command line, version check, plugin env.

Everything that touches a class sglang defines (batches, results, HookRegistry,
the model registry, the server-argument parser) is tested against the real
sglang 0.5.23 in tests/node/ (`make test-node`), never against stand-ins here.
"""
from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from eagleflow.capture import sglang_plugin as plugin
from eagleflow.capture.sglang_launcher import SglangLaunchError, build_command, capture_env, check_supported_version
from eagleflow.config import load_config


def _cfg(**capture):
    return load_config(data={"target_model": "/models/t", "capture": {"backend": "sglang", "tp": 4, **capture}})


def test_command_line_has_the_extraction_flags():
    argv = build_command(_cfg(dtype="bfloat16", extra_server_args=["--mem-fraction-static", "0.3"]),
                         model_path="/models/t", host="127.0.0.1", port=31000, sglang_layer_ids=[1, 29, 57],
                         python="py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    s = " ".join(argv)
    for flag in ("--model-path /models/t", "--port 31000", "--tp-size 4", "--dtype bfloat16",
                 "--cuda-graph-backend-decode disabled", "--cuda-graph-backend-prefill disabled",
                 "--disable-radix-cache", "--chunked-prefill-size -1", "--enable-return-aux-hidden-states",
                 "--speculative-algorithm EAGLE3", "--return-aux-hidden-state-layer-ids 1 29 57"):
        assert flag in s
    assert argv[-2:] == ["--mem-fraction-static", "0.3"]


def test_version_check():
    assert check_supported_version("0.5.23") == "0.5.23"
    with pytest.raises(SglangLaunchError, match=r"sglang 0\.5\.14 is not a version .*supports \(0\.5\.23\)"):
        check_supported_version("0.5.14")


def test_plugin_entry_point_is_declared():
    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert eps["eagleflow_capture"].value == "eagleflow.capture.sglang_plugin:register"
    assert eps["eagleflow_capture"].load() is plugin.register


def test_register_without_launcher_env_stops_the_process(monkeypatch):
    for k in (plugin.ENV_DUMP_DIR, plugin.ENV_AUX_LAYERS):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(plugin, "_settings", None)
    with pytest.raises(SystemExit, match="without EAGLEFLOW_CAPTURE_DUMP_DIR"):
        plugin.register()


def test_capture_env_names_the_plugin():
    env = capture_env(dump_dir="/dev/shm/x", aux_layers=[1, 3, 4], model="m")
    assert env["SGLANG_PLUGINS"] == "eagleflow_capture"
    assert plugin.CaptureSettings.from_env(env).aux_layers == [1, 3, 4]
