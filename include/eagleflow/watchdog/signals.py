"""What the watchdog reads on the node, each signal on its own, in one pass.

Signals (independent on purpose: the seeds' log said "progressing" while
nothing advanced; a hung kernel reads 100 %, a loading model reads 0 %):

- progress: the job's heartbeat (its age, ``last_progress_at``, done/total,
  samples since the watcher's last look) and its in-flight requests (age
  against each request's own timeout);
- server: ``GET /health_generate`` with a timeout, only asked when progress
  is already stale (a fresh sample proves the server works; no extra load);
- processes: worker and server alive, zombie, stopped (SIGSTOP, state T),
  in D state and since when (from /proc, remembered across looks); the CPU
  time the job's process group used, compared with the previous look's (a
  late heartbeat from a process still using CPU is slow, not frozen);
- GPUs: memory held above the idle baseline while utilisation stays 0 over
  a window (several samples per look plus the looks before);
- disk: free bytes where the shard writes.

Every signal carries the time it was read (``read_at``), and every age in a
diagnosis is computed against the time its own signal was read: a health
check that takes 19 s must not make a heartbeat read before it look 19 s
older than it is (the heartbeat and the processes are read again after it).

Everything here runs on the node, without Airflow. ``WatchMemory`` is the
watcher's memory between looks (a small JSON file under <state_dir>/watch),
because /proc tells a process *is* in D, not since when.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from eagleflow import bounded_json
from eagleflow.config import PipelineConfig
from eagleflow.durable import atomic_write
from eagleflow.heartbeat import WAITING_FOR_ROOM, Heartbeat
from eagleflow.layout import RunLayout
from eagleflow.nodes.proc import clock_ticks_per_s, group_cpu_ticks, state_phrase, thread_wchan
from eagleflow.nodes.process_record import RecordRefused, leader_state, load_record
from eagleflow.phases import EXTRACT, GENERATE, ShardKind, kind_of
from eagleflow.capture.manifest import read_manifest
from eagleflow.gpu import IdlePolicy, probe_for
from eagleflow.gpu.idle_policy import select_gpus
from eagleflow.nodes import LocalNode
from eagleflow.phase_jobs import server_url_in
from eagleflow.serving.client import ServerError, ServerTimeout, health_generate
from eagleflow.stores import run_store_settings, store_for


# --------------------------------------------------------------------------- which job
@dataclass(frozen=True)
class WatchedJob:
    """A shard of a sharded phase (``phase``: extraction or generation, whose workers write the same heartbeat
    and manifest, so the same signals and verdicts apply; names and paths from its ``phases.ShardKind``), or the
    trainer (``shard`` None)."""
    shard: int | None
    num_shards: int = 1
    phase: str = EXTRACT

    @property
    def kind(self) -> ShardKind:
        return kind_of(self.phase)

    @property
    def role(self) -> str:
        return "trainer" if self.shard is None else self.kind.worker_role(self.shard)

    @property
    def name(self) -> str:
        return "training" if self.shard is None else f"{self.kind.watch_name} {self.shard}/{self.num_shards}"

    @property
    def uses_server(self) -> bool:
        return self.shard is not None

    @property
    def server_role(self) -> str:
        return self.kind.server_role

    def server_info_path(self, layout: RunLayout) -> str:
        return str(self.kind.server_info_file(layout))

    def heartbeat_path(self, layout: RunLayout) -> str:
        if self.shard is None:
            return str(layout.train_heartbeat_file)
        return str(self.kind.heartbeat_file(layout, self.shard))

    def work_dir(self, layout: RunLayout) -> str:
        return str(layout.draft_dir if self.shard is None else self.kind.shard_dir(layout, self.shard))


# --------------------------------------------------------------------------- signals
@dataclass
class CpuSignal:
    """The CPU time a job's process group used, judged across looks: /proc gives a cumulative count, so whether a
    process still works is told by comparing with the previous read (kept in the node's ``WatchMemory``).

    ``quiet_since`` is the earliest read since which no member gained a tick (the first read itself until one
    does): ``read_at - quiet_since`` is how long the group is *known* to have used no CPU. The last span that
    did gain says how much (``last_gain_s`` seconds of CPU over ``last_gain_over_s``, up to ``last_gain_at``)."""
    read_at: float
    first_at: float                    # the watch's first read of this process (the job's leader, by start time)
    quiet_since: float
    members: int = 0                   # live members of the group at this read
    ticks: int = 0                     # ticks gained since ``first_at`` (member by member: exits take nothing away)
    last_gain_s: float | None = None
    last_gain_over_s: float | None = None
    last_gain_at: float | None = None

    def quiet_for(self, now: float) -> float:
        return max(0.0, now - self.quiet_since)


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
    read_at: float | None = None    # when /proc was read
    oom_killed: bool | None = None  # dead only: the kernel log names it as OOM-killed (None: log not readable)
    exit_code: int | None = None    # dead only, where the pid record kept it
    exit_signal: int | None = None
    refused: str | None = None      # a pid file exists but is not trusted (why): treated as no record
    cpu: CpuSignal | None = None    # the job's own process (worker, trainer) while alive: its group's CPU time

    @property
    def zombie(self) -> bool:
        return self.state == "Z"

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")

    @property
    def state_text(self) -> str:
        """'gone', 'a zombie (...)', 'stopped (state T: ...)' (``nodes.proc.state_phrase``); '' while it works."""
        return state_phrase(self.state if self.alive or self.zombie else None)


@dataclass
class HealthSignal:
    checked: bool = False
    ok: bool = False
    outcome: str = "not checked"    # ok | timeout | refused | http <code> | error: ... | no server info
    latency_s: float | None = None
    url: str | None = None
    read_at: float | None = None    # when the answer (or the timeout) came
    skipped: str = ""               # why it was not asked although progress is stale


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
    read_at: float | None = None       # the last sample
    history: list[list] = field(default_factory=list)  # [[t, {index: max util}], ...] of the looks in the window
    samples: int = 0                   # samples in this look
    span_s: float = 0.0                # from the first to the last sample of this look


# --------------------------------------------------------------------------- this run's own pace
MIN_PACE_SAMPLES = 3   # the first gap includes the worker's start: a p95 of few gaps errs on the slow side


@dataclass
class Pace:
    """How fast this run usually completes samples, from the heartbeat's recent history.

    Progress is judged against it: with 20 s per forward a 20 s gap is the run's
    normal pace, not a stall; at 1 sample/s it is. A check starts only once
    progress is older than ``stale_after_s`` = max(stall_after_s, slow_factor x p95 gap).
    """
    samples: int = 0
    gap_p95_s: float | None = None
    request_p95_s: float | None = None
    stale_after_s: float = 0.0        # progress older than this starts a stall check
    request_limit_s: float = 0.0      # a request older than this while progress is flat is hung

    def describe(self) -> str:
        if self.gap_p95_s is None:
            return f"no pace yet (fewer than {MIN_PACE_SAMPLES} samples), stale after {self.stale_after_s:.0f} s"
        return (f"usual gap between samples {self.gap_p95_s:.1f} s (p95 of the last {self.samples}), "
                f"stale after {self.stale_after_s:.0f} s")


def p95(values: list) -> float | None:
    vals = sorted(float(v) for v in values if isinstance(v, (int, float)))
    if len(vals) < MIN_PACE_SAMPLES:
        return None
    return vals[min(len(vals) - 1, int(round(0.95 * (len(vals) - 1))))]


def pace_of(hb: Heartbeat | None, cfg: PipelineConfig) -> Pace:
    wd = cfg.watchdog
    extra = hb.extra if hb is not None and isinstance(hb.extra, dict) else {}
    gaps = extra.get("recent_gaps_s") or []
    gap = p95(gaps)
    req = p95(extra.get("recent_request_s") or [])
    stale = max(wd.stall_after_s, wd.slow_factor * gap) if gap is not None else wd.stall_after_s
    # without a pace yet, a request is hung only past the stall bound itself (a first sample may be long)
    limit = max(wd.stall_after_s, wd.slow_factor * req) if req is not None else wd.detection_bound_s
    return Pace(samples=len(gaps), gap_p95_s=gap, request_p95_s=req, stale_after_s=stale,
                request_limit_s=max(limit, stale))


FULL_FRACTION = 0.75


@dataclass
class StoreSignal:
    """A streaming run's store server as the trainer's watch sees it (``Store.server_health``): ``ok`` False when
    its master or segment holder is not running by its pid record; ``answering``: its master's port answered."""
    ok: bool
    label: str = ""
    detail: str = ""
    answering: bool | None = None
    allocated_bytes: int | None = None   # the store's bytes held now (Mooncake: master_allocated_bytes), when read
    buffer_bytes: int | None = None      # stream.buffer_gib in bytes: past it the producer waits for room
    key_count: int | None = None         # the objects it holds (master_key_count): their mean is a sample's size
    producer_waits: bool = False         # a capture worker of this node says (its heartbeat) its put waits for room

    def full(self) -> bool:
        """Full for the producer: its next sample waits for room. So when a capture worker says its put waits (its
        own word: the next sample's size is its to know), at 3/4 of the buffer (a sample may be any size up to the
        rest), or when the room left is under 1.5 samples of the mean size held (samples large against the
        buffer: a put waited at 75 % of a 96 KiB buffer, CI stops 55 and 56)."""
        if self.allocated_bytes is None or not self.buffer_bytes:
            return False
        if self.producer_waits:
            return True
        if self.allocated_bytes >= FULL_FRACTION * self.buffer_bytes:
            return True
        mean = self.allocated_bytes / self.key_count if self.key_count else 0
        return bool(mean) and self.buffer_bytes - self.allocated_bytes < 1.5 * mean

    def fill_text(self) -> str:
        """'the store holds A of its B-byte buffer (P %)', or '' when not read."""
        if self.allocated_bytes is None or not self.buffer_bytes:
            return ""
        return (f"the store holds {self.allocated_bytes:,} of its {self.buffer_bytes:,}-byte buffer "
                f"({100 * self.allocated_bytes / self.buffer_bytes:.0f} %)")


def read_store_signal(cfg: PipelineConfig, layout: RunLayout) -> StoreSignal | None:
    """The run's store server's health; None when its store has no server (disk) or the probe itself failed."""
    try:
        h = store_for(cfg.stream.storage).server_health(run_store_settings(cfg, layout))
    except Exception:   # noqa: BLE001 - a look never fails on the store's probe: no reading is no evidence
        return None
    if h is None:
        return None
    alloc, buf, keys = h.get("allocated_bytes"), h.get("buffer_bytes"), h.get("key_count")
    return StoreSignal(ok=bool(h.get("ok")), label=str(h.get("label", "")), detail=str(h.get("detail", "")),
                       answering=h.get("answering"), allocated_bytes=None if alloc is None else int(alloc),
                       buffer_bytes=None if buf is None else int(buf), key_count=None if keys is None else int(keys),
                       producer_waits=_producer_waits_for_room(cfg, layout))


def _producer_waits_for_room(cfg: PipelineConfig, layout: RunLayout) -> bool:
    """Whether an extraction shard's worker on this node says, in its heartbeat, that its put waits for room in
    the store now (a heartbeat unreadable or absent says nothing)."""
    for shard in range(kind_of(EXTRACT).num_shards(cfg)):
        try:
            hb = Heartbeat.read(str(layout.heartbeat_file(shard)))
        except (OSError, ValueError, TypeError):
            continue
        since = hb.extra.get(WAITING_FOR_ROOM) if hb is not None and isinstance(hb.extra, dict) else None
        if hb is not None and hb.state == "running" and isinstance(since, (int, float)) \
                and not isinstance(since, bool):
            return True
    return False


@dataclass
class Observation:
    """Everything one look saw. ``now`` is the node's clock at the end of the look.

    ``heartbeat_read_at`` is when the heartbeat was read: its ages (progress,
    last write, in-flight requests) are judged against that, not against ``now``.
    """
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
    heartbeat_read_at: float | None = None
    stored: int | None = None          # samples in the shard's manifest (read when progress is stale or the worker is not running)
    pace: Pace | None = None
    server_restarted_under_worker: bool = False  # the live server started after the worker did
    progress_during_look: float | None = None     # a sample completed while this look waited on the server (when)
    store: StoreSignal | None = None   # the trainer of a streaming run: its store server (read_store_signal)

    @property
    def hb_clock(self) -> float:
        return self.heartbeat_read_at if self.heartbeat_read_at is not None else self.now


# --------------------------------------------------------------------------- memory between looks
@dataclass
class WatchMemory:
    last_look_at: float | None = None
    last_done: int | None = None
    d_since: dict[str, float] = field(default_factory=dict)       # "<pid>:<start_ticks>" -> first seen in D
    idle_held_since: float | None = None
    gpu_max_util: list[list] = field(default_factory=list)        # [[t, {index: max util}], ...]
    # role -> the last read of its process group's CPU ticks ({"leader": "<pid>:<start_ticks>", "at", "first_at",
    # "quiet_since", "ticks", "members": {"<pid>:<start_ticks>": ticks}, "gain_s", "gain_over_s", "gain_at"})
    cpu: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str) -> "WatchMemory":
        try:
            data = bounded_json.read(path)
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return cls()  # a lost memory only delays a D-state/GPU verdict by one window

    def save(self, path: str) -> None:
        try:
            # no fsync: a memory lost in a crash only delays a verdict by one window
            atomic_write(path, json.dumps(asdict(self)), fsync=False)
        except OSError:
            pass  # disk full: looking must still work, only the memory is lost


