"""The ``sglang`` engine: SGLang 0.5.23 (``requirements-node.txt``), a GPU node's.

- ``launcher.py``: its version check and the capture server (``launch_server`` with our capture hook) and the
  generation server (serving mode); ``plugin.py``: the capture hook, an sglang plugin (entry point
  ``sglang.srt.plugins``) that dumps every prefill's hidden states;
- ``evaluator.py``: the evaluation (the target served with the draft, SGLang's own acceptance counters; trees);
- ``layers.py``: how SGLang numbers the capture layers (the launcher's flag and the export's ``eagle_config``);
- ``serve.py``: the command that serves an exported draft (the ``sglang`` export format: the export folder);
  ``export.py``: that format's writer (``eagleflow export``).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from eagleflow.engines.contract import Engine

from .layers import sglang_aux_layer_ids
from .serve import serve_command

if TYPE_CHECKING:
    from eagleflow.config import PipelineConfig
    from eagleflow.layout import RunLayout
    from eagleflow.train.export import DraftSource

# Each role imports its module when called: the servers and the evaluation import the config, which reads the
# registry that lists this package (and the plugin, sglang itself).


def serve_capture(cfg: PipelineConfig, layout: RunLayout) -> int:
    from .launcher import launch   # lazy: a circle: it imports the config, which reads this registry
    return launch(cfg, layout)


def serve_generation(cfg: PipelineConfig, layout: RunLayout) -> int:
    from .launcher import launch_generate   # lazy: a circle: it imports the config, which reads this registry
    return launch_generate(cfg, layout)


def evaluate(cfg: PipelineConfig, layout: RunLayout, *, target_dir: str, drafts: dict[str, Path],
             prompt_sets: dict[str, list[dict]], log: Callable[[str], None], node: Any = None,
             command: Any = None) -> tuple[list[dict], dict]:
    from .evaluator import results   # lazy: a circle: the config (which reads this registry)
    return results(cfg, layout, target_dir=target_dir, drafts=drafts, prompt_sets=prompt_sets, log=log,
                   node=node, command=command)


def write_draft(src: DraftSource) -> Callable[[Path], None]:
    from .export import writer   # lazy: torch, safetensors: only when exporting
    return writer(src)


def draft_layer_ids(conf: Any) -> Any:
    from .export import layer_ids   # lazy: torch (beside its writer)
    return layer_ids(conf)


ENGINE = Engine(name="sglang", label="SGLang", needs_gpu=True,
                capture_server=serve_capture, generate_server=serve_generation,
                evaluator=evaluate, eval_hooks=frozenset({"node", "command"}), eval_trees=True,
                eval_server_per_config=True, layer_numbering=sglang_aux_layer_ids, serve_command=serve_command,
                draft_format="sglang", draft_dir="", draft_writer=write_draft, draft_layer_ids=draft_layer_ids)
