"""`make airflow` / `make airflow-stop`: Airflow's parts, supervised, in the checkout's home.

``start`` runs ``supervise`` (below) in place of ``airflow standalone``: the same preparation, then the
scheduler, DAG processor, API server and triggerer, each restarted when it dies (``airflow standalone``
does not), after the log server it leaves holding its port is stopped.

Started in its own session (setsid), so it can be stopped as a process group:
in Airflow 3.3 a SIGTERM to the parent leaves the scheduler and workers
orphaned. Stop = SIGINT to the group, wait, then SIGKILL to what is left of
that group only, through eagleflow's one stop (``eagleflow.nodes.process_record``):
<home>/standalone.json records the leader's start time and the token its
processes carry, so a stale file whose group id now names someone else's
processes signals nothing.

The node jobs its runs started on this machine (a trainer, a capture server, workers, their sentinels) are
detached: each in its own session, so the group's stop does not reach them. They inherit the deployment's
environment, where ``start`` put a marker (``DEPLOYMENT_ENV``, a random id kept in standalone.json), beside their
own token and the path of their record (``eagleflow.nodes.detach``). ``stop`` then stops each of them by its
record, through the same one stop (sentinels first, so none alarms on its job's end), after Airflow's parts are
gone (no watch restarts what it stops); ``--keep-node-jobs`` leaves them running and lists each with the command
that stops it. Jobs on nodes reached over SSH do not carry the marker and are never touched from here: ``stop``
says how to list and stop them on their node.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from eagleflow.airflow.deploy.home import airflow_bin, airflow_env
from eagleflow.nodes import process_record
from eagleflow.nodes.proc import read_start_ticks, read_stat
from eagleflow.durable import atomic_replace
from eagleflow.ports import free_port


def standalone_env(home: str | Path | None, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = airflow_env(home, parallelism=4, extra=extra)
    env.update({
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__HOST": env.get("AIRFLOW__API__HOST", "127.0.0.1"),
        "AIRFLOW__API__BASE_URL": f"http://localhost:{port}",
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": env.get("AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT", str(free_port())),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": env.get("AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT", str(free_port())),
        "AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL": "5",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
    })
    return env


DEPLOYMENT_ENV = "EAGLEFLOW_DEPLOYMENT"   # in everything the deployment starts, detached node jobs included
NODE_JOB_GRACE_S = 15.0                    # a node job's TERM grace on `make airflow-stop` (a trainer saves first)


def state_file(home: Path) -> Path:
    return home / "standalone.json"


def start(home: str | Path | None = None, port: int = 8080, *, wait_s: float = 240,
          extra_env: dict[str, str] | None = None) -> dict:
    env = standalone_env(home, port, extra_env)
    home = Path(env["AIRFLOW_HOME"])
    sf = state_file(home)
    if sf.exists():
        old = json.loads(sf.read_text())
        if process_record.members(_record(old)):
            raise RuntimeError(f"Airflow standalone already runs from {home} (process group {old['pgid']}, "
                               f"port {old['port']}); stop it with `make airflow-stop`")
    log = open(home / "standalone.log", "ab")
    # the marker every node job its runs detach on this machine inherits: how `make airflow-stop` finds them
    deployment = secrets.token_hex(16)
    env[DEPLOYMENT_ENV] = deployment
    # our supervisor in place of `airflow standalone`, which neither restarts a dead part nor frees its log port;
    # the token it carries (environ and descriptor) is what proves its group ours to `make airflow-stop`
    with process_record.StartProof() as proof:
        proc = subprocess.Popen([sys.executable, "-m", "eagleflow.airflow.deploy.standalone", "supervise"],
                                env=proof.env(env), pass_fds=proof.pass_fds, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    info = {"pid": proc.pid, "pgid": proc.pid, "start_ticks": read_start_ticks(proc.pid) or 0, "token": proof.token,
            "deployment": deployment, "port": port, "url": f"http://localhost:{port}",
            "log": str(home / "standalone.log"), "home": str(home)}
    _write_state(sf, info)
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"airflow standalone exited with {proc.returncode}; see {info['log']}")
        if _healthy(port):
            break
        time.sleep(1)
    else:
        raise RuntimeError(f"Airflow API not healthy on port {port} after {wait_s} s; see {info['log']}")
    info["password"] = admin_password(home, wait_s=60)
    _write_state(sf, info)
    return info


def _write_state(sf: Path, info: dict) -> None:
    """standalone.json, 0600 from its first byte: it holds the admin password and the group's token."""
    with atomic_replace(sf, mode=0o600) as tmp:
        tmp.write_text(json.dumps(info))


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/monitor/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def admin_password(home: Path, wait_s: float = 0) -> str | None:
    f = home / "simple_auth_manager_passwords.json.generated"
    deadline = time.time() + wait_s
    while True:
        if f.exists():
            try:
                password = json.loads(f.read_text()).get("admin")
                os.chmod(f, 0o600)   # Airflow writes it world-readable; it is the admin's password
                return password
            except json.JSONDecodeError:
                pass
        if time.time() >= deadline:
            return None
        time.sleep(0.5)


