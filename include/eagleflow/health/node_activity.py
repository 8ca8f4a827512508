"""What eagleflow runs on a node right now: live process records, shard progress, incidents.

One node-side command (``python -m eagleflow.health.node_activity --state-dir D``,
one JSON line), so gpu_node_health learns in one round trip which GPU processes
are ours (run, role, shard), how far each live run's shards are, and the
watchdog's incidents. Standard library plus eagleflow's own record module: it
runs with whatever interpreter the node has.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, TypedDict, cast

from eagleflow import bounded_json
from eagleflow.nodes.process_record import RECORD_SUFFIX, scan_records, status
from eagleflow.phases import EXTRACT, KINDS
from eagleflow.stores import STORES, StoreSettings
from eagleflow.watchdog.incidents import history, incident_id, node_time
from eagleflow.watchdog.sentinel import look_interval_s, recent_looks

_SHARD_ROLE = re.compile(re.escape(KINDS[EXTRACT].worker_prefix) + r"(\d{5})")   # an extraction worker
INCIDENT_DAYS = 7  # incidents older than this are history, not something an operator acts on


@dataclass
class OurProcess:
    """One live process group eagleflow started: the proof it is ours is the pid record's start time."""
    pid: int
    pgid: int
    run_id: str
    role: str
    started_at: float = 0.0

    @property
    def shard(self) -> int | None:
        m = _SHARD_ROLE.fullmatch(self.role)
        return int(m.group(1)) if m else None

    @property
    def task(self) -> str:
        """The pipeline task that started it, as the Airflow UI names it."""
        if self.shard is not None:
            return f"extract_shard[{self.shard}]"
        return {"capture_server": "start_capture_server", "trainer": "train_draft"}.get(self.role, self.role)


@dataclass
class ShardProgress:
    shard: int
    done: int
    total: int
    state: str                  # the worker's heartbeat state: starting, running, complete, failed
    last_progress_at: float
    written_at: float
    rate: float = 0.0


@dataclass
class TrainProgress:
    """A run's trainer from its heartbeat (``draft/heartbeat.json``): step of steps, its pace, its latest figures."""
    step: int
    total: int
    state: str                  # the trainer's heartbeat state: starting, running, complete, failed
    last_progress_at: float
    written_at: float
    rate: float = 0.0           # steps/s over this trainer's life
    loss: float | None = None
    acc_0: float | None = None
    accept_length: float | None = None

    @property
    def eta_s(self) -> float | None:
        """Seconds to the last step at this trainer's rate; None when it runs no more or has no rate yet."""
        if self.state != "running" or self.rate <= 0 or self.total <= self.step:
            return None
        return (self.total - self.step) / self.rate


@dataclass
class StoreProgress:
    """A streaming run's hidden-state store on this node, as its registry entry sees it (``Store.server_health``
    of the run's frozen ``stream``): its server running (by its pid records) and answering, and how much of
    ``stream.buffer_gib`` it holds now (None: not read)."""
    label: str
    ok: bool
    detail: str
    answering: bool | None = None
    allocated_bytes: int | None = None
    buffer_bytes: int | None = None


class OurProcessDoc(TypedDict):
    """``OurProcess`` in a status document (``NodeActivity.to_dict``)."""
    pid: int
    pgid: int
    run_id: str
    role: str
    started_at: float


class ShardDoc(TypedDict):
    """``ShardProgress`` in a status document."""
    shard: int
    done: int
    total: int
    state: str
    last_progress_at: float
    written_at: float
    rate: float


class TrainingDoc(TypedDict):
    """``TrainProgress`` in a status document."""
    step: int
    total: int
    state: str
    last_progress_at: float
    written_at: float
    rate: float
    loss: float | None
    acc_0: float | None
    accept_length: float | None


class StoreDoc(TypedDict):
    """``StoreProgress`` in a status document."""
    label: str
    ok: bool
    detail: str
    answering: bool | None
    allocated_bytes: int | None
    buffer_bytes: int | None


class SilentJob(TypedDict):
    """Another running job of an alarm's run that nothing has looked at either (``_silent_alongside``)."""
    role: str
    job: str
    last_look_at: float | None


