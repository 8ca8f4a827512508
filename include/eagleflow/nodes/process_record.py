"""Process records: what eagleflow started on a node, the proof that a PID is still ours, and the one stop.

A record (``<state_dir>/pids/<run_id>.<role>.json``, written by
``eagleflow.nodes.detach`` before the start is reported) holds the leader's
pid, its process group, its start time (field 22 of ``/proc/<pid>/stat``)
and a random token. Every process we start carries that token from exec
(``StartProof``), in two places:
- its environment (``EAGLEFLOW_PROC_TOKEN``), inherited by every descendant;
  ``SPT_NOENV=1`` beside it keeps Python's setproctitle (Airflow, Celery,
  sglang, vLLM) from writing its title over ``/proc/<pid>/environ``;
- an open descriptor, a memfd named ``eagleflow-proof-<token>``, which
  survives what rewrites the environ area anyway (redis-server's title, an
  ``env -i`` exec) and is inherited by forked children.
Both are readable by the process's owner only (``/proc/<pid>/environ``,
``/proc/<pid>/fd``); pid and start time are public.

Proof of "ours", checked on the node each time before a signal:
- the record file: a regular file owned by this user, not writable by group
  or others, opened without following a symlink (``durable.open_owned``);
  anyone else able to write it could name any process;
- the leader: alive (not a zombie) with the recorded start time AND carrying
  the record's token (environ or descriptor). While it lives the group id
  cannot name anyone else's group, so the group is signalled as one
  (``killpg``): only processes of its session can join it;
- with the leader gone: each member of the recorded group that carries the
  record's token is signalled by PID, one by one.
Nothing else proves anything: a process whose environ shows no ``VAR=value``
(a process title overwrote it) and that holds no descriptor of ours is not
ours, whoever owns it. A group id whose number is now used by someone else
(the old group died out, the PID was reused) has no provable member: nothing
is signalled, the record is reported as stale and left for a person.

``stop`` (TERM, CONT so a stopped process acts on it, grace, KILL) is the
only way eagleflow stops a process. It runs on the node: in this process for
``gpu free``, through ``eagleflow.nodes.process_record.main`` (``stop``) from
the control plane (``Node.stop_recorded``). Standard library only: it runs
with whatever interpreter the node has.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagleflow import bounded_json
from eagleflow.durable import UnsafeFile, atomic_write, read_owned
from eagleflow.nodes.proc import ProcState, read_proc_state, read_stat

TOKEN_ENV = "EAGLEFLOW_PROC_TOKEN"
RECORD_ENV = "EAGLEFLOW_PROC_RECORD"   # the record's path, in what detach starts: where a process's own record is
PROOF_FD_PREFIX = "eagleflow-proof-"   # the memfd's name: /proc/<pid>/fd/N -> "/memfd:eagleflow-proof-<token> (deleted)"
RECORD_SUFFIX = ".json"


@dataclass(frozen=True)
class ProcessRecord:
    """One process eagleflow started, as recorded on the node."""
    pid: int
    pgid: int
    start_ticks: int       # /proc/<pid>/stat field 22: tells our process from a later one with the same PID
    role: str
    pid_file: str = ""
    log_file: str = ""
    argv: tuple[str, ...] = ()
    started_at: float = 0.0
    user: str = ""
    token: str = ""        # in the environment of the process and its descendants
    exit_code: int | None = None    # kept by whoever reaped it, where known
    exit_signal: int | None = None

    @property
    def command(self) -> str:
        return " ".join(self.argv)[:200]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["argv"] = list(self.argv)
        return d

    @classmethod
    def from_dict(cls, d: dict, pid_file: str = "") -> "ProcessRecord":
        """Raises ValueError naming the field when the record is not one of ours."""
        if not isinstance(d, dict):
            raise ValueError(f"pid record {pid_file}: expected a JSON object, got {type(d).__name__}")
        try:
            pid = int(d["pid"])
            pgid = int(d.get("pgid") or pid)
            ticks = int(d.get("start_ticks") or 0)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"pid record {pid_file}: field pid/pgid/start_ticks missing or not an integer "
                             f"({ {k: d.get(k) for k in ('pid', 'pgid', 'start_ticks')} })") from None
        if pid <= 1 or pgid <= 1:
            raise ValueError(f"pid record {pid_file}: pid {pid} / pgid {pgid} cannot be a process we started")
        return cls(pid=pid, pgid=pgid, start_ticks=ticks, role=str(d.get("role") or "?"),
                   pid_file=pid_file or str(d.get("pid_file") or ""), log_file=str(d.get("log_file") or ""),
                   argv=tuple(str(a) for a in d.get("argv") or ()), started_at=float(d.get("started_at") or 0.0),
                   user=str(d.get("user") or ""), token=str(d.get("token") or ""),
                   exit_code=_int_or_none(d.get("exit_code")), exit_signal=_int_or_none(d.get("exit_signal")))


def _int_or_none(v) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def record_file(pids_dir: str | os.PathLike, run_id: str, role: str) -> Path:
    """The exact record file of a run's role (the same name as ``RunLayout.pid_file``)."""
    return Path(pids_dir) / f"{run_id}.{role}{RECORD_SUFFIX}"


