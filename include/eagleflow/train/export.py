"""Export a trained draft in the formats the serving engines serve (``eagleflow export``), in one atomic step.

This module is the format-neutral half: the checkpoint read and checked (``verify_checkpoint_files``, the
weights ``SGLANG_WEIGHT_NAMES``, the layers it was trained on), the weights in the export dtype
(``DraftSource``), the draft's own config as a ``LlamaForCausalLMEagle3`` (``export_config``), the atomic folder
and ``eagleflow_export.json``. Each format is its serving engine's (``eagleflow.engines``: ``draft_format``,
``draft_dir``, ``draft_writer``, ``draft_layer_ids``), written by that engine's ``engines/<name>/export.py``:

- ``sglang`` (``engines/sglang/export.py``): the export folder itself, served by
  ``sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path
  <draft_dir>/export``;
- ``speculators`` (``engines/vllm/export.py``): ``<draft_dir>/export/speculators/``, served by
  ``vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "<draft_dir>/export/speculators", ...}'``.

Every writer reads and checks what its format needs (the layer ids in its engine's numbering, never null; the
target's embedding) before anything is written, so a refused export leaves no folder.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from eagleflow.durable import atomic_dir
from eagleflow.engines import engine_serving_format
from eagleflow.engines.contract import LayerNumberingFn
from eagleflow.serving.aux_layers import target_architectures_and_layers
from eagleflow import bounded_json

from .checkpoint import MODEL_FILE, latest_checkpoint, verify_checkpoint_files
from .export_formats import EXPORT_FORMATS, format_dir
from .model import DraftConfig, Eagle3Draft
from .loss import load_target_head_and_embedding

# The checkpoint names SGLang's LlamaForCausalLMEagle3 loads (srt/models/llama_eagle3.py):
# q/k/v and gate/up are stacked by its loader, d2t becomes the hot-token map, t2d is skipped.
SGLANG_WEIGHT_NAMES = (
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def target_dtype_name(target_dir: str | Path) -> str:
    tc = json.loads((Path(target_dir) / "config.json").read_text())
    name = str(tc.get("torch_dtype") or tc.get("dtype") or "bfloat16")
    return name if name in _DTYPES else "bfloat16"


def layer_ids_for(numbering: LayerNumberingFn, target_dir: str | Path, aux_layers: list[int],
                  what: str = "") -> list[int]:
    """The target's layer ids for the samples' layer outputs ``aux_layers`` in an engine's ``numbering`` (its
    ``layer_numbering``); a target it cannot number is refused naming ``what`` is exported and the target."""
    path = Path(target_dir) / "config.json"
    archs, num_layers = target_architectures_and_layers(json.loads(path.read_text()))
    try:
        return numbering(aux_layers, archs, num_layers)
    except ValueError as e:
        raise ValueError(f"exporting {what}for target {path}: {e}") from None


@dataclass(frozen=True)
class DraftSource:
    """What every format writer exports: one checked checkpoint's weights in the export dtype."""
    checkpoint: Path
    state: dict[str, Any]                # the checkpoint's state (target_model, aux_layers, step, metrics)
    dcfg: DraftConfig
    weights: dict[str, torch.Tensor]     # SGLANG_WEIGHT_NAMES, in the export dtype (d2t, t2d as stored)
    dtype: str                           # the export dtype's name (bfloat16, float16, float32)
    torch_dtype: torch.dtype
    metadata: dict[str, str]             # the safetensors metadata every format's weights carry

    @property
    def target_model(self) -> str:
        return str(self.state["target_model"])

    @property
    def aux_layers(self) -> list[int]:
        return list(self.state["aux_layers"])


def check_formats(formats: Any) -> tuple[str, ...]:
    fmts = tuple(formats)
    bad = [f for f in fmts if f not in EXPORT_FORMATS]
    if not fmts or bad:
        raise ValueError(f"export formats {list(fmts)}: use one or more of {', '.join(EXPORT_FORMATS)}")
    return fmts


