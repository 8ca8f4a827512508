"""The sglang backend's pure parts, without sglang: command line, version check, plugin env.

Everything that touches a class sglang defines (batches, results, HookRegistry,
the model registry, the server-argument parser) is tested against the real
sglang 0.5.23 in tests/node/ (`make test-node`), never against stand-ins here.
"""
from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from eagleflow.engines.sglang import plugin
from eagleflow.serving.dump_protocol import ENV_DUMP_KEY
from eagleflow.engines.sglang.launcher import SglangLaunchError, build_command, capture_env, check_supported_version
from eagleflow.config import load_config


def _cfg(**server):
    return load_config(data={"target_model": "/models/t", "capture": {"backend": "sglang"},
                             "server": {"tp": 4, **server}})


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
    assert eps["eagleflow_capture"].value == "eagleflow.engines.sglang.plugin:register"
    assert eps["eagleflow_capture"].load() is plugin.register


def _no_capture_env(monkeypatch):
    import os
    for k in [k for k in os.environ if k.startswith(plugin.CAPTURE_ENV_PREFIX)]:
        monkeypatch.delenv(k)
    monkeypatch.setattr(plugin, "_settings", None)


def test_register_without_capture_settings_is_inert(monkeypatch, capsys):
    """A plain sglang launch on the node loads every installed plugin: ours must return, hooking nothing
    (here sglang is not even installed, so reaching for it would raise)."""
    _no_capture_env(monkeypatch)
    assert plugin.register() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a capture launch" in err and "plugin inert" in err
    assert plugin._settings is None


@pytest.mark.parametrize("env, named", [
    ({plugin.ENV_DUMP_DIR: "/dev/shm/x"}, "without EAGLEFLOW_CAPTURE_AUX_LAYERS"),
    ({plugin.ENV_MODEL: "m"}, "without EAGLEFLOW_CAPTURE_DUMP_DIR, EAGLEFLOW_CAPTURE_AUX_LAYERS"),
    ({ENV_DUMP_KEY: "00" * 32}, "without EAGLEFLOW_CAPTURE_DUMP_DIR, EAGLEFLOW_CAPTURE_AUX_LAYERS"),
    ({plugin.ENV_DUMP_DIR: "", plugin.ENV_AUX_LAYERS: "[1]"}, "without EAGLEFLOW_CAPTURE_DUMP_DIR"),
    ({plugin.ENV_DUMP_DIR: "/d", plugin.ENV_AUX_LAYERS: "1,3,4"}, "EAGLEFLOW_CAPTURE_AUX_LAYERS='1,3,4' is not a JSON"),
    ({plugin.ENV_DUMP_DIR: "/d", plugin.ENV_AUX_LAYERS: "[]"}, "EAGLEFLOW_CAPTURE_AUX_LAYERS='\\[\\]' is not"),
    ({plugin.ENV_DUMP_DIR: "/d", plugin.ENV_AUX_LAYERS: "[1, true]"}, "is not a JSON list of layer indices"),
    ({plugin.ENV_DUMP_DIR: "/d", plugin.ENV_AUX_LAYERS: "[1, -2]"}, "is not a JSON list of layer indices"),
])
def test_register_with_incomplete_or_malformed_settings_stops_the_process(monkeypatch, env, named):
    _no_capture_env(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit, match=named):
        plugin.register()


def test_capture_env_names_the_plugin():
    env = capture_env(dump_dir="/dev/shm/x", aux_layers=[1, 3, 4], model="m", environ={})
    assert env["SGLANG_PLUGINS"] == "eagleflow_capture"
    assert plugin.capture_requested(env)
    assert plugin.CaptureSettings.from_env(env).aux_layers == [1, 3, 4]
    # plugins the operator already named stay loaded, ours is added once
    kept = capture_env(dump_dir="/d", aux_layers=[1], model="m", environ={"SGLANG_PLUGINS": "other, eagleflow_capture"})
    assert kept["SGLANG_PLUGINS"] == "other,eagleflow_capture"
    assert capture_env(dump_dir="/d", aux_layers=[1], model="m",
                       environ={"SGLANG_PLUGINS": "other"})["SGLANG_PLUGINS"] == "other,eagleflow_capture"


def test_the_launcher_refuses_settings_or_an_sglang_the_schedulers_would_refuse():
    """Checked before sglang starts: a bad setting, or (here) an interpreter without sglang, stops the launch."""
    from eagleflow.engines.sglang.launcher import check_capture_plugin
    env = capture_env(dump_dir="/dev/shm/x", aux_layers=[1, 3, 4], model="m", environ={})
    with pytest.raises(SglangLaunchError, match=r"EAGLEFLOW_CAPTURE_AUX_LAYERS='\[1, 3\]x' is not a JSON list"):
        check_capture_plugin({**env, plugin.ENV_AUX_LAYERS: "[1, 3]x"})
    with pytest.raises(SglangLaunchError, match=r"sglang \(not installed\): cannot import sglang"):
        check_capture_plugin(env)