def record_run_id(rec: ProcessRecord) -> str | None:
    """The run a record belongs to: its file name is ``<run_id>.<role>.json`` with the role it holds. None when the
    name does not end with the record's own role (renamed or forged: it belongs to no run we can name)."""
    name = Path(rec.pid_file).name
    tail = f".{rec.role}{RECORD_SUFFIX}"
    if not name.endswith(tail):
        return None
    return name[: -len(tail)] or None


class RecordRefused(ValueError):
    """A pid record that cannot be trusted (a symlink, someone else's, writable by others, not a record)."""


def load_record(pid_file: str | os.PathLike) -> ProcessRecord:
    """The record at ``pid_file``; FileNotFoundError when there is none, RecordRefused naming why it is not ours."""
    try:
        data = read_owned(pid_file, limit=1 << 20)
    except UnsafeFile as e:
        raise RecordRefused(f"pid record {e.strerror}") from None
    except ValueError as e:
        raise RecordRefused(f"pid record {e}") from None
    try:
        return ProcessRecord.from_dict(bounded_json.loads(data, source=f"pid record {pid_file}"), str(pid_file))
    except ValueError as e:   # JSONDecodeError too
        raise RecordRefused(str(e) if str(e).startswith("pid record") else f"pid record {pid_file}: not JSON ({e})") \
            from None
    except RecursionError:
        raise RecordRefused(f"pid record {pid_file}: nested too deeply to be a record") from None


def read_record(pid_file: str | os.PathLike) -> ProcessRecord | None:
    """The record at ``pid_file``; None when there is none or it cannot be one of ours (never half-written)."""
    try:
        return load_record(pid_file)
    except (OSError, RecordRefused):
        return None


def write_record(rec: ProcessRecord) -> None:
    # 0600: the token is the proof a process is ours; nobody else needs to read it
    atomic_write(rec.pid_file, json.dumps(rec.to_dict()), mode=0o600)


def records_in(pids_dir: str | os.PathLike, run_id: str | None = None,
               role_pattern: str | None = None) -> list[ProcessRecord]:
    """Records in ``pids_dir``; with ``run_id``, only that run's, matched exactly (never by prefix).

    ``role_pattern`` is a regular expression the whole role must match (e.g. ``worker_shard_\\d{5}``).
    Refused records (see ``scan_records``) are left out.
    """
    return scan_records(pids_dir, run_id, role_pattern)[0]


def scan_records(pids_dir: str | os.PathLike, run_id: str | None = None,
                 role_pattern: str | None = None) -> tuple[list[ProcessRecord], list[tuple[str, str]]]:
    """(records, (file, why) of each refused record file), as ``records_in``: a refused one is never signalled."""
    d = Path(pids_dir)
    if not d.is_dir():
        return [], []
    out: list[ProcessRecord] = []
    refused: list[tuple[str, str]] = []
    for p in sorted(d.iterdir()):
        if not p.name.endswith(RECORD_SUFFIX) or p.name.startswith("."):
            continue
        if run_id is not None and not p.name.startswith(f"{run_id}."):
            continue
        try:
            rec = load_record(p)
        except FileNotFoundError:
            continue
        except (OSError, RecordRefused) as e:
            refused.append((str(p), str(e) if isinstance(e, RecordRefused) else f"pid record {p}: {e}"))
            continue
        # the file name is <run_id>.<role>.json: compare both parts whole
        if run_id is not None and p.name != f"{run_id}.{rec.role}{RECORD_SUFFIX}":
            continue
        if role_pattern is not None and not re.fullmatch(role_pattern, rec.role):
            continue
        out.append(rec)
    return out, refused


