"""Our draft in the speculators format, through speculators 0.9.0's and vLLM 0.33.0's own code, on the CPU.

A draft is trained by our trainer on the tiny demo Llama's stored hidden states and exported by
`eagleflow export` (both formats, the default). Then:

- speculators' ``SpeculatorModel.from_pretrained`` (its registered ``eagle3`` model) loads the
  speculators folder and, for the same aux states and token ids, computes our draft's logits over
  three chained TTT steps (the chain is where ``norm_output`` and the residual choice show);
- the run report's ``vllm serve ... --speculative-config`` command goes through vLLM's own ``serve``
  argument parser and ``create_engine_config`` (target ModelConfig, SpeculativeConfig, the speculators
  config parsed by vLLM's ``SpeculatorsConfig``); the VllmConfig it builds constructs vLLM's
  ``Eagle3LlamaForCausalLM``, whose ``load_weights`` fills every parameter from our file (only the
  embedding, shared with the target at serve time, is not in it), and whose forward (its fc, decoder
  layer, norms, lm_head and d2t mapping; only the paged-attention kernel swapped) gives our logits;
- the ``eagle_aux_hidden_state_layer_ids`` make vLLM's own target models (a Llama through its real
  layers, a DeepSeek-V3 through vLLM's DeepseekV2Model loop) hand out exactly the layer outputs the
  draft was trained on.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagleflow.config import load_config
from eagleflow.engines.vllm import SPECULATORS_DIR
from eagleflow.engines.vllm.export import SPECULATORS_EMBEDDING, SPECULATORS_FLAGS
from eagleflow.layout import RunLayout
from eagleflow.train.export import load_exported
from eagleflow.train.export_formats import SPECULATIVE_TOKENS
from tests.fixtures.train_hidden_states import NOT_DEFAULT_AUX_LAYERS, write_synthetic_hidden_states

pytestmark = pytest.mark.timeout(600)

TOL = 1e-5   # float32 end to end: the same ops in another order
# The layer outputs the draft is trained on: vLLM ids (3, 6, 7), where vLLM's (and speculators') default for the
# 8-layer demo Llama is (2, N // 2, N - 3) = (2, 4, 5). An id list lost on the way cannot serve them by coincidence.
AUX = NOT_DEFAULT_AUX_LAYERS
VLLM_DEFAULT = (2, 8 // 2, 8 - 3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, demo_assets):
    """A draft trained by `eagleflow train`'s trainer and exported by `eagleflow export` (both formats)."""
    from eagleflow.cli import main
    from eagleflow.train.trainer import train
    tmp = tmp_path_factory.mktemp("vllm-export")
    target = demo_assets["target_model"]
    cfg = load_config(data={"run_root": str(tmp / "runs"), "target_model": target,
                            "server": {"tp": 1, "dtype": "float32"},
                            "train": {"device": "cpu", "max_steps": 12, "batch_size": 8, "lr": 3e-3,
                                      "warmup_steps": 2, "ttt_length": 3, "draft_vocab_size": 64,
                                      "checkpoint_every": 1000, "log_every": 1000, "export_dtype": "float32"}})
    layout = RunLayout.for_run(cfg, "r1")
    write_synthetic_hidden_states(layout.hidden_states_dir, target, samples=32, aux_layers=AUX)
    result = train(cfg, layout, log=lambda _m: None)
    assert result.completed
    cfg_file = tmp / "run-config.json"
    cfg_file.write_text(json.dumps(cfg.model_dump(mode="json")))
    assert main(["export", "--config", str(cfg_file), "--run-id", "r1"]) == 0
    export = Path(layout.draft_dir) / "export"
    return {"cfg": cfg, "layout": layout, "target": target, "export": export, "spec": export / SPECULATORS_DIR}


def _target_embedding(target: str) -> torch.Tensor:
    from safetensors.torch import load_file
    return load_file(str(Path(target) / "model.safetensors"))["model.embed_tokens.weight"].float()


def _inputs(trained, t: int = 20, seed: int = 5):
    vocab = json.loads((Path(trained["target"]) / "config.json").read_text())["vocab_size"]
    width = json.loads((trained["spec"] / "config.json").read_text())["target_hidden_size"] * len(AUX)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, t), generator=g), torch.randn(1, t, width, generator=g)


