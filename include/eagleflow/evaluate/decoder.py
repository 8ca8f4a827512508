"""Greedy speculative decoding with an EAGLE-3 draft over a transformers target (the hf backend).

One round, with ``L`` committed tokens ``x_0..x_{L-1}`` (the target's KV cache
holds positions 0..L-2; its aux states are known there):

- draft: as in training-time test (``train.loss``): step 0 at index t reads the
  token x_{t+1} and ``fc(aux_t)``, step k reads x_{t+k+1} (a drafted token past
  the end) and step k-1's output, with step 0's keys causal and steps 1..k only
  on the diagonal. The chain is read at the last index, L-2: step k's argmax
  (through ``d2t``) is draft token d_{k+1}. Through the model's own ``step``, with
  a draft KV cache (:class:`DraftKVCache`): step 0 runs only over the indices
  committed since the last round, steps 1..k at the last index only;
- verify: one target forward over [x_{L-1}, d_1..d_k]; the longest prefix of
  drafts equal to the target's greedy choice is kept, plus the target's token
  after it (the bonus); the target's cache is cropped to what was kept.

Acceptance length = tokens produced by verify passes / verify passes (a draft
never right scores exactly 1.0; SGLang's figure also counts the prefill's
token: (tokens + 1) / passes).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from eagleflow.serving.aux_layers import resolve_aux_layers
from eagleflow.train.export import load_exported

from .lossless import TOP_CANDIDATES, tie_tolerance


def near_tie_threshold(dtype: torch.dtype, top_logit: float, absolute: float | None = None) -> float:
    """How far below the top logit an emitted token may be and still be a tie (:mod:`.lossless`'s rule)."""
    return tie_tolerance(dtype, top_logit, absolute)


class Target:
    """A causal LM that answers logits and the EAGLE-3 aux states (layer outputs ``aux_layers``, concatenated)."""

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "auto"):
        from transformers import AutoModelForCausalLM
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("eval.device is 'cuda' but torch sees no CUDA GPU here; set eval.device: cpu")
        torch_dtype = {"auto": "auto", "bfloat16": torch.bfloat16, "float16": torch.float16,
                       "float32": torch.float32}[dtype]
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers mis-annotates .to()
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.dtype = next(self.model.parameters()).dtype
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = eos if eos is not None else self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def new_cache(self):
        from transformers import DynamicCache
        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def aux_layers(self, configured: list[int] | None) -> list[int]:
        return resolve_aux_layers(configured, self.num_layers)

    def forward(self, ids: list[int], cache,
                aux_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [T, V] float32, aux [T, 3H] or None) of ``ids`` appended after what ``cache`` holds."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, past_key_values=cache, use_cache=True, output_hidden_states=bool(aux_layers))
        # the output of layer j is hidden_states[j + 1] (entry 0 is the embedding), as the capture stores it
        aux = torch.cat([out.hidden_states[i + 1][0] for i in aux_layers], dim=-1) if aux_layers else None
        return out.logits[0].float(), aux


@dataclass
class Decoded:
    tokens: list[int]                 # generated tokens (prompt excluded)
    seconds: float
    verify_passes: int = 0
    accepted: list[int] = field(default_factory=list)   # drafted tokens kept, per verify pass
    # target alone: its best (token, logit) pairs per generated position, best first (the lossless check)
    candidates: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def verify_tokens(self) -> int:
        return sum(a + 1 for a in self.accepted)


def _candidates(logits: torch.Tensor) -> list[tuple[int, float]]:
    v, i = logits.topk(min(TOP_CANDIDATES, logits.shape[-1]))
    return list(zip(i.tolist(), v.tolist()))


def _finish(tokens: list[int], new: list[int], max_new: int, eos: set[int]) -> tuple[list[int], bool]:
    """``tokens`` plus ``new`` up to max_new and the first end-of-sequence token; (kept new, done)."""
    kept: list[int] = []
    for t in new:
        if len(tokens) + len(kept) >= max_new:
            return kept, True
        kept.append(t)
        if t in eos:
            return kept, True
    return kept, len(tokens) + len(kept) >= max_new


@torch.no_grad()
def greedy(target: Target, prompt: list[int], max_new: int, candidates: bool = True) -> Decoded:
    """The target alone, one token a forward (its KV cache kept): the reference and the speed baseline.

    ``candidates``: keep each position's best tokens and logits (the reference); off when only timed."""
    t0 = time.perf_counter()
    cache = target.new_cache()
    logits, _ = target.forward(prompt, cache)
    out: list[int] = []
    cands = []
    while True:
        tok = int(logits[-1].argmax())
        if candidates:
            cands.append(_candidates(logits[-1]))
        kept, done = _finish(out, [tok], max_new, target.eos_ids)
        out += kept
        if done:
            break
        logits, _ = target.forward([tok], cache)
    return Decoded(out, time.perf_counter() - t0, candidates=cands)


