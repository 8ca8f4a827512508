"""Our exported draft, loaded by sglang 0.5.23's own LlamaForCausalLMEagle3 (built on the CPU).

sglang's loader drops names it does not know without a word (a wrong name serves
random weights), so every tensor we export must land in a parameter of sglang's
model, every parameter must be filled from our tensors, and the values must be
ours after its stacking of q/k/v and gate/up.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.train_hidden_states import NOT_DEFAULT_AUX_LAYERS

# the draft is trained on these outputs of the 8-layer target: sglang ids [2, 5, 6] (Llama adds 1: it captures
# layers [3, 6, 7]), where its default captures [2, N // 2, N - 3] = [2, 4, 5]
AUX = NOT_DEFAULT_AUX_LAYERS


def _target(d):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _export(tmp_path, target):
    from eagleflow.train.checkpoint import save_checkpoint
    from eagleflow.train.export import export_draft
    from eagleflow.train.loss import load_target_head_and_embedding
    from eagleflow.train.model import DraftConfig
    from eagleflow.train.trainer import build_draft
    from eagleflow.train.vocab import build_draft_vocab
    dcfg = DraftConfig.from_target(target, 64)
    vocab = build_draft_vocab(torch.randint(0, 50, (256,)), 64, log=lambda *_: None)
    head, embed = load_target_head_and_embedding(target)
    model = build_draft(dcfg, vocab, head, embed, seed=1)
    with torch.no_grad():   # norms away from 1.0, so a norm loaded into the wrong slot shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ckpt = save_checkpoint(tmp_path / "ckpt", 1, model.trainable_state_dict(), opt,
                           {"draft_config": dcfg.to_json(), "aux_layers": AUX, "target_model": str(target),
                            "metrics": {}})
    return export_draft(ckpt, tmp_path / "export", dtype="float32")


def test_export_loads_into_sglangs_eagle3_draft(tmp_path, sglang_world):
    from safetensors.torch import load_file
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    target = _target(tmp_path / "target")
    out = _export(tmp_path, target)
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    hf_conf = LlamaConfig.from_pretrained(out)
    assert hf_conf.draft_vocab_size == 64
    model = LlamaForCausalLMEagle3(hf_conf).to(torch.float32)
    params = dict(model.named_parameters())
    # every parameter starts as NaN: one our export does not fill stays NaN
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    ours = load_file(str(out / "model.safetensors"))

    used: set[str] = set()
    original = {n: p.weight_loader if hasattr(p, "weight_loader") else None for n, p in params.items()}
    for name, p in params.items():
        loader = original[name]
        if loader is None:
            continue

        def tracking(param, loaded, *shard, _n=name, _loader=loader):
            used.add(_n)
            return _loader(param, loaded, *shard)
        p.weight_loader = tracking
    model.load_weights(list(ours.items()))

    embed = "model.embed_tokens.weight"   # replaced by the target's own at serve time
    unfilled = [n for n, p in params.items() if n != embed and torch.isnan(p).any()]
    assert not unfilled, f"sglang's draft has parameters our export does not fill: {unfilled}"
    assert set(params) - {embed} <= used | {n for n in params if original[n] is None}
    # the values are ours after sglang's stacking
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    want_qkv = torch.cat([ours[f"midlayer.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(qkv, want_qkv)
    gate_up = params["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up, torch.cat([ours["midlayer.mlp.gate_proj.weight"], ours["midlayer.mlp.up_proj.weight"]]))
    for sg, mine in (("model.fc.weight", "fc.weight"), ("model.norm.weight", "norm.weight"),
                     ("model.layers.0.hidden_norm.weight", "midlayer.hidden_norm.weight"),
                     ("model.layers.0.input_layernorm.weight", "midlayer.input_layernorm.weight"),
                     ("model.layers.0.post_attention_layernorm.weight", "midlayer.post_attention_layernorm.weight"),
                     ("model.layers.0.self_attn.o_proj.weight", "midlayer.self_attn.o_proj.weight"),
                     ("model.layers.0.mlp.down_proj.weight", "midlayer.mlp.down_proj.weight"),
                     ("lm_head.weight", "lm_head.weight")):
        assert torch.equal(params[sg][:ours[mine].shape[0]], ours[mine]), sg
    # d2t became sglang's hot-token map: the draft's target ids
    hot = model.get_hot_token_id()
    assert torch.equal(hot, ours["t2d"].nonzero().flatten())


def test_config_carries_the_legacy_rope_fields(tmp_path):
    from eagleflow.train.export import export_draft  # noqa: F401  (import proves the module loads here)
    target = _target(tmp_path / "target")
    out = _export(tmp_path, target)
    conf = json.loads((out / "config.json").read_text())
    tconf = json.loads((target / "config.json").read_text())
    assert conf["max_position_embeddings"] == tconf["max_position_embeddings"]
    assert conf["rope_theta"] == 10000.0, "older sglang servers read rope_theta, not rope_parameters"
    assert "rope_scaling" in conf
