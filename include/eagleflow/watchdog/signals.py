"""What the watchdog reads on the node, each signal on its own, in one pass.

Signals (independent on purpose: the seeds' log said "progressing" while
nothing advanced; a hung kernel reads 100 %, a loading model reads 0 %):

- progress: the job's heartbeat (its age, ``last_progress_at``, done/total,
  samples since the watcher's last look) and its in-flight requests (age
  against each request's own timeout);
- server: ``GET /health_generate`` with a timeout, only asked when progress
  is already stale (a fresh sample proves the server works; no extra load);
- processes: worker and server alive, zombie, stopped (SIGSTOP, state T),
  in D state and since when (from /proc, remembered across looks);
- GPUs: memory held above the idle baseline while utilisation stays 0 over
  a window (several samples per look plus the looks before);
- disk: free bytes where the shard writes.

Everything here runs on the node, without Airflow. ``WatchMemory`` is the
watcher's memory between looks (a small JSON file under <state_dir>/watch),
because /proc tells a process *is* in D, not since when.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from eagleflow.config import PipelineConfig
from eagleflow.heartbeat import Heartbeat
from eagleflow.layout import RunLayout
from eagleflow.nodes.proc import read_proc_state


# --------------------------------------------------------------------------- which job
@dataclass(frozen=True)
class WatchedJob:
    """An extraction shard (``shard`` set) or the trainer (``shard`` None)."""
    shard: int | None
    num_shards: int = 1

    @property
    def role(self) -> str:
        return "trainer" if self.shard is None else f"worker_shard_{self.shard:05d}"

    @property
    def name(self) -> str:
        return "training" if self.shard is None else f"shard {self.shard}/{self.num_shards}"

    @property
    def uses_server(self) -> bool:
        return self.shard is not None

    def heartbeat_path(self, layout: RunLayout) -> str:
        return str(layout.train_heartbeat_file if self.shard is None else layout.heartbeat_file(self.shard))

    def work_dir(self, layout: RunLayout) -> str:
        return str(layout.draft_dir if self.shard is None else layout.shard_dir(self.shard))


# --------------------------------------------------------------------------- signals
@dataclass
class ProcessSignal:
    role: str
    recorded: bool                  # a pid file exists
    pid: int | None = None
    alive: bool = False
    state: str | None = None        # R S D Z T t ...
    d_state: bool = False           # the process or one of its threads in D
    d_since: float | None = None    # when the watcher first saw it in D (this episode)
    wchan: str | None = None
    started_at: float | None = None
    log_file: str | None = None

    @property
    def zombie(self) -> bool:
        return self.state == "Z"

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")


@dataclass
class HealthSignal:
    checked: bool = False
    ok: bool = False
    outcome: str = "not checked"    # ok | timeout | refused | http <code> | error: ... | no server info
    latency_s: float | None = None
    url: str | None = None


@dataclass
class GpuReading:
    index: int
    name: str
    memory_used_mib: float | None
    memory_total_mib: float | None
    utilization_pct: float | None
    held: bool


@dataclass
class GpuSignal:
    applicable: bool
    note: str = ""
    readings: list[GpuReading] = field(default_factory=list)   # the last of this look's samples
    busy_now: bool | None = None       # any GPU > 0 % in any of this look's samples
    idle_held_since: float | None = None  # start of an unbroken run of "held at 0 %" looks
    max_util_window: dict[int, float] = field(default_factory=dict)


@dataclass
class Observation:
    """Everything one look saw. ``now`` is the node's clock."""
    job: WatchedJob
    node: str
    now: float
    heartbeat: Heartbeat | None
    heartbeat_error: str | None
    worker: ProcessSignal
    server: ProcessSignal | None
    health: HealthSignal
    gpu: GpuSignal
    free_bytes: int | None
    done_since_last_look: int | None
    last_look_at: float | None
    log_tail: list[str]


# --------------------------------------------------------------------------- memory between looks
@dataclass
class WatchMemory:
    last_look_at: float | None = None
    last_done: int | None = None
    d_since: dict[str, float] = field(default_factory=dict)       # "<pid>:<start_ticks>" -> first seen in D
    idle_held_since: float | None = None
    gpu_max_util: list[list] = field(default_factory=list)        # [[t, {index: max util}], ...]

    @classmethod
    def load(cls, path: str) -> "WatchMemory":
        try:
            with open(path) as f:
                data = json.load(f)
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return cls()  # a lost memory only delays a D-state/GPU verdict by one window

    def save(self, path: str) -> None:
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".watch-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self), f)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            # disk full: looking must still work, only the memory is lost


def memory_path(layout: RunLayout, job: WatchedJob) -> str:
    return str(layout.state_dir / "watch" / f"{layout.run_id}.{job.role}.json")


