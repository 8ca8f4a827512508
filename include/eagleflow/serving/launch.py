"""What every capture server's launcher does once it has built its engine's command (sglang, vLLM).

The engine runs as our child in the same process group (a group signal stops both; TERM and INT are
forwarded), we wait until ``/health_generate`` answers, send one capture request the way the extraction
worker does and require its dump to verify under the run's key with the request's rows (the self-check),
and only then write the server info file the workers and the watch read. Anything failing on the way
stops the child and exits 4, the reason on stderr. Each engine's launcher keeps only what is its own:
the version it supports, its flags, its layer numbering and how it receives the capture settings.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from eagleflow.config import PipelineConfig
from eagleflow.durable import atomic_write
from eagleflow.layout import RunLayout
from eagleflow.ports import free_port
from eagleflow.serving.aux_layers import resolve_aux_layers, target_architectures_and_layers
from eagleflow.serving.client import ServerError, generate, health_generate
from eagleflow.serving.dump_protocol import (DumpTrustError, ENV_DUMP_KEY, SELFCHECK_PREFIX, dump_path,
                                             load_dump_key, private_dump_dir, read_dump, verify_dump)

SELF_CHECK_IDS = [1, 2, 3, 4, 5, 6, 7, 8]
EXIT_NOT_READY = 4


class LaunchError(RuntimeError):
    """A capture server that cannot start or failed its checks; the message says what to do."""


def model_config(model_path: str) -> dict[str, Any]:
    """The target's config.json (a local model folder)."""
    p = Path(model_path) / "config.json"
    try:
        return dict(json.loads(p.read_text()))
    except FileNotFoundError:
        raise LaunchError(f"target_model {model_path} has no config.json; point target_model at a local "
                          "model folder") from None


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal target's text model config (its ``text_config``), else the config itself."""
    return cfg.get("text_config") or cfg


@dataclass(frozen=True)
class CapturePlan:
    """What every engine's capture launch settles before its own command: the target, its layers, the port,
    this user's dump folder and the run's dump key."""
    model_path: str
    model_config: dict[str, Any]
    architectures: list[str]
    num_layers: int
    aux_layers: list[int]
    port: int
    url: str
    dump_dir: str
    dump_key: bytes

    def env(self, settings: Mapping[str, str]) -> dict[str, str]:
        """The engine's environment: ours, its capture settings, and the dump key (hex) for the processes that
        write dumps (an environment is readable by its owner only)."""
        return {**os.environ, **settings, ENV_DUMP_KEY: self.dump_key.hex()}

    def info(self, cfg: PipelineConfig, backend: str, version: str, **layer_ids: list[int]) -> dict[str, Any]:
        """The server info file's fields but the child's pid and start time (``run_capture_server`` adds them)."""
        tcfg = text_config(self.model_config)
        dtype = cfg.server.dtype if cfg.server.dtype != "auto" else str(tcfg.get("torch_dtype") or tcfg.get("dtype"))
        return {"backend": backend, "model": self.model_path, "aux_layers": self.aux_layers,
                "hidden_size": int(tcfg["hidden_size"]), "num_layers": int(tcfg["num_hidden_layers"]), "dtype": dtype,
                "version": version, **layer_ids}


def plan_capture(cfg: PipelineConfig, layout: RunLayout) -> CapturePlan:
    """The target read, its aux layers resolved, a port chosen, the dump folder and key made ready. Raises
    LaunchError or ValueError (the target) or ``protocol.DumpTrustError`` (the folder or key), each naming what
    to fix; the caller prints it and exits 2."""
    model_path = str(cfg.resolve(cfg.target_model))
    mcfg = model_config(model_path)
    archs, num_layers = target_architectures_and_layers(mcfg)
    aux = resolve_aux_layers(cfg.capture.aux_layers, num_layers)
    port = cfg.server.port or free_port(cfg.server.host)
    dumps, key = prepare_dumps(cfg, layout)
    return CapturePlan(model_path=model_path, model_config=mcfg, architectures=list(archs), num_layers=num_layers,
                       aux_layers=aux, port=port, url=f"http://{cfg.server.host}:{port}", dump_dir=dumps,
                       dump_key=key)