class DraftKVCache:
    """The draft's keys and values across a decode, so a round costs O(new tokens), not O(prefix).

    Step 0's key at index t depends only on the committed token x_{t+1} and the target's aux state at t, so
    it never changes once computed: those are kept (``prefix``) and extended by the indices committed since
    the last round; only the last index's output is read (step 1's input). Steps 1..k are needed at
    the last index only: their query sees all of step 0's keys and the chain's own keys at that index (``chain``,
    cleared each round), exactly the training-time-test mask (``train.model``) read at one row.
    """

    def __init__(self) -> None:
        self.prefix: tuple[torch.Tensor, torch.Tensor] | None = None
        self.chain: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.extending = True
        self.last = torch.empty(0)      # step 0's output at the last index (what step 1 reads)

    @property
    def indices(self) -> int:
        return 0 if self.prefix is None else self.prefix[0].shape[2]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.extending:
            self.prefix = (k, v) if self.prefix is None else (torch.cat([self.prefix[0], k], dim=2),
                                                              torch.cat([self.prefix[1], v], dim=2))
            # no causal mask: of the new rows only the last (which sees every key) is ever read
            keys, values = self.prefix
        else:
            assert self.prefix is not None, "a chain step needs step 0's keys first"
            self.chain.append((k, v))
            keys = torch.cat([self.prefix[0], *(c[0] for c in self.chain)], dim=2)
            values = torch.cat([self.prefix[1], *(c[1] for c in self.chain)], dim=2)
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype))


class DraftProposer:
    """Chain drafting with an :class:`~eagleflow.train.model.Eagle3Draft`: its training-time step, read at the
    last index, with a :class:`DraftKVCache` per decode (:meth:`start` begins one)."""

    def __init__(self, draft, aux_layers: list[int], device: torch.device):
        self.aux_layers = list(aux_layers)
        self.draft = draft.to(device).eval()
        self.device = device
        self.dtype = next(draft.fc.parameters()).dtype
        self.d2t = draft.d2t.to(device)
        self.cache = DraftKVCache()

    def start(self) -> None:
        """A new decode: the kept keys belong to the last one."""
        self.cache = DraftKVCache()

    def _token(self, hidden: torch.Tensor) -> int:
        d = int(self.draft.logits(hidden[:, -1]).argmax(-1)[0])
        return d + int(self.d2t[d])          # draft vocabulary -> target id

    @torch.no_grad()
    def propose(self, tokens: list[int], aux: torch.Tensor, steps: int) -> list[int]:
        """``steps`` draft tokens after ``tokens`` (length L), from aux states of positions 0..L-2.

        Step 0 runs over the indices committed since the last call (index t reads x_{t+1} and fc(aux_t) at
        position t); step k at the last index n-1 reads the k-th token past it at position n-1+k."""
        n = len(tokens) - 1                  # draft indices 0..L-2
        cache = self.cache
        done = cache.indices
        if done > n or n == 0:
            raise ValueError(f"draft cache holds {done} indices, the decode {n}: call start() per decode")
        cache.extending, cache.chain = True, []
        if done < n:
            ids = torch.tensor([tokens[done + 1:n + 1]], dtype=torch.long, device=self.device)
            step0 = self.draft.step(ids, self.draft.fc(aux[done:n].to(self.dtype).unsqueeze(0)), done, cache)
            cache.last = step0[:, -1:]
        hidden = cache.last
        drafts = [self._token(hidden)]
        cache.extending = False
        for k in range(1, steps):
            ids = torch.tensor([[drafts[-1]]], dtype=torch.long, device=self.device)
            hidden = self.draft.step(ids, hidden, n - 1 + k, cache)
            drafts.append(self._token(hidden))
        return drafts


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """(drafts accepted, bonus token): the longest prefix equal to the target's argmax, then its next token.

    ``logits`` [k+1, V]: row j is the target's distribution after the j-th fed token."""
    choice = logits.argmax(-1).tolist()
    m = 0
    while m < len(drafts) and drafts[m] == choice[m]:
        m += 1
    return m, choice[m]


@torch.no_grad()
def speculative(target: Target, proposer: DraftProposer, prompt: list[int], max_new: int, steps: int,
                verify=None) -> Decoded:
    """Greedy decoding with the draft; ``verify`` (default :func:`verify_greedy`) decides what is kept."""
    verify = verify or verify_greedy
    t0 = time.perf_counter()
    cache = target.new_cache()
    proposer.start()

    def forward(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        logits, aux = target.forward(ids, cache, proposer.aux_layers)
        if aux is None:   # the target answers aux states only for the layers asked
            raise ValueError("speculative decoding needs the draft's aux layers; this draft names none")
        return logits, aux

    logits, aux = forward(prompt)
    first = int(logits[-1].argmax())
    tokens = list(prompt) + [first]
    out, done = _finish([], [first], max_new, target.eos_ids)
    accepted: list[int] = []
    while not done:
        drafts = proposer.propose(tokens, aux, steps)
        vlogits, vaux = forward([tokens[-1]] + drafts)
        m, bonus = verify(vlogits, drafts)
        extra = cache.get_seq_length() - (len(tokens) + m)   # keep x_{L-1} and the accepted drafts
        if extra > 0:
            cache.crop(-extra)
        aux = torch.cat([aux, vaux[:m + 1]])
        kept, done = _finish(out, drafts[:m] + [bonus], max_new, target.eos_ids)
        out += kept
        tokens += drafts[:m] + [bonus]
        accepted.append(len(kept) - 1 if kept else 0)
    return Decoded(out, time.perf_counter() - t0, verify_passes=len(accepted), accepted=accepted)


def load_draft(export_dir: str | Path, target_dir: str | Path):
    """(draft, aux layer outputs it was trained on) from an export directory."""
    export_dir = Path(export_dir)
    for name in ("config.json", "model.safetensors"):
        if not (export_dir / name).is_file():
            raise FileNotFoundError(f"draft {export_dir} has no {name}; pass an export directory written by "
                                    "`eagleflow export` (config.json + model.safetensors)")
    meta_file = export_dir / "eagleflow_export.json"
    aux = json.loads(meta_file.read_text()).get("aux_layer_outputs") if meta_file.is_file() else None
    return load_exported(export_dir, target_dir), aux
