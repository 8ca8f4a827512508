"""The hf speculative decoder on a real (tiny) transformers target with a learnable next-token rule.

The target is the test assets' tiny Llama with its attention and MLP outputs zeroed and its lm_head
set so that after rule token RULE[i] it predicts RULE[i+1] (a real forward, a deterministic greedy
walk). A draft trained briefly with the TTT objective on the target's own states learns the walk;
one with random weights does not.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from eagleflow.config import load_config
from eagleflow.engines.hf.evaluator import measure
from eagleflow.evaluate.decoder import DraftProposer, Target, greedy, speculative, verify_greedy
from eagleflow.evaluate.run import gate
from eagleflow.train.loss import TrainingTimeTest, load_target_head_and_embedding
from eagleflow.train.model import DraftConfig, Eagle3Draft

RULE = list(range(8, 32))
NEXT = {v: RULE[(i + 1) % len(RULE)] for i, v in enumerate(RULE)}
MAX_NEW, STEPS = 24, 3


@pytest.fixture(scope="module")
def rule_target(demo_assets, tmp_path_factory) -> str:
    from safetensors.torch import load_file, save_file
    d = tmp_path_factory.mktemp("rule") / "target"
    shutil.copytree(demo_assets["target_model"], d)
    w = load_file(str(d / "model.safetensors"))
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k].zero_()   # the residual stream stays the token's embedding
    emb = w["model.embed_tokens.weight"]
    head = torch.zeros_like(w["lm_head.weight"])
    for v, n in NEXT.items():
        head[n] = 20 * emb[v]
    w["lm_head.weight"] = head
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return str(d)


@pytest.fixture(scope="module")
def target(rule_target) -> Target:
    torch.set_num_threads(1)
    t = Target(rule_target)
    t.eos_ids = set()   # every prompt decodes max_new tokens
    return t


def _prompts(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"s{seed}:{i}", "prompt_ids": [RULE[j] for j in torch.randint(0, len(RULE), (6,), generator=g)]}
            for i in range(n)]


def _draft(target_dir: str) -> Eagle3Draft:
    torch.manual_seed(1)
    d = Eagle3Draft(DraftConfig.from_target(target_dir, 825))
    _, emb = load_target_head_and_embedding(target_dir)
    d.embed_tokens.weight.data.copy_(emb.float())
    d.t2d.fill_(True)   # draft vocabulary = target vocabulary, d2t zero
    return d


@pytest.fixture(scope="module")
def drafts(target, rule_target) -> dict:
    """A random draft and one trained 40 steps on the target's own states of training prompts."""
    layers = target.aux_layers(None)
    ids = []
    for p in _prompts(8, 1):
        s = list(p["prompt_ids"])
        while len(s) < 32:
            s.append(NEXT[s[-1]])
        ids.append(s)
    ids = torch.tensor(ids)
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    assert (out.logits.argmax(-1)[:, 5:-1] == ids[:, 6:]).all()   # the target follows the rule
    aux = torch.cat([out.hidden_states[i + 1] for i in layers], -1)
    probs = torch.softmax(out.logits.float(), -1)
    trained = _draft(rule_target)
    ttt = TrainingTimeTest(trained, 4, "loss_positions")
    opt = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(40):
        loss, _ = ttt(ids, aux, probs, probs.argmax(-1), torch.ones(ids.shape, dtype=torch.bool))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"random": DraftProposer(_draft(rule_target), layers, target.device),
            "trained": DraftProposer(trained, layers, target.device)}


@pytest.fixture(scope="module")
def held_out(target) -> tuple[list[dict], dict]:
    prompts = _prompts(3, 2)   # other prompts than the training ones
    return prompts, {p["id"]: greedy(target, p["prompt_ids"], MAX_NEW) for p in prompts}


def _th(top: float) -> float:
    return 1e-4


def test_random_draft_scores_one_and_trained_draft_more_both_lossless(target, drafts, held_out):
    prompts, refs = held_out
    rnd = measure(target, drafts["random"], prompts, refs, STEPS, MAX_NEW, _th)
    got = measure(target, drafts["trained"], prompts, refs, STEPS, MAX_NEW, _th)
    assert rnd["accept_length"] < 1.1 and rnd["lossless"] and not rnd["mismatches"]
    assert got["accept_length"] > 2.5 > rnd["accept_length"] + 1, (got, rnd)
    assert got["lossless"] and not got["mismatches"]
    assert got["accepted_at_position"][0] > 0.8 and len(got["accepted_at_position"]) == STEPS
    # a token count that adds up: every generated token but the prefill's came from a verify pass
    assert got["verify_tokens"] == len(prompts) * (MAX_NEW - 1)
    assert got["sglang_accept_length"] > got["accept_length"]
    assert got["tokens_per_s"] > 0 and got["target_tokens_per_s"] > 0 and got["speedup"] > 0


