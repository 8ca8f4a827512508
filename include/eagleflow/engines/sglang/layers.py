"""How SGLang numbers the EAGLE-3 capture layers: the ids each sglang model family wants for eagleflow's layer
outputs (``eagleflow.serving.aux_layers``).

sglang (read from the 0.5.23 wheel, ``sglang/srt/...``) captures the residual
stream ENTERING decoder layer ``c`` for every ``c`` in the model's
``layers_to_capture`` (llama.py:485-494 ``capture_output`` on ``attn_boundary.prepare``,
deepseek_v2.py:3175-3196 ``captured_last_layer_outputs`` -> ``capture_gathered``;
layers/layer_boundary/stage.py:407-476 captures ``stream.residual``, the
embedding for ``c = 0``), appending in layer order. So layer output ``j`` is
``c = j + 1``. Each model's ``set_eagle3_layers_to_capture(ids)`` turns the ids
it is given into ``layers_to_capture`` by its own rule:

- ``plus_one`` (llama.py:929-941, qwen2.py:781-794, qwen3.py:778-791,
  qwen2_moe.py:1418-1433, qwen3_moe.py:1128-1143, glm4_moe.py): ``[i + 1 for i in ids]``.
- ``plus_one_if_first_is_one`` (deepseek_v2.py:3458-3473, serving DeepSeek-V2/V3/V3.2,
  Kimi-K2 (``DeepseekV3ForCausalLM``), Kimi-K2.5 (kimi_k25.py:693 and 928-939
  delegate to a ``DeepseekV3ForCausalLM``), Mistral-Large-3, GLM-MoE-DSA;
  glm4_moe_lite.py has the same rule): ``+1`` only when ``ids[0] == 1``, else ``ids`` as given.
- ``plus_one_unless_max_is_n`` (gpt_oss.py:1337-1352): ``ids`` as given when
  ``max(ids) == num_layers``, else ``+1``.

Both ways sglang gets the ids go through that one method
(model_runner_components/attention_backend_setup.py:44-61): the capture-only
server's ``--return-aux-hidden-state-layer-ids`` (spec_aux_hidden_state.py:99-106)
and a served draft's ``eagle_config.eagle_aux_hidden_state_layer_ids``
(spec_aux_hidden_state.py:187-196). So the launcher's flag and the export's
``eagle_config`` carry the same list: :func:`sglang_aux_layer_ids`.
"""
from __future__ import annotations

from typing import Callable, Sequence

from eagleflow.serving.aux_layers import resolve_aux_layers

PLUS_ONE = "plus_one"
PLUS_ONE_IF_FIRST_IS_ONE = "plus_one_if_first_is_one"
PLUS_ONE_UNLESS_MAX_IS_N = "plus_one_unless_max_is_n"

# Architecture (config.json "architectures", which is also sglang's model class name) -> the rule
# its set_eagle3_layers_to_capture applies in sglang 0.5.23 (file:line in the module docstring).
SGLANG_AUX_ID_RULES: dict[str, str] = {
    # llama.py (and subclasses that do not override the method: mistral.py:33, ministral3.py:162, llama.py:956-964)
    "LlamaForCausalLM": PLUS_ONE, "MistralForCausalLM": PLUS_ONE, "Ministral3ForCausalLM": PLUS_ONE,
    "Phi3ForCausalLM": PLUS_ONE, "InternLM3ForCausalLM": PLUS_ONE,
    "Qwen2ForCausalLM": PLUS_ONE, "Qwen3ForCausalLM": PLUS_ONE,
    "Qwen2MoeForCausalLM": PLUS_ONE, "Qwen3MoeForCausalLM": PLUS_ONE,
    "Glm4MoeForCausalLM": PLUS_ONE,
    # deepseek_v2.py:3595 EntryClass, and classes built on it
    "DeepseekV2ForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE, "DeepseekV3ForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,
    "DeepseekV32ForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE, "KimiK25ForConditionalGeneration": PLUS_ONE_IF_FIRST_IS_ONE,
    "MistralLarge3ForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE, "GlmMoeDsaForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,
    "Glm4MoeLiteForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,
    "GptOssForCausalLM": PLUS_ONE_UNLESS_MAX_IS_N,
}

