"""The engine registry (issue 39, item 2): every choice of serving engine asks ``eagleflow.engines``.

The registry refuses names it does not know, naming the field; the config validates capture.backend,
generate.backend and eval.backend against it; generation picks its own engine (``generate.backend``); a new
engine is one registered entry (a fake one is served through the real CLI here); and no module outside the
registry branches on an engine's name again.
"""
from __future__ import annotations

import ast
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagleflow import engines
from eagleflow.config import ConfigError, load_config
from eagleflow.engines import (ENGINES, Engine, EngineUnsupported, UnknownEngine, engine, engine_for,
                               engine_serving_format, generation_engine, names_for)
from eagleflow.layout import RunLayout
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.name_branches import name_branches

PKG = Path(__file__).resolve().parents[2] / "include" / "eagleflow"
BASE = {"target_model": "/models/t"}


def _err(data: dict) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(data={**BASE, **data})
    return str(e.value)


# --- the registry --------------------------------------------------------------------------------------

def test_the_registry_refuses_an_unknown_name_naming_the_field_the_value_and_the_engines():
    with pytest.raises(UnknownEngine) as e:
        engine("sglangg", field="capture.backend")
    msg = str(e.value)
    assert "capture.backend = 'sglangg'" in msg and "registered: hf, sglang, vllm" in msg, msg
    assert engine("sglang").name == "sglang" and engine("hf").needs_gpu is False and engine("sglang").needs_gpu


def test_an_engine_without_a_role_is_refused_for_it_by_name(monkeypatch):
    # every registered engine fills every server role now (vllm: issue 40), so the refusal is shown on one
    # registered for capture only
    monkeypatch.setitem(ENGINES, "capture-only", Engine(name="capture-only", label="C", needs_gpu=False,
                                                        capture_server=_fake_serve))
    with pytest.raises(EngineUnsupported, match=r"eval\.backend = 'capture-only': capture-only has no evaluation "
                                                r"in eagleflow yet; .*use 'hf' or 'sglang' or 'vllm'"):
        engine_for("capture-only", "evaluator")
    monkeypatch.delitem(ENGINES, "capture-only")
    assert names_for("evaluator") == ["hf", "sglang", "vllm"]         # vllm evaluates (issue 40 item 4)
    assert names_for("generate_server") == ["hf", "sglang", "vllm"]   # vllm generates (issue 40 item 3)
    assert names_for("capture_server") == ["hf", "sglang", "vllm"]   # vllm captures (issue 40 item 2)
    # vLLM is there for what eagleflow does with it: the export's layer numbering and the report's command
    assert engine_serving_format("speculators").name == "vllm" and engine_serving_format("sglang").name == "sglang"