def _group_alive(pgid: int) -> bool:
    """Any process of the group that is not a zombie (a zombie holds no port and no memory)."""
    _reap(pgid)
    return bool(process_record.group_pids(pgid))


def _reap(pid: int) -> None:
    """Collect the leader's exit status when this process started it (tests, `make airflow`)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop(home: str | Path | None = None, *, grace_s: float = 30, keep_node_jobs: bool = False,
         node_job_grace_s: float = NODE_JOB_GRACE_S, log=print) -> bool:
    """Stop the group we started, then the node jobs its runs detached on this machine (``keep_node_jobs``: list
    them instead); False when nothing of Airflow's group was running. Each node job is reported through ``log``."""
    home = Path(airflow_env(home)["AIRFLOW_HOME"])
    sf = state_file(home)
    if not sf.exists():
        return False
    info = json.loads(sf.read_text())
    _reap(int(info["pid"]))
    res = process_record.stop(_record(info), grace_s=grace_s, kill_wait_s=10.0, remove_record=False,
                              term_signal=signal.SIGINT)
    if res.outcome in ("not_ours", "refused"):
        # nothing was signalled: the state file stays for a person to look at, and nothing is reported stopped
        print(f"airflow standalone: {res.detail}", file=sys.stderr)
        return False
    if res.outcome == "stale_record":
        print(f"airflow standalone: {res.detail}", file=sys.stderr)
    if info.get("deployment"):   # Airflow's parts are gone: nothing restarts or recovers what is stopped now
        stop_node_jobs(str(info["deployment"]), keep=keep_node_jobs, grace_s=node_job_grace_s,
                       skip_token=str(info.get("token") or ""), log=log)
    sf.unlink(missing_ok=True)
    return res.outcome not in ("already_gone", "stale_record")


@dataclass
class NodeJobs:
    """What ``stop_node_jobs`` did: each node job of the deployment stopped or kept, and what it could not tie to
    a record (listed, never signalled)."""
    stopped: list[process_record.StopResult] = field(default_factory=list)
    kept: list[process_record.ProcessRecord] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)


def stop_node_jobs(deployment: str, *, keep: bool = False, grace_s: float = NODE_JOB_GRACE_S, skip_token: str = "",
                   log=print) -> NodeJobs:
    """The node jobs on this machine that carry the deployment's marker: each stopped by its record through the
    one stop (sentinels first), or with ``keep`` listed with the command that stops it."""
    found = process_record.records_started_under(DEPLOYMENT_ENV, deployment, skip_token=skip_token)
    out = NodeJobs(unrecorded=found.unrecorded)
    recs = sorted(found.records, key=lambda r: (not r.role.startswith("sentinel_"), r.pid_file))
    for rec in recs:
        run = process_record.record_run_id(rec) or "?"
        if keep:
            out.kept.append(rec)
            log(f"node job left running: run {run}, {rec.role} pid {rec.pid} (`{rec.command}`); stop it with "
                f"{sys.executable} -m eagleflow.nodes.process_record stop --pid-file {rec.pid_file}")
            continue
        res = process_record.stop(rec, grace_s=grace_s)
        res.run_id = run
        out.stopped.append(res)
        log(f"node job of run {run} stopped: {res.describe()}")
    for line in found.unrecorded:
        log(f"node job left running, no record found: {line}; stop it by hand if it is the run's")
    log("jobs on nodes reached over SSH are not stopped from here: on each node, `python -m "
        "eagleflow.nodes.process_record list --pids-dir <node.state_dir>/pids` lists them, `... stop --pid-file "
        "RECORD` stops one")
    return out


def _record(info: dict) -> process_record.ProcessRecord:
    """standalone.json as a process record (a file from before start times were kept proves nothing)."""
    return process_record.ProcessRecord(pid=int(info["pid"]), pgid=int(info["pgid"]),
                                        start_ticks=int(info.get("start_ticks") or 0), role="airflow_standalone",
                                        token=str(info.get("token") or ""))


