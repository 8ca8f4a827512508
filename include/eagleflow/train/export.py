"""Export a trained draft as the directory SGLang serves, and in the speculators format vLLM serves.

    sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 \
        --speculative-draft-model-path <draft_dir>/export
    vllm serve TARGET --speculative-config \
        '{"method": "eagle3", "model": "<draft_dir>/export/speculators", "num_speculative_tokens": 3}'

- ``config.json``: ``LlamaForCausalLMEagle3``, the draft's dims, one hidden
  layer, the target's ``vocab_size`` and ``draft_vocab_size``, untied
  embeddings, the target's context length and rope settings (SGLang builds the
  draft with the target's context length), and ``eagle_config`` naming the
  capture layers the hidden states were recorded from, in the numbering the
  target's sglang model family reads (``eagleflow.serving.aux_layers``: the
  same list the capture server was given, so serving captures the layers the
  draft was trained on).
- ``model.safetensors``: exactly the names ``LlamaForCausalLMEagle3.load_weights``
  knows (it drops unknown names silently): see ``SGLANG_WEIGHT_NAMES``.

``speculators/`` (``SPECULATORS_DIR``, written in the same atomic step, so both formats are always the
same checkpoint): the format of vllm-project/speculators 0.9.0 (``Eagle3SpeculatorConfig``), which
vLLM 0.33.0 reads itself (``transformers_utils/configs/speculators``):

- ``config.json``: ``Eagle3Speculator``, ``speculators_config`` (algorithm, a greedy proposal of
  ``speculative_tokens``, the verifier = the target), ``transformer_layer_config`` (the draft layer
  as a Llama config, ``vocab_size`` the target's), ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` in vLLM's numbering (``aux_layers.vllm_aux_layer_ids``: the
  layers the draft was trained on; never null, which would make vLLM feed its default layers), and
  the four architecture flags set to what ``model.Eagle3Draft`` computes: ``SPECULATORS_FLAGS``.
  Each is written even where it equals a default: vLLM defaults ``norm_before_residual`` to true.
- ``model.safetensors``: ``midlayer.*`` as ``layers.0.*``, the rest (``d2t``, ``t2d`` included) as named,
  and ``embed_tokens.weight``: the target's own embedding (``SPECULATORS_EMBEDDING``), which the draft reads
  frozen. speculators 0.9.0's ``SpeculatorModel.from_pretrained`` fills a missing embedding from the verifier
  only while it is still NaN, and transformers' initialisation of the missing key gets there first (values
  up to 1.5e37 were seen): without it, speculators' own model of the export computes garbage. vLLM 0.33.0's
  ``Eagle3LlamaForCausalLM.load_weights`` loads it (``has_own_embed_tokens``), and its proposer still shares
  the target's embedding when the two are equal (``_maybe_share_embeddings``: ``torch.equal``; a copy in
  another dtype than the served one is kept beside it, same values rounded). It costs vocab x hidden x the
  export dtype's bytes on disk (Kimi-K2.5 in bf16: 163,840 x 7,168 x 2 = 2.3 GB).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eagleflow.serving.aux_layers import target_architectures_and_layers
from eagleflow.durable import atomic_dir
from eagleflow.engines import engine_serving_format

from .checkpoint import MODEL_FILE, latest_checkpoint, verify_checkpoint_files
from .export_formats import EXPORT_FORMATS, SPECULATIVE_TOKENS, SPECULATORS_DIR, format_dir
from .model import DraftConfig, Eagle3Draft

# The checkpoint names SGLang's LlamaForCausalLMEagle3 loads (srt/models/llama_eagle3.py):
# q/k/v and gate/up are stacked by its loader, d2t becomes the hot-token map, t2d is skipped.
SGLANG_WEIGHT_NAMES = (
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

SPECULATORS_VERSION = "0.9.0"          # the speculators release this format is proven against (tests/node_vllm)
# What model.Eagle3Draft computes, in speculators' (and vLLM's Eagle3LlamaForCausalLM's) terms:
#   norm_before_residual: residual = hidden_norm(hidden)? No: the residual is the raw hidden (DraftDecoderLayer).
#   norm_before_fc / fc_norm: an RMSNorm over the concatenated / each aux state before fc? No: fc(aux) as is.
#   norm_output: feed norm(out) to the next step? No: the pre-norm output; norm only before lm_head.
SPECULATORS_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
# The target's embedding, in the speculators format only (SGLang and vLLM share the target's at serve time;
# speculators' own model reads it from the checkpoint: see the module docstring).
SPECULATORS_EMBEDDING = "embed_tokens.weight"


def target_dtype_name(target_dir: str | Path) -> str:
    tc = json.loads((Path(target_dir) / "config.json").read_text())
    name = str(tc.get("torch_dtype") or tc.get("dtype") or "bfloat16")
    return name if name in _DTYPES else "bfloat16"


def _layer_ids(target_dir: str | Path, aux_layers: list[int], fmt: str, what: str) -> list[int]:
    """The target's layer ids for the samples' layer outputs ``aux_layers`` in the numbering of the engine that
    serves export format ``fmt`` (eagleflow.engines)."""
    path = Path(target_dir) / "config.json"
    archs, num_layers = target_architectures_and_layers(json.loads(path.read_text()))
    try:
        return engine_serving_format(fmt).layer_ids(aux_layers, archs, num_layers)
    except ValueError as e:
        raise ValueError(f"exporting {what}for target {path}: {e}") from None


def eagle_layer_ids(target_dir: str | Path, aux_layers: list[int]) -> list[int]:
    """``eagle_aux_hidden_state_layer_ids`` for the samples' layer outputs ``aux_layers`` on this target."""
    return _layer_ids(target_dir, aux_layers, "sglang", "")