def _our_ttt_logits(model, ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Our draft's logits per TTT step, chained as eagleflow.train.loss.TrainingTimeTest chains them: step k
    reads the ids shifted by k (zero-padded), rope offset k, the previous step's pre-norm output."""
    t = ids.shape[1]
    hidden, cache, out = model.fc(aux), [], []
    for k in range(steps):
        tok = torch.zeros_like(ids)
        tok[:, :t - k] = ids[:, k:]
        hidden = model.step(tok, hidden, k, cache)
        out.append(model.logits(hidden))
    return out


def test_the_export_writes_both_formats_from_the_same_tensors(trained):
    from safetensors.torch import load_file
    spec = json.loads((trained["spec"] / "config.json").read_text())
    assert spec["architectures"] == ["Eagle3Speculator"] and spec["speculators_model_type"] == "eagle3"
    assert spec["eagle_aux_hidden_state_layer_ids"] == [j + 1 for j in AUX]   # vLLM: the input of layer j+1
    assert {k: spec[k] for k in SPECULATORS_FLAGS} == SPECULATORS_FLAGS
    assert spec["speculators_config"]["verifier"] == {"name_or_path": str(trained["target"]),
                                                      "architectures": ["LlamaForCausalLM"]}
    ours, theirs = load_file(str(trained["export"] / "model.safetensors")), load_file(str(trained["spec"] / "model.safetensors"))
    assert {n.replace("midlayer.", "layers.0.") for n in ours} | {SPECULATORS_EMBEDDING} == set(theirs)
    assert all(torch.equal(t, theirs[n.replace("midlayer.", "layers.0.")]) for n, t in ours.items())
    assert torch.equal(theirs[SPECULATORS_EMBEDDING], _target_embedding(trained["target"]))   # the target's own
    assert theirs["d2t"].dtype == torch.int64 and theirs["t2d"].dtype == torch.bool


def test_speculators_loads_the_export_and_computes_our_logits_over_the_ttt_chain(trained):
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    model = SpeculatorModel.from_pretrained(str(trained["spec"])).eval()
    assert isinstance(model, Eagle3DraftModel) and isinstance(model.config, Eagle3SpeculatorConfig)
    assert model.config.eagle_aux_hidden_state_layer_ids == [j + 1 for j in AUX]
    assert [getattr(model.config, k) for k in SPECULATORS_FLAGS] == list(SPECULATORS_FLAGS.values())
    assert model.draft_vocab_size == 64 and model.use_draft_vocab
    # the model as from_pretrained leaves it, nothing set by hand: the embedding is the target's, read from the
    # export (speculators fills a missing one from the verifier only while it is NaN, and transformers' init of
    # the missing key got there first before the export carried it: values up to 1.5e37)
    assert torch.equal(model.embed_tokens.weight, _target_embedding(trained["target"]))

    # speculators' default attention (flex, block size 128) extends its block mask per TTT step: whole blocks
    ids, aux = _inputs(trained, t=128)
    t, steps = ids.shape[1], 3
    got: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _a, out: got.append(out))
    with torch.no_grad():
        drafted = model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, t, dtype=torch.long),
                        position_ids=torch.arange(t)[None], ttt_steps=steps)
    hook.remove()
    ours = load_exported(trained["export"], trained["target"]).eval()
    with torch.no_grad():
        want = _our_ttt_logits(ours, ids, aux, steps)
    diffs = [(g - w).abs().max().item() for g, w in zip(got, want)]
    print(f"speculators Eagle3DraftModel vs ours, max |logit diff| per TTT step: {diffs}")
    assert len(got) == steps and max(diffs) < TOL, diffs
    assert torch.equal(drafted[0], want[0].argmax(-1))
    # the same export read with norm_output on (post-norm state fed on) differs from step 1: the check can fail
    model.config.norm_output = True
    got.clear()
    model.lm_head.register_forward_hook(lambda _m, _a, out: got.append(out))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, t, dtype=torch.long),
              position_ids=torch.arange(t)[None], ttt_steps=2)
    assert (got[0] - want[0]).abs().max() < TOL and (got[1] - want[1]).abs().max() > 1e-3


