"""Dependencies are declared: pyproject.toml's ranges, requirements.txt's pins, and a slim control plane.

The control-plane extra (what the Dockerfile installs) must be enough to import every DAG, the plugin
and every eagleflow.airflow module: proven by importing them in a subprocess in which every installed
distribution outside that extra's dependency closure cannot be imported (torch, transformers, ...).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
NODE_ONLY = {"torch", "transformers", "datasets", "tokenizers", "pyarrow", "pandas", "safetensors", "matplotlib",
             "nvidia-ml-py", "sglang", "pytest", "aiosmtpd"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[_norm(name)] = version
    return pins


def _closure(requirements: list[str]) -> set[str]:
    """Installed distributions that ``requirements`` pull in, walked through their metadata."""
    seen: set[str] = set()
    todo = [(Requirement(r), frozenset()) for r in requirements]
    while todo:
        req, _ = todo.pop()
        name = _norm(req.name)
        if name == "eagleflow":
            for extra in req.extras:
                todo += [(Requirement(r), frozenset()) for r in PROJECT["optional-dependencies"][extra]]
            continue
        env = default_environment()
        if name in seen and not req.extras:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        for sub in dist.requires or []:
            r = Requirement(sub)
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in (req.extras or {""})):
                todo.append((r, frozenset()))
    return seen


def test_extras_exist_and_every_range_admits_its_pin():
    extras = PROJECT["optional-dependencies"]
    assert {"control-plane", "node", "test"} <= set(extras)
    pins = _pins()
    for spec in PROJECT["dependencies"] + [r for rs in extras.values() for r in rs]:
        req = Requirement(spec)
        if _norm(req.name) == "eagleflow":
            continue
        assert _norm(req.name) in pins, f"{req.name} is declared in pyproject.toml but not pinned in requirements.txt"
        pinned = pins[_norm(req.name)].split("+")[0]
        assert req.specifier.contains(pinned, prereleases=True), f"{spec} does not admit the pin {pinned}"


def test_the_control_plane_closure_leaves_the_node_libraries_out():
    closure = _closure(PROJECT["dependencies"] + PROJECT["optional-dependencies"]["control-plane"])
    assert {"apache-airflow", "apache-airflow-providers-celery", "psycopg2-binary", "celery", "redis"} <= closure
    assert not (closure & NODE_ONLY), sorted(closure & NODE_ONLY)


@pytest.mark.slow  # imports every DAG and operator in a fresh interpreter (about 20 s)
def test_dags_plugin_and_operators_import_with_only_the_control_plane(tmp_path):
    closure = _closure(PROJECT["dependencies"] + PROJECT["optional-dependencies"]["control-plane"])
    blocked = sorted({mod for mod, dists in metadata.packages_distributions().items()
                      if mod.isidentifier() and not any(_norm(d) in closure or _norm(d) == "eagleflow" for d in dists)})
    assert "torch" in blocked and "transformers" in blocked
    script = f'''
import importlib, pkgutil, runpy, sys
BLOCKED = set({json.dumps(blocked)})
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not in the control-plane image")
sys.meta_path.insert(0, Blocker())
import eagleflow.airflow
for m in pkgutil.iter_modules(eagleflow.airflow.__path__):
    importlib.import_module("eagleflow.airflow." + m.name)
for f in {json.dumps([str(p) for p in sorted((REPO / "dags").glob("*.py")) + sorted((REPO / "plugins").glob("*.py"))])}:
    runpy.run_path(f)
print("imported")
'''
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0 and "imported" in res.stdout, res.stderr[-3000:]


def test_the_image_installs_the_control_plane_extra_pinned_by_the_lock():
    run_lines = [ln for ln in (REPO / "Dockerfile").read_text().splitlines() if ln.startswith("RUN ")]
    assert run_lines == ['RUN pip install --no-cache-dir --constraint /opt/eagleflow/requirements.txt '
                         '-e "/opt/eagleflow[control-plane]"']
