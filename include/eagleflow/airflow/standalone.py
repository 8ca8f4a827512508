"""`make airflow` / `make airflow-stop`: Airflow standalone in the checkout's home.

Started in its own session (setsid), so it can be stopped as a process group:
in Airflow 3.3 a SIGTERM to the parent leaves the scheduler and workers
orphaned. Stop = SIGINT to the group, wait, then SIGKILL to what is left of
that group only, through eagleflow's one stop (``eagleflow.nodes.process_record``):
<home>/standalone.json records the leader's start time and the token its
processes carry, so a stale file whose group id now names someone else's
processes signals nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from eagleflow.airflow.home import airflow_bin, airflow_env
from eagleflow.nodes import process_record
from eagleflow.nodes.proc import parse_stat, read_start_ticks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    token = secrets.token_hex(16)
    proc = subprocess.Popen([airflow_bin(), "standalone"], env={**env, process_record.TOKEN_ENV: token},
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    info = {"pid": proc.pid, "pgid": proc.pid, "start_ticks": read_start_ticks(proc.pid) or 0, "token": token,
            "port": port, "url": f"http://localhost:{port}", "log": str(home / "standalone.log"), "home": str(home)}
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
    from eagleflow.durable import atomic_replace
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
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                _, state, rest = parse_stat(f.read())
        except (OSError, ValueError):
            continue
        if int(rest[1]) == pgid and state != "Z":  # rest[1] is field 5, the process group
            return True
    return False


def _reap(pid: int) -> None:
    """Collect the leader's exit status when this process started it (tests, `make airflow`)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop(home: str | Path | None = None, *, grace_s: float = 30) -> bool:
    """Stop the group we started; False when nothing of ours was running."""
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
    sf.unlink(missing_ok=True)
    return res.outcome not in ("already_gone", "stale_record")


def _record(info: dict) -> process_record.ProcessRecord:
    """standalone.json as a process record (a file from before start times were kept proves nothing)."""
    return process_record.ProcessRecord(pid=int(info["pid"]), pgid=int(info["pgid"]),
                                        start_ticks=int(info.get("start_ticks") or 0), role="airflow_standalone",
                                        token=str(info.get("token") or ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagleflow.airflow.standalone", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--port", type=int, default=int(os.environ.get("AIRFLOW_PORT", "8080")))
    s.add_argument("--home")
    t = sub.add_parser("stop")
    t.add_argument("--home")
    a = ap.parse_args(argv)
    if a.cmd == "start":
        print(f"starting airflow standalone on port {a.port} (first start migrates the DB, ~30-60 s) ...", flush=True)
        info = start(a.home, a.port)
        print(f"Airflow UI:  {info['url']}\nuser: admin\npassword: {info['password']}\n"
              f"log: {info['log']}\nstop with: make airflow-stop")
        return 0
    print("stopped" if stop(a.home) else "nothing to stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