def export_config(dcfg: DraftConfig, sglang_layer_ids: list[int], dtype: str) -> dict[str, Any]:
    """The draft as a ``LlamaForCausalLMEagle3`` config.json: the SGLang format's (``sglang_layer_ids`` from
    ``engines.sglang.export.eagle_layer_ids``: sglang's numbering, not ours), the base of the speculators
    format's ``transformer_layer_config``."""
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


def export_draft(checkpoint: str | Path, out_dir: str | Path, dtype: str = "auto",
                 formats: Any = EXPORT_FORMATS) -> Path:
    """Write ``out_dir`` from a training checkpoint, atomically: each export format in ``formats``, in its folder
    (``eagleflow.engines.format_dirs``), by the writer of the engine that serves it, from the same tensors."""
    fmts = check_formats(formats)
    from safetensors.torch import load_file
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
    out: dict[str, torch.Tensor] = {}
    for n in SGLANG_WEIGHT_NAMES:
        t = weights[n]
        out[n] = t.contiguous() if n in ("d2t", "t2d") else t.to(_DTYPES[name]).contiguous()
    src = DraftSource(checkpoint=ckpt, state=state, dcfg=dcfg, weights=out, dtype=name, torch_dtype=_DTYPES[name],
                      metadata={"format": "pt", "source_checkpoint": str(ckpt)})
    # each format's engine reads and checks what it needs (layer ids, the target's embedding) before any write
    writers: list[tuple[str, Callable[[Path], None]]] = [(f, engine_serving_format(f).draft_writer_for(src))
                                                         for f in fmts]
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:   # a server never loads half an export
        for fmt, write in writers:
            folder = format_dir(tmp, fmt)
            folder.mkdir(parents=True, exist_ok=True)
            write(folder)
        (tmp / "eagleflow_export.json").write_text(json.dumps(
            {"checkpoint": str(ckpt), "step": state["step"], "metrics": state.get("metrics", {}),
             "target_model": state["target_model"], "aux_layer_outputs": state["aux_layers"],
             "formats": {f: str(format_dir(out_dir, f)) for f in fmts}},
            indent=2) + "\n")
    return out_dir


def layer_ids_problem(export_dir: str | Path, target_dir: str | Path, fmt: str) -> str | None:
    """Why the engine serving export format ``fmt`` would feed the draft other target layers than the ones it
    was trained on, or None. Both engines read the draft's ``eagle_aux_hidden_state_layer_ids`` (SGLang under
    ``eagle_config``) and, where it is missing or empty, take their own default (vLLM (2, N // 2, N - 3),
    sglang the same layers) without a word: a list dropped on the way (speculators' converter writes null unless
    told) or written for other layers is refused here, before anything is served."""
    path = format_dir(export_dir, fmt) / "config.json"
    conf = bounded_json.read(path)
    serving = engine_serving_format(fmt)
    ids = serving.layer_ids_in(conf if isinstance(conf, dict) else {})
    engine = serving.label
    if not ids:
        return (f"{path} names no eagle_aux_hidden_state_layer_ids ({ids!r}): {engine} would feed the draft its "
                "own default layers, not the ones it was trained on; re-export it with `eagleflow export` (or "
                f"write the ids its training used, in {engine}'s numbering)")
    meta = Path(export_dir) / "eagleflow_export.json"
    trained = bounded_json.read(meta) if meta.is_file() else None
    trained = trained.get("aux_layer_outputs") if isinstance(trained, dict) else None
    if trained:
        want = layer_ids_for(serving.layer_ids, target_dir, trained)
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

    export_dir = Path(export_dir)
    cfg = json.loads((export_dir / "config.json").read_text())
    dcfg = DraftConfig.from_target(target_dir, int(cfg["draft_vocab_size"]))
    model = Eagle3Draft(dcfg)
    weights = load_file(str(export_dir / "model.safetensors"))
    _, embed = load_target_head_and_embedding(target_dir)
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    model.load_state_dict({**weights, "embed_tokens.weight": embed.float()}, strict=True)
    return model