# ----------------------------------------------------------------------------- proof of ownership
class StartProof:
    """The token a process we start carries from exec, so that a later stop can prove it ours (module doc).

    ``with StartProof() as proof: Popen(argv, env=proof.env(env), pass_fds=proof.pass_fds, ...)``, then record
    ``proof.token``. The child holds its own copy of the descriptor; ours is closed on leaving the block.
    """

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        try:
            self.fd: int | None = os.memfd_create(PROOF_FD_PREFIX + self.token, os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            self.fd = None   # no memfd here (not Linux >= 3.17): the environment is then the only proof

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return () if self.fd is None else (self.fd,)

    def env(self, base) -> dict[str, str]:
        # SPT_NOENV: setproctitle writes its title over argv only, so /proc/<pid>/environ keeps the token
        return {**base, TOKEN_ENV: self.token, "SPT_NOENV": "1"}

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "StartProof":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _environ_entries(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None   # gone, or not ours to read


def _holds_proof_fd(pid: int, token: str) -> bool:
    want = f"/memfd:{PROOF_FD_PREFIX}{token} (deleted)"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                return True
        except OSError:
            continue
    return False


def _carries_token(pid: int, token: str) -> bool:
    """The record's token in the process's own environ or an inherited descriptor named with it: nothing else.
    A blank environ (a process title overwrote it) proves nothing: anyone's process can look like that."""
    if not token:
        return False
    env = _environ_entries(pid)
    if env is not None and f"{TOKEN_ENV}={token}".encode() in env:
        return True
    return _holds_proof_fd(pid, token)


def _blank_environ(pid: int) -> bool:
    """/proc/<pid>/environ readable and holding no VAR=value at all (a process title overwrote it, or env -i)."""
    env = _environ_entries(pid)
    return env is not None and not any(b"=" in e for e in env)


def _runs_with_recorded_start(rec: ProcessRecord) -> bool:
    st = read_stat(rec.pid)
    return st is not None and st.alive and rec.start_ticks > 0 and st.start_ticks == rec.start_ticks


def leader_is_ours(rec: ProcessRecord) -> bool:
    """The recorded PID runs (not a zombie), started when the record says, and carries the record's token
    (environ or descriptor): it is the process we started. Pid and start time alone are public."""
    return _runs_with_recorded_start(rec) and _carries_token(rec.pid, rec.token)


def leader_state(rec: ProcessRecord) -> ProcState | None:
    """The /proc state of the recorded leader when it is the process we started (same start
    time), a zombie included so its exit can be read; None when it is gone or the PID is someone else's.
    What the watchdog reads; it never signals through this."""
    st = read_proc_state(rec.pid)
    if st is None or rec.start_ticks <= 0 or st.start_ticks != rec.start_ticks:
        return None
    return st


def _leads_its_group(rec: ProcessRecord) -> bool:
    """Our leader runs and still leads the recorded group: the group id cannot name anyone else's group."""
    st = read_stat(rec.pid)
    return leader_is_ours(rec) and st is not None and st.pgid == rec.pgid


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) PIDs whose process group is ``pgid``, whoever they belong to."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = read_stat(int(name))
            if st is not None and st.pgid == pgid and st.alive:
                out.append(int(name))
    return out


def members(rec: ProcessRecord) -> list[int]:
    """The live processes of the record's group that are provably ours.

    While our leader lives, the whole group: only processes of its session (ours: detach started it
    with setsid) can join it, even a child that cleared its environment. Once the leader is gone, its
    number may be reused by anyone, so then only members carrying the record's token count (a blank
    environ is no proof: such a member is reported, never signalled).
    """
    if _leads_its_group(rec):
        return group_pids(rec.pgid)
    return [p for p in group_pids(rec.pgid) if p != rec.pid and _carries_token(p, rec.token)]


@dataclass
class RecordStatus:
    """What ``status`` tells the control plane about one record."""
    recorded: bool
    alive: bool = False                  # the leader runs with the recorded start time
    members: int = 0                     # live processes of the group proven ours
    state: str | None = None             # the leader's /proc state (R S D T Z ...)
    record: ProcessRecord | None = None
    detail: str = ""


def status(pid_file: str | os.PathLike) -> RecordStatus:
    try:
        rec = load_record(pid_file)
    except FileNotFoundError:
        return RecordStatus(recorded=False, detail=f"no pid record at {pid_file}")
    except (OSError, RecordRefused) as e:
        return RecordStatus(recorded=False, detail=f"refused: {e}")
    st = read_stat(rec.pid)
    alive = leader_is_ours(rec)
    mine = members(rec)
    if alive:
        detail = f"{rec.role} pid {rec.pid} running"
    elif _runs_with_recorded_start(rec):
        detail = (f"not ours: {rec.role} pid {rec.pid} runs but does not carry the record's token (token mismatch"
                  f"{_blank_note(rec.pid)})")
    elif st is not None and st.alive:
        detail = f"{rec.role} pid {rec.pid} gone; the PID now belongs to another process (start time differs)"
    else:
        detail = f"{rec.role} pid {rec.pid} gone"
    return RecordStatus(recorded=True, alive=alive, members=len(mine), state=st.state if st else None, record=rec,
                        detail=detail)


@dataclass
class RecordList:
    records: list[RecordStatus] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)   # record files not trusted (see scan_records), why each