def test_every_reference_in_the_registry_names_a_function_that_exists():
    # an engine's roles import their modules when called: a typo in one of those imports would only show on the
    # node, at the first call, so each is resolved here (the heavy libraries themselves stay unimported)
    for e in ENGINES.values():
        for role in engines.ROLES:
            if getattr(e, role) is not None:
                assert callable(e.function(role)), (e.name, role)
    for module in engines.ENGINE_MODULES:
        init = importlib.import_module(module)
        for node in ast.walk(ast.parse(Path(str(init.__file__)).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level or isinstance(node, ast.ImportFrom) and \
                    (node.module or "").startswith("eagleflow."):
                target = importlib.import_module(("." * node.level) + (node.module or ""), package=module)
                for alias in node.names:
                    assert hasattr(target, alias.name), (module, node.module, alias.name)


def test_the_registry_loads_every_engine_without_its_heavy_parts():
    # the control plane, the config and the DAG files read the registry in a plain venv: loading the engines'
    # packages imports no engine library, no torch and not the config (each role imports those when called)
    code = ("import sys, eagleflow.engines as e; print(sorted(e.ENGINES)); print(sorted(m for m in sys.modules if "
            "m.split('.')[0] in ('torch', 'transformers', 'sglang', 'vllm', 'pydantic', 'yaml') or "
            "m in ('eagleflow.config', 'eagleflow.layout')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.split("\n")[:2] == ["['hf', 'sglang', 'vllm']", "[]"], \
        res.stdout + res.stderr


def test_the_registry_refuses_a_module_without_an_engine_or_a_name_twice():
    with pytest.raises(TypeError, match=r"eagleflow\.engines\.contract\.ENGINE is NoneType, not an "):
        engines.load_engines(["eagleflow.engines.contract"])
    with pytest.raises(ValueError, match=r"eagleflow\.engines\.hf\.ENGINE is named 'hf', like an engine registered"):
        engines.load_engines(["eagleflow.engines.hf", "eagleflow.engines.hf"])


def test_the_layer_numbering_is_each_engines_own():
    # output of layer j: SGLang id j for Llama, vLLM id j + 1 (docs/engines.md)
    assert engine("sglang").layer_ids([1, 3, 4], ["LlamaForCausalLM"], 8) == [1, 3, 4]
    assert engine("vllm").layer_ids([1, 3, 4], ["LlamaForCausalLM"], 8) == [2, 4, 5]
    with pytest.raises(EngineUnsupported, match="hf has no layer numbering"):
        engine("hf").layer_ids([1], ["LlamaForCausalLM"], 8)


# --- the config against the registry -------------------------------------------------------------------

@pytest.mark.parametrize("section,role,names", [("capture", "capture server", "'hf' or 'sglang' or 'vllm'"),
                                                ("generate", "generation server", "'hf' or 'sglang' or 'vllm'"),
                                                ("eval", "evaluation", "'hf' or 'sglang' or 'vllm'")])
def test_the_config_refuses_an_unknown_engine_naming_the_field_never_the_value(section, role, names):
    msg = _err({section: {"backend": "nope-Secret1"}})
    assert f"{section}.backend: Input should be {names}: the engines eagleflow.engines registers for " \
           f"the {role} (got a value of type str, not shown)" in msg, msg
    assert "nope-Secret1" not in msg   # a config's values are never echoed (docs/safety.md)


@pytest.mark.parametrize("section,what", [("generate", "generation server"), ("eval", "evaluation")])
def test_the_config_refuses_an_engine_where_it_has_no_server(section, what, monkeypatch):
    monkeypatch.setitem(ENGINES, "capture-only", Engine(name="capture-only", label="C", needs_gpu=False,
                                                        capture_server=_fake_serve))
    msg = _err({"node": {"has_gpu": True}, section: {"backend": "capture-only"}})
    assert f"{section}.backend: Value error, capture-only has no {what} in eagleflow yet" in msg, msg
    assert "use 'hf' or 'sglang' or 'vllm'" in msg, msg


def test_existing_configs_load_unchanged_and_generation_follows_capture_by_default():
    repo = PKG.parents[1]
    for name in ("local-demo.yaml", "gpu-node.example.yaml", "fleet.example.yaml"):
        cfg = load_config(repo / "configs" / name)
        assert cfg.generate.backend is None
        assert generation_engine(cfg).name == cfg.capture.backend, name
    cfg = load_config(data={**BASE, "capture": {"backend": "sglang"}, "generate": {"backend": "hf"}})
    assert (cfg.capture.backend, generation_engine(cfg).name) == ("sglang", "hf")


def test_the_gpu_node_checks_ask_each_servers_engine():
    msg = _err({"node": {"has_gpu": False}, "generate": {"backend": "sglang"}})
    assert "generate.backend 'sglang' needs a GPU node, but node.has_gpu is false; use backend 'hf'" in msg, msg
    msg = _err({"node": {"has_gpu": False}, "capture": {"backend": "sglang"}})
    assert "capture.backend 'sglang' needs a GPU node" in msg and "generate.backend" not in msg, msg
    load_config(data={**BASE, "node": {"has_gpu": False}, "capture": {"backend": "hf"}, "generate": {"backend": "hf"}})
    fleet = {"nodes": [{"name": "a", "conn_id": "a"}, {"name": "b", "conn_id": "b", "has_gpu": False}]}
    msg = _err({"fleet": fleet, "generate": {"backend": "sglang"}})
    assert "fleet node 'b' has has_gpu false, but generate.backend is 'sglang', which needs a GPU node" in msg, msg


def test_trees_are_evaluated_by_the_engines_that_draft_them():
    tree = [{"steps": 3, "topk": 2, "draft_tokens": 6}]
    msg = _err({"eval": {"backend": "hf", "configs": tree}})
    assert "the hf evaluator drafts chains only (topk 1); use eval.backend sglang for top-k > 1" in msg, msg
    assert load_config(data={**BASE, "eval": {"backend": "sglang", "configs": tree}}).eval.backend == "sglang"


def test_capture_serve_offers_the_registered_capture_engines(capsys):
    from eagleflow.cli import main
    with pytest.raises(SystemExit) as e:
        main(["capture", "serve", "--config", "x.yaml", "--backend", "vllmm"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'vllmm'" in err and "'hf', 'sglang', 'vllm'" in err, err


# --- a new engine is one registered entry ------------------------------------------------------------------

def _fake_serve(cfg, layout) -> int:
    """A registered engine's capture and generation server: leaves a mark naming what it served."""
    Path(str(layout.run_dir)).mkdir(parents=True, exist_ok=True)
    (Path(str(layout.run_dir)) / "served.json").write_text(json.dumps({"backend": cfg.capture.backend,
                                                                       "generate": cfg.generate.backend}))
    return 7


def test_a_registered_engine_serves_through_the_real_cli_without_touching_another_module(tmp_path, monkeypatch):
    fake = Engine(name="fake", label="Fake", needs_gpu=False, capture_server=_fake_serve,
                  generate_server=_fake_serve)
    monkeypatch.setitem(ENGINES, "fake", fake)
    # an "else: sglang" would exec sglang's launch_server in place of this test process
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail(f"exec'd {a[1][:3]} instead of the registered engine"))
    cfgp = tmp_path / "c.yaml"
    cfgp.write_text(yaml.safe_dump({"run_root": str(tmp_path / "runs"), "target_model": "/models/t",
                                    "node": {"has_gpu": False, "state_dir": str(tmp_path / "state")},
                                    "capture": {"backend": "fake"}}))
    from eagleflow.cli import main
    for phase in ("capture", "generate"):
        assert main([phase, "serve", "--config", str(cfgp), "--run-id", phase]) == 7
        cfg = load_config(cfgp)
        served = json.loads((Path(str(RunLayout.for_run(cfg, phase).run_dir)) / "served.json").read_text())
        assert served == {"backend": "fake", "generate": None}


def _fake_command(cfg, draft_dir: str) -> str:
    return f"fake-serve {cfg.target_model} --draft {draft_dir}"


def test_the_run_report_prints_each_registered_serving_engines_command(tmp_path, monkeypatch):
    from eagleflow.console.run_report import write_report
    from tests.unit.test_run_report import _complete_run, _config
    monkeypatch.setitem(ENGINES, "fake", Engine(name="fake", label="FakeServe", needs_gpu=True, draft_format="sglang",
                                                serve_command=_fake_command))
    cfg, layout = _config(tmp_path)
    _complete_run(cfg, layout, 1.7e9)
    html = write_report(cfg, layout).read_text()
    export = Path(str(layout.draft_dir)) / "export"
    assert "Serve it with SGLang:" in html and "No speculators-format export for vLLM" in html
    assert f"Serve it with FakeServe:</p><pre class='cmd'>fake-serve {cfg.target_model} --draft {export}</pre>" in html


# --- a new engine is a folder and one line (docs/engines.md, "A new engine") ------------------------------

STUB_ENGINE = '''"""A stub engine, written by tests/unit/test_engines.py into a copy of the package."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from eagleflow.engines.contract import Engine


def serve(cfg: Any, layout: Any) -> int:
    Path(str(layout.run_dir)).mkdir(parents=True, exist_ok=True)
    (Path(str(layout.run_dir)) / "stub-served.json").write_text(json.dumps({"backend": cfg.capture.backend}))
    return 5


def evaluate(cfg: Any, layout: Any, **kw: Any) -> tuple[list[dict], dict]:
    return [], {"engine": "stub"}


def layer_ids(layer_outputs: Sequence[int] | None, architectures: Sequence[str], num_layers: int) -> list[int]:
    return [j + 10 for j in (layer_outputs or [])]


def serve_command(cfg: Any, draft_dir: str) -> str:
    return f"stub-serve {cfg.target_model} --draft {draft_dir}"


ENGINE = Engine(name="stub", label="Stub", needs_gpu=False, capture_server=serve, generate_server=serve,
                evaluator=evaluate, layer_numbering=layer_ids, serve_command=serve_command,
                draft_format="stub-format", draft_dir="stub")
'''

STUB_CHECKS = '''
import json, sys
from pathlib import Path
import yaml
import eagleflow
from eagleflow.cli import main
from eagleflow.config import ConfigError, load_config
from eagleflow.engines import ENGINES, engine_serving_format, export_formats, names_for
from eagleflow.layout import RunLayout
from eagleflow.train.export_formats import format_dir

tmp = Path(sys.argv[1])
assert Path(eagleflow.__file__).is_relative_to(tmp), eagleflow.__file__   # the copy, not the repository
assert list(ENGINES) == ["hf", "sglang", "vllm", "stub"], list(ENGINES)
for role in ("capture_server", "generate_server", "evaluator", "layer_numbering", "serve_command"):
    assert "stub" in names_for(role), role
assert export_formats() == ["sglang", "speculators", "stub-format"], export_formats()
assert engine_serving_format("stub-format").layer_ids([1, 2], ["X"], 8) == [11, 12]
assert format_dir("/e", "stub-format") == Path("/e/stub")
base = {"target_model": "/models/t", "run_root": str(tmp / "runs"),
        "node": {"has_gpu": False, "state_dir": str(tmp / "state")}}
cfg = load_config(data={**base, "capture": {"backend": "stub"}, "generate": {"backend": "stub"},
                        "eval": {"backend": "stub"}, "train": {"export_formats": ["stub-format"]}})
assert (cfg.capture.backend, cfg.generate.backend, cfg.eval.backend) == ("stub", "stub", "stub")
assert load_config(data=base).train.export_formats == ["sglang", "speculators", "stub-format"]
try:
    load_config(data={**base, "capture": {"backend": "stubb"}})
    raise AssertionError("an unknown engine was taken")
except ConfigError as e:
    assert "'hf' or 'sglang' or 'vllm' or 'stub'" in str(e), str(e)
cfgp = tmp / "c.yaml"
cfgp.write_text(yaml.safe_dump({**base, "capture": {"backend": "stub"}}))
assert main(["capture", "serve", "--config", str(cfgp), "--run-id", "s", "--backend", "stub"]) == 5
served = Path(str(RunLayout.for_run(load_config(cfgp), "s").run_dir)) / "stub-served.json"
assert json.loads(served.read_text()) == {"backend": "stub"}
print("STUB OK")
'''


@pytest.mark.timeout(180)
def test_a_stub_engine_is_its_folder_and_one_line_in_the_registry(tmp_path):
    """The dry run docs/engines.md promises: in a copy of the package, a stub engine's folder plus its line in
    ENGINE_MODULES is registered, offered by the config (capture, generate and eval backends, export formats), the
    CLI and the layer numbering, and served through the real CLI; no other module of the package changed."""
    pkg = tmp_path / "src" / "eagleflow"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "engines" / "stub").mkdir()
    (pkg / "engines" / "stub" / "__init__.py").write_text(STUB_ENGINE)
    registry = pkg / "engines" / "__init__.py"
    line = '"eagleflow.engines.vllm")'
    assert line in registry.read_text()
    registry.write_text(registry.read_text().replace(line, '"eagleflow.engines.vllm",\n'
                                                           '                                 "eagleflow.engines.stub")'))
    changed = sorted(p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py")
                     if p.parent.name != "stub" and p.read_bytes() != (PKG / p.relative_to(pkg)).read_bytes())
    assert changed == ["engines/__init__.py"], changed
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", STUB_CHECKS, str(tmp_path)], env={**env, "PYTHONPATH": str(pkg.parent)},
                         cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert res.returncode == 0 and "STUB OK" in res.stdout, res.stdout + res.stderr


# --- generation picks its own engine -----------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_generate_serve_runs_generate_backend_hf_beside_capture_backend_sglang(tmp_path, demo_assets):
    """On a GPU node whose capture is sglang, generate.backend hf serves generation with our hf server (this
    venv has no sglang: the old choice, capture.backend's engine, could not start at all)."""
    from eagleflow.serving.client import generate_tokens, health_generate
    cfgp = write_short_config(tmp_path, demo_assets, node={"has_gpu": True},
                              capture={"backend": "sglang"}, generate={"backend": "hf", "port": 0})
    cfg = load_config(cfgp)
    assert (cfg.capture.backend, generation_engine(cfg).name) == ("sglang", "hf")
    layout = RunLayout.for_run(cfg, "gen-hf")
    info_file = Path(str(layout.generate_server_info_file))
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "eagleflow.cli", "generate", "serve", "--config", str(cfgp),
                             "--run-id", "gen-hf"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not info_file.exists():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no generation server info within 150 s"
            time.sleep(0.2)
        info = json.loads(info_file.read_text())
        assert (info["backend"], info["mode"], info["pid"]) == ("hf", "generate", proc.pid), info
        health_generate(info["url"], 30)
        ids, finish = generate_tokens(info["url"], [1, 2, 3, 4], "engines-0", max_new_tokens=3, temperature=0.0,
                                      top_p=1.0, seed=0, stop_token_ids=[], timeout_s=60)
        assert len(ids) == 3 and finish == "length"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)   # ours, by pid
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


# --- no engine branch outside the registry -------------------------------------------------------------------

# the export *formats* are named "sglang" and "speculators": a different idea, allowed to branch on its names
FORMAT_MODULES = {"train/commands.py"}


def engine_branches(source: str, filename: str = "<src>") -> list[int]:
    """Lines comparing something with an engine's name (``x == "sglang"``, ``"hf" != y``, ``x in ("hf", ...)``)."""
    return name_branches(source, set(ENGINES) | {"hf", "sglang", "vllm"}, filename)


# the registry itself (engines/__init__.py, engines/contract.py) names the engines' packages; an engine's own
# folder (engines/<name>/) is checked like every other module: it is that engine, it needs no branch on a name
REGISTRY_MODULES = {"engines/__init__.py", "engines/contract.py"}


def test_no_module_outside_the_registry_branches_on_an_engines_name():
    found = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if rel in REGISTRY_MODULES or rel in FORMAT_MODULES:
            continue
        found += [f"{rel}:{line}" for line in engine_branches(p.read_text(), str(p))]
    assert not found, ("engine branches outside eagleflow/engines/ (give the Engine a field instead): "
                       + ", ".join(found))


def test_the_export_names_no_format_and_no_engine():
    # issue 48: each format's writer and where it keeps its layer ids are its engine's (engines/<name>/export.py,
    # ENGINE.draft_writer / draft_layer_ids); train/export.py asks the registry, so it names none outside its
    # docstrings (not even `"sglang" in fmts`, which the branch check lets through)
    names = set(engines.export_formats()) | set(ENGINES)
    for rel in ("train/export.py", "train/export_formats.py"):
        tree = ast.parse((PKG / rel).read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        named = [f"{rel}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and n.value in names and id(n) not in docs]
        assert not named, named


def test_the_branch_check_reads_every_engines_folder():
    # the engines moved into folders of their own (issue 48): the check reads each of them too
    checked = {p.relative_to(PKG).parts[1] for p in PKG.glob("engines/*/*.py")}
    assert checked >= {m.rpartition(".")[2] for m in engines.ENGINE_MODULES}, checked


def test_the_branch_check_sees_the_shapes_it_guards_against():
    # the check passing means nothing if it cannot see a branch
    src = ('if cfg.capture.backend == "hf":\n    pass\n'
           'if "sglang" != backend:\n    pass\n'
           "ok = backend in ('hf', 'sglang')\n"
           'match backend:\n    case "vllm":\n        pass\n'
           'fmt_ok = "sglang" in fmts\n'            # a membership test on a format list: not an engine branch
           'name = "sglang"\n')
    assert engine_branches(src) == [1, 3, 5, 7]