def test_output_with_the_draft_is_the_targets_token_for_token(target, drafts, held_out):
    prompts, refs = held_out
    for p in prompts:
        ref = refs[p["id"]].tokens
        assert ref == [NEXT[x] for x in [p["prompt_ids"][-1]] + ref[:-1]]   # the rule's walk
        for steps in (1, 3, 7):
            assert speculative(target, drafts["trained"], p["prompt_ids"], MAX_NEW, steps).tokens == ref


def test_lossless_check_catches_a_corrupted_verify(target, drafts, held_out, monkeypatch):
    prompts, refs = held_out

    def accept_one_wrong(logits, drafts_):   # keeps every draft, then a token the target did not choose
        m, bonus = verify_greedy(logits, drafts_)
        return len(drafts_), (bonus + 1) % logits.shape[-1]

    bad = measure(target, drafts["random"], prompts, refs, STEPS, MAX_NEW, _th, verify=accept_one_wrong)
    assert not bad["lossless"]
    m = bad["mismatches"][0]
    assert m["prompt"] == prompts[0]["id"] and m["position"] == 1 and not m["near_tie"]
    assert m["emitted_logit_gap"] > 1.0   # the emitted token is far below the target's top: not a tie
    cfg = load_config(data={"target_model": "x", "eval": {"min_accept_length": 1.0}})
    why = gate([{"config": "3/1/4", "prompt_set": "held_out", "prompts": 3, "min_accept_length": 1.0,
                 "draft": bad}], cfg, baseline=False)
    assert len(why) == 1 and f"prompt {prompts[0]['id']} position 1" in why[0] and "not lossless" in why[0]


def test_gate_refuses_a_random_draft_and_one_worse_than_the_baseline(target, drafts, held_out):
    prompts, refs = held_out
    rnd = measure(target, drafts["random"], prompts, refs, STEPS, MAX_NEW, _th)
    got = measure(target, drafts["trained"], prompts, refs, STEPS, MAX_NEW, _th)
    cfg = load_config(data={"target_model": "x"})   # default eval.min_accept_length 1.5, tolerance 0.05
    row = {"config": "3/1/4", "prompt_set": "held_out", "prompts": 3, "min_accept_length": 1.5}
    why = gate([{**row, "draft": rnd}], cfg, baseline=False)
    assert why == [f"configuration 3/1/4 on held_out (3 prompts): acceptance length {rnd['accept_length']:.3f} "
                   "is below eval.min_accept_length 1.500"]
    assert gate([{**row, "draft": got}], cfg, baseline=False) == []
    worse = gate([{**row, "draft": got, "baseline": {**got, "accept_length": got["accept_length"] + 0.2}}], cfg,
                 baseline=True)
    assert len(worse) == 1 and f"worse than the baseline draft's {got['accept_length'] + 0.2:.3f}" in worse[0]
    within = gate([{**row, "draft": got, "baseline": {**got, "accept_length": got["accept_length"] + 0.04}}], cfg,
                  baseline=True)
    assert within == []


def _drafts_recomputed(draft: Eagle3Draft, tokens: list[int], aux: torch.Tensor, steps: int) -> list[int]:
    """The chain as training-time test computes it: every step over the whole prefix, read at its last index."""
    n = len(tokens) - 1
    ext = list(tokens)
    hidden = draft.fc(aux[:n].unsqueeze(0))
    cache: list = []
    for k in range(steps):
        hidden = draft.step(torch.tensor([ext[k + 1:k + 1 + n]]), hidden, k, cache)
        d = int(draft.logits(hidden[:, -1]).argmax(-1)[0])
        ext.append(d + int(draft.d2t[d]))
    return ext[len(tokens):]


@pytest.mark.parametrize("which", ["random", "trained"])
def test_draft_kv_cache_drafts_what_the_whole_prefix_recomputed_drafts(demo_assets, rule_target, drafts, which):
    """The proposer keeps step 0's keys across rounds and runs steps 1..k at the last index only; over a decode
    whose rounds commit 1 to 4 tokens, every round's chain equals the one recomputed over the whole prefix
    (on the demo's real target, whose attention is not zeroed, for the random draft)."""
    real = Target(demo_assets["target_model"] if which == "random" else rule_target)
    proposer = drafts[which]
    draft = proposer.draft
    if which == "random":
        proposer = DraftProposer(_draft(demo_assets["target_model"]), real.aux_layers(None), real.device)
        draft = proposer.draft
    prompt = _prompts(1, 3)[0]["prompt_ids"]
    seq = prompt + greedy(real, prompt, 40, candidates=False).tokens
    with torch.no_grad():
        out = real.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i + 1][0] for i in proposer.aux_layers], -1)
        proposer.start()
        length, rounds, commits = len(prompt) + 1, 0, [1, 3, 2, 4]
        while length <= len(seq):
            for steps in (1, 3) if rounds % 2 else (3,):
                cached = proposer.propose(seq[:length], aux[:length - 1], steps)
                assert cached == _drafts_recomputed(draft, seq[:length], aux, steps), (which, length, steps)
            assert proposer.cache.indices == length - 1
            length += commits[rounds % len(commits)]
            rounds += 1
    assert rounds >= 10
    with pytest.raises(ValueError, match="call start"):
        proposer.propose(seq[:5], aux, 3)