# ----------------------------------------------------------------------------- what a deployment started
@dataclass
class StartedUnder:
    """What ``records_started_under`` found: records to stop, and processes it could not tie to a record."""
    records: list[ProcessRecord] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)   # one line each: pid, command, why no record


def _env_value(env: list[bytes], name: str) -> str | None:
    prefix = f"{name}=".encode()
    for e in env:
        if e.startswith(prefix):
            return e[len(prefix):].decode("utf-8", "replace")
    return None


def records_started_under(marker: str, value: str, *, skip_token: str = "") -> StartedUnder:
    """The records of the live processes of this user whose environ holds ``marker=value``.

    A deployment puts such a marker in its own environment; every job its tasks detach on this machine inherits
    it (``eagleflow.nodes.detach`` copies the caller's environment), next to the job's own token and the path of
    its record (``RECORD_ENV``). A record counts only when it is one of ours (``load_record``: our file, not a
    link) and its token is the one the process carries; a process with the marker that names no such record is
    listed in ``unrecorded``, never signalled. ``skip_token``: processes carrying this token (the deployment's own
    group, stopped by its own record) are not looked at. Each record once, whichever of its processes named it.
    """
    out = StartedUnder()
    want = f"{marker}={value}".encode()
    seen: set[str] = set()
    for name in sorted(os.listdir("/proc"), key=lambda n: (len(n), n)):
        if not name.isdigit():
            continue
        pid = int(name)
        env = _environ_entries(pid)
        st = read_stat(pid)
        if env is None or want not in env or st is None or not st.alive:
            continue
        token = _env_value(env, TOKEN_ENV) or ""
        if skip_token and token == skip_token:
            continue
        path = _env_value(env, RECORD_ENV)
        cmd = _cmdline(pid)
        if not path or not token:
            out.unrecorded.append(f"pid {pid} (`{cmd}`): no record named in its environment (started before "
                                  f"records were named there, or not through eagleflow.nodes.detach)")
            continue
        if path in seen:
            continue
        try:
            rec = load_record(path)
        except FileNotFoundError:
            out.unrecorded.append(f"pid {pid} (`{cmd}`): its record {path} is gone")
            continue
        except (OSError, RecordRefused) as e:
            out.unrecorded.append(f"pid {pid} (`{cmd}`): {e}")
            continue
        if rec.token != token:
            out.unrecorded.append(f"pid {pid} (`{cmd}`): record {path} holds another token (a later start of the "
                                  "same role); not this process's record")
            continue
        seen.add(path)
        out.records.append(rec)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(4096).replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200]
    except OSError:
        return "?"


# ----------------------------------------------------------------------------- the one stop
@dataclass
class StopResult:
    """terminated | killed | already_gone | stale_record | not_ours | refused | unkillable | survived | not_recorded
    | left_running."""
    outcome: str
    pid: int = 0
    pgid: int = 0
    role: str = ""
    user: str | None = None
    command: str = ""
    record: str = ""
    wchan: str | None = None
    left_alone: list[int] = field(default_factory=list)  # group members not proven ours: never signalled
    detail: str = ""
    foreign: bool = False          # not started by eagleflow (a GPU holder stopped only with force)
    gpu_mib: int | None = None
    run_id: str = ""               # the record's run, where the stop's caller tells it (``gpu free``)

    @property
    def stuck(self) -> bool:
        return self.outcome in ("unkillable", "survived")

    def describe(self) -> str:
        what = "foreign process" if self.foreign else self.role
        wchan = f", waiting in kernel function {self.wchan}" if self.wchan else ""
        mem = f", {self.gpu_mib} MiB on GPU" if self.gpu_mib is not None else ""
        return f"{what} pid {self.pid} ({self.user or 'user ?'}, `{self.command}`{mem}): {self.outcome}{wchan}"