class WatchAlarm(TypedDict, total=False):
    """A sentinel's raised alarm record (eagleflow.watchdog.sentinel writes it), with ``silent_with`` added on the
    node. It is the node's answer: whoever reads a value checks it (``.get``, isinstance, node_time). The dataclass
    field stays ``list[dict]``: pydantic validates ``NodeActivity`` from the node's answer and must not coerce it."""
    state: str
    at: float
    run_id: str
    role: str
    job: str
    node: str
    poll_interval_s: float
    silent_since: float | None
    raised_at: float | None
    subject: str | None
    mailed: bool
    mail_error: str
    detail: str
    last_look: dict[str, Any] | None
    sentinel_pid: int
    silent_with: list[SilentJob]


class ActivityDoc(TypedDict):
    """A status document's ``activity``: ``NodeActivity`` as ``dataclasses.asdict`` writes it. The incidents and
    the sentinels' alarms are the node's own records, kept as it wrote them (their keys are read with ``.get``)."""
    processes: list[OurProcessDoc]
    shards: dict[str, list[ShardDoc]]
    incidents: list[dict[str, Any]]
    read_at: float
    skipped: list[str]
    watch_alarms: list[WatchAlarm]
    training: dict[str, TrainingDoc]
    stores: dict[str, StoreDoc]


def eta_of_training(t: Mapping[str, Any]) -> float | None:
    """``TrainProgress.eta_s`` of a status document's ``activity.training`` entry (a plain dict)."""
    try:
        return TrainProgress(**t).eta_s
    except TypeError:
        return None