def _vllm_config_from_the_report(trained, spec: Path | None = None):
    """The report's `vllm serve` command (for the export's speculators folder, or ``spec``) through vLLM's own
    `serve` parser and engine-config builder."""
    import vllm.entrypoints.cli.serve as serve
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from eagleflow.engines.vllm.serve import vllm_serve_command
    argv = shlex.split(vllm_serve_command(trained["cfg"], str(spec or trained["spec"])))
    assert argv[:2] == ["vllm", "serve"]
    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="subparser")
    cmd = serve.ServeSubcommand()
    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(argv[1:])     # an unknown flag or a bad JSON exits here
    cmd.validate(args)
    args.model = args.model_tag            # what ServeSubcommand.cmd does first
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def test_vllm_parses_the_report_command_and_reads_the_speculators_config(trained):
    vc = _vllm_config_from_the_report(trained)
    spec = vc.speculative_config
    assert vc.model_config.model == str(trained["target"]) and vc.parallel_config.tensor_parallel_size == 1
    assert vc.model_config.dtype == torch.float32
    assert spec.method == "eagle3" and spec.num_speculative_tokens == SPECULATIVE_TOKENS
    draft = spec.draft_model_config
    assert draft.architectures == ["Eagle3LlamaForCausalLM"]
    hf = draft.hf_config
    assert type(hf).__name__ == "SpeculatorsConfig"
    assert list(hf.eagle_aux_hidden_state_layer_ids) == [j + 1 for j in AUX]
    # vLLM defaults norm_before_residual to TRUE when the key is missing (speculators/algos.py): ours is written
    assert {k: getattr(hf, k) for k in SPECULATORS_FLAGS} == SPECULATORS_FLAGS
    assert hf.draft_vocab_size == 64 and hf.target_hidden_size == hf.hidden_size
    # what the GPU model runner hands set_aux_hidden_state_layers (gpu_model_runner.py, its own method)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.speculative_config = spec
    assert runner._get_eagle3_aux_layers_from_config() == tuple(j + 1 for j in AUX)


def _swap_paged_attention(attention_module) -> None:
    """Replace only vLLM's paged-attention call (vllm._C, not in the CUDA wheel on a CPU) by causal attention
    over the q, k, v that vLLM's own qkv_proj and rotary embedding computed. GQA and scale as vLLM's."""
    a = attention_module

    def causal(q, k, v, *_args, **_kw):
        t = q.shape[0]
        q = q.view(t, a.num_heads, a.head_dim).transpose(0, 1)[None]
        k = k.view(t, a.num_kv_heads, a.head_dim).transpose(0, 1)[None]
        v = v.view(t, a.num_kv_heads, a.head_dim).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=a.scaling)
        return o[0].transpose(0, 1).reshape(t, -1)
    a.attn.forward = causal