# --------------------------------------------------------------------------- GPU probe seam
class GpuSampler(Protocol):
    """Anything that returns the node's GPUs now (the GPU engineer's probe, or a fake in tests)."""

    def sample(self) -> list[GpuReading]: ...


class ProbeSampler:
    """Adapts eagleflow.gpu (``probe_for(node, cfg).snapshot()`` and ``IdlePolicy``) to GpuReading."""

    def __init__(self, cfg: PipelineConfig):
        from eagleflow.gpu import IdlePolicy, probe_for
        from eagleflow.nodes import LocalNode
        self.cfg = cfg
        self.probe = probe_for(LocalNode(name=cfg.node.name), cfg)
        baseline_text = None
        if cfg.gpu.baseline_file:
            try:
                baseline_text = Path(cfg.resolve(cfg.gpu.baseline_file)).read_text()
            except OSError:
                baseline_text = None  # no baseline yet: the margin over 0 MiB still tells "held"
        self.policy = IdlePolicy.from_config(cfg, baseline_text)

    def sample(self) -> list[GpuReading]:
        from eagleflow.gpu.idle_policy import select_gpus
        snaps = select_gpus(self.probe.snapshot(), list(self.cfg.gpu.select), self.cfg.node.name)
        return [GpuReading(index=s.index, name=s.name, memory_used_mib=s.memory_used_mib,
                           memory_total_mib=s.memory_total_mib, utilization_pct=s.utilization_pct,
                           held=s.memory_used_mib is not None and s.memory_used_mib > self.policy.allowed_mib(s.uuid))
                for s in snaps]


def read_gpus(cfg: PipelineConfig, sampler: GpuSampler | None, mem: WatchMemory, now: float,
              samples: int = 3, spacing_s: float = 0.25) -> GpuSignal:
    """Sample the GPUs a few times (a utilisation reading covers only the last ~1 s) and update the window."""
    if not cfg.node.has_gpu:
        return GpuSignal(applicable=False, note="not applicable: node.has_gpu is false")
    try:
        sampler = sampler or ProbeSampler(cfg)
        looks = []
        for i in range(samples):
            if i:
                time.sleep(spacing_s)
            looks.append(sampler.sample())
    except Exception as e:  # a probe that fails is reported, never a reason to call a stall
        return GpuSignal(applicable=True, note=f"no reading: {type(e).__name__}: {e}")
    last = looks[-1]
    if not last:
        return GpuSignal(applicable=True, note="no GPU found by the probe")
    utils = [r.utilization_pct for look in looks for r in look if r.utilization_pct is not None]
    busy = any(u > 0 for u in utils) if utils else None
    all_held = all(r.held for r in last)
    this_max = {}
    for look in looks:
        for r in look:
            if r.utilization_pct is not None:
                this_max[r.index] = max(this_max.get(r.index, 0.0), float(r.utilization_pct))
    idle_held = all_held and busy is False
    if idle_held:
        mem.idle_held_since = mem.idle_held_since or now
    else:
        mem.idle_held_since = None
    window = cfg.watchdog.gpu_window_s
    mem.gpu_max_util = [e for e in mem.gpu_max_util if now - e[0] <= window] + [[now, {str(k): v for k, v in this_max.items()}]]
    win_max: dict[int, float] = {}
    for _, m in mem.gpu_max_util:
        for k, v in m.items():
            win_max[int(k)] = max(win_max.get(int(k), 0.0), v)
    note = "" if utils else "utilisation not reported by the driver"
    return GpuSignal(applicable=True, note=note, readings=last, busy_now=busy,
                     idle_held_since=mem.idle_held_since, max_util_window=win_max)


# --------------------------------------------------------------------------- processes
def read_process(layout: RunLayout, role: str, mem: WatchMemory, now: float) -> ProcessSignal:
    pid_file = str(layout.pid_file(role))
    try:
        with open(pid_file) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return ProcessSignal(role=role, recorded=False)
    pid = int(rec.get("pid", 0))
    sig = ProcessSignal(role=role, recorded=True, pid=pid, started_at=rec.get("started_at"),
                        log_file=rec.get("log_file"))
    st = read_proc_state(pid) if pid > 0 else None
    want_ticks = int(rec.get("start_ticks") or 0)
    if st is None or (want_ticks and st.start_ticks != want_ticks):
        return sig  # gone, or the PID now belongs to someone else
    sig.alive = not st.is_zombie
    sig.state = st.state
    sig.wchan = st.wchan
    sig.d_state = st.in_d_state
    key = f"{pid}:{st.start_ticks}"
    if st.in_d_state:
        mem.d_since[key] = mem.d_since.get(key, now)
        sig.d_since = mem.d_since[key]
    else:
        mem.d_since.pop(key, None)
    return sig