@dataclass
class NodeActivity:
    processes: list[OurProcess] = field(default_factory=list)
    shards: dict[str, list[ShardProgress]] = field(default_factory=dict)   # run_id -> its shards
    incidents: list[dict] = field(default_factory=list)                    # the watchdog's, newest last
    read_at: float = 0.0
    skipped: list[str] = field(default_factory=list)   # "<file> line N: why": bad lines left out, never fatal
    watch_alarms: list[dict] = field(default_factory=list)   # sentinels' raised alarms: nothing looks at a job
    training: dict[str, TrainProgress] = field(default_factory=dict)       # run_id -> its trainer's progress
    stores: dict[str, StoreProgress] = field(default_factory=dict)         # run_id -> its streaming store

    def job_pids(self) -> set[int]:
        return {p.pid for p in self.processes} | {p.pgid for p in self.processes}

    def owner_of(self, pid: int, pgid: int | None) -> OurProcess | None:
        for p in self.processes:
            if pid == p.pid or (pgid is not None and pgid == p.pgid):
                return p
        return None

    def to_dict(self) -> ActivityDoc:
        return cast(ActivityDoc, asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> "NodeActivity":
        """The node's answer, read as untrusted input: an incident without a plain id or with a time that is not
        finite and before 2100 (``"opened_at": 1e999``), a shard or process with such a time, is left out and
        named in ``skipped`` (gpu_node_health logs it), never handed to the GPU view or a mail."""
        skipped = [str(s) for s in d.get("skipped") or []]
        processes = [OurProcess(**p) for p in d.get("processes") or []
                     if _times_ok(p, ("started_at",), f"process {p.get('pid')}", skipped)]
        shards = {r: [ShardProgress(**s) for s in v
                      if _times_ok(s, ("last_progress_at", "written_at"), f"run {r} shard {s.get('shard')}", skipped)]
                  for r, v in (d.get("shards") or {}).items()}
        incidents = []
        for n, inc in enumerate(d.get("incidents") or [], start=1):
            try:
                if not isinstance(inc, dict):
                    raise ValueError("not an object")
                incident_id(inc.get("id"))
            except ValueError as e:
                skipped.append(f"node answer: incident {n}: {e}; left out")
                continue
            if _times_ok(inc, ("opened_at", "ended_at"), f"incident {inc['id']}", skipped):
                incidents.append(inc)
        read_at = node_time(d.get("read_at"), "read_at") or 0.0
        training = {}
        for r, t in (d.get("training") or {}).items():
            t = asdict(t) if isinstance(t, TrainProgress) else t
            if not (isinstance(t, dict) and _times_ok(t, ("last_progress_at", "written_at"), f"run {r} training",
                                                      skipped)):
                continue
            try:
                training[str(r)] = TrainProgress(step=int(t["step"]), total=int(t["total"]), state=str(t["state"]),
                                                 last_progress_at=float(t["last_progress_at"] or 0),
                                                 written_at=float(t["written_at"] or 0), **_finite_figures(t))
            except (KeyError, TypeError, ValueError, OverflowError) as e:
                skipped.append(f"node answer: run {r} training: {type(e).__name__}; left out")
        stores = {}
        for r, st in (d.get("stores") or {}).items():
            st = asdict(st) if isinstance(st, StoreProgress) else st
            if isinstance(st, dict) and (store := _store_progress(st)) is not None:
                stores[str(r)] = store
            else:
                skipped.append(f"node answer: run {r} store: not a store's state; left out")
        return cls(processes=processes, shards=shards, incidents=incidents, read_at=read_at, skipped=skipped,
                   watch_alarms=[a for a in d.get("watch_alarms") or [] if isinstance(a, dict)], training=training,
                   stores=stores)


def _times_ok(entry: dict, keys: tuple[str, ...], what: str, skipped: list[str]) -> bool:
    try:
        for k in keys:
            node_time(entry.get(k), k)
    except ValueError as e:
        skipped.append(f"node answer: {what}: {e}; left out")
        return False
    return True


def _run_dir(log_file: str, role: str) -> Path | None:
    """A record's log is <run_dir>/logs/<role>.log: its run directory, without needing the run's config. A node-wide
    log (<state_dir>/logs/<run>.<role>.log: the run's store processes) names no run directory."""
    p = Path(log_file) if log_file else None
    return p.parent.parent if p is not None and p.parent.name == "logs" and p.name == f"{role}.log" else None


def _shards(run_dir: Path, skipped: list[str] | None = None) -> list[ShardProgress]:
    out = []
    for hb in sorted((run_dir / "hidden_states").glob("shard_*/heartbeat.json")):
        try:
            shard = int(hb.parent.name.split("_")[1])
            text = hb.read_text()
        except (OSError, ValueError, IndexError):
            continue  # half a run dir is not an error of this probe
        try:
            d = bounded_json.loads(text, source=str(hb))
            if not isinstance(d, dict):
                raise TypeError(f"a JSON {type(d).__name__}, not an object")
            out.append(ShardProgress(shard=shard, done=int(d.get("done") or 0), total=int(d.get("total") or 0),
                                     state=str(d.get("state") or "?"),
                                     last_progress_at=float(d.get("last_progress_at") or 0),
                                     written_at=float(d.get("time") or 0), rate=float(d.get("rate") or 0)))
        except (ValueError, TypeError, RecursionError) as e:   # one bad heartbeat: that shard, not the node
            if skipped is not None:
                skipped.append(f"{hb}: not a heartbeat ({type(e).__name__}: {str(e)[:200]}); shard {shard} left out")
    return out


def _finite_figures(d: dict) -> dict:
    """A trainer's figures as finite numbers or None (a NaN loss is said as unknown, never drawn or mailed)."""
    out: dict = {}
    for k in ("rate", "loss", "acc_0", "accept_length"):
        v = d.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
        else:
            out[k] = 0.0 if k == "rate" else None
    return out


def _training(run_dir: Path, skipped: list[str] | None = None) -> TrainProgress | None:
    """The run's trainer from its heartbeat; None before it wrote one."""
    hb = run_dir / "draft" / "heartbeat.json"
    try:
        text = hb.read_text()
    except OSError:
        return None
    try:
        d = bounded_json.loads(text, source=str(hb))
        if not isinstance(d, dict):
            raise TypeError(f"a JSON {type(d).__name__}, not an object")
        extra = d.get("extra")
        extra = extra if isinstance(extra, dict) else {}
        return TrainProgress(step=int(d.get("done") or 0), total=int(d.get("total") or 0),
                             state=str(d.get("state") or "?"), last_progress_at=float(d.get("last_progress_at") or 0),
                             written_at=float(d.get("time") or 0),
                             **_finite_figures({"rate": d.get("rate"), **extra}))
    except (ValueError, TypeError, RecursionError) as e:
        if skipped is not None:
            skipped.append(f"{hb}: not a heartbeat ({type(e).__name__}: {str(e)[:200]}); training left out")
        return None


def _store_progress(h: Mapping[str, Any]) -> StoreProgress | None:
    """A store's health answer (or its status document entry) as ``StoreProgress``; None when it is not one."""
    def count(k: str) -> int | None:
        v = h.get(k)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 \
            else None
    answering = h.get("answering")
    if not isinstance(h.get("ok"), bool) or not isinstance(h.get("label"), str):
        return None
    return StoreProgress(label=str(h["label"]), ok=bool(h["ok"]), detail=str(h.get("detail") or ""),
                         answering=answering if isinstance(answering, bool) else None,
                         allocated_bytes=count("allocated_bytes"), buffer_bytes=count("buffer_bytes"))


def _store(run_dir: Path, run_id: str, roles: set[str], skipped: list[str] | None = None,
           state_dir: Path | None = None) -> StoreProgress | None:
    """The run's streaming store (its frozen config's ``stream.storage``), while the run has one: its endpoint
    written (started, not yet stopped) or a process of its server alive. None for a store without a server
    (disk) or a run without a frozen config, and on a fleet's capture node sharing the run root: the endpoint
    there is the training node's, its pid records not this node's (``state_dir``), so they would read as dead."""
    cfg_file = run_dir / "run-config.json"
    try:
        stream = bounded_json.read(cfg_file).get("stream") or {}
        store = STORES.get(str(stream.get("storage") or "disk"))
        buffer_bytes = int(float(stream.get("buffer_gib") or 0) * (1 << 30))
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        return None    # no frozen config yet (or not one): nothing says the run streams
    endpoint = run_dir / "store_endpoint.json"
    if store is None or not store.health or not (_endpoint_here(endpoint, state_dir) or roles & set(store.roles)):
        return None
    settings = StoreSettings(run_id=run_id, root=str(run_dir / "hidden_states"), buffer_bytes=buffer_bytes,
                             endpoint_file=str(endpoint))
    try:
        h = store.server_health(settings) or {}
    except Exception as e:  # noqa: BLE001 - one run's store probe never makes the node unreadable
        if skipped is not None:
            skipped.append(f"run {run_id} store: {type(e).__name__}: {str(e)[:200]}; left out")
        return None
    progress = _store_progress({"buffer_bytes": buffer_bytes, **h})
    if progress is None and skipped is not None:
        skipped.append(f"run {run_id} store: its health answer is not one ({str(h)[:200]}); left out")
    return progress


def _endpoint_here(endpoint: Path, state_dir: Path | None) -> bool:
    """A store endpoint whose processes are recorded on this node (its master's pid record under ``state_dir``;
    any written endpoint when the state dir is not known)."""
    if not endpoint.exists():
        return False
    if state_dir is None:
        return True
    try:
        record = str(bounded_json.read(endpoint).get("master_pid_file") or "")
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        return True          # unreadable: the health read names it
    return not record or Path(record).parent == state_dir / "pids"   # no record named: the health read says so


def _incidents(state_dir: Path, now: float, skipped: list[str] | None = None) -> list[dict]:
    """The incident book (``watchdog.incidents.history``: a malformed line is left out and named in ``skipped``,
    never the whole node made unreadable) folded to one entry per incident (opened, then recovered or not)."""
    by_id: dict[str, dict] = {}
    for e in history(state_dir, skipped):
        if e.get("event") == "opened":
            by_id[e["id"]] = {"id": e["id"], "node": e.get("node"), "cause": e.get("cause"),
                              "opened_at": e.get("opened_at"), "ended_at": None, "outcome": "open",
                              "shards": sorted((e.get("shards") or {}).keys()),
                              "run_ids": sorted({s["run_id"] for s in (e.get("shards") or {}).values()
                                                 if isinstance(s, dict) and isinstance(s.get("run_id"), str)
                                                 and s["run_id"]})}
        elif e["id"] in by_id:
            by_id[e["id"]].update(ended_at=e.get("at"), outcome=e.get("event"),
                                  shard_count=e.get("shard_count"))
    return [i for i in by_id.values() if now - float(i.get("opened_at") or 0) < INCIDENT_DAYS * 86400]


def _watch_alarms(state_dir: Path, skipped: list[str] | None = None) -> list[dict]:
    """The sentinels' alarm records still raised (eagleflow.watchdog.sentinel): a job nobody looks at."""
    out = []
    for path in sorted((state_dir / "watch").glob("*.alarm.json")):
        try:
            d = bounded_json.read(path)
        except (OSError, ValueError) as e:
            if skipped is not None:
                skipped.append(f"{path}: not an alarm record ({type(e).__name__}); left out")
            continue
        if not (isinstance(d, dict) and d.get("state") == "raised"):
            continue
        # a sentinel stopped while raised never wrote "ended": its alarm holds only while that sentinel runs
        # (a later try's sentinel of the same role, which found looks, does not keep it open)
        sentinel = status(state_dir / "pids" / f"{d.get('run_id')}.sentinel_{d.get('role')}{RECORD_SUFFIX}")
        if sentinel.alive and sentinel.record is not None and sentinel.record.pid == d.get("sentinel_pid"):
            out.append(d)
    raised = {(a.get("run_id"), a.get("role")) for a in out}
    for a in out:
        a["silent_with"] = _silent_alongside(state_dir, a, raised)
    return out


def _job_name(role: str, alarm: dict) -> str:
    """How the watch names the job of ``role`` ("shard 1/2", "generate shard 1/2", "training"): the shard count
    from the alarm's own job when it is a shard of the same phase."""
    if role == "trainer":
        return "training"
    for kind in KINDS.values():
        if re.fullmatch(kind.worker_role_pattern(), role):
            shard = int(role[-5:])
            m = re.fullmatch(re.escape(kind.watch_name) + r" \d+/(\d+)", str(alarm.get("job") or ""))
            return f"{kind.watch_name} {shard}" + (f"/{m.group(1)}" if m else "")
    return role


def _silent_alongside(state_dir: Path, alarm: dict, raised: set) -> list[SilentJob]:
    """The other running jobs of the alarm's run that nothing has looked at either since its watch went silent (no
    look within one of their own look intervals after the alarm's last look: one triggerer watches them all, so
    a live one would have looked), each {"role", "job", "last_look_at"}. Their own sentinels alarm later, each on
    its own clock; gpu_node_health's mail names them all at once (issue 52: it named shard 0 only)."""
    run, since, poll = alarm.get("run_id"), alarm.get("silent_since"), alarm.get("poll_interval_s")
    if not isinstance(run, str) or not run or not isinstance(since, (int, float)) \
            or not isinstance(poll, (int, float)) or poll <= 0:
        return []
    suffix = ".looks.jsonl"
    out: list[SilentJob] = []
    for path in sorted((state_dir / "watch").glob(f"{glob.escape(run)}.*{suffix}")):
        role = path.name[len(run) + 1:-len(suffix)]
        if (run, role) in raised or not re.fullmatch(r"trainer|[a-z_]+\d{5}", role):
            continue
        job = status(state_dir / "pids" / f"{run}.{role}{RECORD_SUFFIX}")
        if not job.alive or job.record is None:
            continue
        fresh = [lk for lk in recent_looks(str(path)) if float(lk["at"]) >= job.record.started_at]
        last = float(fresh[-1]["at"]) if fresh else None
        if (last if last is not None else job.record.started_at) <= since + look_interval_s(fresh, float(poll)):
            out.append({"role": role, "job": _job_name(role, alarm), "last_look_at": last})
    return out


def collect(state_dir: str | Path, now: float | None = None) -> NodeActivity:
    now = time.time() if now is None else now
    state_dir = Path(state_dir)
    act = NodeActivity(read_at=now)
    run_dirs: dict[str, Path] = {}
    roles: dict[str, set[str]] = {}     # run_id -> the roles of its live processes
    recs, refused = scan_records(state_dir / "pids")
    act.skipped += [f"{why}; left out" for _, why in refused]
    for rec in recs:
        st = status(rec.pid_file)
        if not st.alive:
            continue
        run_id = Path(rec.pid_file).name[: -len(f".{rec.role}{RECORD_SUFFIX}")]
        act.processes.append(OurProcess(pid=rec.pid, pgid=rec.pgid, run_id=run_id, role=rec.role,
                                        started_at=rec.started_at))
        roles.setdefault(run_id, set()).add(rec.role)
        rd = _run_dir(rec.log_file, rec.role)
        if rd is not None:
            run_dirs[run_id] = rd
    for run_id, rd in sorted(run_dirs.items()):
        act.shards[run_id] = _shards(rd, act.skipped)
        train = _training(rd, act.skipped)
        if train is not None:
            act.training[run_id] = train
        store = _store(rd, run_id, roles.get(run_id, set()), act.skipped, state_dir)
        if store is not None:
            act.stores[run_id] = store
    act.incidents = _incidents(state_dir, now, act.skipped)
    act.watch_alarms = _watch_alarms(state_dir, act.skipped)
    return act


def read_node_activity(node, state_dir: str) -> NodeActivity:
    """``collect`` run on the node: one command, its answer's shape validated (``Node.run_json``), then its
    values (``NodeActivity.from_dict``: ids and times a node may not make up)."""
    act = node.run_json([node.python, "-m", "eagleflow.health.node_activity", "--state-dir", state_dir],
                        NodeActivity, timeout=60)
    return NodeActivity.from_dict(act.to_dict())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagleflow.health.node_activity", description=__doc__)
    ap.add_argument("--state-dir", required=True, help="the node's eagleflow state dir (node.state_dir)")
    a = ap.parse_args(argv)
    print(json.dumps(collect(a.state_dir).to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