def memory_path(layout: RunLayout, job: WatchedJob) -> str:
    return str(layout.state_dir / "watch" / f"{layout.run_id}.{job.role}.json")


# --------------------------------------------------------------------------- GPU probe seam
class GpuSampler(Protocol):
    """Anything that returns the node's GPUs now (the GPU engineer's probe, or a fake in tests)."""

    def sample(self) -> list[GpuReading]: ...


class ProbeSampler:
    """Adapts eagleflow.gpu (``probe_for(node, cfg).snapshot()`` and ``IdlePolicy``) to GpuReading."""

    def __init__(self, cfg: PipelineConfig):
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
        snaps = select_gpus(self.probe.snapshot(), list(self.cfg.gpu.select), self.cfg.node.name)
        return [GpuReading(index=s.index, name=s.name, memory_used_mib=s.memory_used_mib,
                           memory_total_mib=s.memory_total_mib, utilization_pct=s.utilization_pct,
                           held=s.memory_used_mib is not None and s.memory_used_mib > self.policy.allowed_mib(s.uuid))
                for s in snaps]


def read_gpus(cfg: PipelineConfig, sampler: GpuSampler | None, mem: WatchMemory, now: float,
              samples: int = 3, spacing_s: float = 0.25, until: threading.Event | None = None,
              min_span_s: float = 0.0) -> GpuSignal:
    """Sample the GPUs several times (a utilisation reading covers only the last ~1 s) and update the window.

    With ``until``, sampling goes on (every ``max(spacing_s, 1 s)``) until the event is set and at least
    ``min_span_s`` passed: a GPU busy 45 % of the time in bursts of seconds reads 0 % in three samples
    0.25 s apart often enough to look idle; a span of several seconds does not.
    """
    if not cfg.node.has_gpu:
        return GpuSignal(applicable=False, note="not applicable: node.has_gpu is false")
    t_first = time.time()
    try:
        sampler = sampler or ProbeSampler(cfg)
        looks = []
        i = 0
        while True:
            looks.append(sampler.sample())
            i += 1
            elapsed = time.time() - t_first
            if until is None:
                if i >= samples and elapsed >= min_span_s:
                    break
                time.sleep(spacing_s)
            else:
                if until.is_set() and i >= samples and elapsed >= min_span_s:
                    break
                until.wait(max(spacing_s, 1.0))
    except Exception as e:  # a probe that fails is reported, never a reason to call a stall
        return GpuSignal(applicable=True, note=f"no reading: {type(e).__name__}: {e}")
    t_last = time.time()
    now = max(now, t_last) if until is not None else now
    last = looks[-1]
    if not last:
        return GpuSignal(applicable=True, note="no GPU found by the probe")
    utils = [r.utilization_pct for look in looks for r in look if r.utilization_pct is not None]
    busy = any(u > 0 for u in utils) if utils else None
    all_held = all(r.held for r in last)
    this_max: dict[int, float] = {}
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
                     idle_held_since=mem.idle_held_since, max_util_window=win_max, read_at=now,
                     history=[list(e) for e in mem.gpu_max_util], samples=len(looks), span_s=t_last - t_first)