def dump_dir(cfg: PipelineConfig) -> str:
    """Where a capture server dumps (``server.dump_dir``, resolved): every engine's, and the worker's reading."""
    return str(cfg.resolve(cfg.server.dump_dir))


def write_info_file(path: str, info: dict) -> None:
    """A server's info file (capture_server.json, generate_server.json), atomically (a reader polls for it)."""
    atomic_write(path, json.dumps(info, indent=2), mode=0o644)   # read as ours: never group-writable (umask 002)


def prepare_dumps(cfg: PipelineConfig, layout: RunLayout) -> tuple[str, bytes]:
    """(this user's private 0700 dump folder, the run's dump MAC key), created when missing.
    Raises ``protocol.DumpTrustError`` naming the folder or key that is not ours alone."""
    return str(private_dump_dir(dump_dir(cfg))), load_dump_key(layout.dump_key_file, create=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, engine: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LaunchError(f"{engine} exited with code {proc.returncode} while loading; its output is above "
                              "in this log")
        try:
            health_generate(url, 20)
            return
        except ServerError:
            time.sleep(2)
    raise LaunchError(f"{engine} did not answer {url}/health_generate within {timeout_s:.0f} s")


def self_check(url: str, dump_dir: str, key: bytes, *, engine: str, missing_hint: str,
               appear_within_s: float = 10.0, timeout_s: float = 120) -> Path:
    """One capture request; its dump must appear (within ``appear_within_s`` of the answer), verify under
    ``key`` and hold the request's ids and rows. ``missing_hint``: what an absent dump means for the engine."""
    rid = f"{SELFCHECK_PREFIX}{os.getpid()}"
    generate(url, SELF_CHECK_IDS, rid, timeout_s)
    p = dump_path(dump_dir, rid)
    deadline = time.monotonic() + appear_within_s
    while not p.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not p.exists():
        raise LaunchError(f"{engine} answered the self-check request {rid} but no dump is at {p}: {missing_hint}")
    try:
        d = read_dump(p)
        verify_dump(d, key, p, rid)
    except DumpTrustError as e:
        raise LaunchError(f"self-check: {e}") from None
    if d.input_ids.tolist() != SELF_CHECK_IDS or d.hidden_states.shape[0] != len(SELF_CHECK_IDS):
        raise LaunchError(f"self-check dump {p} has {d.hidden_states.shape[0]} rows for {len(SELF_CHECK_IDS)} "
                          "tokens")
    p.unlink()
    return p


def run_capture_server(argv: list[str], env: Mapping[str, str], *, engine: str, url: str, ready_timeout_s: float,
                       dump_dir: str, dump_key: bytes, missing_dump_hint: str, appear_within_s: float,
                       info_file: str, info: dict[str, Any]) -> int:
    """Start ``argv`` as our child, wait until it is healthy and passes the self-check, write ``info`` (with
    the child's pid and the start time) to ``info_file``, then wait for the child: its exit code, or 4 when
    it never became ready (the child stopped: TERM, 60 s, KILL)."""
    proc = subprocess.Popen(argv, env=dict(env))   # same process group: a group signal stops both

    def _forward(signum, _frame):
        proc.send_signal(signum)
    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    try:
        wait_healthy(url, proc, ready_timeout_s, engine)
        self_check(url, dump_dir, dump_key, engine=engine, missing_hint=missing_dump_hint,
                   appear_within_s=appear_within_s)
    except Exception as e:   # noqa: BLE001 - whatever stopped it, the child must not outlive the launch
        print(f"eagleflow capture serve ({engine}): {e}", file=sys.stderr, flush=True)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        return EXIT_NOT_READY
    write_info_file(info_file, {**info, "url": url, "pid": proc.pid, "dump_dir": dump_dir, "started_at": time.time()})
    print(f"eagleflow capture serve: {engine} ready and capturing at {url}", file=sys.stderr, flush=True)
    return proc.wait()
