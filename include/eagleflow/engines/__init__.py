"""The serving engines: one folder each (``engines/hf``, ``engines/sglang``, ``engines/vllm``), the one place that
knows what each can do.

Every choice of engine asks this registry: the capture server (``capture.backend``), the generation server
(``generate.backend``, default ``capture.backend``), the evaluation (``eval.backend``), the config's GPU-node
checks, the export formats (``train.export_formats``: each serving engine's ``draft_format``), the layer
numbering the export writes, and the serve command the run report prints. No other module branches on an
engine's name (tests/unit/test_engines.py reads every module for such a branch).

Each engine is a package ``eagleflow.engines.<name>`` whose ``ENGINE`` is an ``Engine``
(``eagleflow.engines.contract``): its roles are typed callables that import the engine's heavy parts (torch,
transformers, sglang, vLLM) when called. The registry loads those packages by module name (``ENGINE_MODULES``):
they sit above the config, which reads this registry, so a static import here would be an import circle. This
module and the engines' ``__init__`` import no third-party library and not the config (only the standard library
and the engines' light parts: their layer numbering and serve command), so the control plane, the config and the
DAG files can read the registry in a plain venv (a test loads it and looks).

A new engine is a folder ``engines/<name>/`` with its ``ENGINE`` plus its line in ``ENGINE_MODULES``
(docs/engines.md lists the files).
"""
from __future__ import annotations

import importlib
from typing import Iterable

from .contract import (ROLE_FIELDS, ROLES, Engine, EngineError, EngineUnsupported, PipelineConfig, RunLayout,
                       UnknownEngine)

__all__ = ["ENGINES", "ENGINE_MODULES", "ROLES", "ROLE_FIELDS", "Engine", "EngineError", "EngineUnsupported",
           "PipelineConfig", "RunLayout", "UnknownEngine", "engine", "engine_for", "engine_serving_format",
           "eval_engine", "export_formats", "format_dirs", "generation_backend", "generation_engine",
           "load_engines", "names_for", "serving_engines"]

# The engines' packages, in registration order (the order of every list of choices).
ENGINE_MODULES: tuple[str, ...] = ("eagleflow.engines.hf", "eagleflow.engines.sglang", "eagleflow.engines.vllm")


def load_engines(modules: Iterable[str]) -> dict[str, Engine]:
    """name -> the ``ENGINE`` of each module; a module without an ``Engine`` there, or a name twice, is refused."""
    found: dict[str, Engine] = {}
    for module in modules:
        eng = getattr(importlib.import_module(module), "ENGINE", None)
        if not isinstance(eng, Engine):
            raise TypeError(f"{module}.ENGINE is {type(eng).__name__}, not an eagleflow.engines.Engine")
        if eng.name in found:
            raise ValueError(f"{module}.ENGINE is named {eng.name!r}, like an engine registered before it")
        found[eng.name] = eng
    return found


ENGINES: dict[str, Engine] = load_engines(ENGINE_MODULES)


def engine(name: str, field: str = "backend") -> Engine:
    """The registered engine ``name``; an unknown one is refused naming ``field``, the value and the engines."""
    try:
        return ENGINES[name]
    except (KeyError, TypeError):
        raise UnknownEngine(f"{field} = {name!r} is no engine eagleflow knows; registered: {', '.join(ENGINES)} "
                            "(eagleflow.engines.ENGINES)") from None


def engine_for(name: str, role: str, field: str | None = None) -> Engine:
    """``engine(name)`` that can fill ``role`` (a field of Engine: capture_server, generate_server, evaluator)."""
    field = field or ROLE_FIELDS.get(role, "backend")
    eng = engine(name, field)
    if getattr(eng, role) is None:
        raise EngineUnsupported(f"{field} = {name!r}: {eng.unsupported(role)}")
    return eng


def names_for(role: str) -> list[str]:
    """The engines that can fill ``role``, in registration order (the CLI's and the DAG Param's choices)."""
    return [n for n, e in ENGINES.items() if getattr(e, role) is not None]


def generation_backend(cfg: PipelineConfig) -> tuple[str, str]:
    """(engine name, the field it came from): ``generate.backend``, else ``capture.backend``."""
    if cfg.generate.backend is not None:
        return cfg.generate.backend, "generate.backend"
    return cfg.capture.backend, "capture.backend (generate.backend unset)"


def generation_engine(cfg: PipelineConfig) -> Engine:
    name, field = generation_backend(cfg)
    return engine_for(name, "generate_server", field)


def eval_engine(cfg: PipelineConfig) -> Engine:
    return engine_for(cfg.eval.backend, "evaluator")


def serving_engines() -> list[Engine]:
    """The engines that serve an exported draft, each with its format and serve command (the run report)."""
    return [e for e in ENGINES.values() if e.serve_command is not None and e.draft_format is not None]


def engine_serving_format(fmt: str) -> Engine:
    """The engine that serves the export format ``fmt`` (its layer numbering goes into that format's config)."""
    for e in serving_engines():
        if e.draft_format == fmt:
            return e
    raise UnknownEngine(f"export format {fmt!r} is served by no registered engine; formats served: "
                        f"{', '.join(export_formats())}")


def export_formats() -> list[str]:
    """The draft formats ``eagleflow export`` can write: each serving engine's, in registration order, once."""
    return list(format_dirs())


def format_dirs() -> dict[str, str]:
    """Each export format's folder inside the export ("" = the export folder itself)."""
    dirs: dict[str, str] = {}
    for e in serving_engines():
        dirs.setdefault(str(e.draft_format), e.draft_dir)
    return dirs
