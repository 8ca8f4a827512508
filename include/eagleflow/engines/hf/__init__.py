"""The ``hf`` engine: our own transformers server (CPU or GPU) for capture and generation, and our own
speculative decoder for the evaluation. It serves no exported draft (no layer numbering, no serve command):
transformers' ``hidden_states[j + 1]`` is eagleflow's layer output ``j``.

- ``server.py``: the capture and generation server (``eagleflow capture serve`` / ``generate serve``).
- ``evaluator.py``: the evaluation, our own speculative decoder (``eagleflow.evaluate.decoder``) in process; it
  reads the SGLang-format files of the export (``eval_format``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from eagleflow.engines.contract import Engine

if TYPE_CHECKING:
    from eagleflow.config import PipelineConfig
    from eagleflow.layout import RunLayout

# Each role imports its module when called: they load torch and transformers, and they import the config,
# which reads the registry that lists this package.


def serve_capture(cfg: PipelineConfig, layout: RunLayout) -> int:
    from .server import serve_capture as serve   # lazy: torch, transformers: only on the node that serves
    return serve(cfg, layout)


def serve_generation(cfg: PipelineConfig, layout: RunLayout) -> int:
    from .server import serve_generation as serve   # lazy: torch, transformers: only on the node that serves
    return serve(cfg, layout)


def evaluate(cfg: PipelineConfig, layout: RunLayout, *, target_dir: str, drafts: dict,
             prompt_sets: dict[str, list[dict]], log: Callable[[str], None],
             verify: Any = None) -> tuple[list[dict], dict]:
    from .evaluator import results   # lazy: torch (the decoder): only when evaluating
    return results(cfg, layout, target_dir=target_dir, drafts=drafts, prompt_sets=prompt_sets, log=log,
                      verify=verify)


ENGINE = Engine(name="hf", label="transformers", needs_gpu=False,
                capture_server=serve_capture, generate_server=serve_generation,
                evaluator=evaluate, eval_hooks=frozenset({"verify"}), eval_format="sglang")