_RULES: dict[str, Callable[[list[int], int], list[int]]] = {
    PLUS_ONE: lambda ids, n: [i + 1 for i in ids],
    PLUS_ONE_IF_FIRST_IS_ONE: lambda ids, n: [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids),
    PLUS_ONE_UNLESS_MAX_IS_N: lambda ids, n: list(ids) if ids and max(ids) == n else [i + 1 for i in ids],
}


def sglang_aux_id_rule(architectures: Sequence[str]) -> str:
    """The rule the target's sglang model class applies to EAGLE-3 layer ids (see the module docstring)."""
    archs = [architectures] if isinstance(architectures, str) else list(architectures)
    for arch in archs:
        if arch in SGLANG_AUX_ID_RULES:
            return SGLANG_AUX_ID_RULES[arch]
    raise ValueError(f"target architectures {archs}: eagleflow does not know how sglang numbers this model's "
                     "EAGLE-3 capture layers (its set_eagle3_layers_to_capture differs per model family), so it "
                     "cannot name the layers without risking capturing others. Known: "
                     f"{', '.join(sorted(SGLANG_AUX_ID_RULES))}. Read that method in sglang/srt/models/ and add the "
                     "architecture to eagleflow.engines.sglang.layers.SGLANG_AUX_ID_RULES")


def sglang_layers_to_capture(ids: Sequence[int], architectures: Sequence[str], num_layers: int) -> list[int]:
    """``layers_to_capture`` (inputs of these layers) that sglang derives from ``ids`` for this target."""
    return _RULES[sglang_aux_id_rule(architectures)](list(ids), num_layers)


def sglang_aux_layer_ids(layer_outputs: Sequence[int] | None, architectures: Sequence[str], num_layers: int) -> list[int]:
    """The ids to give sglang so that it captures the outputs of ``layer_outputs`` (0-based, increasing).

    One list for both places sglang reads them: ``--return-aux-hidden-state-layer-ids``
    of the capture server and ``eagle_config.eagle_aux_hidden_state_layer_ids`` of the
    exported draft.
    """
    outputs = resolve_aux_layers(layer_outputs, num_layers)
    rule = sglang_aux_id_rule(architectures)
    if rule in (PLUS_ONE, PLUS_ONE_UNLESS_MAX_IS_N):
        ids = list(outputs)   # gpt-oss: max(outputs) <= N-2 never equals N, so it adds 1 too
    elif outputs[0] == 1:
        ids = list(outputs)   # DeepSeek adds 1 to all when the first id is 1
    else:
        ids = [j + 1 for j in outputs]   # otherwise it takes them as layer inputs
        if ids[0] == 1:
            # The output of layer 0 would be read as "first id is 1" and shifted again. sglang only
            # looks at ids[0] and captures in layer order, so put that id last.
            if len(ids) == 1:
                raise ValueError(f"capture.aux_layers {outputs}: sglang's DeepSeek family cannot capture only the "
                                 "output of layer 0 (an id list [1] is shifted to layer 1's output); add a layer")
            ids = ids[1:] + ids[:1]
    captured = sorted(sglang_layers_to_capture(ids, architectures, num_layers))
    if captured != [j + 1 for j in outputs]:   # the rule tables above disagree with this function
        raise AssertionError(f"sglang ids {ids} for {list(architectures)} capture layer inputs {captured}, "
                             f"not the outputs of {outputs}")
    return ids


def layer_outputs_from_sglang_ids(ids: Sequence[int], architectures: Sequence[str], num_layers: int) -> list[int]:
    """The 0-based layer outputs sglang captures when given ``ids`` (the inverse of :func:`sglang_aux_layer_ids`)."""
    return [c - 1 for c in sorted(sglang_layers_to_capture(ids, architectures, num_layers))]
