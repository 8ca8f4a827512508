"""Which target layers EAGLE-3 captures, in eagleflow's own numbering (every engine's server reads them).

eagleflow's own convention, everywhere (``capture.aux_layers``, the dumps' and
stored samples' ``aux_layers`` metadata, training): the 0-based index ``j`` of a
decoder layer whose OUTPUT is captured, i.e. transformers'
``hidden_states[j + 1]`` (``hidden_states[0]`` is the embedding output). The
captured states are concatenated in increasing layer order.

The ``hf`` capture twin needs no mapping: it reads ``hidden_states[j + 1]``.

Each engine numbers these layers its own way: ``eagleflow.engines.<name>.layers`` (its ``ENGINE.layer_numbering``).
"""
from __future__ import annotations

from typing import Sequence


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default: outputs of layers 1, N/2-1 and N-4 (0-based) of an N-layer target.

    The same layers as sglang's own default ``layers_to_capture = [2, N // 2, N - 3]``
    (layer inputs, llama.py:936, deepseek_v2.py:3465).
    """
    if num_layers < 5:
        raise ValueError(f"the target has {num_layers} layers; EAGLE-3's default capture layers need at least 5 "
                         "(set capture.aux_layers explicitly)")
    return [1, num_layers // 2 - 1, num_layers - 4]


def resolve_aux_layers(configured: Sequence[int] | None, num_layers: int) -> list[int]:
    """The capture layers to use: the config's, checked against the model, or the default."""
    layers = list(configured) if configured else default_aux_layers(num_layers)
    # The output of the last layer is only available after the final norm; a capture
    # layer must be a residual-stream state before it (sglang captures the input of layer j+1).
    bad = [x for x in layers if not 0 <= x <= num_layers - 2]
    if bad:
        raise ValueError(f"capture.aux_layers {layers}: layer(s) {bad} are outside 0..{num_layers - 2} "
                         f"for a target with {num_layers} layers; use the 0-based index of a layer whose output "
                         "feeds another layer")
    # sglang concatenates captured layers in layer order whatever order it is given: so must we.
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise ValueError(f"capture.aux_layers {layers} must be strictly increasing (sglang concatenates the "
                         f"captured layers in layer order); use {sorted(set(layers))}")
    return layers


def target_architectures_and_layers(config: dict) -> tuple[list[str], int]:
    """(architectures, decoder layers) from a target's config.json (multimodal ones nest ``text_config``)."""
    archs = config.get("architectures") or []
    text = config.get("text_config") or config
    if "num_hidden_layers" not in text:
        raise ValueError(f"target config (architectures {archs}) has no num_hidden_layers")
    return list(archs), int(text["num_hidden_layers"])
