"""The ``sglang`` export format, SGLang's own: the export folder itself (``eagleflow export``).

    sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 \
        --speculative-draft-model-path <draft_dir>/export

- ``config.json``: ``LlamaForCausalLMEagle3`` (``eagleflow.train.export.export_config``: the draft's dims, one
  hidden layer, the target's ``vocab_size`` and ``draft_vocab_size``, untied embeddings, the target's context
  length and rope settings), with ``eagle_config`` naming the capture layers the hidden states were recorded
  from, in the numbering the target's sglang model family reads (``layers.sglang_aux_layer_ids``: the same
  list the capture server was given, so serving captures the layers the draft was trained on).
- ``model.safetensors``: exactly the names ``LlamaForCausalLMEagle3.load_weights`` knows (it drops unknown names
  silently): ``eagleflow.train.export.SGLANG_WEIGHT_NAMES``, the checkpoint's own.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from eagleflow.train.export import DraftSource, export_config, layer_ids_for

from .layers import sglang_aux_layer_ids


def eagle_layer_ids(target_dir: str | Path, aux_layers: list[int]) -> list[int]:
    """``eagle_aux_hidden_state_layer_ids`` for the samples' layer outputs ``aux_layers`` on this target."""
    return layer_ids_for(sglang_aux_layer_ids, target_dir, aux_layers, "")


def writer(src: DraftSource) -> Callable[[Path], None]:
    """The SGLang format of ``src``: its layer ids are found (or refused) now, the files written by the result."""
    layer_ids = eagle_layer_ids(src.target_model, src.aux_layers)

    def write(folder: Path) -> None:
        from safetensors.torch import save_file
        save_file(src.weights, str(folder / "model.safetensors"), metadata=src.metadata)
        (folder / "config.json").write_text(json.dumps(export_config(src.dcfg, layer_ids, src.dtype), indent=2)
                                            + "\n")
    return write


def layer_ids(conf: Any) -> Any:
    """The ids an SGLang-format config.json names: under ``eagle_config``."""
    holder = conf.get("eagle_config") if isinstance(conf, dict) else None
    return holder.get("eagle_aux_hidden_state_layer_ids") if isinstance(holder, dict) else None
