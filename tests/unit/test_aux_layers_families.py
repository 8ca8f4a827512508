"""The seeds' target families: the hf twin, the sglang path and the export name the SAME layers.

Per family (Llama, Qwen2, Qwen3, DeepSeek-V3 as served by sglang's deepseek_v2.py, like
Kimi-K2/K2.5) a tiny random model is built from a transformers config and saved locally.
Then, through the real code:

1. the hf capture server stores a dump over HTTP; its aux rows must equal the outputs of
   the intended 0-based layers, taken by forward hooks on the model's decoder layers;
2. the dump becomes a stored sample, its ``aux_layers`` go into a checkpoint, and
   ``export_draft`` writes ``eagle_config.eagle_aux_hidden_state_layer_ids``;
3. those ids, put through sglang 0.5.23's own ``set_eagle3_layers_to_capture`` rule for
   the family (transcribed below with file and lines; the node tier runs the real
   methods), give ``layers_to_capture``; sglang captures the residual stream ENTERING
   those layers, emulated here with forward pre-hooks: the rows must equal the dump's;
4. the speculators export's ids (vLLM's numbering: the stream entering layer ``c``, no
   shift; tests/node_vllm runs vLLM's own models) hold the same rows.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from eagleflow.engines.sglang.layers import layer_outputs_from_sglang_ids, sglang_aux_layer_ids
from eagleflow.serving.aux_layers import default_aux_layers, resolve_aux_layers, target_architectures_and_layers
from eagleflow.serving.client import generate
from eagleflow.engines.hf.server import CaptureModel, CaptureServer
from eagleflow.serving.dump_protocol import read_dump, request_id
from eagleflow.capture.storage import SampleWriter
from eagleflow.train.checkpoint import save_checkpoint
from eagleflow.train.data import SampleRef, read_aux_layers
from eagleflow.train.export import export_draft
from eagleflow.train.model import DraftConfig, Eagle3Draft

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # builds four model families

N_LAYERS = 8
INPUT_IDS = [5, 17, 42, 3, 99, 64, 8, 21, 77]

# sglang 0.5.23 set_eagle3_layers_to_capture(ids) -> model.layers_to_capture, per family, as written there
# (an oracle independent of eagleflow.serving.aux_layers' table):
SGLANG_RULES = {
    # llama.py:929-941: "we plus 1 here because in sglang, for the ith layer, it takes the output of the (i-1)th"
    "LlamaForCausalLM": lambda ids: [v + 1 for v in ids],
    "Qwen2ForCausalLM": lambda ids: [v + 1 for v in ids],    # qwen2.py:781-794
    "Qwen3ForCausalLM": lambda ids: [v + 1 for v in ids],    # qwen3.py:778-791
    # deepseek_v2.py:3458-3473: "if layer_ids and layer_ids[0] == 1: +1, else: list(layer_ids)"
    "DeepseekV3ForCausalLM": lambda ids: [v + 1 for v in ids] if ids and ids[0] == 1 else list(ids),
}


def _config(family: str):
    from transformers import DeepseekV3Config, LlamaConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=N_LAYERS,
                  num_attention_heads=4, max_position_embeddings=256, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(num_key_value_heads=2, **common)
    if family == "qwen2":
        return Qwen2Config(num_key_value_heads=2, **common)
    if family == "qwen3":
        return Qwen3Config(num_key_value_heads=2, head_dim=8, **common)
    # DeepSeek-V3 (MLA + MoE after the first dense layer), the architecture of Kimi-K2
    return DeepseekV3Config(num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                            qk_nope_head_dim=8, v_head_dim=8, **common)


FAMILIES = ["llama", "qwen2", "qwen3", "deepseek_v3"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM
    out = {}
    for i, family in enumerate(FAMILIES):
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"target-{family}")
        model.save_pretrained(path)   # random weights, safetensors + config.json
        out[family] = path
    return out


def _captured_by_hooks(target: Path, ids: list[int], *, outputs_of: list[int] = (), inputs_of: list[int] = ()):
    """Decoder-layer outputs (forward hooks) or inputs (pre-hooks), concatenated in layer order."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    got: dict[int, torch.Tensor] = {}

    def out_hook(i):
        return lambda _m, _a, o: got.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].clone())

    def in_hook(i):
        return lambda _m, a, kw: got.__setitem__(i, (kw.get("hidden_states", a[0] if a else None))[0].clone())

    layers = model.model.layers
    handles = [layers[i].register_forward_hook(out_hook(i)) for i in outputs_of]
    handles += [layers[c].register_forward_pre_hook(in_hook(c), with_kwargs=True) for c in inputs_of]
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in handles:
        h.remove()
    return torch.cat([got[i] for i in sorted(got)], dim=-1)


def _capture_with_hf_twin(target: Path, aux: list[int] | None, dump_dir: Path):
    model = CaptureModel(str(target), aux_layers=aux, model_name=target.name)
    srv = CaptureServer(("127.0.0.1", 0), model, str(dump_dir))
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        rid = request_id("fam", 0, 0)
        generate(srv.url, INPUT_IDS, rid, timeout_s=60)
    finally:
        srv.shutdown()
        srv.server_close()
    return read_dump(dump_dir / f"{rid}.safetensors")


