"""No import circles between the package's modules, lazy imports included (issue 39, "layers you can see").

A function-local import is still an arrow: ``a`` importing ``b`` inside a function while ``b`` imports ``a``
is a circle that only hides until someone moves the import up. The graph is read from the source (``ast``):
``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``; a package's
``__init__`` re-exporting its own submodules is not a circle (Python runs it first either way).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "include" / "eagleflow"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line}, every import (module level or not), relative ones resolved."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, path in modules.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        edges = graph.setdefault(mod, {})
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                target = known(t) if t.split(".")[0] == root.name else None
                if target is None or target == mod or mod.startswith(target + "."):
                    continue   # outside the package, itself, or its own package's __init__
                edges.setdefault(target, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(graph, comp: list[str]) -> str:
    members = set(comp)
    arrows = [f"{a} -> {b} (line {line})" for a in comp for b, line in sorted(graph[a].items()) if b in members]
    return "{" + ", ".join(comp) + "}: " + "; ".join(arrows)


def test_the_package_has_no_import_circles():
    graph = import_graph(PKG)
    found = circles(graph)
    assert not found, ("import circles (lazy imports count; move the shared piece down a layer): "
                       + " | ".join(_describe(graph, c) for c in found))


def test_the_circle_check_sees_lazy_relative_and_from_package_imports(tmp_path):
    # the check passing means nothing if it cannot see the circles it guards against
    root = tmp_path / "eagleflow"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("from .x import f\n")       # a package re-exporting: no circle
    (root / "a" / "x.py").write_text("def f():\n    from ..b import y\n")   # lazy and relative
    (root / "b" / "__init__.py").write_text("")
    (root / "b" / "y.py").write_text("from eagleflow.a import x\n")        # `from package import module`
    (root / "b" / "z.py").write_text("from eagleflow.a import f\n")        # a name, not a module: eagleflow.a
    graph = import_graph(root)
    assert graph["eagleflow.b.y"] == {"eagleflow.a.x": 1}
    assert graph["eagleflow.b.z"] == {"eagleflow.a": 1}
    assert circles(graph) == [["eagleflow.a.x", "eagleflow.b.y"]]
    with pytest.raises(AssertionError):
        assert not circles(graph)
