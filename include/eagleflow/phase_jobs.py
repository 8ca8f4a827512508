"""A sharded phase's detached jobs on the node, whichever phase's (capture or generation): the one exclusive
start of a server or worker (or attach to the live recorded one), a server's info file, one look at its state
(ready, loading, stuck, dead), the wait until ready, a job's log tail.

Works through ``eagleflow.nodes.Node`` primitives only (LocalNode, SSHNode, the operators and the watchdog's
recovery alike). ``ctx`` is anything with ``cfg``, ``layout``, ``node`` and ``eagleflow_argv``
(``eagleflow.layout.RunLike``). Each phase's lifecycle (``capture.lifecycle``, ``generate.lifecycle``) names its
jobs' roles, its server's info file and health command, and calls these.
"""
from __future__ import annotations

import shlex
import time

from eagleflow import bounded_json
from eagleflow.serving.client import ServerError, health_generate
from eagleflow.layout import RunLike
from eagleflow.nodes import JobAlreadyRunning, LocalNode, NodeFileRefused, ProcessRecord


class ServerNotReady(RuntimeError):
    """The server died while loading or did not answer /health_generate in time."""


INFO_MAX_BYTES = 1 << 16   # a server's info file: a few fields


def read_server_info(ctx: RunLike, info_file: str) -> dict | None:
    """A server's info file (url, pid, model, ...) as written once it listens; None while absent, unreadable or
    refused (``server_info_or_why``)."""
    return server_info_or_why(ctx, info_file)[0]


def server_info_or_why(ctx: RunLike, info_file: str) -> tuple[dict | None, str]:
    """(the info, "") or (None, why not): read on the node the way pid records are (``Node.read_owned_text``: our
    own regular file that nobody else may write, no link followed) and parsed within bounds (``bounded_json``),
    since its URL is where the workers send the corpus: one someone else wrote names no server of ours."""
    try:
        text = ctx.node.read_owned_text(info_file, limit=INFO_MAX_BYTES)
        if not text:
            return None, f"{info_file} not written yet"
        info = bounded_json.loads(text, source=f"{info_file} on node {ctx.node.name}", max_bytes=INFO_MAX_BYTES)
    except (NodeFileRefused, ValueError) as e:
        return None, f"{info_file} refused: {e}"
    return (info, "") if isinstance(info, dict) else (None, f"{info_file} refused: not a JSON object")


def server_url_in(info_file: str) -> str:
    """On the node: the URL a server's info file names, read as one of our own files within bounds
    (``bounded_json.read(owned=True)``); OSError (``durable.UnsafeFile`` when it is not ours) or ValueError
    naming the file and why when there is no URL to trust."""
    info = bounded_json.read(info_file, max_bytes=INFO_MAX_BYTES, owned=True)
    url = info.get("url") if isinstance(info, dict) else None
    if not isinstance(url, str) or not url:
        raise ValueError(f"{info_file} names no server url")
    return url


def start_or_attach_server(ctx: RunLike, role: str, argv: list[str], info_file: str, what: str,
                           log=None) -> tuple[ProcessRecord, bool]:
    """The one server start (capture and generation): a live recorded server is kept, and the start is
    exclusive, like a worker's: detach takes ``lock_file(role)`` and the server holds it for its life, so
    two callers at once (concurrent retries) start one server and the other attaches to it."""
    # A stale info file from an earlier server would make readiness read the wrong URL (a concurrent
    # starter's server writes its own only once loaded, long after this).
    rec, started = start_exclusive(ctx, role, argv,
                                   before=lambda: ctx.node.run(["rm", "-f", "--", info_file], timeout=30))
    if log and started:
        log(f"{what} started on node {ctx.node.name}: pid {rec.pid}, log {rec.log_file}, command {shlex.join(argv)}")
    elif log:
        log(f"{what.split(' (')[0]} already running: pid {rec.pid} (record {ctx.layout.pid_file(role)}); keeping it")
    return rec, started


def start_exclusive(ctx: RunLike, role: str, argv: list[str], before=None) -> tuple[ProcessRecord, bool]:
    """(record, started): the live recorded process of ``role``, or a new detached one that holds
    ``lock_file(role)`` for its life; a concurrent start that won the lock is attached to (servers, workers).
    ``before`` runs just before a spawn."""
    pid_file = str(ctx.layout.pid_file(role))
    rec = ctx.node.live_record(pid_file)
    if rec is not None:
        return rec, False
    if before is not None:
        before()
    try:
        return ctx.node.spawn_detached(argv, role=role, pid_file=pid_file, log_file=str(ctx.layout.log_file(role)),
                                       lock_file=str(ctx.layout.lock_file(role)),
                                       owned_roots=ctx.layout.owned_roots), True
    except JobAlreadyRunning as e:   # a concurrent start won the lock: the process it records
        return _recorded_holder(ctx, pid_file, e), False


