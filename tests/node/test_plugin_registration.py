"""The plugin as sglang loads it: entry point, load_plugins(), HookRegistry, and the start-up contract.

sglang 0.5.23 loads every installed ``sglang.srt.plugins`` entry point when SGLANG_PLUGINS is unset, so ours
runs in every plain sglang launch on the node: it must stay inert there, and wrap only in a capture launch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from eagleflow.engines.sglang import plugin


def test_entry_point_is_found_in_the_node_venv():
    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert "eagleflow_capture" in eps, "eagleflow is not installed in this venv with its entry point"
    assert eps["eagleflow_capture"].load() is plugin.register


def test_the_installed_sglang_meets_the_hook_contract():
    plugin.check_sglang_contract()


def plain_env() -> dict[str, str]:
    """This environment as a plain sglang launch sees it: no capture settings, SGLANG_PLUGINS unset."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EAGLEFLOW_CAPTURE_") and k != "SGLANG_PLUGINS"}


REPORT = """
    now = tw.TpModelWorker.forward_batch_generation
    ours = sorted(t for t, hooks in HookRegistry._hooks.items()
                  if any(src is not None and src.plugin_name == "eagleflow_capture" for _, _, src in hooks))
    print(json.dumps({"changed": id(now) != original_id, "wrapped_id": id(getattr(now, "__wrapped__", None)) ==
                      original_id, "ours": ours, "patched": sorted(HookRegistry._patched)}))
"""


def _run_load_plugins(tmp_path, env: dict[str, str], body: str = REPORT) -> subprocess.CompletedProcess:
    """A fresh interpreter doing what every sglang process does at start: load_plugins() (its guard and the
    hooks it applies are process-wide, so each case gets its own process)."""
    code = textwrap.dedent("""
        import json, sys
        import sglang.srt.managers.tp_worker as tw
        original_id = id(tw.TpModelWorker.forward_batch_generation)
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)


def test_a_plain_sglang_launch_is_untouched(tmp_path):
    res = _run_load_plugins(tmp_path, plain_env())
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert (got["changed"], got["wrapped_id"], got["ours"]) == (False, False, [])
    assert plugin.TARGET not in got["patched"]
    # every installed plugin ran: sglang's own dependency smg-grpc-servicer hooks its CLI arguments
    assert "sglang.srt.server_args.ServerArgs.add_cli_args" in got["patched"]
    ours = [line for line in res.stderr.splitlines() if line.startswith("eagleflow capture:")]
    assert len(ours) == 1 and "not a capture launch" in ours[0] and "plugin inert" in ours[0], res.stderr[-3000:]


def test_load_plugins_wraps_the_real_target(tmp_path):
    """With the env the capture launcher gives sglang (its own capture_env)."""
    from eagleflow.engines.sglang.launcher import capture_env
    env = {**plain_env(), **capture_env(dump_dir=str(tmp_path / "d"), aux_layers=[1, 3, 4], model="m", environ={})}
    assert env["SGLANG_PLUGINS"] == "eagleflow_capture"
    res = _run_load_plugins(tmp_path, env)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    # SGLANG_PLUGINS names ours alone: only our target is patched
    assert got == {"changed": True, "wrapped_id": True, "ours": [plugin.TARGET], "patched": [plugin.TARGET]}
    assert "eagleflow capture: hook installed" in res.stderr


def test_a_capture_launch_with_incomplete_settings_stops(tmp_path):
    """sglang's load_plugins() only logs an Exception from a plugin: ours must stop the process instead."""
    env = {**plain_env(), "SGLANG_PLUGINS": "eagleflow_capture", plugin.ENV_DUMP_DIR: str(tmp_path / "d")}
    res = _run_load_plugins(tmp_path, env, "print('served anyway')")
    assert res.returncode != 0 and "served anyway" not in res.stdout
    assert ("eagleflow capture: FATAL: eagleflow capture plugin loaded without EAGLEFLOW_CAPTURE_AUX_LAYERS"
            in res.stderr), res.stderr[-3000:]


def test_the_launcher_proves_the_plugin_before_sglang_starts(monkeypatch):
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from eagleflow.engines.sglang.launcher import SglangLaunchError, capture_env, check_capture_plugin
    env = capture_env(dump_dir="/dev/shm/x", aux_layers=[1, 3, 4], model="m", environ={})
    assert check_capture_plugin(env).aux_layers == [1, 3, 4]
    with pytest.raises(SglangLaunchError, match="EAGLEFLOW_CAPTURE_AUX_LAYERS='1 3 4' is not a JSON list"):
        check_capture_plugin({**env, plugin.ENV_AUX_LAYERS: "1 3 4"})
    fields = {k: v for k, v in ScheduleBatch.__dataclass_fields__.items() if k != "extend_lens"}
    monkeypatch.setattr(ScheduleBatch, "__dataclass_fields__", fields)
    with pytest.raises(SglangLaunchError, match=r"sglang 0\.5\.23: .*ScheduleBatch has no attribute 'extend_lens'"):
        check_capture_plugin(env)


def test_an_sglang_whose_batch_lacks_a_field_stops_at_start(monkeypatch, capture_env):
    """As a later sglang that renamed ScheduleBatch.extend_lens would: the scheduler exits, naming both."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    fields = {k: v for k, v in ScheduleBatch.__dataclass_fields__.items() if k != "extend_lens"}
    monkeypatch.setattr(ScheduleBatch, "__dataclass_fields__", fields)
    with pytest.raises(SystemExit, match=r"sglang 0\.5\.23: .*ScheduleBatch has no attribute 'extend_lens'"):
        plugin.register()


def test_an_sglang_without_the_rank_api_stops_at_start(monkeypatch, capture_env):
    import sglang.srt.runtime_context as rc
    monkeypatch.delattr(rc, "get_parallel")
    with pytest.raises(SystemExit, match="get_parallel"):
        plugin.register()
