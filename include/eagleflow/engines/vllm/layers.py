"""How vLLM numbers the EAGLE-3 capture layers (eagleflow's layer outputs: ``eagleflow.serving.aux_layers``).

vLLM (read from the 0.33.0 wheel, ``vllm/model_executor/models/...``) has one rule for every
family and applies no shift: an id ``c`` is the residual stream ENTERING decoder layer ``c``
(``c = N``: the last layer's output before the final norm). ``EagleModelMixin._maybe_add_hidden_state``
(interfaces.py:1640-1650) is called with ``start_layer`` before the first layer and ``idx + 1``
after layer ``idx`` (llama.py:427-441, qwen2.py:424-432, qwen3_moe.py:505-513, gpt_oss.py:526-532);
deepseek_v2.py:1561-1587 (and ``vllm/models/deepseek_v32/nvidia/model.py:289``, DeepSeek-V3.2 and
GLM-MoE-DSA) append ``hidden_states + residual`` before layer ``idx`` when ``idx`` is listed, and after
the last one for ``end_layer``. ``set_aux_hidden_state_layers`` stores the ids
sorted (interfaces.py:1616-1617); the ids come from the draft's ``eagle_aux_hidden_state_layer_ids``
(v1/worker/gpu_model_runner.py:5180-5224), else vLLM's default ``(2, N // 2, N - 3)``
(interfaces.py:1751-1772). So layer output ``j`` is vLLM id ``j + 1``: :func:`vllm_aux_layer_ids`.
"""
from __future__ import annotations

from typing import Sequence

from eagleflow.serving.aux_layers import resolve_aux_layers

# Target architectures whose vLLM 0.33.0 model class implements SupportsEagle3 (so vLLM can feed an
# EAGLE-3 draft its aux hidden states) and numbers the ids as above; tests/node_vllm checks both against
# vLLM's own registry and classes. sglang families missing here (Qwen2Moe, Glm4Moe, Glm4MoeLite) have no
# EAGLE-3 support in vLLM 0.33.0.
VLLM_EAGLE3_ARCHITECTURES: frozenset[str] = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Ministral3ForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM",
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "MistralLarge3ForCausalLM", "GlmMoeDsaForCausalLM",
    "GptOssForCausalLM",
})


def vllm_aux_layer_ids(layer_outputs: Sequence[int] | None, architectures: Sequence[str], num_layers: int) -> list[int]:
    """``eagle_aux_hidden_state_layer_ids`` that make vLLM capture the outputs of ``layer_outputs``.

    Refuses (never guesses) a target whose vLLM numbering is not known: a wrong or missing list makes
    vLLM feed the draft other layers than it was trained on, silently.
    """
    outputs = resolve_aux_layers(layer_outputs, num_layers)
    archs = [architectures] if isinstance(architectures, str) else list(architectures)
    if not any(a in VLLM_EAGLE3_ARCHITECTURES for a in archs):
        raise ValueError(f"target architectures {archs}: eagleflow does not know that vLLM serves this model "
                         "with an EAGLE-3 draft (its model class must implement SupportsEagle3) or how it numbers "
                         "the capture layers, so it will not write eagle_aux_hidden_state_layer_ids for it. Known: "
                         f"{', '.join(sorted(VLLM_EAGLE3_ARCHITECTURES))}. Export the SGLang format only "
                         "(train.export_formats: [sglang], or `eagleflow export --format sglang`), or read the "
                         "model's forward in vllm/model_executor/models/ and add the architecture to "
                         "eagleflow.engines.vllm.layers.VLLM_EAGLE3_ARCHITECTURES")
    return [j + 1 for j in outputs]
