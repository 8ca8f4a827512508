"""The sglang backend without sglang: command line, version check, refusal, hook install, slicing and dumps."""
from __future__ import annotations

import functools
import json
import sys
import types
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import pytest
import torch

from eagleflow.capture import sglang_plugin as plugin
from eagleflow.capture.protocol import read_dump, request_id
from eagleflow.capture.sglang_launcher import (SglangLaunchError, build_command, capture_env, capture_mode_for,
                                               check_model_supports_capture)
from eagleflow.config import load_config


def _cfg(**capture):
    return load_config(data={"target_model": "/models/t", "capture": {"backend": "sglang", "tp": 4, **capture}})


def test_command_line_has_the_extraction_flags_for_0_5_23():
    argv = build_command(_cfg(dtype="bfloat16", extra_server_args=["--mem-fraction-static", "0.3"]),
                         model_path="/models/t", host="127.0.0.1", port=31000, version="0.5.23", mode="native",
                         aux_layers=[1, 29, 57], python="py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    s = " ".join(argv)
    for flag in ("--model-path /models/t", "--port 31000", "--tp-size 4", "--dtype bfloat16", "--disable-cuda-graph",
                 "--disable-radix-cache", "--chunked-prefill-size -1", "--disable-prefill-cuda-graph",
                 "--enable-return-aux-hidden-states", "--speculative-algorithm EAGLE3",
                 "--return-aux-hidden-state-layer-ids 1 29 57"):
        assert flag in s
    assert argv[-2:] == ["--mem-fraction-static", "0.3"]


def test_command_line_for_0_5_14_has_no_0_5_23_only_flags():
    argv = build_command(_cfg(), model_path="/m", host="h", port=1, version="0.5.14", mode="logits",
                         aux_layers=[1, 3, 4])
    assert "--disable-prefill-cuda-graph" not in argv and "--enable-return-aux-hidden-states" not in argv
    assert "--disable-radix-cache" in argv and argv[argv.index("--chunked-prefill-size") + 1] == "-1"


def test_version_check(monkeypatch):
    monkeypatch.delenv("EAGLEFLOW_SGLANG_CAPTURE_MODE", raising=False)
    assert capture_mode_for("0.5.23") == "native" and capture_mode_for("0.5.14") == "logits"
    with pytest.raises(SglangLaunchError, match=r"sglang 0\.4\.6 is not a version .*0\.5\.14, 0\.5\.23"):
        capture_mode_for("0.4.6")


def _model_dir(tmp_path, archs):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": archs, "num_hidden_layers": 8}))
    return str(tmp_path)


def test_refuses_a_model_without_eagle3_capture(tmp_path):
    class LlamaForCausalLM:
        def set_eagle3_layers_to_capture(self, ids):
            pass

    class MambaForCausalLM:
        pass

    classes = {"LlamaForCausalLM": LlamaForCausalLM, "MambaForCausalLM": MambaForCausalLM}
    resolve = lambda archs: classes[archs[0]]  # noqa: E731
    assert check_model_supports_capture(_model_dir(tmp_path, ["LlamaForCausalLM"]), resolve) == "LlamaForCausalLM"
    with pytest.raises(SglangLaunchError, match="MambaForCausalLM .*has no set_eagle3_layers_to_capture"):
        check_model_supports_capture(_model_dir(tmp_path, ["MambaForCausalLM"]), resolve)
    with pytest.raises(SglangLaunchError, match="no config.json"):
        check_model_supports_capture(str(tmp_path / "nowhere"), resolve)


def test_plugin_entry_point_is_declared():
    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert eps["eagleflow_capture"].value == "eagleflow.capture.sglang_plugin:register"
    assert eps["eagleflow_capture"].load() is plugin.register


# --- fakes of sglang's batch objects ---------------------------------------------------

class _Mode:
    def __init__(self, extend: bool):
        self.extend = extend

    def is_extend(self) -> bool:
        return self.extend


@dataclass
class FakeForwardBatch:
    rids: list
    extend_seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    input_ids: torch.Tensor
    forward_mode: _Mode = field(default_factory=lambda: _Mode(True))
    extend_prefix_lens: torch.Tensor | None = None


@dataclass
class FakeReq:
    rid: str


@dataclass
class FakeScheduleBatch:
    reqs: list
    extend_seq_lens: list
    input_ids: torch.Tensor
    forward_mode: _Mode = field(default_factory=lambda: _Mode(True))


def _batch(lens, rids):
    T = sum(lens)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    return FakeForwardBatch(rids=rids, extend_seq_lens=torch.tensor(lens), extend_start_loc=starts,
                            input_ids=torch.arange(100, 100 + T))


@pytest.fixture
def settings(tmp_path, monkeypatch):
    monkeypatch.setenv(plugin.ENV_DUMP_DIR, str(tmp_path))
    monkeypatch.setenv(plugin.ENV_AUX_LAYERS, "[1, 3, 4]")
    monkeypatch.setenv(plugin.ENV_MODE, "native")
    monkeypatch.setenv(plugin.ENV_MODEL, "tiny")
    monkeypatch.setattr(plugin, "_settings", None)
    return plugin.CaptureSettings.from_env()


def test_slices_a_batched_prefill_per_request(settings, tmp_path):
    lens = [3, 5, 2]
    rids = [request_id("r", 0, 0), "HEALTH_CHECK_abc", request_id("r", 1, 7)]
    b = _batch(lens, rids)
    H = 4
    aux_list = [torch.randn(10, H) for _ in range(3)]
    last = torch.randn(10, H)
    written = plugin.write_request_dumps(settings, plugin.extend_view(b), aux_list, last, b.input_ids)
    assert written == [rids[0], rids[2]], "sglang's own requests get no dump"
    d0 = read_dump(tmp_path / f"{rids[0]}.safetensors")
    torch.testing.assert_close(d0.aux_hidden_states, torch.cat(aux_list, -1)[0:3])
    torch.testing.assert_close(d0.hidden_states, last[0:3])
    assert d0.input_ids.tolist() == [100, 101, 102] and d0.aux_layers == [1, 3, 4] and d0.model == "tiny"
    d2 = read_dump(tmp_path / f"{rids[2]}.safetensors")
    torch.testing.assert_close(d2.hidden_states, last[8:10])
    assert d2.input_ids.tolist() == [108, 109]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{r}.safetensors" for r in written)


def test_packed_aux_and_schedule_batch_without_start_locs(settings, tmp_path):
    b = FakeScheduleBatch(reqs=[FakeReq(request_id("r", 0, 1)), FakeReq(request_id("r", 0, 3))],
                          extend_seq_lens=[2, 4], input_ids=torch.arange(6))
    view = plugin.extend_view(b)
    assert view.starts == [0, 2] and view.lens == [2, 4]
    packed = torch.randn(6, 12)
    plugin.write_request_dumps(settings, view, packed, torch.randn(6, 4), b.input_ids)
    torch.testing.assert_close(read_dump(tmp_path / f"{request_id('r', 0, 3)}.safetensors").aux_hidden_states,
                               packed[2:6])


def test_cached_prefix_and_decode_write_nothing(settings, tmp_path):
    b = _batch([3], [request_id("r", 0, 0)])
    b.extend_prefix_lens = torch.tensor([2])
    assert plugin.write_request_dumps(settings, plugin.extend_view(b), torch.randn(3, 12), torch.randn(3, 4)) == []
    b.forward_mode = _Mode(False)
    assert plugin.extend_view(b) is None


def test_native_hook_writes_from_tp_rank_0_only(settings, tmp_path):
    b = _batch([4], [request_id("r", 0, 2)])
    result = types.SimpleNamespace(logits_output=types.SimpleNamespace(hidden_states=torch.randn(4, 12),
                                                                       last_hidden_states=torch.randn(4, 4)))
    plugin.after_forward_batch_generation(result, types.SimpleNamespace(tp_rank=1), b)
    assert not list(tmp_path.iterdir())
    plugin.after_forward_batch_generation(result, types.SimpleNamespace(tp_rank=0), b)
    assert [p.name for p in tmp_path.iterdir()] == [f"{request_id('r', 0, 2)}.safetensors"]
    no_aux = types.SimpleNamespace(logits_output=types.SimpleNamespace(hidden_states=None, last_hidden_states=None))
    with pytest.raises(plugin.CaptureHookError, match="--enable-return-aux-hidden-states"):
        plugin.after_forward_batch_generation(no_aux, types.SimpleNamespace(tp_rank=0), b)


def test_logits_mode_hooks(settings, tmp_path):
    calls = []
    model = types.SimpleNamespace(set_eagle3_layers_to_capture=calls.append)
    plugin.after_load_model(None, types.SimpleNamespace(model=model, is_draft_worker=False))
    assert calls == [[1, 3, 4]]
    with pytest.raises(plugin.CaptureHookError, match="has no set_eagle3_layers_to_capture"):
        plugin.after_load_model(None, types.SimpleNamespace(model=object(), is_draft_worker=False))
    b = _batch([2, 3], [request_id("r", 0, 0), request_id("r", 0, 2)])
    plugin.before_logits_forward(object(), b.input_ids, torch.randn(5, 4), None, b,
                                 [torch.randn(5, 4) for _ in range(3)])
    assert len(list(tmp_path.iterdir())) == 2


# --- hook installation through a registry shaped like sglang's HookRegistry ---------------

class FakeHookType:
    BEFORE, AFTER = "before", "after"


class FakeRegistry:
    def __init__(self, applies: bool = True):
        self.hooks, self._patched, self.applies = {}, set(), applies

    def register(self, target, fn, kind):
        self.hooks[target] = (fn, kind)

    def apply_hooks(self):
        import pkgutil
        if not self.applies:
            return   # sglang logs "Failed to apply hooks" and goes on
        for t, (fn, kind) in self.hooks.items():
            obj_path, attr = t.rsplit(".", 1)
            obj = pkgutil.resolve_name(obj_path)
            orig = getattr(obj, attr)

            @functools.wraps(orig)
            def wrapper(*a, _orig=orig, _fn=fn, **kw):
                res = _orig(*a, **kw)
                return _fn(res, *a, **kw) or res
            setattr(obj, attr, wrapper)
            self._patched.add(t)


@pytest.fixture
def fake_module(monkeypatch):
    mod = types.ModuleType("fake_sglang_worker")

    class Worker:
        def forward(self, x):
            return x * 2
    mod.Worker = Worker
    monkeypatch.setitem(sys.modules, "fake_sglang_worker", mod)
    return mod


def test_install_applies_and_verifies_hooks(fake_module):
    seen = []
    hooks = {"fake_sglang_worker.Worker.forward": ("AFTER", lambda res, self, x: seen.append(res))}
    assert plugin.install(FakeRegistry(), FakeHookType, "native", hooks) == ["fake_sglang_worker.Worker.forward"]
    assert fake_module.Worker().forward(3) == 6 and seen == [6]


def test_install_fails_loudly_when_a_hook_did_not_apply(fake_module):
    hooks = {"fake_sglang_worker.Worker.forward": ("AFTER", lambda res, self, x: None)}
    with pytest.raises(plugin.CaptureHookError, match="did not apply .*Worker.forward"):
        plugin.install(FakeRegistry(applies=False), FakeHookType, "native", hooks)
    with pytest.raises(plugin.CaptureHookError, match="cannot find fake_sglang_worker.Worker.nope"):
        plugin.install(FakeRegistry(), FakeHookType, "native", {"fake_sglang_worker.Worker.nope": ("AFTER", print)})


def test_register_without_launcher_env_stops_the_process(monkeypatch):
    for k in (plugin.ENV_DUMP_DIR, plugin.ENV_AUX_LAYERS, plugin.ENV_MODE):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(plugin, "_settings", None)
    with pytest.raises(SystemExit, match="without EAGLEFLOW_CAPTURE_DUMP_DIR"):
        plugin.register()


def test_capture_env_names_the_plugin():
    env = capture_env(dump_dir="/dev/shm/x", aux_layers=[1, 3, 4], model="m", mode="native")
    assert env["SGLANG_PLUGINS"] == "eagleflow_capture"
    assert plugin.CaptureSettings.from_env(env).aux_layers == [1, 3, 4]
