"""Where commands run: the interface that LocalNode and SSHNode share.

Everything that touches a GPU node goes through a ``Node`` so that the same
code works on this machine and over SSH. Commands are argv lists; a node that
needs a shell (SSH) quotes every element itself.
"""
from __future__ import annotations

import json
import shlex
import signal as _signal
from abc import ABC, abstractmethod
from dataclasses import dataclass


class NodeError(RuntimeError):
    """A command could not be run on a node; the message names node and command."""


class NodeCommandTimeout(NodeError):
    pass


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class DetachedProcess:
    """What ``spawn_detached`` recorded: enough to find and signal it later."""
    pid: int
    pgid: int
    start_ticks: int  # /proc/<pid>/stat field 22: tells a PID from a reused one
    role: str
    pid_file: str
    log_file: str


class Node(ABC):
    name: str

    @abstractmethod
    def run(self, argv: list[str], *, timeout: float | None = 60.0, input: str | None = None,
            env: dict[str, str] | None = None, cwd: str | None = None) -> CommandResult:
        """Run argv to completion; never raises for a non-zero exit (see ``check``)."""

    def check(self, argv: list[str], **kw) -> CommandResult:
        res = self.run(argv, **kw)
        if not res.ok:
            raise NodeError(f"on node {self.name}: `{shlex.join(argv)}` exited {res.exit_code}: "
                            f"{(res.stderr or res.stdout).strip()[-2000:]}")
        return res

    @property
    @abstractmethod
    def python(self) -> str:
        """The interpreter on the node that has eagleflow installed."""

    def eagleflow_argv(self, *args: str) -> list[str]:
        return [self.python, "-m", "eagleflow.cli", *args]

    def spawn_detached(self, argv: list[str], *, role: str, pid_file: str, log_file: str,
                       env: dict[str, str] | None = None, cwd: str | None = None) -> DetachedProcess:
        """Start argv in its own session so it outlives this task; record its PID.

        The record (pid, pgid, start ticks, role, argv) is written atomically by
        ``eagleflow.nodes.detach`` on the node before this returns.
        """
        cmd = [self.python, "-m", "eagleflow.nodes.detach", "--role", role, "--pid-file", pid_file,
               "--log-file", log_file]
        if cwd:
            cmd += ["--cwd", cwd]
        for k, v in (env or {}).items():
            cmd += ["--env", f"{k}={v}"]
        res = self.check(cmd + ["--", *argv], timeout=60)
        rec = json.loads(res.stdout.strip().splitlines()[-1])
        return DetachedProcess(pid=rec["pid"], pgid=rec["pgid"], start_ticks=rec["start_ticks"],
                               role=role, pid_file=pid_file, log_file=log_file)

    def read_text(self, path: str, *, missing_ok: bool = True) -> str | None:
        res = self.run(["cat", "--", path], timeout=30)
        if res.ok:
            return res.stdout
        if missing_ok and "No such file" in res.stderr:
            return None
        raise NodeError(f"on node {self.name}: cannot read {path}: {res.stderr.strip()}")

    def write_text(self, path: str, text: str) -> None:
        """Atomic write on the node (temp file, then rename)."""
        self.check([self.python, "-c",
                    "import os,sys,tempfile;p=sys.argv[1];d=os.path.dirname(p) or '.';os.makedirs(d,exist_ok=True);"
                    "fd,t=tempfile.mkstemp(dir=d,prefix='.tmp-');f=os.fdopen(fd,'w');f.write(sys.stdin.read());"
                    "f.flush();os.fsync(f.fileno());f.close();os.replace(t,p)", path], input=text, timeout=30)

    def signal(self, pid: int, sig: int = _signal.SIGTERM, *, group: bool = False) -> bool:
        """Send a signal; False when the process no longer exists."""
        target = f"-{pid}" if group else str(pid)
        res = self.run(["kill", f"-{int(sig)}", "--", target], timeout=30)
        return res.ok

    def pid_alive(self, pid: int) -> bool:
        return self.run(["kill", "-0", str(pid)], timeout=30).ok

    def free_bytes(self, path: str) -> int:
        """Free space for an unprivileged writer at path (its nearest existing parent)."""
        res = self.check([self.python, "-c",
                          "import os,sys;p=os.path.abspath(sys.argv[1])\n"
                          "while not os.path.exists(p): p=os.path.dirname(p)\n"
                          "s=os.statvfs(p);print(s.f_bavail*s.f_frsize)", path], timeout=30)
        return int(res.stdout.strip())

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