def test_vllm_builds_its_eagle3_draft_loads_every_weight_and_computes_our_logits(trained, vllm_world):
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.model_executor.models.registry import ModelRegistry

    vc = _vllm_config_from_the_report(trained)
    draft_cfg = vc.speculative_config.draft_model_config
    cls, arch = ModelRegistry.resolve_model_cls(draft_cfg.architectures, draft_cfg)
    assert cls is Eagle3LlamaForCausalLM and arch == "Eagle3LlamaForCausalLM"
    with set_current_vllm_config(vc):
        model = cls(vllm_config=vc)
    params = dict(model.named_parameters())
    with torch.no_grad():   # a parameter our file does not fill keeps its poison
        for p in params.values():
            p.fill_(float("nan")) if p.is_floating_point() else p.fill_(-7)
    ours = load_file(str(trained["spec"] / "model.safetensors"))
    model.load_weights(list(ours.items()))
    unfilled = [n for n, p in params.items()
                if (torch.isnan(p).any() if p.is_floating_point() else (p == -7).any())]
    assert unfilled == [], f"vLLM's draft has parameters our export does not fill: {unfilled}"
    # the embedding is loaded too (vLLM then marks the draft has_own_embed_tokens) and is the target's (vLLM's
    # loader pads the rows to its own multiple with zeros)
    embed, target_embed = params["model.embed_tokens.weight"], _target_embedding(trained["target"])
    assert model.has_own_embed_tokens and torch.equal(embed[:len(target_embed)], target_embed)
    assert not embed[len(target_embed):].any()
    assert torch.equal(params["draft_id_to_target_id"], ours["d2t"])
    assert torch.equal(params["model.layers.0.self_attn.qkv_proj.weight"],
                       torch.cat([ours[f"layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]))
    assert torch.equal(params["model.fc.weight"], ours["fc.weight"])
    assert not model.model.layers[0].hidden_norm.weight.isnan().any()

    process_weights_after_loading(model, draft_cfg, torch.device("cpu"))   # what vLLM's loader does next
    _swap_paged_attention(model.model.layers[0].self_attn)
    ids, aux = _inputs(trained)
    t = ids.shape[1]
    with set_current_vllm_config(vc), torch.no_grad():
        hidden = model.combine_hidden_states(aux[0])
        out, fed_on = model(ids[0], torch.arange(t), hidden)
        logits = model.compute_logits(out)                     # over the target vocabulary, via d2t
        mine = load_exported(trained["export"], trained["target"]).eval()
        want = mine.first_step_logits(ids, aux)[0]
        our_state = mine.step(ids, mine.fc(aux), 0, [])[0]
    hot = torch.arange(64) + ours["d2t"]
    diff = (logits[:, hot] - want).abs().max().item()
    print(f"vLLM Eagle3LlamaForCausalLM vs ours, max |logit diff| (draft vocab): {diff:.3g}")
    assert diff < TOL
    others = torch.ones(logits.shape[1], dtype=torch.bool)
    others[hot] = False
    assert torch.isinf(logits[:, others]).all(), "tokens outside the draft vocabulary must be -inf"
    # what vLLM's proposer feeds the next step (norm_output false): our pre-norm output
    assert (fed_on - our_state).abs().max().item() < TOL


def _vllm_target(model_dir: str | Path, vllm_world):
    """vLLM's own model class for a target, built on the CPU from its ModelConfig."""
    from vllm.config import CompilationConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.registry import ModelRegistry
    mc = ModelConfig(model=str(model_dir), dtype="float32")
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                    compilation_config=CompilationConfig(mode=0, custom_ops=["none"]))
    cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    with set_current_vllm_config(vc):
        model = cls(vllm_config=vc)
    return model, vc


def _hf_hidden_states(model_dir: str | Path, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None], output_hidden_states=True, use_cache=False).hidden_states   # [0] = embeddings


def _vllm_llama_target(target: str, vllm_world):
    """vLLM's LlamaForCausalLM for the target, real layers and weights (only the paged-attention call swapped)."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    model, vc = _vllm_target(target, vllm_world)
    model.load_weights(list(load_file(str(Path(target) / "model.safetensors")).items()))
    process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    for layer in model.model.layers:
        _swap_paged_attention(layer.self_attn)
    return model, vc


def _layers_vllm_feeds(trained, spec: Path, vllm_world) -> tuple[tuple[int, ...], list[int]]:
    """What vLLM feeds the draft served from ``spec``: the report's serve command parsed into vLLM's config, its
    model runner's own `set_eagle3_aux_hidden_state_layers` (model runner v2, vLLM's default; the v1 runner reads
    the same field) applied to vLLM's Llama target, then a forward: (the ids it set, the layer outputs j whose
    transformers state hidden_states[j + 1] each returned aux state equals; -1 where none does)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import set_eagle3_aux_hidden_state_layers

    target = trained["target"]
    vc_draft = _vllm_config_from_the_report(trained, spec)
    model, vc = _vllm_llama_target(target, vllm_world)
    set_eagle3_aux_hidden_state_layers(model, vc_draft.speculative_config)
    x = torch.tensor([3, 17, 42, 8, 99, 64, 5, 21, 300, 77, 12])
    with set_current_vllm_config(vc), torch.no_grad():
        _, aux = model(x, torch.arange(len(x)))
    hs = _hf_hidden_states(target, x)
    fed = [next((j for j in range(len(hs) - 1) if (got - hs[j + 1][0]).abs().max().item() < TOL), -1)
           for got in aux]
    return tuple(model.model.aux_hidden_state_layers), fed


