"""The capture layer ids per target family, through sglang 0.5.23's own models (built on the CPU).

``eagleflow.engines.sglang.layers.sglang_aux_layer_ids`` turns "outputs of layers j"
into the ids given to sglang (the launcher's ``--return-aux-hidden-state-layer-ids``
and the export's ``eagle_config.eagle_aux_hidden_state_layer_ids``, both read by the
target's ``set_eagle3_layers_to_capture``). sglang captures the residual stream
entering each layer in ``layers_to_capture``, i.e. the output of the layer before.
Here sglang's real Llama, Qwen2, Qwen3 and DeepSeek-V3 (Kimi-K2's class) models
are built and given those ids: ``layers_to_capture`` must be exactly j + 1.
"""
from __future__ import annotations

import importlib

import pytest

from eagleflow.engines.sglang.layers import sglang_aux_layer_ids, sglang_layers_to_capture
from eagleflow.serving.aux_layers import default_aux_layers

N = 8
COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=N, num_attention_heads=4,
              max_position_embeddings=256)


def _config(family: str):
    from transformers import DeepseekV3Config, LlamaConfig, Qwen2Config, Qwen3Config
    if family == "LlamaForCausalLM":
        return "llama", LlamaConfig(num_key_value_heads=2, **COMMON)
    if family == "Qwen2ForCausalLM":
        return "qwen2", Qwen2Config(num_key_value_heads=2, **COMMON)
    if family == "Qwen3ForCausalLM":
        return "qwen3", Qwen3Config(num_key_value_heads=2, head_dim=8, **COMMON)
    # the fields of DeepSeek-V3's own config.json that sglang's deepseek_v2.py reads
    return "deepseek_v2", DeepseekV3Config(
        num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, moe_layer_freq=1,
        topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **COMMON)


FAMILIES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_sglang_captures_the_layers_we_name(sglang_world, arch):
    module, cfg = _config(arch)
    cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), arch)
    for outputs in ([1, 3, 4], [0, 3, 5], [2, 4, 6], [0, 1, 6], [3, 5]):
        model = cls(cfg)
        ids = sglang_aux_layer_ids(outputs, [arch], N)
        model.set_eagle3_layers_to_capture(ids)
        assert model.capture_aux_hidden_states
        got = list(model.model.layers_to_capture)
        assert sorted(got) == [j + 1 for j in outputs], (arch, outputs, ids, got)
        assert got == sglang_layers_to_capture(ids, [arch], N)   # our rule table = sglang's code
    model = cls(cfg)
    model.set_eagle3_layers_to_capture(None)                     # sglang's default = EAGLE-3's default
    assert list(model.model.layers_to_capture) == [j + 1 for j in default_aux_layers(N)]
