"""The ``speculators`` export format vLLM serves: ``<export>/speculators/`` (``SPECULATORS_DIR``), written in the
same atomic step as the other formats (``eagleflow export``), so every format is always the same checkpoint.

    vllm serve TARGET --speculative-config \
        '{"method": "eagle3", "model": "<draft_dir>/export/speculators", "num_speculative_tokens": 3}'

The format of vllm-project/speculators 0.9.0 (``Eagle3SpeculatorConfig``), which vLLM 0.33.0 reads itself
(``transformers_utils/configs/speculators``):

- ``config.json``: ``Eagle3Speculator``, ``speculators_config`` (algorithm, a greedy proposal of
  ``speculative_tokens``, the verifier = the target), ``transformer_layer_config`` (the draft layer
  as a Llama config, ``vocab_size`` the target's), ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` in vLLM's numbering (``layers.vllm_aux_layer_ids``: the
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
from typing import TYPE_CHECKING, Any, Callable

from eagleflow.serving.aux_layers import target_architectures_and_layers
from eagleflow.train.export import DraftSource, export_config, layer_ids_for
from eagleflow.train.export_formats import SPECULATIVE_TOKENS
from eagleflow.train.loss import load_target_tensors

from .layers import vllm_aux_layer_ids

if TYPE_CHECKING:
    import torch

    from eagleflow.train.model import DraftConfig

SPECULATORS_VERSION = "0.9.0"          # the speculators release this format is proven against (tests/node_vllm)
# What model.Eagle3Draft computes, in speculators' (and vLLM's Eagle3LlamaForCausalLM's) terms:
#   norm_before_residual: residual = hidden_norm(hidden)? No: the residual is the raw hidden (DraftDecoderLayer).
#   norm_before_fc / fc_norm: an RMSNorm over the concatenated / each aux state before fc? No: fc(aux) as is.
#   norm_output: feed norm(out) to the next step? No: the pre-norm output; norm only before lm_head.
SPECULATORS_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
# The target's embedding, in the speculators format only (SGLang and vLLM share the target's at serve time;
# speculators' own model reads it from the checkpoint: see the module docstring).
SPECULATORS_EMBEDDING = "embed_tokens.weight"


def vllm_layer_ids(target_dir: str | Path, aux_layers: list[int]) -> list[int]:
    """``eagle_aux_hidden_state_layer_ids`` in vLLM's numbering for the samples' layer outputs ``aux_layers``."""
    return layer_ids_for(vllm_aux_layer_ids, target_dir, aux_layers, "the speculators format ")


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


def target_embedding(target_dir: str | Path, dcfg: DraftConfig) -> torch.Tensor:
    """The target's input embedding [vocab, hidden] (what the draft reads, frozen), checked against the draft."""
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


def writer(src: DraftSource) -> Callable[[Path], None]:
    """The speculators format of ``src``: its layer ids and the target's embedding are read (or refused) now,
    the files written by the result."""
    vllm_ids = vllm_layer_ids(src.target_model, src.aux_layers)
    embedding = target_embedding(src.target_model, src.dcfg)

    def write(folder: Path) -> None:
        from safetensors.torch import save_file
        spec_weights = {speculators_weight_name(n): t for n, t in src.weights.items()}
        spec_weights[SPECULATORS_EMBEDDING] = embedding.to(src.torch_dtype).contiguous()
        save_file(spec_weights, str(folder / "model.safetensors"), metadata=src.metadata)
        (folder / "config.json").write_text(json.dumps(
            speculators_config(src.dcfg, vllm_ids, src.dtype, src.target_model), indent=2) + "\n")
    return write


def layer_ids(conf: Any) -> Any:
    """The ids a speculators config.json names: at its top."""
    return conf.get("eagle_aux_hidden_state_layer_ids") if isinstance(conf, dict) else None