def server_healthy(url: str, timeout_s: float) -> bool:
    """One real one-token generation answered within ``timeout_s``."""
    try:
        health_generate(url, timeout_s)
        return True
    except ServerError:
        return False


class ServerStuck(ServerNotReady):
    """The recorded server is ours and alive but stopped (state T/t) or a zombie: it can never answer, so
    nobody waits for it to load; it must be stopped and started again."""


# /proc states in which a live recorded server cannot answer however long one waits
STUCK_STATES = {"T": "stopped (state T: SIGSTOP'd)", "t": "stopped by a tracer (state t)", "Z": "a zombie (state Z)"}


def check_server_ready(ctx: RunLike, role: str, info_file: str, health_cmd: str, what: str,
                       health_timeout_s: float) -> tuple[str, dict | None, str]:
    """One cheap look at a recorded server (capture or generation): ("ready" | "loading" | "stuck" | "dead",
    its info, detail). "stuck" is read off the leader's /proc state, with no health request: a SIGSTOP'd
    server must not be taken for one still loading (the generation drill that waited out ready_timeout_s).

    Over SSH the health request runs on the node (the server binds the node's loopback), through
    ``eagleflow <health_cmd> health``.
    """
    pid_file = ctx.layout.pid_file(role)
    st = ctx.node.process_status(str(pid_file))
    if not st.alive:
        return "dead", None, (f"the {what} is not running (pid record {pid_file}: "
                              f"{'absent' if not st.recorded else st.detail}); last lines of "
                              f"{ctx.layout.log_file(role)}:\n{log_tail(ctx, role)}")
    if st.state in STUCK_STATES:
        pid = st.record.pid if st.record else "?"
        return "stuck", None, (f"the {what} pid {pid} is {STUCK_STATES[st.state]}: it cannot answer until it is "
                               "stopped and started again")
    info, why = server_info_or_why(ctx, info_file)
    if not info or not info.get("url"):
        return "loading", None, f"loading: {why or f'{info_file} names no url yet'}"
    if isinstance(ctx.node, LocalNode):
        ok = server_healthy(info["url"], health_timeout_s)
    else:
        ok = ctx.node.run(ctx.eagleflow_argv(health_cmd, "health", "--timeout", str(health_timeout_s)),
                          timeout=health_timeout_s + 60).ok
    return ("ready" if ok else "loading"), info, ("ready" if ok else f"{info['url']} not answering yet")


def wait_server_ready(ctx: RunLike, look, what: str, role: str, timeout_s: float, poll_s: float = 1.0,
                      died: type[ServerNotReady] = ServerNotReady) -> dict:
    """Poll ``look()`` (a ``check_server_ready``) until "ready"; ``died`` when the server is gone, ServerStuck at
    once when it can never answer, ServerNotReady when ``timeout_s`` ran out."""
    deadline = time.monotonic() + timeout_s
    while True:
        state, info, detail = look()
        if state == "ready":
            return info
        if state == "dead":
            raise died(detail)
        if state == "stuck":
            raise ServerStuck(detail)
        if time.monotonic() >= deadline:
            raise ServerNotReady(f"the {what} did not become ready within {timeout_s:.0f} s "
                                        f"({detail}); raise server.ready_timeout_s if the model loads slowly, "
                                        f"or read {ctx.layout.log_file(role)}")
        time.sleep(poll_s)


def log_tail(ctx: RunLike, role: str, lines: int = 20) -> str:
    res = ctx.node.run(["tail", "-n", str(lines), "--", str(ctx.layout.log_file(role))], timeout=30)
    return res.stdout if res.ok else "(no log)"


def _recorded_holder(ctx: RunLike, pid_file: str, refused: JobAlreadyRunning, wait_s: float = 10.0) -> ProcessRecord:
    """The recorded job (server or worker) that holds the lock (a concurrent start records it within moments),
    else the refusal.

    A live recorded worker is the holder: detach hands the lock to the worker it records, and a
    worker that finds the lock taken exits at once.
    """
    deadline = time.monotonic() + wait_s
    while True:
        rec = ctx.node.live_record(pid_file)
        if rec is not None:
            return rec
        if time.monotonic() >= deadline:
            raise refused
        time.sleep(0.2)