def test_vllm_feeds_a_llama_target_s_trained_layers_to_the_draft(trained, vllm_world):
    """vLLM's LlamaForCausalLM, real layers and weights, told the export's ids the way its model runner tells it
    (from the served speculators config): the aux states it returns are the outputs of the layers the draft was
    trained on (transformers' hidden_states[j + 1] for j in the stored samples' aux_layers), which are not vLLM's
    default layers for this target."""
    trained_on = json.loads((trained["export"] / "eagleflow_export.json").read_text())["aux_layer_outputs"]
    assert trained_on == AUX
    model, _ = _vllm_llama_target(trained["target"], vllm_world)
    assert model.get_eagle3_default_aux_hidden_state_layers() == VLLM_DEFAULT != tuple(j + 1 for j in AUX)
    ids, fed = _layers_vllm_feeds(trained, trained["spec"], vllm_world)
    assert ids == tuple(j + 1 for j in AUX) and fed == trained_on


def test_an_export_with_its_layer_ids_removed_fails_every_check(trained, vllm_world, tmp_path):
    """The same export with eagle_aux_hidden_state_layer_ids removed (what speculators' converter writes unless
    given them): vLLM and speculators silently take their default layers, so the layer check above fails on it
    (it can tell), and eagleflow's own check refuses it before any server starts."""
    import shutil

    from speculators import SpeculatorModel

    from eagleflow.engines.vllm.evaluator import VllmEvalError, check_drafts
    export = tmp_path / "export"
    shutil.copytree(trained["export"], export)
    spec = export / SPECULATORS_DIR
    conf = json.loads((spec / "config.json").read_text())
    del conf["eagle_aux_hidden_state_layer_ids"]
    (spec / "config.json").write_text(json.dumps(conf))

    ids, fed = _layers_vllm_feeds(trained, spec, vllm_world)
    assert ids == VLLM_DEFAULT and fed == [j - 1 for j in VLLM_DEFAULT]
    assert fed != AUX, "vLLM fed the trained layers without the ids: the check could not tell"
    with pytest.warns(UserWarning):
        model = SpeculatorModel.from_pretrained(str(spec))
    assert tuple(model.config.eagle_aux_hidden_state_layer_ids) == VLLM_DEFAULT   # speculators' default too
    with pytest.raises(VllmEvalError, match=r"names no eagle_aux_hidden_state_layer_ids \(None\): vLLM would feed "
                                            r"the draft its own default layers"):
        check_drafts({"draft": export}, trained["target"])
    check_drafts({"draft": trained["export"]}, trained["target"])   # the export as written passes


def test_vllm_still_shares_the_target_s_embedding_with_the_draft(trained, vllm_world):
    """The export now carries the target's embedding: vLLM's loader takes it (has_own_embed_tokens), and both its
    model runners still serve the draft with the target's own embedding module (equal weights: shared)."""
    import types

    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import maybe_share_target_embed

    vc = _vllm_config_from_the_report(trained)
    draft_cfg = vc.speculative_config.draft_model_config
    target, _ = _vllm_llama_target(trained["target"], vllm_world)

    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    with set_current_vllm_config(vc):
        draft = Eagle3LlamaForCausalLM(vllm_config=vc)
    draft.load_weights(list(load_file(str(trained["spec"] / "model.safetensors")).items()))
    process_weights_after_loading(draft, draft_cfg, torch.device("cpu"))
    own = draft.model.embed_tokens
    assert draft.has_own_embed_tokens and own is not target.model.embed_tokens
    maybe_share_target_embed(draft, draft.model, target.model)          # model runner v2 (vLLM's default)
    assert draft.model.embed_tokens is target.model.embed_tokens
    draft.model.embed_tokens = own                                      # as loaded again, for the v1 runner's
    SpecDecodeBaseProposer._maybe_share_embeddings(types.SimpleNamespace(model=draft), target)
    assert draft.model.embed_tokens is target.model.embed_tokens