def vllm_layer_ids(target_dir: str | Path, aux_layers: list[int]) -> list[int]:
    """``eagle_aux_hidden_state_layer_ids`` in vLLM's numbering for the samples' layer outputs ``aux_layers``."""
    return _layer_ids(target_dir, aux_layers, "speculators", "the speculators format ")


def check_formats(formats: Any) -> tuple[str, ...]:
    fmts = tuple(formats)
    bad = [f for f in fmts if f not in EXPORT_FORMATS]
    if not fmts or bad:
        raise ValueError(f"export formats {list(fmts)}: use one or more of {', '.join(EXPORT_FORMATS)}")
    return fmts


def export_config(dcfg: DraftConfig, sglang_layer_ids: list[int], dtype: str) -> dict[str, Any]:
    """config.json; ``sglang_layer_ids`` from :func:`eagle_layer_ids` (sglang's numbering, not ours)."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": dcfg.hidden_size,
        "intermediate_size": dcfg.intermediate_size,
        "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads,
        "head_dim": dcfg.head_dim,
        "hidden_act": dcfg.hidden_act,
        "rms_norm_eps": dcfg.rms_norm_eps,
        "num_hidden_layers": 1,
        "vocab_size": dcfg.vocab_size,
        "draft_vocab_size": dcfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(sglang_layer_ids), "use_aux_hidden_state": True},
    }
    if dcfg.target_hidden_size and dcfg.target_hidden_size != dcfg.hidden_size:
        cfg["target_hidden_size"] = dcfg.target_hidden_size
    # Context length, rope and token ids exactly as the target has them.
    for k, v in dcfg.target_fields.items():
        if k not in ("rms_norm_eps", "hidden_act"):
            cfg[k] = v
    cfg.setdefault("max_position_embeddings", dcfg.max_position_embeddings)
    # transformers 5 writes rope_parameters only; sglang servers that predate it read the legacy pair
    # (rope_theta, rope_scaling: null for plain rope). Both forms, the same values.
    cfg.setdefault("rope_theta", dcfg.rope_theta)
    cfg.setdefault("rope_scaling", dcfg.rope_scaling)
    return cfg


def speculators_config(dcfg: DraftConfig, vllm_ids: list[int], dtype: str, target_model: str | Path,
                       speculative_tokens: int = SPECULATIVE_TOKENS) -> dict[str, Any]:
    """config.json of the speculators format; ``vllm_ids`` from :func:`vllm_layer_ids` (vLLM's numbering)."""
    if not vllm_ids:   # speculators and vLLM read null/[] as "use vLLM's default layers": never that
        raise ValueError("speculators export: the draft's aux layer ids are empty; the checkpoint must name the "
                         "layers it was trained on")
    tconf = json.loads((Path(target_model) / "config.json").read_text())
    archs, _ = target_architectures_and_layers(tconf)
    layer = export_config(dcfg, [], dtype)
    for k in ("architectures", "eagle_config", "draft_vocab_size", "target_hidden_size", "torch_dtype"):
        layer.pop(k, None)
    layer["dtype"] = dtype
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_model), "architectures": list(archs)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": dcfg.draft_vocab_size,
        "target_hidden_size": dcfg.target_hidden_size or dcfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(vllm_ids),
        **SPECULATORS_FLAGS,
        "dtype": dtype,
    }


