"""The EAGLE-3 draft model: one Llama decoder layer over fused target features.

Parameter names are the ones SGLang's ``LlamaForCausalLMEagle3`` loads
(``srt/models/llama_eagle3.py``): ``midlayer.self_attn.{q,k,v,o}_proj``,
``midlayer.mlp.{gate,up,down}_proj``, ``midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``.
SGLang silently drops names it does not know, so the names are the contract.

One decoding step (mirrors SGLang's forward, so a trained draft behaves the same
when served):

    residual = hidden                              # fc(aux 3H) at step 0, own output after
    x = cat(input_layernorm(embed), hidden_norm(hidden))        # 2H
    h = self_attn(x) + residual
    out = mlp(post_attention_layernorm(h)) + h     # fed to the next step
    logits = lm_head(norm(out))                    # over the draft vocabulary

Attention during training-time test (TTT): the query of step k at position t
sees step 0's keys at positions <= t (causal) and, for steps 1..k, only the
key at its own position t: the chain of its own earlier drafts, as in a
drafted sequence at inference.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int               # the target's vocabulary
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    target_hidden_size: int = 0   # 0 = hidden_size
    # Target config fields copied verbatim into the export (rope, context length, token ids).
    target_fields: dict[str, Any] = field(default_factory=dict)

    @property
    def aux_width(self) -> int:
        return 3 * (self.target_hidden_size or self.hidden_size)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DraftConfig":
        return cls(**data)

    @classmethod
    def from_target(cls, target_dir: str | Path, draft_vocab_size: int) -> "DraftConfig":
        """Draft dims equal to one layer of the target (EAGLE-3's default for Llama targets)."""
        path = Path(target_dir) / "config.json"
        try:
            tc = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"target config {path} does not exist; set target_model to a local model "
                                    "directory with config.json and safetensors weights") from None
        tc = tc.get("text_config", tc) if "hidden_size" not in tc else tc
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in tc]
        if missing:
            raise ValueError(f"target config {path} lacks {', '.join(missing)}; the draft takes its dims from it")
        heads = int(tc["num_attention_heads"])
        hidden = int(tc["hidden_size"])
        theta, scaling = _rope_settings(tc, path)
        keep = ("max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "bos_token_id",
                "eos_token_id", "pad_token_id", "rms_norm_eps", "hidden_act")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(tc["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(tc.get("num_key_value_heads") or heads),
            head_dim=int(tc.get("head_dim") or hidden // heads),
            vocab_size=int(tc["vocab_size"]),
            draft_vocab_size=min(int(draft_vocab_size), int(tc["vocab_size"])),
            rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(tc.get("max_position_embeddings", 4096)),
            hidden_act=str(tc.get("hidden_act", "silu")),
            target_fields={k: tc[k] for k in keep if k in tc},
        )


def _rope_settings(tc: dict[str, Any], where: Path) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the classic fields or transformers 5's ``rope_parameters``."""
    params = tc.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", tc.get("rope_theta", 10000.0)))
    scaling = tc.get("rope_scaling")
    if params and params.get("rope_type", "default") != "default":
        scaling = dict(params)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "llama3", "linear"):
            raise ValueError(f"target config {where}: rope type {kind!r} is not supported by the draft trainer "
                             "(supported: default, llama3, linear)")
        if kind == "default":
            scaling = None
    return theta, scaling


def rope_inv_freq(cfg: DraftConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if not s:
        return inv.float()
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return (inv / float(s["factor"])).float()
    # llama3: long wavelengths slowed by `factor`, short kept, smooth blend between
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(mid, blended, scaled).float()


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim] for integer positions [T]."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


EXPLICIT_ATTENTION_MAX_LEN = 2048


class Attender(Protocol):
    """Attention over keys kept elsewhere: ``attend(q, k, v)`` gets this call's queries, keys and values
    ([B, heads, T, head_dim], rope applied, KV heads repeated) and answers the attention output of the queries."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        # Up to this length the scores are materialised (fewest FLOPs); past it one fused
        # attention call over all steps' keys keeps memory linear in the length (8k-token samples).
        self.explicit_max_len = EXPLICIT_ATTENTION_MAX_LEN
        # The training step's fast path (``TrainingTimeTest(fast=True)``): the same attention as
        # ``_explicit`` with fewer, larger kernels (``_explicit_fast``).
        self.fast = False

    def _explicit(self, q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        t = q.shape[2]
        scale = 1.0 / math.sqrt(self.head_dim)
        k0, v0 = cache[0]
        scores = (q @ k0.transpose(-1, -2)).float() * scale                      # [B, h, T, T]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        diag = [(q.float() * ki.float()).sum(-1, keepdim=True) * scale for ki, _ in cache[1:]]  # [B, h, T, 1]
        probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1).to(v0.dtype)
        out = probs[..., :t] @ v0
        for i, (_, vi) in enumerate(cache[1:]):
            out = out + probs[..., t + i:t + i + 1] * vi
        return out

    def _explicit_fast(self, q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``_explicit``'s attention in fewer kernels (equal to float32 rounding; issue 49). ``cache`` holds the
        KV heads unrepeated ([B, kv, T, d]): the ``rep`` query heads of a KV head are one matmul's rows, so no
        repeated copy of the keys and values; the scale and the causal mask are folded into one ``baddbmm`` (no
        masked_fill forward and backward over [B, h, T, T]); the earlier steps' own-position keys and values are
        stacked, scored and summed in one op each (not one per step)."""
        b, h, t, d = q.shape
        kv = cache[0][0].shape[1]
        rep = h // kv
        scale = 1.0 / math.sqrt(self.head_dim)
        k0, v0 = cache[0]
        bias = torch.full((t, t), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        qg = q.reshape(b, kv, rep, t, d)
        scores = torch.baddbmm(bias.repeat(rep, 1), qg.reshape(b * kv, rep * t, d),
                               k0.reshape(b * kv, t, d).transpose(1, 2), alpha=scale).float()
        scores = scores.view(b, kv, rep, t, t)
        if len(cache) == 1:
            out = torch.softmax(scores, dim=-1).to(v0.dtype).view(b * kv, rep * t, t) @ v0.reshape(b * kv, t, d)
            return out.view(b, h, t, d)
        kd = torch.stack([ki for ki, _ in cache[1:]], dim=-2).unsqueeze(2)     # [B, kv, 1, T, k, d]
        vd = torch.stack([vi for _, vi in cache[1:]], dim=-2).unsqueeze(2)
        diag = (qg.float().unsqueeze(-2) * kd.float()).sum(-1) * scale           # [B, kv, rep, T, k]
        probs = torch.softmax(torch.cat([scores, diag], dim=-1), dim=-1).to(v0.dtype)
        out = (probs[..., :t].reshape(b * kv, rep * t, t) @ v0.reshape(b * kv, t, d)).view(b, kv, rep, t, d)
        return (out + (probs[..., t:].unsqueeze(-1) * vd).sum(-2)).view(b, h, t, d)

    def _fused(self, q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The same attention as ``_explicit``: keys of all steps side by side, causal block + diagonals."""
        t = q.shape[2]
        keys = torch.cat([ki for ki, _ in cache], dim=2)
        values = torch.cat([vi for _, vi in cache], dim=2)
        eye = torch.eye(t, dtype=torch.bool, device=q.device)
        mask = torch.cat([torch.ones(t, t, dtype=torch.bool, device=q.device).tril()] + [eye] * (len(cache) - 1),
                         dim=1)
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]] | Attender) -> torch.Tensor:
        """x [B, T, 2H]; ``cache``: the (k, v) of the earlier TTT steps, gaining this step's (training and the
        reference), or an :class:`Attender` that keeps keys its own way (the decoder's draft KV cache)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        if isinstance(cache, list) and self.fast and t <= self.explicit_max_len:
            cache.append((k, v))   # unrepeated: _explicit_fast groups the query heads instead
            out = self._explicit_fast(q, cache)
            out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
            return self.o_proj(out)
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if isinstance(cache, list):
            cache.append((k, v))
            out = self._fused(q, cache) if t > self.explicit_max_len else self._explicit(q, cache)
        else:
            out = cache.attend(q, k, v)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.o_proj(out)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"target hidden_act {cfg.hidden_act!r}: the draft trainer supports silu only")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]] | Attender) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        h = self.self_attn(x, cos, sin, cache) + hidden
        return self.mlp(self.post_attention_layernorm(h)) + h


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        # Taken from the target and frozen; SGLang substitutes the target's own at serve time.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.aux_width, cfg.hidden_size, bias=False)
        self.midlayer = DraftDecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    # the buffers registered above, typed (nn.Module's __getattr__ answers Tensor | Module)
    d2t: torch.Tensor
    t2d: torch.Tensor
    inv_freq: torch.Tensor

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embedding (reloaded from the target)."""
        return {k: v for k, v in self.state_dict().items() if k != "embed_tokens.weight"}

    def rope(self, t: int, offset: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(offset, offset + t, device=device)
        return rope_cos_sin(self.inv_freq, pos, dtype)

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, offset: int,
             cache: list[tuple[torch.Tensor, torch.Tensor]] | Attender) -> torch.Tensor:
        """One draft step over a whole sequence; returns the pre-norm output fed to the next step."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rope(input_ids.shape[1], offset, hidden.device, hidden.dtype)
        return self.midlayer(embeds, hidden, cos, sin, cache)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def first_step_logits(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of TTT step 0 (the draft's first token); used to compare a reloaded export."""
        return self.logits(self.step(input_ids, self.fc(aux_hidden_states), 0, []))