# --------------------------------------------------------------------------- server health
def check_health(url: str | None, timeout_s: float) -> HealthSignal:
    if not url:
        return HealthSignal(checked=False, outcome="no server info")
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health_generate", timeout=timeout_s) as r:
            r.read()
            return HealthSignal(True, True, "ok", time.monotonic() - t0, url)
    except urllib.error.HTTPError as e:
        return HealthSignal(True, False, f"http {e.code}", time.monotonic() - t0, url)
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return HealthSignal(True, False, "timeout", time.monotonic() - t0, url)
        if isinstance(reason, ConnectionRefusedError):
            return HealthSignal(True, False, "refused", time.monotonic() - t0, url)
        return HealthSignal(True, False, f"error: {reason}", time.monotonic() - t0, url)
    except (socket.timeout, TimeoutError):
        return HealthSignal(True, False, "timeout", time.monotonic() - t0, url)
    except (ConnectionError, OSError) as e:
        return HealthSignal(True, False, f"error: {type(e).__name__}: {e}", time.monotonic() - t0, url)


def server_url(layout: RunLayout) -> str | None:
    try:
        with open(str(layout.server_info_file)) as f:
            return json.load(f).get("url")
    except (OSError, ValueError, AttributeError):
        return None


# --------------------------------------------------------------------------- the look
def tail_lines(path: str | None, n: int = 6, max_bytes: int = 8192) -> list[str]:
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line.rstrip()[:300] for line in deque(text.splitlines(), maxlen=n) if line.strip()]


def free_bytes_at(path: str) -> int | None:
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    try:
        s = os.statvfs(p)
    except OSError:
        return None
    return s.f_bavail * s.f_frsize


def observe(cfg: PipelineConfig, layout: RunLayout, job: WatchedJob, mem: WatchMemory, *,
            gpu_sampler: GpuSampler | None = None, health_when_stale_after_s: float | None = None,
            now: float | None = None) -> Observation:
    """One look at a job. The server is asked for health only once progress is stale."""
    now = time.time() if now is None else now
    hb_path = job.heartbeat_path(layout)
    hb_err = None
    try:
        hb = Heartbeat.read(hb_path)
    except (ValueError, TypeError, KeyError) as e:
        hb, hb_err = None, f"{hb_path} unreadable: {e}"
    worker = read_process(layout, job.role, mem, now)
    if hb is not None and job.shard is not None and not worker.alive and hb.state != "complete":
        # A dead worker's heartbeat lags its last stored samples by up to one interval;
        # the manifest is what is stored, so the diagnosis counts from it.
        hb.done = max(hb.done, stored_samples(layout, job.shard))
    server = read_process(layout, "capture_server", mem, now) if job.uses_server else None
    health = HealthSignal()
    stale_after = cfg.watchdog.stall_after_s if health_when_stale_after_s is None else health_when_stale_after_s
    if job.uses_server and hb is not None and hb.state not in ("complete", "failed") \
            and now - _progress_at(hb, worker) >= stale_after:
        health = check_health(server_url(layout), cfg.watchdog.health_timeout_s)
        now = max(now, time.time())  # the check took time: judge ages at its end
    gpu = read_gpus(cfg, gpu_sampler, mem, now)
    done_since = None
    if hb is not None and mem.last_done is not None:
        done_since = hb.done - mem.last_done
    obs = Observation(job=job, node=cfg.node.name, now=now, heartbeat=hb, heartbeat_error=hb_err, worker=worker,
                      server=server, health=health, gpu=gpu, free_bytes=free_bytes_at(job.work_dir(layout)),
                      done_since_last_look=done_since, last_look_at=mem.last_look_at,
                      log_tail=tail_lines(worker.log_file or str(layout.log_file(job.role))))
    mem.last_look_at = now
    mem.last_done = hb.done if hb is not None else mem.last_done
    return obs


def stored_samples(layout: RunLayout, shard: int) -> int:
    """Distinct samples in the shard's manifest (a partial last line is not one)."""
    from eagleflow.capture.manifest import read_manifest
    try:
        return len(read_manifest(layout.manifest_file(shard)).entries)
    except OSError:
        return 0


def _progress_at(hb: Heartbeat, worker: ProcessSignal) -> float:
    return max(hb.last_progress_at or 0.0, hb.started_at or 0.0, worker.started_at or 0.0)


def progress_at(obs: Observation) -> float | None:
    """When the job last advanced (or started, if it has not yet)."""
    if obs.heartbeat is None:
        return obs.worker.started_at
    return _progress_at(obs.heartbeat, obs.worker)