# ----------------------------------------------------------------------------- the supervisor
PARTS = ("scheduler", "dag-processor", "api-server", "triggerer")   # what `airflow standalone` runs
RESTART_MAX_DELAY_S = 30.0   # a part that keeps dying is restarted at 1, 2, 4 ... s, at most this far apart
STEADY_AFTER_S = 60.0        # a part that ran this long before it died is restarted at once


# A fresh deployment's first gpu_node_health run (unpaused on creation, due at once) failed with its log ending at
# "Pre Execute" (issue 50): the scheduler started it while the API server was still loading, the task's supervisor
# could not tell the execution API the task had started (its few retries spent) and killed it. The API server now
# starts first; the other parts once it answers (or after API_FIRST_WAIT_S, said in the log).
API_FIRST = "api-server"
API_FIRST_WAIT_S = 240.0
API_READY_PATH = "/api/v2/monitor/health"


def api_answers(base_url: str, timeout_s: float = 3.0) -> bool:
    """Whether the API server at ``base_url`` answers HTTP (its health endpoint, any status): the execution API
    task supervisors call is served by the same process."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + API_READY_PATH, timeout=timeout_s):
            return True
    except urllib.error.HTTPError:   # an answer, even an error one: the server is up
        return True
    except (OSError, ValueError):
        return False


def start_parts(parts: dict, env: dict[str, str], log, stopping: threading.Event, *,
                wait_s: float = API_FIRST_WAIT_S, poll_s: float = 1.0) -> bool:
    """Start the API server, wait until it answers (at most ``wait_s``; not when it dies or we are told to stop),
    then the other parts, so no task starts before the execution API can take it. True when it answered."""
    api = parts[API_FIRST]
    log(f"{api.name} started: pid {api.start(env).pid}; the other parts start once it answers")
    base = env.get("AIRFLOW__API__BASE_URL") or os.environ.get("AIRFLOW__API__BASE_URL") or ""
    t0 = time.time()
    answered = False
    while base and not stopping.is_set() and time.time() - t0 < wait_s:
        if api_answers(base):
            answered = True
            break
        if api.proc is not None and api.proc.poll() is not None:
            break   # it died: the supervisor's loop restarts it
        stopping.wait(poll_s)
    if stopping.is_set():
        return answered
    log(f"{api.name} answers at {base}{API_READY_PATH} after {time.time() - t0:.0f} s" if answered else
        f"{api.name} did not answer at {base or '(no [api] base_url)'}{API_READY_PATH} within "
        f"{time.time() - t0:.0f} s; starting the other parts anyway")
    for p in parts.values():
        if p is not api:
            log(f"{p.name} started: pid {p.start(env).pid}")
    return answered


def parts_file(home: Path) -> Path:
    """What the supervisor runs now: each part's pid, start time, restarts and its log-server child."""
    return home / "standalone-parts.json"


