"""Where Airflow may be imported: the claim in README.md and eagleflow/airflow/__init__.py, checked.

The core runs on a GPU node that has no Airflow. Outside ``eagleflow.airflow`` only two kinds of import are
allowed, both inside functions: the SSH provider in ``nodes/ssh.py``/``nodes/ssh_async.py`` (a node reached
through an Airflow connection is a control-plane node) and ``demo.py`` driving Airflow for ``make demo``.
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "include" / "eagleflow"
LAZY_ALLOWED = {"nodes/ssh.py": "airflow.providers.ssh", "nodes/ssh_async.py": "airflow.providers.ssh",
                "demo.py": "eagleflow.airflow"}


def _airflow_imports(path: Path):
    """(module imported, line, at module level?) for each import of airflow or eagleflow.airflow."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = set(id(n) for n in tree.body)
    package = ["eagleflow", *path.relative_to(PKG).parent.parts]
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level and node.module:
            # resolved: ``from ..airflow import x`` in eagleflow/demo/ is the adapter, health's ``.airflow_health`` not
            names = [".".join(package[:len(package) - node.level + 1] + [node.module])]
        for name in names:
            if name == "airflow" or name.startswith(("airflow.", "eagleflow.airflow")):
                yield name, node.lineno, id(node) in top


def test_only_the_adapter_package_imports_airflow():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("airflow/"):
            continue
        for name, line, top_level in _airflow_imports(path):
            allowed = LAZY_ALLOWED.get(rel)
            if top_level or allowed is None or not name.startswith(allowed):
                offenders.append(f"{rel}:{line} imports {name}" + (" at module level" if top_level else ""))
    assert not offenders, "Airflow imported outside eagleflow/airflow: " + "; ".join(offenders)


# Packages that must not import others (anywhere, lazily included): the layering is strictly downward,
# console -> health -> gpu (eagleflow/health/__init__.py); an arrow back is the gpu <-> console loop again.
NEVER_IMPORTS = {"gpu": ("console", "health"), "health": ("console",)}


def _eagleflow_imports(path: Path):
    """(eagleflow module imported, line) for every import in ``path``, relative ones resolved."""
    package = ["eagleflow", *path.relative_to(PKG).parent.parts]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[:len(package) - node.level + 1])
            names = [f"{base}.{node.module}" if node.module else f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("eagleflow."):
                yield name, node.lineno


def test_layering_is_strictly_downward():
    offenders = []
    for low, banned in NEVER_IMPORTS.items():
        for path in sorted((PKG / low).rglob("*.py")):
            for name, line in _eagleflow_imports(path):
                top = name.split(".")[1]
                if top in banned:
                    offenders.append(f"{path.relative_to(PKG).as_posix()}:{line} imports {name}")
    assert not offenders, ("an upward import (allowed: console -> health -> gpu, see eagleflow/health/__init__.py): "
                           + "; ".join(sorted(set(offenders))))


def test_the_layering_check_sees_relative_and_lazy_imports(tmp_path, monkeypatch):
    # the check above passing means nothing if it cannot see the loop it guards against
    fake = tmp_path / "eagleflow"
    (fake / "gpu").mkdir(parents=True)
    (fake / "gpu" / "x.py").write_text("from ..console.status_doc import program_name\n"
                                       "def f():\n    from eagleflow.health import rules\n"
                                       "from eagleflow import console\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    found = sorted(n for n, _ in _eagleflow_imports(fake / "gpu" / "x.py"))
    assert found == ["eagleflow.console", "eagleflow.console.status_doc", "eagleflow.health",
                     "eagleflow.health.rules"], found
    with pytest.raises(AssertionError, match="gpu/x.py:1 imports eagleflow.console.status_doc"):
        test_layering_is_strictly_downward()


@pytest.mark.slow   # a fresh interpreter importing the whole core
def test_core_imports_and_cli_run_with_airflow_unimportable():
    # A node without Airflow: any import of it fails, and the core modules plus the CLI's help still work.
    core = sorted("eagleflow." + p.relative_to(PKG).with_suffix("").as_posix().replace("/", ".")
                  for p in PKG.rglob("*.py")
                  if not p.relative_to(PKG).as_posix().startswith("airflow/") and p.name != "__init__.py"
                  and p.relative_to(PKG).as_posix() not in ("demo.py", "demo_assets.py"))
    script = (
        "import sys, importlib, importlib.abc\n"
        "class NoAirflow(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'airflow' or name.startswith('airflow.'):\n"
        "            raise ImportError('no airflow on this node: ' + name)\n"
        "sys.meta_path.insert(0, NoAirflow())\n"
        f"for m in {core!r}:\n"
        "    importlib.import_module(m)\n"
        "from eagleflow.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print('OK', len(sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
