"""The speculators-format export (for vLLM) beside the SGLang one: config writer, weights, formats, refusals.

Fast and in the main venv (no vllm or speculators here): what the files say. That speculators' and vLLM's
own code read them as our draft is proven in tests/node_vllm (`make test-node-vllm`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagleflow.engines.sglang.layers import sglang_aux_layer_ids
from eagleflow.engines.vllm import SPECULATORS_DIR
from eagleflow.engines.vllm.export import SPECULATORS_EMBEDDING, SPECULATORS_FLAGS
from eagleflow.engines.vllm.layers import VLLM_EAGLE3_ARCHITECTURES, vllm_aux_layer_ids
from eagleflow.train.checkpoint import save_checkpoint
from eagleflow.train.export import SGLANG_WEIGHT_NAMES, export_draft
from eagleflow.train.export_formats import SPECULATIVE_TOKENS
from eagleflow.train.model import DraftConfig, Eagle3Draft

AUX = [1, 2, 3]


def _target(d: Path, architectures: list[str] | None = None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(d)
    if architectures:
        conf = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(dict(conf, architectures=architectures)))
    return d


def _checkpoint(tmp: Path, target: Path, aux_layers: list[int] = AUX, root: str = "ckpt") -> Path:
    dcfg = DraftConfig.from_target(target, 64)
    torch.manual_seed(1)
    draft = Eagle3Draft(dcfg)
    with torch.no_grad():
        draft.d2t.copy_(torch.arange(64) * 2)            # draft id i -> target id 3i: a real map
        draft.t2d.zero_()
        draft.t2d[torch.arange(64) * 3] = True
    return save_checkpoint(tmp / root, 1, draft.trainable_state_dict(), torch.optim.AdamW(draft.parameters()),
                           {"draft_config": dcfg.to_json(), "aux_layers": aux_layers, "target_model": str(target),
                            "metrics": {}})


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return _target(tmp_path_factory.mktemp("target") / "tiny-llama")


def test_both_formats_by_default_same_tensors_vllm_numbering_and_our_flags(tmp_path, llama):
    from safetensors.torch import load_file
    out = export_draft(_checkpoint(tmp_path, llama), tmp_path / "export", dtype="float32")
    # the SGLang export is what it was (config, names), the speculators one sits in its own folder
    sglang = json.loads((out / "config.json").read_text())
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX       # sglang's numbering (Llama: +1 inside)
    assert set(load_file(str(out / "model.safetensors"))) == set(SGLANG_WEIGHT_NAMES)
    spec = json.loads((out / SPECULATORS_DIR / "config.json").read_text())
    tconf = json.loads((llama / "config.json").read_text())
    assert spec["architectures"] == ["Eagle3Speculator"] and spec["speculators_model_type"] == "eagle3"
    assert spec["speculators_config"] == {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS}],
        "verifier": {"name_or_path": str(llama), "architectures": ["LlamaForCausalLM"]}}
    # vLLM: id c = the stream entering layer c, so the output of layer j is j + 1 (sglang's Llama list + 1)
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    # every flag written, even where it is a default: vLLM reads a missing norm_before_residual as true
    assert SPECULATORS_FLAGS == {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
                                 "norm_output": False}
    assert {k: spec[k] for k in SPECULATORS_FLAGS} == SPECULATORS_FLAGS
    assert spec["draft_vocab_size"] == 64 and spec["target_hidden_size"] == 64
    layer = spec["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["vocab_size"] == tconf["vocab_size"] and layer["hidden_size"] == tconf["hidden_size"]
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (4, 2, 16)
    assert layer["rope_parameters"] == tconf["rope_parameters"] and layer["tie_word_embeddings"] is False
    assert "architectures" not in layer and "eagle_config" not in layer
    # weights: midlayer.* as layers.0.*, the same tensors, d2t/t2d kept as they are
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(out / SPECULATORS_DIR / "model.safetensors"))
    assert set(theirs) == {n.replace("midlayer.", "layers.0.") for n in SGLANG_WEIGHT_NAMES} | {SPECULATORS_EMBEDDING}
    for n, t in ours.items():
        assert torch.equal(theirs[n.replace("midlayer.", "layers.0.")], t), n
    # the target's own embedding, which speculators' model reads from the checkpoint (vLLM shares the target's)
    target_embed = load_file(str(llama / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(theirs[SPECULATORS_EMBEDDING], target_embed.float())
    assert torch.equal(theirs["d2t"], torch.arange(64) * 2) and theirs["d2t"].dtype == torch.int64
    assert theirs["t2d"].dtype == torch.bool and int(theirs["t2d"].sum()) == 64
    meta = json.loads((out / "eagleflow_export.json").read_text())
    assert meta["formats"] == {"sglang": str(out), "speculators": str(out / SPECULATORS_DIR)}
    assert meta["aux_layer_outputs"] == AUX


def test_one_format_only(tmp_path, llama):
    ckpt = _checkpoint(tmp_path, llama)
    only_sglang = export_draft(ckpt, tmp_path / "a", formats=["sglang"])
    assert sorted(p.name for p in only_sglang.iterdir()) == ["config.json", "eagleflow_export.json", "model.safetensors"]
    only_spec = export_draft(ckpt, tmp_path / "b", formats=("speculators",))
    assert sorted(p.name for p in only_spec.iterdir()) == ["eagleflow_export.json", SPECULATORS_DIR]
    with pytest.raises(ValueError, match=r"export formats \['vllm'\]: use one or more of sglang, speculators"):
        export_draft(ckpt, tmp_path / "c", formats=["vllm"])


def test_a_target_vllm_cannot_number_is_refused_by_name_and_nothing_is_written(tmp_path):
    # Qwen2-MoE: sglang serves it with EAGLE-3, vLLM 0.33.0 does not (no SupportsEagle3)
    target = _target(tmp_path / "moe", ["Qwen2MoeForCausalLM"])
    ckpt = _checkpoint(tmp_path, target)
    out = tmp_path / "export"
    with pytest.raises(ValueError, match=rf"exporting the speculators format for target {target}/config.json: "
                                         r"target architectures \['Qwen2MoeForCausalLM'\].*--format sglang"):
        export_draft(ckpt, out)
    assert not out.exists(), "a refused export must leave nothing behind"
    assert (export_draft(ckpt, out, formats=["sglang"]) / "config.json").is_file()   # the way out the error names


def test_vllm_ids_are_layer_outputs_plus_one_for_every_family_and_never_empty():
    for arch in sorted(VLLM_EAGLE3_ARCHITECTURES):
        assert vllm_aux_layer_ids([0, 3, 5], [arch], 8) == [1, 4, 6], arch
    # where sglang's lists differ per family, vLLM's do not
    assert sglang_aux_layer_ids([1, 3, 4], ["DeepseekV3ForCausalLM"], 8) == [1, 3, 4]
    assert vllm_aux_layer_ids([1, 3, 4], ["DeepseekV3ForCausalLM"], 8) == [2, 4, 5]
    assert sglang_aux_layer_ids([1, 3, 4], ["LlamaForCausalLM"], 8) == [1, 3, 4]
    assert vllm_aux_layer_ids([1, 3, 4], ["LlamaForCausalLM"], 8) == [2, 4, 5]
    # Kimi-K2.5 (61 layers): EAGLE-3's default outputs are vLLM's own default ids (2, N // 2, N - 3)
    assert vllm_aux_layer_ids(None, ["KimiK25ForConditionalGeneration"], 61) == [2, 61 // 2, 61 - 3]
    with pytest.raises(ValueError, match=r"outside 0..6"):
        vllm_aux_layer_ids([1, 7], ["LlamaForCausalLM"], 8)
    with pytest.raises(ValueError, match=r"\['MambaForCausalLM'\].*VLLM_EAGLE3_ARCHITECTURES"):
        vllm_aux_layer_ids([1, 3, 4], ["MambaForCausalLM"], 8)


def test_no_layer_ids_never_fall_back_to_defaults(tmp_path, llama):
    # a checkpoint without its aux layers would otherwise resolve to EAGLE-3's default layers, silently
    ckpt = _checkpoint(tmp_path, llama, aux_layers=[])
    with pytest.raises(ValueError, match=r"names no aux_layers"):
        export_draft(ckpt, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    from eagleflow.engines.vllm.export import speculators_config
    dcfg = DraftConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=4, vocab_size=32, draft_vocab_size=16)
    with pytest.raises(ValueError, match="aux layer ids are empty"):
        speculators_config(dcfg, [], "float32", "/nowhere")


def test_an_export_whose_layer_ids_were_removed_or_changed_is_refused_before_vllm_serves_it(tmp_path, llama):
    """vLLM takes its default layers (2, N // 2, N - 3) where eagle_aux_hidden_state_layer_ids is missing: the
    export check (run by the vllm evaluator before any server starts) refuses such an export, and one whose ids
    are not the layers eagleflow_export.json says it was trained on."""
    from eagleflow.engines.vllm.evaluator import VllmEvalError, check_drafts
    from eagleflow.train.export import layer_ids_problem
    out = export_draft(_checkpoint(tmp_path, llama), tmp_path / "export", dtype="float32")
    spec = out / SPECULATORS_DIR / "config.json"
    conf = json.loads(spec.read_text())
    assert conf["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]   # AUX + 1; vLLM's default for 6 layers: 2, 3, 3
    assert layer_ids_problem(out, llama, "speculators") is None
    check_drafts({"draft": out}, llama)
    for ids in (None, []):
        spec.write_text(json.dumps({**conf, "eagle_aux_hidden_state_layer_ids": ids}))
        assert f"names no eagle_aux_hidden_state_layer_ids ({ids!r}): vLLM would feed the draft its own " \
               "default layers" in str(layer_ids_problem(out, llama, "speculators"))
        with pytest.raises(VllmEvalError, match=r"draft draft .*export: .*names no eagle_aux_hidden_state_layer_ids"):
            check_drafts({"draft": out}, llama)
    spec.write_text(json.dumps({k: v for k, v in conf.items() if k != "eagle_aux_hidden_state_layer_ids"}))
    with pytest.raises(VllmEvalError, match=r"names no eagle_aux_hidden_state_layer_ids \(None\)"):
        check_drafts({"draft": out}, llama)
    spec.write_text(json.dumps({**conf, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))   # sglang's numbering
    with pytest.raises(VllmEvalError, match=r"eagle_aux_hidden_state_layer_ids \[1, 2, 3\], but the draft was "
                                            r"trained on the outputs of layers \[1, 2, 3\] .*vLLM ids \[2, 3, 4\]"):
        check_drafts({"draft": out}, llama)


def test_cli_export_writes_the_configured_formats(tmp_path, llama):
    from eagleflow.cli import main
    from eagleflow.config import load_config
    from eagleflow.layout import RunLayout
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": str(llama)})
    assert cfg.train.export_formats == ["sglang", "speculators"]
    layout = RunLayout.for_run(cfg, "r1")
    _checkpoint(Path(layout.draft_dir), llama, root="checkpoints")
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(cfg.model_dump(mode="json")))
    assert main(["export", "--config", str(cfg_file), "--run-id", "r1"]) == 0
    export = Path(layout.draft_dir) / "export"
    assert (export / "config.json").is_file() and (export / SPECULATORS_DIR / "config.json").is_file()
    assert main(["export", "--config", str(cfg_file), "--run-id", "r1", "--format", "sglang"]) == 0
    assert not (export / SPECULATORS_DIR).exists()
    with pytest.raises(Exception, match="export_formats"):
        load_config(data={"target_model": str(llama), "train": {"export_formats": ["onnx"]}})


def test_the_report_prints_the_vllm_command_beside_the_sglang_one(tmp_path):
    import shlex

    from eagleflow.console.run_report import write_report
    from eagleflow.engines.vllm.serve import vllm_serve_command
    from tests.unit.test_run_report import _complete_run, _config
    cfg, layout = _config(tmp_path)
    _complete_run(cfg, layout, 1.7e9)
    spec_dir = Path(layout.draft_dir) / "export" / SPECULATORS_DIR
    argv = shlex.split(vllm_serve_command(cfg, str(spec_dir)))
    assert argv[:3] == ["vllm", "serve", str(cfg.target_model)]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": str(spec_dir), "num_speculative_tokens": SPECULATIVE_TOKENS}
    assert argv[argv.index("--tensor-parallel-size") + 1] == str(cfg.server.tp)
    html = write_report(cfg, layout).read_text()
    assert "No speculators-format export for vLLM" in html and "vllm serve" not in html
    spec_dir.mkdir()
    (spec_dir / "config.json").write_text("{}")
    html = write_report(cfg, layout).read_text()
    assert "Serve it with SGLang:" in html and "Serve it with vLLM" in html
    import html as html_lib
    assert html_lib.escape(vllm_serve_command(cfg, str(spec_dir)), quote=True) in html