def _children(pid: int) -> list[tuple[int, int, str]]:
    """(pid, start_ticks, cmdline) of the live children of ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        st = read_stat(int(entry)) if entry.isdigit() else None
        if st is None or st.ppid != pid or not st.alive:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        out.append((st.pid, st.start_ticks, cmd))
    return out


class _Part:
    """One Airflow part run by the supervisor, and the log server it forked (scheduler, triggerer)."""

    def __init__(self, name: str, log):
        self.name, self.log = name, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_ticks = 0
        self.started_at = 0.0
        self.restarts = 0
        self.fails = 0                  # quick deaths in a row: the restart backs off
        self.next_start_at = 0.0
        self.log_server: tuple[int, int] | None = None   # (pid, start_ticks) of its own serve-logs child

    def start(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.proc = proc = subprocess.Popen([airflow_bin(), self.name], env=env, stdin=subprocess.DEVNULL)
        self.start_ticks = read_start_ticks(proc.pid) or 0
        self.started_at = time.time()
        self.log_server = None
        return proc

    def find_log_server(self) -> None:
        if self.log_server is None and self.proc is not None:
            for pid, ticks, cmd in _children(self.proc.pid):
                if cmd.startswith("airflow serve-logs"):
                    self.log_server = (pid, ticks)

    def free_log_server(self) -> None:
        """Its orphaned serve-logs child holds the log port: stop that one recorded PID (same start time), only."""
        if self.log_server is None:
            return
        pid, ticks = self.log_server
        self.log_server = None
        if read_start_ticks(pid) != ticks:
            return   # gone already, or the PID is someone else's now: nothing to signal
        outcome, _ = process_record.stop_pid(pid, grace_s=5.0, kill_wait_s=5.0)
        self.log(f"{self.name}: its log server pid {pid} (port holder) {outcome}")

    def state(self) -> dict:
        return {"pid": self.proc.pid if self.proc else None, "start_ticks": self.start_ticks,
                "started_at": self.started_at, "restarts": self.restarts,
                "log_server_pid": self.log_server[0] if self.log_server else None}


def _prepare_airflow() -> dict[str, str]:
    """What `airflow standalone` does before it starts the parts: its environment (LocalExecutor, the simple
    auth manager), the admin password file, the metadata DB; through its own code, so they stay the same."""
    from airflow.configuration import write_default_airflow_configuration_if_needed

    # what the `airflow` command does first: airflow.cfg with its generated secrets (the JWT secret the API
    # server checks task tokens with) exists before any part starts, or each part makes up its own
    write_default_airflow_configuration_if_needed()
    from airflow.cli.commands.standalone_command import StandaloneCommand
    from airflow.utils.providers_configuration_loader import providers_configuration_loaded

    cmd = StandaloneCommand()

    @providers_configuration_loaded
    def prepare() -> dict[str, str]:
        env = cmd.calculate_env()
        cmd.find_user_info()
        cmd.initialize_database()
        return env

    env = prepare()
    cmd.update_output()
    from airflow.settings import dispose_orm
    dispose_orm()   # the supervisor holds no connection to the metadata DB (SQLite: one writer at a time)
    return env


def supervise(home: Path, *, poll_s: float = 1.0) -> int:
    """Run Airflow's parts and keep them running: a part that exits is started again (backed off when it keeps
    dying), after its orphaned log server is stopped. SIGINT or SIGTERM: stop restarting, wait for the parts."""
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())

    def log(msg: str) -> None:
        print(f"[supervisor] {time.strftime('%H:%M:%S')} {msg}", flush=True)

    env = _prepare_airflow()
    if stopping.is_set():   # told to stop while preparing: start nothing
        return 0
    parts = {n: _Part(n, log) for n in PARTS}
    start_parts(parts, env, log, stopping)
    written = None
    while not stopping.is_set():
        now = time.time()
        for p in parts.values():
            if p.proc is not None:
                rc = p.proc.poll()
                if rc is None:
                    p.find_log_server()
                    continue
                # it just died
                ran = now - p.started_at
                p.fails = 0 if ran >= STEADY_AFTER_S else p.fails + 1
                delay = 0.0 if p.fails == 0 else min(RESTART_MAX_DELAY_S, 2.0 ** (p.fails - 1))
                log(f"{p.name} pid {p.proc.pid} exited ({'signal ' + str(-rc) if rc < 0 else 'code ' + str(rc)}) "
                    f"after {ran:.0f} s; restarting it in {delay:.0f} s")
                p.free_log_server()
                p.proc, p.next_start_at = None, now + delay
            if now >= p.next_start_at and not stopping.is_set():
                proc = p.start(env)
                p.restarts += 1
                log(f"{p.name} restarted: pid {proc.pid} (restart {p.restarts})")
        state = {n: p.state() for n, p in parts.items()}
        if state != written:
            _write_state(parts_file(home), {"supervisor_pid": os.getpid(), "parts": state})
            written = state
        stopping.wait(poll_s)
    log("stopping: no more restarts; waiting for the parts")
    deadline = time.time() + 25.0
    for p in parts.values():
        if p.proc is not None:
            try:
                p.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass   # `make airflow-stop` KILLs what is left of the group
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagleflow.airflow.deploy.standalone", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--port", type=int, default=int(os.environ.get("AIRFLOW_PORT", "8080")))
    s.add_argument("--home")
    t = sub.add_parser("stop")
    t.add_argument("--home")
    t.add_argument("--keep-node-jobs", action="store_true",
                   help="leave the node jobs its runs started on this machine running; list each and how to stop it")
    sub.add_parser("supervise", help="(run by start) run Airflow's parts, restarting a dead one")
    a = ap.parse_args(argv)
    if a.cmd == "supervise":
        return supervise(Path(airflow_env(None)["AIRFLOW_HOME"]))
    if a.cmd == "start":
        print(f"starting airflow standalone on port {a.port} (first start migrates the DB, ~30-60 s) ...", flush=True)
        info = start(a.home, a.port)
        print(f"Airflow UI:  {info['url']}\nuser: admin\npassword: {info['password']}\n"
              f"log: {info['log']}\nstop with: make airflow-stop")
        return 0
    print("stopped" if stop(a.home, keep_node_jobs=a.keep_node_jobs) else "nothing to stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
