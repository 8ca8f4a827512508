"""The ``vllm`` engine: vLLM 0.33.0 (``requirements-node-vllm.txt``), a GPU node's. It serves the exported draft
(the speculators format), captures (``vllm serve`` with its extract_hidden_states method and our KV connector),
generates (``vllm serve`` in serving mode) and evaluates (``vllm serve`` with the draft, acceptance from its own
spec-decode counters; vLLM's EAGLE-3 drafts chains only, so ``eval_trees`` stays false and the config refuses a
top-k > 1 configuration by name).

- ``launcher.py``: its version check and the capture server; ``connector.py``: the KV connector that dumps the
  captured states; ``api.py``: the capture and generation API (a ``--middleware`` on vLLM's server);
- ``generate_server.py``: the generation server; ``evaluator.py``: the evaluation;
- ``layers.py``: how vLLM numbers the capture layers (the launcher's ids and the speculators ``config.json``);
- ``serve.py``: the command that serves an exported draft (the ``speculators`` format, its ``speculators/``);
  ``export.py``: that format's writer (``eagleflow export``).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from eagleflow.engines.contract import Engine

from .layers import vllm_aux_layer_ids

# the speculators format's folder inside the export
SPECULATORS_DIR = "speculators"

if TYPE_CHECKING:
    from eagleflow.config import PipelineConfig
    from eagleflow.layout import RunLayout
    from eagleflow.train.export import DraftSource

# Each role imports its module when called: the servers and the evaluation import the config, which reads the
# registry that lists this package (and the connector, vLLM itself).


def serve_capture(cfg: PipelineConfig, layout: RunLayout) -> int:
    from .launcher import launch   # lazy: a circle: it imports the config, which reads this registry
    return launch(cfg, layout)


def serve_generation(cfg: PipelineConfig, layout: RunLayout) -> int:
    from .generate_server import launch_generate   # lazy: a circle: it imports the config, which reads this registry
    return launch_generate(cfg, layout)


def evaluate(cfg: PipelineConfig, layout: RunLayout, *, target_dir: str, drafts: dict[str, Path],
             prompt_sets: dict[str, list[dict]], log: Callable[[str], None], node: Any = None,
             command: Any = None) -> tuple[list[dict], dict]:
    from .evaluator import results   # lazy: a circle: the config (which reads this registry)
    return results(cfg, layout, target_dir=target_dir, drafts=drafts, prompt_sets=prompt_sets, log=log,
                   node=node, command=command)


def serve_command(cfg: PipelineConfig, draft_dir: str) -> str:
    from .serve import vllm_serve_command   # lazy: a circle: train.export_formats reads this registry
    return vllm_serve_command(cfg, draft_dir)


def write_draft(src: DraftSource) -> Callable[[Path], None]:
    from .export import writer   # lazy: torch, safetensors: only when exporting
    return writer(src)


def draft_layer_ids(conf: Any) -> Any:
    from .export import layer_ids   # lazy: torch (beside its writer)
    return layer_ids(conf)


ENGINE = Engine(name="vllm", label="vLLM", needs_gpu=True,
                capture_server=serve_capture, generate_server=serve_generation,
                evaluator=evaluate, eval_hooks=frozenset({"node", "command"}), eval_server_per_config=True,
                layer_numbering=vllm_aux_layer_ids, serve_command=serve_command,
                draft_format="speculators", draft_dir=SPECULATORS_DIR, draft_writer=write_draft,
                draft_layer_ids=draft_layer_ids)
