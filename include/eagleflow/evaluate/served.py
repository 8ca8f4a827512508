"""What the served evaluation backends (eval.backend sglang, vllm) share: the recorded servers, the order they
run in, the lossless rule on log-probabilities and the paired speed-up, and the rows the gate reads.

Per run: the target alone is served once (the lossless reference, with each position's best
``TOP_CANDIDATES`` log-probabilities, and the speed baseline); then per configuration and per draft (the new
one, the baseline) the target is served with that draft. Every server is started detached and recorded like
every process eagleflow starts (``Node.spawn_detached``: a pid record under the run's state), polled until it
answers, warmed up by one untimed request, and stopped through its record (``Node.stop_recorded``) whatever
happens. The servers cannot run side by side on one GPU set, so the speed-up is one pair per prompt set (the
target alone, then with the draft).

An engine's module supplies only what is its own: the argv, the readiness probe, how a prompt set is sent
and how its figures are read (:class:`ServedEngine`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from eagleflow.config import PipelineConfig, SpecConfig
from eagleflow.engines import EngineError
from eagleflow.layout import RunLayout
from eagleflow.nodes import LocalNode
from eagleflow.serving.client import ServerError, request_json
from eagleflow.serving.dump_protocol import loopback_host
from eagleflow.ports import free_port
from .lossless import SERVER_TOP_LOGIT, first_difference, tie_tolerance
from .prompt_sets import expand_turns
from .speed import speed_figures

TARGET_ALONE = "target"


def near_tie_threshold(dtype: str, absolute: float | None) -> float:
    """The lossless rule's tolerance for log-probabilities: the top logit's magnitude is not answered, so
    :data:`.lossless.SERVER_TOP_LOGIT` stands for it ('auto' reads as bfloat16, the widest)."""
    return tie_tolerance(dtype, SERVER_TOP_LOGIT, absolute)


def lossless_and_speed(answers: dict[str, dict], alone: dict[str, dict], secs: float, alone_secs: float,
                       accept_length: float, threshold: float) -> dict:
    """The figures every backend reports the same way: each prompt's output with the draft against the target
    alone (``tokens``; the reference's ``candidates`` per position, best first), and the one timed pair."""
    mismatches = []
    for pid, a in answers.items():
        cands = alone[pid].get("candidates", [])
        mm = first_difference(alone[pid]["tokens"], a["tokens"], lambda i: cands[i] if i < len(cands) else [],
                              lambda top: threshold)
        if mm:
            mismatches.append({"prompt": pid, **mm})
    generated = sum(len(alone[pid]["tokens"]) for pid in answers)
    speed = speed_figures([generated], [alone_secs], [secs], accept_length,
                          "one pair per prompt set: the target alone, then with the draft, each server warmed up")
    return {**speed,
            "lossless": not [m for m in mismatches if not m["near_tie"]],
            "near_ties": sum(m["near_tie"] for m in mismatches),
            # at most 20 kept, real differences first (the gate names the first one)
            "mismatches": sorted(mismatches, key=lambda m: m["near_tie"])[:20]}


@dataclass(frozen=True)
class ServedEngine:
    """One engine's own parts of a served evaluation.

    - ``command(cfg, *, model_path, host, port, draft_dir, sc)``: the server's argv (``sc`` None: alone);
    - ``ready(url)``: returns when the server answers, raises ``ServerError`` while it does not;
    - ``reference(url, prompts, tag)``: the target alone's answers {prompt id: {"tokens", "candidates"}} and
      the wall seconds;
    - ``with_draft(url, prompts, tag, sc, alone, alone_secs)``: the figures of one draft on one prompt set;
    - ``warm_up(url, speculative)``: one short untimed request (first requests pay for allocations)."""
    label: str                        # in roles, logs and messages: sglang, vllm
    error: type[EngineError]
    command: Callable[..., list[str]]
    ready: Callable[[str], object]
    reference: Callable[[str, list[dict], str], tuple[dict[str, dict], float]]
    with_draft: Callable[..., dict]
    warm_up: Callable[[str, bool], object]


def role(label: str, draft_role: str, sc: SpecConfig | None) -> str:
    return f"eval_{label}_{draft_role}" + (f"_{sc.steps}_{sc.topk}_{sc.draft_tokens}" if sc else "")


class Server:
    """One recorded evaluation server: started detached, polled until ready, stopped by its record on exit."""

    def __init__(self, cfg: PipelineConfig, layout: RunLayout, node, argv: list[str], role_name: str, url: str,
                 log, engine: ServedEngine):
        self.cfg, self.layout, self.node, self.argv, self.role, self.url, self.log, self.engine = (
            cfg, layout, node, argv, role_name, url, log, engine)
        self.pid_file = str(layout.pid_file(role_name))
        self.log_file = str(layout.log_file(role_name))

    def __enter__(self) -> "Server":
        Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
        if self.node.live_record(self.pid_file) is not None:
            # an earlier try's server (a retry after the task was killed): stop it, its port and flags may differ
            self.node.stop_recorded(self.pid_file, grace_s=30)
        rec = self.node.spawn_detached(self.argv, role=self.role, pid_file=self.pid_file, log_file=self.log_file,
                                       owned_roots=self.layout.owned_roots)
        self.log(f"evaluate ({self.engine.label}): {self.role} pid {rec.pid}, log {self.log_file}: "
                 f"{' '.join(self.argv)}")
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        label = self.engine.label
        deadline = time.monotonic() + self.cfg.eval.ready_timeout_s
        while time.monotonic() < deadline:
            if not self.node.process_status(self.pid_file).alive:
                raise self.engine.error(f"{label} ({self.role}) exited while loading; read {self.log_file}")
            try:
                self.engine.ready(self.url)
                return
            except ServerError:
                time.sleep(2)
        raise self.engine.error(f"{label} ({self.role}) did not answer {self.url} within "
                                f"{self.cfg.eval.ready_timeout_s:.0f} s; raise eval.ready_timeout_s or read "
                                f"{self.log_file}")

    def __exit__(self, *exc) -> None:
        res = self.node.stop_recorded(self.pid_file, grace_s=30)
        self.log(f"evaluate ({self.engine.label}): {res.detail}")


def serve_and_measure(cfg: PipelineConfig, layout: RunLayout, engine: ServedEngine, *, target_dir: str,
                      drafts: dict[str, Path], prompt_sets: dict[str, list[dict]], log, node=None) -> list[dict]:
    """The result rows (configuration x prompt set, each draft's figures under its role), in the hf backend's
    shape so ``run.gate`` reads them unchanged."""

    ec = cfg.eval
    node = node or LocalNode(name=cfg.node.name)
    host = loopback_host(cfg.server.host)   # its servers take no credential: loopback only

    def serve(draft_role, draft_dir, sc):
        port = free_port(host)
        argv = engine.command(cfg, model_path=target_dir, host=host, port=port, draft_dir=draft_dir, sc=sc)
        return Server(cfg, layout, node, argv, role(engine.label, draft_role, sc), f"http://{host}:{port}", log,
                      engine)

    alone, alone_secs = {}, {}
    prompt_sets = dict(prompt_sets)
    with serve(TARGET_ALONE, None, None) as srv:
        engine.warm_up(srv.url, False)
        for name, prompts in prompt_sets.items():
            def answers(ps: list[dict], tag: str = f"alone-{name}-turns") -> dict[str, list[int]]:
                return {pid: a["tokens"] for pid, a in engine.reference(srv.url, ps, tag)[0].items()}
            # MT-Bench: each later turn follows the target's own greedy answer to the turns before it; then the
            # whole set is the reference, sent as the drafts' servers get it (the timed pair compares like with like)
            prompt_sets[name] = expand_turns(prompts, answers, target_dir)
            alone[name], alone_secs[name] = engine.reference(srv.url, prompt_sets[name], f"alone-{name}")
    rows = {(sc.label, name): {"config": sc.label, "steps": sc.steps, "topk": sc.topk,
                               "draft_tokens": sc.draft_tokens, "prompt_set": name, "prompts": len(prompts),
                               "min_accept_length": sc.min_accept_length or ec.min_accept_length}
            for sc in ec.configs for name, prompts in prompt_sets.items()}
    for sc in ec.configs:
        for draft_role, d in drafts.items():
            with serve(draft_role, d, sc) as srv:
                engine.warm_up(srv.url, True)
                for name, prompts in prompt_sets.items():
                    rows[(sc.label, name)][draft_role] = engine.with_draft(
                        srv.url, prompts, f"{draft_role}-{name}", sc, alone[name], alone_secs[name])
    return list(rows.values())


def post_all(url: str, path: str, prompts: list[dict], *, body: Callable[[dict], dict],
             read: Callable[[dict, str], dict], error: type[Exception], concurrency: int,
             timeout_s: float) -> tuple[dict[str, dict], float]:
    """Every prompt POSTed to ``url + path`` (``body(prompt)``), ``concurrency`` in flight, each answer read by
    ``read(answer, where)``; (answers by prompt id, wall seconds). A request that fails raises ``error`` naming
    the prompt."""
    from concurrent.futures import ThreadPoolExecutor


    def one(p: dict) -> tuple[str, dict]:
        where = f"{url}{path} prompt {p['id']}"
        try:
            ans = request_json(url, "POST", path, body(p), timeout_s)
        except ServerError as e:
            raise error(f"{where}: {e}") from None
        return p["id"], read(ans, where)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(concurrency, max(1, len(prompts)))) as pool:
        out = dict(pool.map(one, prompts))
    return out, time.monotonic() - started

