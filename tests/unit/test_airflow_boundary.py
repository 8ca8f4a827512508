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
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level and node.module and node.module.startswith("airflow"):
            names = ["eagleflow." + node.module]  # relative import of the adapter package
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