def _term_grace_kill(remaining, send, grace_s: float, kill_wait_s: float,
                     term_signal: int = signal.SIGTERM) -> tuple[str, str | None]:
    """TERM (and CONT, so a SIGSTOPped process acts on it), wait, KILL, wait. (outcome, wchan when stuck in D)."""
    def wait_gone(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while remaining():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    send(term_signal)
    send(signal.SIGCONT)
    if wait_gone(grace_s):
        return "terminated", None
    send(signal.SIGKILL)
    if wait_gone(kill_wait_s):
        return "killed", None
    for p in remaining():
        ps = read_proc_state(p)
        if ps is not None and ps.in_d_state:
            return "unkillable", ps.wchan or "?"
    return "survived", None


def _send(rec: ProcessRecord, sig: int, ours) -> None:
    """One signal to what is proven ours right now: the whole group through a live leader, else one by one."""
    try:
        if _leads_its_group(rec):
            os.killpg(rec.pgid, sig)
            return
    except ProcessLookupError:
        pass
    for p in ours():
        _kill(p, sig)


def _threads_still_exiting(pid: int) -> bool:
    """A zombie leader whose other threads are still exiting: /proc shows the leader Z as soon as its own thread
    ends, while a sibling thread still tears down the memory and holds the descriptors (a job's life lock, a
    GPU's memory) until it ends too. Not gone yet: a restart right after would find the lock still held."""
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def stop(rec: ProcessRecord, *, grace_s: float = 15.0, kill_wait_s: float = 5.0,
         remove_record: bool = True, term_signal: int = signal.SIGTERM) -> StopResult:
    """TERM what is ours of the record's group, grace, KILL; report a process stuck in D with its wchan.

    The record is removed once nothing of ours is left (kept when something
    survived, so a later stop can try again). A stale record is reported and
    removed; what now holds its PID or group id is left alone.
    """
    res = StopResult(outcome="already_gone", pid=rec.pid, pgid=rec.pgid, role=rec.role, user=rec.user or None,
                     command=rec.command, record=rec.pid_file)
    mine = members(rec)
    foreign = [p for p in group_pids(rec.pgid) if p not in mine]
    res.left_alone = foreign
    if not mine:
        st = read_stat(rec.pid)
        if _runs_with_recorded_start(rec):
            # pid, group and start time match but the environment does not: a forged or foreign record
            res.outcome = "not_ours"
            res.detail = (f"not ours: pid {rec.pid} (group {rec.pgid}) has the recorded start time but neither its "
                          f"/proc/{rec.pid}/environ nor its open descriptors carry record {rec.pid_file}'s token "
                          f"(token mismatch{'' if rec.token else ': the record has none'}{_blank_note(rec.pid)}); "
                          "not signalled. The record is kept for a person to look at: check that process "
                          f"(ps -o pid,user,lstart,args -p {rec.pid}) and stop it by hand if it is the run's")
            return res
        if st is not None and st.alive:
            res.outcome = "stale_record"
            res.detail = (f"record {rec.pid_file}: pid {rec.pid} now belongs to another process (start time "
                          f"{st.start_ticks}, recorded {rec.start_ticks}); not signalled")
        elif foreign:
            res.outcome = "stale_record"
            blank = [p for p in foreign if _blank_environ(p)]
            res.detail = (f"record {rec.pid_file}: {rec.role} pid {rec.pid} is gone and process group {rec.pgid} now "
                          f"holds {len(foreign)} process(es) that carry no proof of being ours ({_pids(foreign)}: "
                          "neither the record's token in their environ nor a descriptor of ours"
                          + (f"; {_pids(blank)} show a blank environ, which proves nothing" if blank else "")
                          + "); not signalled")
        else:
            res.detail = f"{rec.role} pid {rec.pid} not running"
        if remove_record:
            _remove(rec)  # gone or stale: it can never name our process again; the report says which
        return res
    # Proven ours at this first look stays ours while it runs with the same start time: a leader that exits
    # first (airflow standalone on SIGINT) must not orphan children whose environ a proc title overwrote.
    known = {p: st.start_ticks for p in mine if (st := read_stat(p)) is not None}

    def ours() -> list[int]:
        now = set(members(rec))
        now.update(p for p, ticks in known.items()
                   if (st := read_stat(p)) is not None and st.start_ticks == ticks
                   and (st.alive or _threads_still_exiting(p)))
        return sorted(now)

    res.outcome, res.wchan = _term_grace_kill(ours, lambda sig: _send(rec, sig, ours), grace_s, kill_wait_s,
                                              term_signal)
    res.detail = f"{rec.role} pid {rec.pid} (group {rec.pgid}) {res.outcome}" + (
        f", waiting in kernel function {res.wchan}" if res.wchan else "") + (
        f"; left {len(foreign)} process(es) of the group that are not ours: {_pids(foreign)}" if foreign else "")
    if remove_record and not res.stuck:
        _remove(rec)
    return res


def stop_pid(pid: int, *, grace_s: float = 15.0, kill_wait_s: float = 5.0) -> tuple[str, str | None]:
    """TERM, grace, KILL one process we did not start (``gpu free --force``), as it is now: never its group.

    Its start time is read first and checked before every signal, so a PID
    reused meanwhile is not touched. Returns (outcome, wchan).
    """
    st = read_stat(pid)
    if st is None or not st.alive:
        return "already_gone", None
    ticks = st.start_ticks

    def remaining() -> list[int]:
        now = read_stat(pid)
        return [pid] if now is not None and now.alive and now.start_ticks == ticks else []

    def send(sig: int) -> None:
        if remaining():
            _kill(pid, sig)
    return _term_grace_kill(remaining, send, grace_s, kill_wait_s)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_file(pid_file: str | os.PathLike, *, grace_s: float = 15.0, kill_wait_s: float = 5.0) -> StopResult:
    try:
        rec = load_record(pid_file)
    except FileNotFoundError:
        return StopResult(outcome="not_recorded", record=str(pid_file), detail=f"no pid record at {pid_file}")
    except (OSError, RecordRefused) as e:
        return StopResult(outcome="refused", record=str(pid_file), detail=f"{e}; nothing signalled")
    return stop(rec, grace_s=grace_s, kill_wait_s=kill_wait_s)


def _remove(rec: ProcessRecord) -> None:
    if rec.pid_file:
        try:
            os.unlink(rec.pid_file)
        except FileNotFoundError:
            pass


def _blank_note(pid: int) -> str:
    if not _blank_environ(pid):
        return ""
    return (f": /proc/{pid}/environ shows no VAR=value at all (a process title overwrote it, or env -i), which "
            "proves nothing")


def _pids(pids: list[int]) -> str:
    return ", ".join(f"pid {p}" for p in pids[:10]) + (" ..." if len(pids) > 10 else "")


# ----------------------------------------------------------------------------- node-side command
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagleflow.nodes.process_record",
                                 description="eagleflow's pid records on this node: status and stop (one JSON line)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status", help="is the recorded process still the one we started?")
    s.add_argument("--pid-file", required=True)
    t = sub.add_parser("stop", help="TERM, grace, KILL what is proven ours of the record's group")
    t.add_argument("--pid-file", required=True)
    t.add_argument("--grace", type=float, default=15.0)
    t.add_argument("--kill-wait", type=float, default=5.0)
    ls = sub.add_parser("list", help="every record in a pids dir with whether it still runs")
    ls.add_argument("--pids-dir", required=True)
    ls.add_argument("--run-id", help="only this run's records (exact run id)")
    ls.add_argument("--role-pattern", help="only roles this regular expression matches whole")
    a = ap.parse_args(argv)
    if a.cmd == "status":
        out = asdict(status(a.pid_file))
    elif a.cmd == "stop":
        out = asdict(stop_file(a.pid_file, grace_s=a.grace, kill_wait_s=a.kill_wait))
    else:
        recs, refused = scan_records(a.pids_dir, a.run_id, a.role_pattern)
        out = asdict(RecordList([status(r.pid_file) for r in recs], [why for _, why in refused]))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