def speculators_weight_name(name: str) -> str:
    """Our (SGLang's) tensor name as the speculators format has it: the one decoder layer is ``layers.0``."""
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def export_draft(checkpoint: str | Path, out_dir: str | Path, dtype: str = "auto",
                 formats: Any = EXPORT_FORMATS) -> Path:
    """Write ``out_dir`` from a training checkpoint, atomically: config.json + model.safetensors for SGLang
    (``"sglang"`` in ``formats``) and ``out_dir/speculators/`` (``"speculators"``), from the same tensors."""
    fmts = check_formats(formats)
    from safetensors.torch import load_file, save_file
    ckpt = Path(checkpoint)
    # a damaged checkpoint is refused by name (never a raw SafetensorError, never an older one silently)
    state = verify_checkpoint_files(ckpt)
    dcfg = DraftConfig.from_json(state["draft_config"])
    weights = load_file(str(ckpt / MODEL_FILE))
    missing = [n for n in SGLANG_WEIGHT_NAMES if n not in weights]
    if missing:
        raise KeyError(f"checkpoint {ckpt} lacks {missing}; it was not written by `eagleflow train`")
    name = target_dtype_name(state["target_model"]) if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ValueError(f"export dtype {dtype!r}: use one of auto, {', '.join(_DTYPES)}")
    # all fail before anything is written
    if not state.get("aux_layers"):   # never let a format fall back to default layers the draft never saw
        raise ValueError(f"checkpoint {ckpt} names no aux_layers (the target layers its hidden states came from); "
                         "it was not written by `eagleflow train`")
    layer_ids = eagle_layer_ids(state["target_model"], state["aux_layers"]) if "sglang" in fmts else []
    vllm_ids = vllm_layer_ids(state["target_model"], state["aux_layers"]) if "speculators" in fmts else []
    embedding = target_embedding(state["target_model"], dcfg) if "speculators" in fmts else None
    out: dict[str, torch.Tensor] = {}
    for n in SGLANG_WEIGHT_NAMES:
        t = weights[n]
        out[n] = t.contiguous() if n in ("d2t", "t2d") else t.to(_DTYPES[name]).contiguous()
    out_dir = Path(out_dir)
    meta = {"format": "pt", "source_checkpoint": str(ckpt)}
    with atomic_dir(out_dir) as tmp:   # a server never loads half an export
        if "sglang" in fmts:
            save_file(out, str(tmp / "model.safetensors"), metadata=meta)
            (tmp / "config.json").write_text(json.dumps(export_config(dcfg, layer_ids, name), indent=2) + "\n")
        if "speculators" in fmts:
            spec = tmp / SPECULATORS_DIR
            spec.mkdir()
            spec_weights = {speculators_weight_name(n): t for n, t in out.items()}
            if embedding is not None:   # always, with the speculators format (read above, before any write)
                spec_weights[SPECULATORS_EMBEDDING] = embedding.to(_DTYPES[name]).contiguous()
            save_file(spec_weights, str(spec / "model.safetensors"), metadata=meta)
            (spec / "config.json").write_text(json.dumps(
                speculators_config(dcfg, vllm_ids, name, state["target_model"]), indent=2) + "\n")
        (tmp / "eagleflow_export.json").write_text(json.dumps(
            {"checkpoint": str(ckpt), "step": state["step"], "metrics": state.get("metrics", {}),
             "target_model": state["target_model"], "aux_layer_outputs": state["aux_layers"],
             "formats": {f: str(format_dir(out_dir, f)) for f in fmts}},
            indent=2) + "\n")
    return out_dir


