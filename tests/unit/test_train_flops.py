"""The draft step's FLOP count (eagleflow.train.flops, issue 49): a hand count for a tiny config, and PyTorch's
own FlopCounterMode over one real forward + backward of TrainingTimeTest."""
from __future__ import annotations

import pytest
import torch

from eagleflow.train.flops import draft_step_flops
from eagleflow.train.loss import TrainingTimeTest
from eagleflow.train.model import DraftConfig, Eagle3Draft

# H 8, I 16, 2 heads of 4 (1 KV head), target vocab 50, draft vocab 20, aux 3 x 8 = 24
TINY = DraftConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                   vocab_size=50, draft_vocab_size=20)


def test_tiny_config_matches_a_hand_count():
    B, T, K = 2, 5, 3
    f = draft_step_flops(TINY, B, T, K)
    # fc: forward 2*B*T*24*8 = 3840, + weight grad = 7680
    assert f.fc == 7680
    # per step per token: q 2H x 8 + k, v 2H x 4 each + o 8 x 8 = 16*8 + 16*4*2 + 64 = 320 MACs = 640 FLOPs;
    # x B*T = 10 tokens, x K = 3 steps, x 3 (fwd + bwd) = 57,600
    assert f.projections == 640 * 10 * 3 * 3 == 57_600
    # MLP: 3 x 8 x 16 = 384 MACs = 768 FLOPs a token: x 10 x 3 x 3 = 69,120
    assert f.mlp == 69_120
    # attention: two T x T matmuls per step: 2 * 2*B*h*T*T*d = 2 * 2*2*2*25*4 = 1,600 a step, x 3 steps x 3
    assert f.attention_matmul == 14_400
    # diagonal keys: step k has k of them, each 2 * 2*B*h*T*d = 320 forward: (0 + 1 + 2) * 320 * 3
    assert f.attention_diagonal == 2_880
    # draft head: rows 4 + 3 + 2 + the zero term's 1 = 10 a sample, x B = 20 rows x 2*8*20 = 6,400, x 3
    assert f.lm_head == 19_200
    # target head: 2*B*T*H*V = 2*10*8*50, forward only
    assert f.target_head == 8_000
    assert f.draft == 7680 + 57_600 + 69_120 + 14_400 + 2_880 + 19_200
    assert f.total == f.draft + 8_000
    fwd = draft_step_flops(TINY, B, T, K, backward=False)
    assert fwd.fc == 3840 and fwd.projections == 19_200 and fwd.target_head == 8_000


def test_the_fused_attention_path_counts_every_steps_keys():
    f = draft_step_flops(TINY, 1, 6, 2, explicit_max_len=4)
    # step 0: T keys, step 1: 2T keys; 2 matmuls, 2*B*h*T*keys*d each, x 3
    assert f.attention_matmul == 3 * 2 * 2 * 2 * 6 * (6 + 12) * 4
    assert f.attention_diagonal == 0


@pytest.mark.parametrize("T", [5, 9])
def test_count_matches_flop_counter_mode_on_one_forward_backward(T):
    from torch.utils.flop_counter import FlopCounterMode
    B, K = 2, 3
    torch.manual_seed(0)
    ttt = TrainingTimeTest(Eagle3Draft(TINY), K)
    ids = torch.randint(0, TINY.vocab_size, (B, T))
    aux = torch.randn(B, T, TINY.aux_width)
    probs = torch.softmax(torch.randn(B, T, TINY.draft_vocab_size), -1)
    top = probs.argmax(-1)
    valid = torch.ones(B, T, dtype=torch.bool)
    counter = FlopCounterMode(display=False)
    with counter:
        loss, _ = ttt(ids, aux, probs, top, valid)
        loss.backward()
    # FlopCounterMode counts matmuls only: the elementwise diagonal terms and the target head are apart
    assert counter.get_total_flops() == draft_step_flops(TINY, B, T, K).draft_matmul