# --------------------------------------------------------------------------- processes
def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def track_cpu(mem: WatchMemory, role: str, leader: str, sample: dict[str, int], now: float) -> CpuSignal:
    """Compare this read of a process group's CPU ticks (``proc.group_cpu_ticks``) with the last one kept for
    ``role`` and keep this one. A new leader (another process, or the same PID started again), a memory that
    does not parse, or a clock that went back starts over: nothing is known about CPU before this read."""
    hz = float(clock_ticks_per_s())
    if not isinstance(mem.cpu, dict):   # a damaged memory file: start over
        mem.cpu = {}
    prev = mem.cpu.get(role)
    members = prev.get("members") if isinstance(prev, dict) else None
    same = (isinstance(prev, dict) and prev.get("leader") == leader and isinstance(members, dict)
            and all(_num(prev.get(k)) for k in ("at", "first_at", "quiet_since", "ticks"))
            and all(isinstance(k, str) and _num(v) for k, v in members.items())
            and prev["first_at"] <= prev["quiet_since"] <= prev["at"] <= now)
    if not same or prev is None or members is None:
        mem.cpu[role] = {"leader": leader, "at": now, "first_at": now, "quiet_since": now, "ticks": 0,
                         "members": dict(sample)}
        return CpuSignal(read_at=now, first_at=now, quiet_since=now, members=len(sample))
    # member by member: a member that exited takes nothing away; one that appeared since brings all it used
    gained = sum(max(0, int(t) - int(members.get(k, 0))) for k, t in sample.items())
    entry = {**prev, "at": now, "ticks": int(prev["ticks"]) + gained, "members": dict(sample)}
    if gained > 0:
        entry.update(quiet_since=now, gain_s=gained / hz, gain_over_s=now - float(prev["at"]), gain_at=now)
    mem.cpu[role] = entry
    gain_ok = all(_num(entry.get(k)) for k in ("gain_s", "gain_over_s", "gain_at"))
    return CpuSignal(read_at=now, first_at=float(entry["first_at"]), quiet_since=float(entry["quiet_since"]),
                     members=len(sample), ticks=int(entry["ticks"]),
                     last_gain_s=float(entry["gain_s"]) if gain_ok else None,
                     last_gain_over_s=float(entry["gain_over_s"]) if gain_ok else None,
                     last_gain_at=float(entry["gain_at"]) if gain_ok else None)