def _export_from_sample(target: Path, dump, work: Path) -> dict:
    """Stored sample -> its aux_layers -> a checkpoint's state -> export_draft -> config.json."""
    n = dump.input_ids.rows
    stored = SampleWriter(work / "shard_00000").write(
        index=0, sample_id="s0", input_ids=dump.input_ids, loss_mask=torch.ones(n, dtype=torch.uint8),
        aux_hidden_states=dump.aux_hidden_states, hidden_states=dump.hidden_states, aux_layers=dump.aux_layers,
        model=dump.model)
    aux_layers = read_aux_layers(SampleRef(shard=0, index=0, id="s0", path=str(stored.path), tokens=n,
                                           bytes=0, sha256=""))
    dcfg = DraftConfig.from_target(target, 64)
    draft = Eagle3Draft(dcfg)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    ckpt = save_checkpoint(work / "checkpoints", 1, draft.trainable_state_dict(), opt,
                           {"draft_config": dcfg.to_json(), "aux_layers": aux_layers, "target_model": str(target),
                            "metrics": {}})
    out = export_draft(ckpt, work / "export")
    return json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("aux", [None, [0, 3, 5], [2, 4, 6]], ids=["default", "with-layer-0", "first-not-1"])
def test_hf_twin_sglang_and_export_name_the_same_layers(targets, tmp_path, family, aux):
    target = targets[family]
    archs, n = target_architectures_and_layers(json.loads((target / "config.json").read_text()))
    intended = aux or default_aux_layers(n)          # 0-based layer outputs
    # 1. the hf twin stores exactly the outputs of the intended layers
    dump = _capture_with_hf_twin(target, aux, tmp_path / "dumps")
    assert dump.aux_layers == intended
    want = _captured_by_hooks(target, INPUT_IDS, outputs_of=intended)
    torch.testing.assert_close(dump.aux_hidden_states.to_torch(), want, rtol=0, atol=1e-6)
    wrong = _captured_by_hooks(target, INPUT_IDS, outputs_of=[j + 1 for j in intended])
    assert (dump.aux_hidden_states.to_torch() - wrong).abs().max() > 1e-3    # a layer off by one would show
    # 2. the export names them in sglang's numbering for this family
    conf = _export_from_sample(target, dump, tmp_path / "draft")
    ids = conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert conf["eagle_config"]["use_aux_hidden_state"] is True
    # the capture server is given the same list (--return-aux-hidden-state-layer-ids)
    assert ids == sglang_aux_layer_ids(intended, archs, n)
    # 3. sglang's own rule for the family turns them into layer inputs holding the same rows
    layers_to_capture = SGLANG_RULES[archs[0]](ids)
    assert sorted(layers_to_capture) == [j + 1 for j in intended]
    sglang_rows = _captured_by_hooks(target, INPUT_IDS, inputs_of=layers_to_capture)
    torch.testing.assert_close(sglang_rows, dump.aux_hidden_states.to_torch(), rtol=0, atol=1e-6)
    assert layer_outputs_from_sglang_ids(ids, archs, n) == intended
    # 4. the speculators export names them in vLLM 0.33's numbering: id c = the residual stream ENTERING layer c,
    # for every family, no shift (EagleModelMixin._maybe_add_hidden_state; tests/node_vllm runs vLLM's own)
    spec = json.loads((tmp_path / "draft" / "export" / "speculators" / "config.json").read_text())
    vllm_ids = spec["eagle_aux_hidden_state_layer_ids"]
    assert vllm_ids == [j + 1 for j in intended]
    vllm_rows = _captured_by_hooks(target, INPUT_IDS, inputs_of=vllm_ids)
    torch.testing.assert_close(vllm_rows, dump.aux_hidden_states.to_torch(), rtol=0, atol=1e-6)


def test_family_numbering_differs_where_sglang_differs():
    # DeepSeek: +1 only when the first id is 1, so other lists go as layer inputs
    assert sglang_aux_layer_ids([1, 3, 4], ["DeepseekV3ForCausalLM"], 8) == [1, 3, 4]
    assert sglang_aux_layer_ids([2, 4, 6], ["DeepseekV3ForCausalLM"], 8) == [3, 5, 7]
    # the output of layer 0 as [1, ...] would be shifted again: the 1 goes last (sglang reads ids[0] only)
    assert sglang_aux_layer_ids([0, 3, 5], ["DeepseekV3ForCausalLM"], 8) == [4, 6, 1]
    assert sglang_aux_layer_ids([0, 3, 5], ["KimiK25ForConditionalGeneration"], 8) == [4, 6, 1]
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GptOssForCausalLM"):
        assert sglang_aux_layer_ids([0, 3, 5], [arch], 8) == [0, 3, 5]
    # Kimi-K2 (61 layers): sglang's default [2, 30, 58] inputs are EAGLE-3's default outputs
    assert [c - 1 for c in (2, 61 // 2, 61 - 3)] == default_aux_layers(61) == [1, 29, 57]


def test_bad_layer_lists_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match=r"strictly increasing .* use \[1, 3, 5\]"):
        resolve_aux_layers([5, 1, 3], 8)
    with pytest.raises(ValueError, match=r"outside 0..6"):
        resolve_aux_layers([1, 7], 8)
    with pytest.raises(ValueError, match=r"\['MambaForCausalLM'\].*SGLANG_AUX_ID_RULES"):
        sglang_aux_layer_ids([1, 3, 4], ["MambaForCausalLM"], 8)
    with pytest.raises(ValueError, match="cannot capture only the output of layer 0"):
        sglang_aux_layer_ids([0], ["DeepseekV3ForCausalLM"], 8)


def test_export_refuses_a_target_family_it_cannot_number(targets, tmp_path):
    from eagleflow.engines.sglang.export import eagle_layer_ids
    target = tmp_path / "odd"
    target.mkdir()
    conf = json.loads((targets["llama"] / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(dict(conf, architectures=["MambaForCausalLM"])))
    with pytest.raises(ValueError, match=rf"exporting for target {target}/config.json: .*MambaForCausalLM"):
        eagle_layer_ids(target, [1, 3, 4])