def target_embedding(target_dir: str | Path, dcfg: DraftConfig) -> torch.Tensor:
    """The target's input embedding [vocab, hidden] (what the draft reads, frozen), checked against the draft."""
    from .loss import load_target_tensors
    got = load_target_tensors(target_dir, ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight"])
    embed = got.get("model.embed_tokens.weight", got.get("model.language_model.embed_tokens.weight"))
    if embed is None:
        raise KeyError(f"exporting the speculators format for target {target_dir}: no model.embed_tokens.weight in "
                       "its safetensors (speculators' model reads the draft's embedding from the export)")
    if tuple(embed.shape) != (dcfg.vocab_size, dcfg.hidden_size):
        raise ValueError(f"exporting the speculators format for target {target_dir}: its embedding is "
                         f"{list(embed.shape)}, the draft reads [{dcfg.vocab_size}, {dcfg.hidden_size}]; was the "
                         "draft trained on this target?")
    return embed


def layer_ids_problem(export_dir: str | Path, target_dir: str | Path, fmt: str) -> str | None:
    """Why the engine serving export format ``fmt`` would feed the draft other target layers than the ones it
    was trained on, or None. Both engines read the draft's ``eagle_aux_hidden_state_layer_ids`` (SGLang under
    ``eagle_config``) and, where it is missing or empty, take their own default (vLLM (2, N // 2, N - 3),
    sglang the same layers) without a word: a list dropped on the way (speculators' converter writes null unless
    told) or written for other layers is refused here, before anything is served."""
    from eagleflow import bounded_json
    path = format_dir(export_dir, fmt) / "config.json"
    conf = bounded_json.read(path)
    conf = conf if isinstance(conf, dict) else {}
    holder = conf if fmt == "speculators" else conf.get("eagle_config")
    ids = holder.get("eagle_aux_hidden_state_layer_ids") if isinstance(holder, dict) else None
    engine = engine_serving_format(fmt).label
    if not ids:
        return (f"{path} names no eagle_aux_hidden_state_layer_ids ({ids!r}): {engine} would feed the draft its "
                "own default layers, not the ones it was trained on; re-export it with `eagleflow export` (or "
                f"write the ids its training used, in {engine}'s numbering)")
    meta = Path(export_dir) / "eagleflow_export.json"
    trained = bounded_json.read(meta) if meta.is_file() else None
    trained = trained.get("aux_layer_outputs") if isinstance(trained, dict) else None
    if trained:
        want = _layer_ids(target_dir, trained, fmt, "")
        if list(ids) != want:
            return (f"{path}: eagle_aux_hidden_state_layer_ids {list(ids)}, but the draft was trained on the outputs "
                    f"of layers {trained} of {target_dir}, {engine} ids {want} ({meta}); re-export it with "
                    "`eagleflow export`")
    return None


def export_latest(draft_dir: str | Path, out_dir: str | Path | None = None, dtype: str = "auto",
                  formats: Any = EXPORT_FORMATS) -> Path:
    ckpt = latest_checkpoint(Path(draft_dir) / "checkpoints")
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint under {Path(draft_dir) / 'checkpoints'}; run `eagleflow train` first")
    return export_draft(ckpt, out_dir or Path(draft_dir) / "export", dtype, formats)


def load_exported(export_dir: str | Path, target_dir: str | Path) -> Eagle3Draft:
    """A draft rebuilt from an export (weights as SGLang reads them) plus the target's embedding."""
    from safetensors.torch import load_file

    from .loss import load_target_head_and_embedding
    export_dir = Path(export_dir)
    cfg = json.loads((export_dir / "config.json").read_text())
    dcfg = DraftConfig.from_target(target_dir, int(cfg["draft_vocab_size"]))
    model = Eagle3Draft(dcfg)
    weights = load_file(str(export_dir / "model.safetensors"))
    _, embed = load_target_head_and_embedding(target_dir)
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    model.load_state_dict({**weights, "embed_tokens.weight": embed.float()}, strict=True)
    return model