def read_process(layout: RunLayout, role: str, mem: WatchMemory, now: float, cpu: bool = False) -> ProcessSignal:
    """The recorded process of ``role`` as /proc shows it; with ``cpu``, its process group's CPU time too, compared
    with the previous read kept in ``mem`` (for the job whose heartbeat is judged: the worker or the trainer)."""
    try:   # eagleflow.nodes.process_record: the one record shape
        rec = load_record(str(layout.pid_file(role)))
    except FileNotFoundError:
        return ProcessSignal(role=role, recorded=False, read_at=now)
    except (OSError, RecordRefused) as e:   # not proven ours: never signalled, and the diagnosis says why
        return ProcessSignal(role=role, recorded=False, read_at=now, refused=str(e))
    pid = rec.pid
    sig = ProcessSignal(role=role, recorded=True, pid=pid, started_at=rec.started_at or None,
                        log_file=rec.log_file or None, read_at=now,
                        exit_code=rec.exit_code, exit_signal=rec.exit_signal)
    st = leader_state(rec)
    if st is None:
        return sig  # gone, or the PID now belongs to someone else (start time differs or unproven)
    sig.alive = st.alive
    sig.state = st.state
    if st.zombie:
        sig.exit_code, sig.exit_signal = st.exit_code, st.exit_signal
    sig.wchan = st.wchan
    sig.d_state = st.in_d_state
    if st.d_state_threads and st.state != "D":
        # the main thread sleeps; the one in D says where the process is stuck
        sig.wchan = thread_wchan(pid, st.d_state_threads[0]) or sig.wchan
    key = f"{pid}:{st.start_ticks}"
    if st.in_d_state:
        mem.d_since[key] = mem.d_since.get(key, now)
        sig.d_since = mem.d_since[key]
    else:
        mem.d_since.pop(key, None)
    if cpu and st.alive:
        # the recorded group while its leader (proven by its start time) leads it: only its session can join it
        sample = group_cpu_ticks(rec.pgid) if st.pgid == rec.pgid else {}
        sample.setdefault(key, st.cpu_ticks)   # the leader counts even when it left the recorded group
        sig.cpu = track_cpu(mem, role, key, sample, now)
    return sig


