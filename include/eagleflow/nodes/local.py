"""LocalNode: commands on this machine, without a shell."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from eagleflow.durable import read_owned

from . import process_record
from .base import CommandResult, Node, NodeCommandTimeout, NodeError, NodeFileRefused, check_file_mode

KILL_AFTER_S = 5.0  # as SSHNode: TERM at the deadline, KILL what is left this much later


class LocalNode(Node):
    def __init__(self, name: str = "local", python: str | None = None):
        self.name = name
        self._python = python or sys.executable

    @property
    def python(self) -> str:
        return self._python

    def run(self, argv, *, timeout=60.0, input=None, env=None, cwd=None) -> CommandResult:
        full_env = None
        if env:
            full_env = dict(os.environ)
            full_env.update(env)
        try:
            # its own process group: a timeout ends the command and its children, nothing else
            p = subprocess.Popen(list(argv), stdin=subprocess.PIPE if input is not None else None,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=cwd,
                                 process_group=0)
        except FileNotFoundError as e:
            raise NodeError(f"on node {self.name}: {argv[0]!r} is not on PATH ({e})") from None
        try:
            out, err = p.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_group(p)
            raise NodeCommandTimeout(f"on node {self.name}: `{' '.join(argv)}` did not finish within {timeout} s; "
                                     f"its process group was ended") from None
        except BaseException:
            _end_group(p)
            raise
        return CommandResult(tuple(argv), p.returncode, out, err)

    def open_file(self, path: str, mode: str):
        check_file_mode(self.name, path, mode)
        try:
            return open(path, mode)
        except OSError as e:
            raise NodeError(f"on node {self.name}: cannot open {path} ({mode}): {e}") from None

    def read_owned_text(self, path: str, limit: int = 1 << 20) -> str | None:
        # this machine is the node: durable.read_owned itself, as the remote command runs it
        try:
            return read_owned(path, limit=limit).decode("utf-8", "replace")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:   # UnsafeFile (a link, someone else's, writable by others), too large
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise NodeFileRefused(f"on node {self.name}: {why if path in why else f'{path}: {why}'}") from None

    def rename(self, src: str, dst: str) -> None:
        try:
            os.replace(src, dst)
        except OSError as e:
            raise NodeError(f"on node {self.name}: cannot rename {src} to {dst}: {e}") from None

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise NodeError(f"on node {self.name}: cannot create folder {path}: {e}") from None

    # This machine is the node: the same process_record functions, called here instead of through a
    # new interpreter (a reconcile scan asks once per shard; a poke every few seconds).
    def process_status(self, pid_file: str) -> process_record.RecordStatus:
        return process_record.status(pid_file)

    def stop_recorded(self, pid_file: str, grace_s: float = 15.0,
                      kill_wait_s: float = 5.0) -> process_record.StopResult:
        return process_record.stop_file(pid_file, grace_s=grace_s, kill_wait_s=kill_wait_s)


def _end_group(p: subprocess.Popen) -> None:
    """TERM the command's group (the leader is our child, not yet reaped: its group id is still ours), then KILL."""
    for sig, wait in ((signal.SIGTERM, KILL_AFTER_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.communicate(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
