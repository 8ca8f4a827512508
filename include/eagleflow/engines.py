"""The serving engines, one registered ``Engine`` each: the one place that knows what hf, sglang and vllm can do.

Every choice of engine asks this registry: the capture server (``capture.backend``), the generation server
(``generate.backend``, default ``capture.backend``), the evaluation (``eval.backend``), the config's GPU-node
checks, the layer numbering the export writes, and the serve command the run report prints. No other module
branches on an engine's name.

The implementations are referenced as ``"module:function"`` strings and imported only when called: they pull
in torch, transformers or sglang, and they sit above this module (capture, generate, evaluate, console import
it), so a static import here would be an import circle. This module itself imports only the standard library,
so the control plane, the config and the DAG files can read it in a plain venv.

A new engine is an ``Engine`` in ``ENGINES`` plus the functions it names (docs/engines.md lists the files).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeAlias

# The config (eagleflow.config.PipelineConfig) and run layout are passed through untyped here: config imports
# this module to validate its engine fields, so importing it back, even for types, would be a circle.
PipelineConfig: TypeAlias = Any
RunLayout: TypeAlias = Any

# what each role of an engine is called in messages
ROLES = {"capture_server": "capture server", "generate_server": "generation server", "evaluator": "evaluation",
         "layer_numbering": "layer numbering", "serve_command": "serve command"}
# the config field that picks the engine of each server role
ROLE_FIELDS = {"capture_server": "capture.backend", "generate_server": "generate.backend",
               "evaluator": "eval.backend"}


class UnknownEngine(ValueError):
    """A name that is no registered engine; the message names the field, the value and the registered names."""


class EngineUnsupported(ValueError):
    """A registered engine asked for a role it has no implementation of in eagleflow (e.g. hf's serve command)."""


class EngineError(RuntimeError):
    """An engine could not do what it can do, here and now (not installed, wrong version, failed to load);
    the message says what to do."""


@dataclass(frozen=True)
class Engine:
    """One serving engine. Each reference is ``"module:function"`` (imported when called) or None: not built."""
    name: str
    label: str                           # how people write it (SGLang, vLLM)
    needs_gpu: bool                      # its servers need a GPU node (node.has_gpu)
    # (cfg, layout) -> exit code: the capture server in the foreground, dumping hidden states
    capture_server: str | None = None
    # (cfg, layout) -> exit code: the target in serving mode (sampling) in the foreground
    generate_server: str | None = None
    # (cfg, layout, *, target_dir, drafts, prompt_sets, log, **hooks) -> (result rows, what describes the target)
    evaluator: str | None = None
    eval_hooks: frozenset[str] = field(default_factory=frozenset)   # test hooks its evaluator takes
    eval_trees: bool = False             # evaluates top-k > 1 (tree) configurations
    eval_server_per_config: bool = False  # loads the target once per configuration and draft (slow to start)
    # (layer_outputs, architectures, num_layers) -> the engine's ids for eagleflow's 0-based layer outputs
    layer_numbering: str | None = None
    # (cfg, draft_dir) -> the shell command that serves the target with the exported draft
    serve_command: str | None = None
    draft_format: str | None = None      # the export format (train.export_formats) it serves
    not_built: str = ""                  # what to say when asked for a role it lacks

    def unsupported(self, role: str) -> EngineUnsupported:
        return EngineUnsupported(f"{self.name} has no {ROLES[role]} in eagleflow yet"
                                 + (f"; {self.not_built}" if self.not_built else "")
                                 + f"; use {' or '.join(map(repr, names_for(role)))}")

    def _function(self, role: str) -> Callable[..., Any]:
        ref = getattr(self, role)
        if ref is None:
            raise self.unsupported(role)
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)

    def serve_capture(self, cfg: PipelineConfig, layout: RunLayout) -> int:
        return self._function("capture_server")(cfg, layout)

    def serve_generation(self, cfg: PipelineConfig, layout: RunLayout) -> int:
        return self._function("generate_server")(cfg, layout)

    def evaluate(self, cfg: PipelineConfig, layout: RunLayout, **kw) -> tuple[list[dict], dict]:
        return self._function("evaluator")(cfg, layout, **kw)

    def layer_ids(self, layer_outputs: Sequence[int] | None, architectures: Sequence[str],
                  num_layers: int) -> list[int]:
        return self._function("layer_numbering")(layer_outputs, architectures, num_layers)

    def serve_command_for(self, cfg: PipelineConfig, draft_dir: str) -> str:
        return self._function("serve_command")(cfg, draft_dir)


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine(name="hf", label="transformers", needs_gpu=False,
           capture_server="eagleflow.capture.hf_server:serve_capture",
           generate_server="eagleflow.capture.hf_server:serve_generation",
           evaluator="eagleflow.evaluate.run:hf_results", eval_hooks=frozenset({"verify"})),
    Engine(name="sglang", label="SGLang", needs_gpu=True,
           capture_server="eagleflow.capture.sglang_launcher:launch",
           generate_server="eagleflow.capture.sglang_launcher:launch_generate",
           evaluator="eagleflow.evaluate.sglang_backend:results", eval_hooks=frozenset({"node", "command"}),
           eval_trees=True, eval_server_per_config=True,
           layer_numbering="eagleflow.capture.aux_layers:sglang_aux_layer_ids",
           serve_command="eagleflow.console.run_report:serve_command", draft_format="sglang"),
    # vLLM serves the exported draft (the speculators format), captures (`vllm serve` with its
    # extract_hidden_states method and our KV connector), generates (`vllm serve` in serving mode) and evaluates
    # (`vllm serve` with the draft, acceptance from its own spec-decode counters; vLLM's EAGLE-3 drafts chains
    # only, so eval_trees stays false and the config refuses a top-k > 1 configuration by name)
    Engine(name="vllm", label="vLLM", needs_gpu=True,
           capture_server="eagleflow.capture.vllm_launcher:launch",
           generate_server="eagleflow.generate.vllm_server:launch_generate",
           evaluator="eagleflow.evaluate.vllm_backend:results", eval_hooks=frozenset({"node", "command"}),
           eval_server_per_config=True,
           layer_numbering="eagleflow.capture.aux_layers:vllm_aux_layer_ids",
           serve_command="eagleflow.console.run_report:vllm_serve_command", draft_format="speculators"),
)}


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
                        f"{', '.join(str(e.draft_format) for e in serving_engines())}")
