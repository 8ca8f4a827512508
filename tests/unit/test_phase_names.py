"""The phase is a descriptor everywhere past the CLI's parsing (issue 48): no string literal naming a sharded
phase ("extract", "generate") anywhere in the package, the DAGs or the plugins outside the phases' descriptors
(``eagleflow/phases/<name>/__init__.py``, each its ``KIND``), which own the names.

A module that writes ``phase="generate"`` or ``if phase == "extract"`` is deciding what the descriptor should
say (a field of ``ShardKind``: its CLI group ``command``, its server's ``server_mode``...; a ``PhaseLifecycle``
function); ``EXTRACT``/``GENERATE``, ``KIND`` and ``kind.phase`` are the names' one home. The phases' own
folders are scanned too: their commands and lifecycles read their ``KIND``.
"""
from __future__ import annotations

import ast
from pathlib import Path

from eagleflow.phases import KINDS

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "include" / "eagleflow"
OWNERS = {PACKAGE / "phases" / name / "__init__.py" for name in KINDS}   # each phase's descriptor (its KIND)


def phase_name_literals(source: str, filename: str = "<src>") -> list[int]:
    """Lines holding a string constant that is exactly a sharded phase's name."""
    names = set(KINDS)
    return sorted({node.lineno for node in ast.walk(ast.parse(source, filename=filename))
                   if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names})


def _scanned() -> list[Path]:
    files = [*PACKAGE.rglob("*.py"), *(REPO / "dags").rglob("*.py"), *(REPO / "plugins").rglob("*.py")]
    return sorted(f for f in files if f not in OWNERS and "__pycache__" not in f.parts)


def test_the_check_finds_a_phase_name_and_nothing_else():
    src = 'a = "extract"\nif phase == "generate":\n    pass\nb = "extraction"\nc = EXTRACT\nd = f"{x} generate"\n'
    assert phase_name_literals(src) == [1, 2]


def test_no_phase_name_literal_outside_the_descriptors():
    scanned = _scanned()
    rel = {f.relative_to(REPO).as_posix() for f in scanned}
    # the layers issue 48 names, all scanned
    assert {"dags/eagle3_pipeline.py", "include/eagleflow/airflow/shard_operators.py",
            "include/eagleflow/watchdog/recovery.py", "include/eagleflow/protocol.py",
            "include/eagleflow/phases/generate/lifecycle.py", "include/eagleflow/phases/extract/commands.py",
            "include/eagleflow/phases/shared/commands.py", "include/eagleflow/engines/hf/server.py",
            "include/eagleflow/capture/verify.py", "include/eagleflow/serving/launch.py"} <= rel
    assert len(OWNERS) == len(KINDS) and all(f.is_file() for f in OWNERS), OWNERS
    found = {f.relative_to(REPO).as_posix(): lines for f in scanned
             if (lines := phase_name_literals(f.read_text(), str(f)))}
    assert found == {}, ("phase names written as strings (use the descriptor: phases.KINDS / EXTRACT / GENERATE, "
                         f"a ShardKind field or its lifecycle): {found}")


# the one module of a phase's package others still read: the manifest format both phases write (capture's)
SHARED_FORMATS = {"eagleflow.capture.manifest"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_watchdog_and_the_operators_reach_a_phase_through_its_descriptor():
    """A phase's server and workers are its descriptor's ``lifecycle()`` (``lifecycle_ref``): the watchdog, the
    operators, the fleet and the DAGs import no phase package (imports inside functions counted)."""
    packages = {kind.lifecycle_ref.split(":")[0].rsplit(".", 1)[0] for kind in KINDS.values()}
    assert packages == {"eagleflow.phases.extract", "eagleflow.phases.generate"}
    layers = [PACKAGE / "watchdog", PACKAGE / "airflow", PACKAGE / "fleet", REPO / "dags", REPO / "plugins"]
    found = {}
    for f in sorted(p for layer in layers for p in layer.rglob("*.py")):
        bad = sorted(m for m in _imports(f) if any(m == p or m.startswith(p + ".") for p in packages)
                     and not any(m == s or m.startswith(s + ".") for s in SHARED_FORMATS))
        if bad:
            found[f.relative_to(REPO).as_posix()] = bad
    assert found == {}, f"a phase's package imported past its descriptor: {found}"
    for kind in KINDS.values():   # and each descriptor names a lifecycle that is there
        assert kind.lifecycle().start_worker is not None