KMSG_PATH = "/dev/kmsg"


def kernel_oom_killed(pid: int, kmsg_path: str = KMSG_PATH, max_records: int = 200_000) -> bool | None:
    """Whether the kernel log says the OOM killer killed ``pid``; None when the log cannot be read.

    /dev/kmsg gives one record per read and EAGAIN at the end when opened non-blocking;
    a plain file (tests, a saved dmesg) is read line by line.
    """
    needles = (f"Killed process {pid} (".encode(), f"oom-kill:".encode())
    try:
        fd = os.open(kmsg_path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    buf = b""
    try:
        for _ in range(max_records):
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue  # a record was overwritten while reading: go on with the next
            except OSError:
                return None
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if needles[0] in line or (needles[1] in line and f",pid={pid},".encode() in line):
                    return True
    finally:
        os.close(fd)
    return needles[0] in buf


# --------------------------------------------------------------------------- server health
def check_health(url: str | None, timeout_s: float) -> HealthSignal:
    sig = _check_health(url, timeout_s)
    sig.read_at = time.time()
    return sig


def _check_health(url: str | None, timeout_s: float) -> HealthSignal:
    if not url:
        return HealthSignal(checked=False, outcome="no server info")
    t0 = time.monotonic()
    try:   # the one client of the server's API: its timeout bounds connect and answer alike
        health_generate(url.rstrip("/"), timeout_s)
        return HealthSignal(True, True, "ok", time.monotonic() - t0, url)
    except ServerTimeout:
        return HealthSignal(True, False, "timeout", time.monotonic() - t0, url)
    except ServerError as e:
        if e.http_status is not None:
            outcome = f"http {e.http_status}"
        elif isinstance(e.cause, ConnectionRefusedError):
            outcome = "refused"
        elif e.cause is not None:
            outcome = f"error: {type(e.cause).__name__}: {e.cause}"
        else:
            outcome = f"error: {e}"
        return HealthSignal(True, False, outcome, time.monotonic() - t0, url)


def server_url(layout: RunLayout, job: WatchedJob | None = None) -> str | None:
    try:   # our own file, within bounds: one someone else wrote names no server of ours
        return server_url_in(job.server_info_path(layout) if job else str(layout.server_info_file))
    except (OSError, ValueError):
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


GPU_SPAN_WHEN_STALE_S = 5.0   # how long the GPUs are sampled (about 1 Hz) once progress is stale


def observe(cfg: PipelineConfig, layout: RunLayout, job: WatchedJob, mem: WatchMemory, *,
            gpu_sampler: GpuSampler | None = None, health_when_stale_after_s: float | None = None,
            now: float | None = None, health_check: Callable[[str | None, float], HealthSignal] | None = None,
            kmsg_path: str = KMSG_PATH, clock: Callable[[], float] | None = None) -> Observation:
    """One look at a job. The server is asked for health only once progress is stale.

    Order matters for honest ages: the health check can take up to its timeout, so the heartbeat and
    the processes are read again after it, and every age is judged against the time of its own read.
    The health check is skipped when the server (or the worker) is provably stuck without it: gone,
    a zombie or stopped (state T); that saves up to ``health_timeout_s`` on the way to recovery.
    """
    clock = clock or ((lambda: now) if now is not None else time.time)
    check = health_check or check_health
    t0 = clock()
    hb, hb_err = _read_heartbeat(job, layout)
    hb_read_at = t0
    worker = read_process(layout, job.role, mem, t0, cpu=True)
    server = read_process(layout, job.server_role, mem, t0) if job.uses_server else None
    pace = pace_of(hb, cfg)
    stale_after = pace.stale_after_s if health_when_stale_after_s is None else health_when_stale_after_s
    stale = (hb is not None and hb.state not in ("complete", "failed")
             and t0 - _progress_at(hb, worker) >= stale_after)
    health = HealthSignal()
    progressed: float | None = None
    skip = _provably_stuck(worker, server) if stale and job.uses_server else ""
    if stale and hb is not None and job.uses_server and not skip:   # stale: a heartbeat was read
        # GPUs sampled for the whole check (>= GPU_SPAN_WHEN_STALE_S), so a bursty GPU is seen busy
        until = threading.Event()
        box: dict = {}
        span = min(GPU_SPAN_WHEN_STALE_S, cfg.watchdog.health_timeout_s)  # never longer than the bound allows
        t = threading.Thread(target=lambda: box.update(gpu=read_gpus(
            cfg, gpu_sampler, mem, t0, until=until, min_span_s=span)), daemon=True)
        t.start()
        try:
            health = check(server_url(layout, job), cfg.watchdog.health_timeout_s)
        finally:
            until.set()
            t.join()
        gpu = box.get("gpu") or GpuSignal(applicable=cfg.node.has_gpu, note="no reading")
        # read again what has an age: the check took time, and the worker may have moved meanwhile
        before = _progress_at(hb, worker)
        hb_read_at = clock()
        hb, hb_err = _read_heartbeat(job, layout)
        worker = read_process(layout, job.role, mem, hb_read_at, cpu=True)
        server = read_process(layout, job.server_role, mem, hb_read_at)
        pace = pace_of(hb, cfg)
        if hb is not None and (hb.last_progress_at or 0.0) > before:
            progressed = hb.last_progress_at
    else:
        if skip:
            health.skipped = skip
        gpu = read_gpus(cfg, gpu_sampler, mem, t0,
                        min_span_s=min(GPU_SPAN_WHEN_STALE_S, cfg.watchdog.health_timeout_s) if stale else 0.0)
    t_end = max(clock(), hb_read_at)
    stored = None
    if job.shard is not None and hb is not None and hb.state != "complete" \
            and (not worker.alive or worker.stopped or t_end - _progress_at(hb, worker) >= stale_after):
        # the heartbeat lags the manifest by up to one write interval, and a frozen or dead
        # worker never catches up: the manifest is what is stored
        stored = stored_samples(layout, job.shard, job)
        hb.done = max(hb.done, stored)
    if not worker.alive and worker.recorded and hb is not None and hb.state not in ("complete", "failed") \
            and worker.pid:
        worker.oom_killed = kernel_oom_killed(worker.pid, kmsg_path)
    restarted_under = bool(server is not None and server.alive and server.started_at and worker.started_at
                           and server.started_at > worker.started_at)
    done_since = None
    if hb is not None and mem.last_done is not None:
        done_since = hb.done - mem.last_done
    store = read_store_signal(cfg, layout) if job.shard is None else None
    obs = Observation(job=job, node=cfg.node.name, now=t_end, heartbeat=hb, heartbeat_error=hb_err, worker=worker,
                      server=server, health=health, gpu=gpu, free_bytes=free_bytes_at(job.work_dir(layout)),
                      done_since_last_look=done_since, last_look_at=mem.last_look_at,
                      log_tail=tail_lines(worker.log_file or str(layout.log_file(job.role))),
                      heartbeat_read_at=hb_read_at, stored=stored, pace=pace,
                      server_restarted_under_worker=restarted_under, progress_during_look=progressed,
                      store=store)
    mem.last_look_at = t_end
    mem.last_done = hb.done if hb is not None else mem.last_done
    return obs


def _read_heartbeat(job: WatchedJob, layout: RunLayout) -> tuple[Heartbeat | None, str | None]:
    path = job.heartbeat_path(layout)
    try:
        return Heartbeat.read(path), None
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:   # a damaged file: a finding
        return None, f"{path} unreadable: {str(e) or type(e).__name__}"


def _provably_stuck(worker: ProcessSignal, server: ProcessSignal | None) -> str:
    """Why no health check is needed to call this stuck ('' when one is)."""
    if server is not None:
        if not server.recorded:
            return "no capture server recorded"
        if not server.alive or server.stopped:
            return f"server pid {server.pid} is {server.state_text}"
    if worker.recorded and (not worker.alive or worker.stopped):
        return f"worker pid {worker.pid} is {worker.state_text}"
    return ""


def stored_samples(layout: RunLayout, shard: int, job: WatchedJob | None = None) -> int:
    """Distinct samples (records, for a generation shard) in the shard's manifest (a partial last line is not one);
    of a streaming run that re-captures per epoch, in each pass's manifest (as its heartbeat counts done)."""
    d = Path(str((job or WatchedJob(shard=shard)).kind.shard_dir(layout, shard)))
    try:
        later = sorted(d.glob("manifest.pass*.jsonl")) if d.is_dir() else []
        return sum(len(read_manifest(path).entries) for path in [d / "manifest.jsonl", *later])
    except OSError:
        return 0


def _progress_at(hb: Heartbeat, worker: ProcessSignal) -> float:
    return max(hb.last_progress_at or 0.0, hb.started_at or 0.0, worker.started_at or 0.0)


def progress_at(obs: Observation) -> float | None:
    """When the job last advanced (or started, if it has not yet)."""
    if obs.heartbeat is None:
        return obs.worker.started_at
    return _progress_at(obs.heartbeat, obs.worker)
