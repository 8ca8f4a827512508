"""What a serving engine is to eagleflow: the ``Engine`` each ``engines/<name>/`` package exports as ``ENGINE``.

Standard library only: the registry (``eagleflow.engines``) is read by the config and the DAG files in a
plain venv. Each role is a typed callable, so mypy checks every engine's ``ENGINE`` against it; an engine's
package imports its heavy parts (torch, transformers, sglang, vLLM) inside those callables, when called.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeAlias

# The config (eagleflow.config.PipelineConfig) and the run layout (eagleflow.layout.RunLayout) as this contract
# sees them: the config imports the registry to validate its engine fields, so the contract cannot import the
# config back, even for types (an import circle). Each engine's package annotates its callables with the real
# types (it imports them under TYPE_CHECKING; the registry loads the engines by module name), so mypy checks
# each engine's use of them there.
PipelineConfig: TypeAlias = Any
RunLayout: TypeAlias = Any

# (cfg, layout) -> exit code: a server in the foreground (capture: dumping hidden states; generation: sampling)
ServerFn: TypeAlias = Callable[[PipelineConfig, RunLayout], int]
# (cfg, layout, *, target_dir, drafts, prompt_sets, log, **hooks) -> (result rows, what describes the target)
EvaluatorFn: TypeAlias = Callable[..., "tuple[list[dict], dict]"]
# (layer_outputs, architectures, num_layers) -> the engine's ids for eagleflow's 0-based layer outputs
LayerNumberingFn: TypeAlias = Callable[[Sequence[int] | None, Sequence[str], int], "list[int]"]
# (cfg, draft_dir) -> the shell command that serves the target with the exported draft
ServeCommandFn: TypeAlias = Callable[[PipelineConfig, str], str]
# The draft being exported (eagleflow.train.export.DraftSource: checkpoint, config, weights, dtype, target) as this
# contract sees it (it imports torch; the registry is read without it).
DraftSource: TypeAlias = Any
# (draft source) -> the function that writes the engine's draft format into its folder; everything the format
# needs is read and checked before it returns, so a refusal leaves nothing written (`eagleflow export`)
DraftWriterFn: TypeAlias = Callable[[DraftSource], Callable[[Path], None]]
# (the format's config.json, as read) -> the eagle_aux_hidden_state_layer_ids it names, where the format keeps them
DraftLayerIdsFn: TypeAlias = Callable[[Any], Any]

# what each role of an engine is called in messages
ROLES = {"capture_server": "capture server", "generate_server": "generation server", "evaluator": "evaluation",
         "layer_numbering": "layer numbering", "serve_command": "serve command", "draft_writer": "export writer",
         "draft_layer_ids": "export layer ids reader"}
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
    """One serving engine. Each role is a callable, or None: not built in eagleflow."""
    name: str
    label: str                           # how people write it (SGLang, vLLM)
    needs_gpu: bool                      # its servers need a GPU node (node.has_gpu)
    capture_server: ServerFn | None = None
    generate_server: ServerFn | None = None
    evaluator: EvaluatorFn | None = None
    eval_hooks: frozenset[str] = field(default_factory=frozenset)   # test hooks its evaluator takes
    eval_trees: bool = False             # evaluates top-k > 1 (tree) configurations
    eval_server_per_config: bool = False  # loads the target once per configuration and draft (slow to start)
    layer_numbering: LayerNumberingFn | None = None
    serve_command: ServeCommandFn | None = None
    draft_format: str | None = None      # the export format it serves (`eagleflow export --format`)
    draft_dir: str = ""                  # that format's folder inside the export ("" = the export folder itself)
    draft_writer: DraftWriterFn | None = None        # writes draft_format (`eagleflow export`)
    draft_layer_ids: DraftLayerIdsFn | None = None   # the layer ids a draft_format config.json names
    eval_format: str | None = None       # the export format its evaluator reads (None: its draft_format)
    not_built: str = ""                  # what to say when asked for a role it lacks

    def unsupported(self, role: str, alternatives: Sequence[str] | None = None) -> EngineUnsupported:
        """The refusal of ``role``, naming the engines that fill it (default: the registry's)."""
        if alternatives is None:
            # lazy: a circle: the registry's package (eagleflow.engines) imports this module first
            from eagleflow.engines import names_for
            alternatives = names_for(role)
        return EngineUnsupported(f"{self.name} has no {ROLES[role]} in eagleflow yet"
                                 + (f"; {self.not_built}" if self.not_built else "")
                                 + f"; use {' or '.join(map(repr, alternatives))}")

    def function(self, role: str) -> Callable[..., Any]:
        """The callable that fills ``role``; EngineUnsupported when this engine has none."""
        fn = getattr(self, role)
        if fn is None:
            raise self.unsupported(role)
        return fn

    def serve_capture(self, cfg: PipelineConfig, layout: RunLayout) -> int:
        return self.function("capture_server")(cfg, layout)

    def serve_generation(self, cfg: PipelineConfig, layout: RunLayout) -> int:
        return self.function("generate_server")(cfg, layout)

    def evaluate(self, cfg: PipelineConfig, layout: RunLayout, **kw: Any) -> tuple[list[dict], dict]:
        return self.function("evaluator")(cfg, layout, **kw)

    def layer_ids(self, layer_outputs: Sequence[int] | None, architectures: Sequence[str],
                  num_layers: int) -> list[int]:
        return self.function("layer_numbering")(layer_outputs, architectures, num_layers)

    def serve_command_for(self, cfg: PipelineConfig, draft_dir: str) -> str:
        return self.function("serve_command")(cfg, draft_dir)

    def draft_writer_for(self, source: DraftSource) -> Callable[[Path], None]:
        return self.function("draft_writer")(source)

    def layer_ids_in(self, draft_config: Any) -> Any:
        return self.function("draft_layer_ids")(draft_config)
