"""The FLOPs of one draft training step, counted from the model's shapes (issue 49).

Counted as the trainer executes them (``loss.TrainingTimeTest`` over ``model.Eagle3Draft``), on the padded
batch [B, T] (padding is computed too; a caller that wants useful FLOPs scales by real / padded tokens).
A multiply-add is 2 FLOPs; a matmul [M, K] x [K, N] is 2 M K N.

Forward, per batch:

- ``fc``: 2 B T (3H_target) H, once (TTT step 0's input);
- per TTT step k = 0..K-1 (all T positions):
  - q, k, v, o projections: 2 B T (2H (h d + 2 kv d) + h d H);
  - MLP (gate, up, down): 2 B T 3 H I;
  - attention (``DraftAttention._explicit``, T <= its explicit limit): scores q k0^T and probs v0 over the
    full T x T square, 2 x 2 B h T T d (the causal half masked, not skipped), and for each of the k earlier
    steps' diagonal keys an elementwise score and value term, 2 x 2 B h T d a key; past the explicit limit
    (``_fused``: one SDPA call over (k+1) T keys) 2 x 2 B h T (k+1)T d;
  - ``lm_head`` on the positions whose target exists, n_k = T - k - 1: 2 B n_k H V_draft;
- one more ``lm_head`` row per sample (the zero term that reaches every parameter): 2 B H V_draft.

Backward: twice the forward of every matmul whose input needs a gradient (input grad + weight grad, or both
operands' grads), once for ``fc`` (its input, the stored aux states, needs none). So training = 3 x forward,
``fc`` 2 x forward.

The target's frozen ``lm_head`` over the full vocabulary (``loss.target_batch``, no gradient) is forward only,
2 B T H V, and reported apart: it is work the step does, not the draft's training.

RMSNorm, rope, softmax, SiLU and the loss's elementwise terms are not counted (O(B T (H + V_draft)) a step,
below 1 % at every size the trainer runs).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .model import EXPLICIT_ATTENTION_MAX_LEN, DraftConfig


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step on a [batch, seq_len] padded batch, forward + backward, by part."""
    fc: int
    projections: int          # q, k, v, o over all TTT steps
    mlp: int                  # gate, up, down over all TTT steps
    attention_matmul: int     # the T x T (or fused) score and value matmuls over all TTT steps
    attention_diagonal: int   # the earlier steps' own-position keys (elementwise in the explicit path)
    lm_head: int              # the draft's head over the draft vocabulary, all TTT steps
    target_head: int          # the target's frozen head, forward only (no gradient)

    @property
    def draft_matmul(self) -> int:
        """Everything counted as a matmul in the draft's forward + backward (what FlopCounterMode sees)."""
        return self.fc + self.projections + self.mlp + self.attention_matmul + self.lm_head

    @property
    def draft(self) -> int:
        """The draft's training FLOPs (forward + backward), the target head not included."""
        return self.draft_matmul + self.attention_diagonal

    @property
    def total(self) -> int:
        """All the step's counted FLOPs: the draft's training plus the target head's forward."""
        return self.draft + self.target_head

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "draft_matmul": self.draft_matmul, "draft": self.draft, "total": self.total}


def draft_step_flops(cfg: DraftConfig, batch: int, seq_len: int, ttt_length: int, *,
                     backward: bool = True, explicit_max_len: int = EXPLICIT_ATTENTION_MAX_LEN) -> StepFlops:
    """FLOPs of one TTT training step of the draft ``cfg`` on a padded [batch, seq_len] batch (see the module).

    ``backward=False``: the forward only (the evaluator's and held-out loss's cost).
    """
    B, T, K = batch, seq_len, ttt_length
    H, I = cfg.hidden_size, cfg.intermediate_size
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    Vd, V = cfg.draft_vocab_size, cfg.vocab_size
    train = 3 if backward else 1          # forward + (input grad + weight grad)
    fc_train = 2 if backward else 1       # forward + weight grad (its input needs no gradient)
    fc = fc_train * 2 * B * T * cfg.aux_width * H
    proj = train * K * 2 * B * T * (2 * H * (h * d + 2 * kv * d) + h * d * H)
    mlp = train * K * 2 * B * T * 3 * H * I
    att_mm = att_diag = 0
    for k in range(K):
        if T > explicit_max_len:
            att_mm += 2 * 2 * B * h * T * (k + 1) * T * d
        else:
            att_mm += 2 * 2 * B * h * T * T * d
            att_diag += k * 2 * 2 * B * h * T * d
    head_rows = sum(max(T - k - 1, 0) for k in range(K)) + 1
    lm = train * 2 * B * head_rows * H * Vd
    return StepFlops(fc=fc, projections=proj, mlp=mlp, attention_matmul=train * att_mm,
                     attention_diagonal=train * att_diag, lm_head=lm, target_head=2 * B * T * H * V)


def draft_matmul_shapes(cfg: DraftConfig, tokens: int) -> list[tuple[str, int, int, int]]:
    """The draft step's weight matmuls as (name, M, K, N) for ``tokens`` rows: what a throughput probe of
    "this machine's matmul at the draft's shapes" should time."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return [("fc", tokens, cfg.aux_width, H), ("qkv", tokens, 2 * H, (h + 2 * kv) * d), ("o", tokens, h * d, H),
            ("gate_up", tokens, H, 2 * I), ("down", tokens, I, H), ("lm_head", tokens, H, cfg.draft_vocab_size),
            ("target_head", tokens, H, cfg.vocab_size)]
