"""The plugin as sglang loads it: entry point, load_plugins(), HookRegistry, and the start-up contract."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from eagleflow.capture import sglang_plugin as plugin


def test_entry_point_is_found_in_the_node_venv():
    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert "eagleflow_capture" in eps, "eagleflow is not installed in this venv with its entry point"
    assert eps["eagleflow_capture"].load() is plugin.register


def test_the_installed_sglang_meets_the_hook_contract():
    plugin.check_sglang_contract()


def _run_load_plugins(tmp_path, env_extra: dict[str, str], body: str) -> subprocess.CompletedProcess:
    """A fresh interpreter doing what every sglang scheduler process does at start: load_plugins()."""
    code = textwrap.dedent("""
        import json, sys
        import sglang.srt.managers.tp_worker as tw
        original_id = id(tw.TpModelWorker.forward_batch_generation)
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
    """) + textwrap.dedent(body)
    env = {**os.environ, "SGLANG_PLUGINS": "eagleflow_capture", **env_extra}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)


def test_load_plugins_wraps_the_real_target(tmp_path):
    env = {plugin.ENV_DUMP_DIR: str(tmp_path / "d"), plugin.ENV_AUX_LAYERS: "[1, 3, 4]", plugin.ENV_MODEL: "m"}
    res = _run_load_plugins(tmp_path, env, """
        now = tw.TpModelWorker.forward_batch_generation
        print(json.dumps({"changed": id(now) != original_id, "wrapped_id": id(now.__wrapped__) == original_id,
                          "patched": sorted(HookRegistry._patched)}))
    """)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"changed": True, "wrapped_id": True, "patched": [plugin.TARGET]}
    assert "eagleflow capture: hook installed" in res.stderr


def test_a_scheduler_without_the_launcher_env_stops(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLEFLOW_CAPTURE_")}
    code = "from sglang.srt.plugins import load_plugins; load_plugins(); print('served anyway')"
    res = subprocess.run([sys.executable, "-c", code], env={**env, "SGLANG_PLUGINS": "eagleflow_capture"},
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode != 0 and "served anyway" not in res.stdout
    assert "without EAGLEFLOW_CAPTURE_DUMP_DIR" in res.stderr


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