def _deepseek_v3_target(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, DeepseekV3Config
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                           tie_word_embeddings=False, moe_intermediate_size=16, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                           first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=8)
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def _export_for(target: Path, aux_layers: list[int], work: Path) -> dict:
    """A checkpoint trained on ``aux_layers`` of ``target`` (its state as the trainer saves it), exported."""
    from eagleflow.train.checkpoint import save_checkpoint
    from eagleflow.train.export import export_draft
    from eagleflow.train.model import DraftConfig, Eagle3Draft
    dcfg = DraftConfig.from_target(target, 64)
    draft = Eagle3Draft(dcfg)
    ckpt = save_checkpoint(work / "checkpoints", 1, draft.trainable_state_dict(),
                           torch.optim.AdamW(draft.parameters()),
                           {"draft_config": dcfg.to_json(), "aux_layers": aux_layers, "target_model": str(target),
                            "metrics": {}})
    out = export_draft(ckpt, work / "export", dtype="float32")
    return json.loads((out / SPECULATORS_DIR / "config.json").read_text())


@pytest.mark.parametrize("aux_layers", [AUX, [0, 3, 6]])   # neither is vLLM's default (2, 4, 5) - 1
def test_vllm_feeds_a_deepseek_v3_target_s_trained_layers_to_the_draft(tmp_path, vllm_world, aux_layers):
    """DeepSeek-V3 (the architecture of Kimi-K2; Kimi-K2.5's language model) is built by vLLM's own
    DeepseekV3ForCausalLM on the CPU and told the export's ids by its own set_aux_hidden_state_layers. Its MLA
    and MoE kernels do not run on a CPU, so each decoder layer is stood in for by transformers' output of that
    layer (asserting it was handed transformers' input of that layer); the aux capture under test is vLLM's
    DeepseekV2Model.forward loop itself. ``[0, ...]``: the id list starting at 1 that sglang's DeepSeek rule
    shifts; vLLM applies no shift."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2Model, DeepseekV3ForCausalLM

    target = _deepseek_v3_target(tmp_path / "dsv3")
    spec = _export_for(target, aux_layers, tmp_path / "draft")
    ids = spec["eagle_aux_hidden_state_layer_ids"]
    assert spec["speculators_config"]["verifier"]["architectures"] == ["DeepseekV3ForCausalLM"]
    model, vc = _vllm_target(target, vllm_world)
    assert isinstance(model, DeepseekV3ForCausalLM) and isinstance(model.model, DeepseekV2Model)
    model.set_aux_hidden_state_layers(tuple(ids))

    x = torch.tensor([3, 17, 42, 8, 99, 64, 5, 21, 30, 77])
    hs = _hf_hidden_states(target, x)

    class LayerOutput(torch.nn.Module):
        use_sequence_parallel_moe = False

        def __init__(self, i: int):
            super().__init__()
            self.i = i

        def forward(self, positions, hidden_states, residual, *_rest):
            stream = hidden_states if residual is None else hidden_states + residual
            assert (stream - hs[self.i][0]).abs().max().item() < TOL, f"layer {self.i} was handed another state"
            return hs[self.i + 1][0].clone(), torch.zeros_like(stream)

    model.model.layers = torch.nn.ModuleList([LayerOutput(i) for i in range(len(model.model.layers))])
    with set_current_vllm_config(vc), torch.no_grad():
        _, aux = model.model(None, torch.arange(len(x)), None, inputs_embeds=hs[0][0])
    assert len(aux) == len(aux_layers)
    for j, got in zip(aux_layers, aux):
        assert torch.equal(got, hs[j + 1][0]), f"aux state for layer output {j}"


def test_vllm_eagle3_architectures_are_the_targets_vllm_serves_with_eagle3():
    """Every architecture we number for vLLM resolves, in vLLM's own registry, to a class that supports
    EAGLE-3; every sglang-numbered architecture left out does not (so nothing is refused that vLLM serves)."""
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    from eagleflow.engines.sglang.layers import SGLANG_AUX_ID_RULES
    from eagleflow.engines.vllm.layers import VLLM_EAGLE3_ARCHITECTURES

    def eagle3(arch: str) -> bool:
        cls = ModelRegistry._try_load_model_cls(arch)
        assert cls is not None, f"{arch} is not in vLLM 0.33.0's registry"
        return supports_eagle3(cls)

    assert sorted(a for a in VLLM_EAGLE3_ARCHITECTURES if not eagle3(a)) == []
    left_out = sorted(set(SGLANG_AUX_ID_RULES) - VLLM_EAGLE3_ARCHITECTURES)
    assert [a for a in left_out if eagle3(a)] == [], "vLLM serves these with EAGLE-3: add them"
