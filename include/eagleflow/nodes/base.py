"""Where commands run: the interface that LocalNode and SSHNode share.

Everything that touches a GPU node goes through a ``Node`` so that the same
code works on this machine and over SSH. Commands are argv lists; a node that
needs a shell (SSH) quotes every element itself.
"""
from __future__ import annotations

import functools
import shlex
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, TypeVar

from eagleflow import bounded_json
from eagleflow.durable import EXIT_ABSENT

from .process_record import ProcessRecord, RecordStatus, StopResult

T = TypeVar("T")

# detach's exit code when the job's lock is held by a live process (EX_TEMPFAIL)
EXIT_LOCKED = 75


class NodeError(RuntimeError):
    """A command could not be run on a node; the message names node and command."""


class NodeCommandTimeout(NodeError):
    pass


class NodeUnreachable(NodeError):
    """The node could not be reached, or the connection to it dropped: it says nothing about the node's jobs
    (detached ones keep running there); the caller may reconnect later."""


class NodeCommandFailed(NodeError):
    """A node command exited with a code that carries no answer; ``exit_code`` and ``stderr`` say why."""

    def __init__(self, node: str, argv, exit_code: int, stdout: str, stderr: str):
        self.node, self.argv, self.exit_code, self.stdout, self.stderr = node, tuple(argv), exit_code, stdout, stderr
        super().__init__(f"on node {node}: `{shlex.join(self.argv)}` exited {exit_code}: "
                         f"{(stderr or stdout).strip()[-2000:]}")


class NodeAnswerError(NodeError):
    """A node command ran but its last stdout line is not the JSON answer it owes."""


class NodeAnswerRefused(NodeAnswerError):
    """A node's answer beyond the size or depth bound (``eagleflow.bounded_json``): refused unparsed. ``node``
    names the node, ``refusal`` is the ``bounded_json.JsonRefused`` (a ValueError naming node and command)."""

    def __init__(self, message: str, node: str, refusal: ValueError):
        super().__init__(message)
        self.node, self.refusal = node, refusal


class NodeFileRefused(NodeError):
    """A file read as one of ours (``Node.read_owned_text``) is a link, someone else's, writable by others or too
    large: not trusted; the message names the node, the file and why."""


class JobAlreadyRunning(NodeError):
    """A job's lock is held: ``holder_pid`` runs it (one worker per shard)."""

    def __init__(self, message: str, holder_pid: int | None, lock_file: str):
        super().__init__(message)
        self.holder_pid, self.lock_file = holder_pid, lock_file


FILE_MODES = ("rb", "wb", "ab")


def check_file_mode(node: str, path: str, mode: str) -> None:
    if mode not in FILE_MODES:
        raise ValueError(f"on node {node}: open_file({path!r}, {mode!r}): mode must be one of {FILE_MODES}")


# ProcessRecord is what spawn_detached returns and what every pid record holds (one shape).
DetachedProcess = ProcessRecord


@functools.lru_cache(maxsize=None)
def _adapter(model):
    from pydantic import TypeAdapter
    return TypeAdapter(model)  # building one costs milliseconds: once per model


def answer_of(node: str, argv, res: "CommandResult", model: type[T], answer_codes: tuple[int, ...],
              log: Callable[[str], None] | None) -> T:
    """What ``run_json`` (sync or async) makes of a finished command: stderr to ``log``, exit code checked,
    the answer parsed."""
    if log is not None:
        for line in res.stderr.splitlines():
            if line.strip():
                log(line)
    if res.exit_code not in answer_codes:
        raise NodeCommandFailed(node, argv, res.exit_code, res.stdout, res.stderr)
    return parse_answer(node, argv, res.exit_code, res.stdout, res.stderr, model)


def parse_answer(node: str, argv, exit_code: int, stdout: str, stderr: str, model: type[T]) -> T:
    """The last non-empty stdout line as JSON, validated into ``model`` (a pydantic model, dataclass or type)."""
    from pydantic import ValidationError
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    cmd = shlex.join(tuple(argv))
    if not lines:
        raise NodeAnswerError(f"on node {node}: `{cmd}` (exit {exit_code}) printed no answer; "
                              f"stderr: {stderr.strip()[-1500:]}")
    try:
        # within bounds (eagleflow.bounded_json): an answer nested thousands deep is this node's wrong answer,
        # never a RecursionError that fails the caller whole (a fleet's takeover of the honest nodes' shards)
        doc = bounded_json.loads(lines[-1], source=f"on node {node}: the answer of `{cmd}`")
        # a class is hashable (type.__hash__); mypy does not see it on type[T] against lru_cache's Hashable
        return _adapter(model).validate_python(doc)  # type: ignore[arg-type]  # a class is Hashable
    except bounded_json.JsonRefused as e:
        raise NodeAnswerRefused(f"{e}: that node's answer is refused; stderr: {stderr.strip()[-500:]}", node,
                                e) from None
    except ValueError as e:  # JSONDecodeError and ValidationError
        name = getattr(model, "__name__", model)
        what = f"does not fit {name}" if isinstance(e, ValidationError) else "is not JSON"
        why = " ".join(str(e).split())[:500]  # pydantic's report spans lines: one line for a log
        raise NodeAnswerError(f"on node {node}: the last line `{cmd}` printed {what} ({why}): "
                              f"{lines[-1][:300]!r}; stderr: {stderr.strip()[-1000:]}") from None


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass
class DetachAnswer:
    """What ``eagleflow.nodes.detach`` prints: the started process, or the holder of the job's lock."""
    started: bool
    record: ProcessRecord | None = None
    holder_pid: int | None = None
    lock_file: str = ""
    detail: str = ""


class Node(ABC):
    name: str

    @abstractmethod
    def run(self, argv: list[str], *, timeout: float | None = 60.0, input: str | None = None,
            env: dict[str, str] | None = None, cwd: str | None = None) -> CommandResult:
        """Run argv to completion; never raises for a non-zero exit (see ``check``)."""

    def check(self, argv: list[str], **kw) -> CommandResult:
        res = self.run(argv, **kw)
        if not res.ok:
            raise NodeCommandFailed(self.name, argv, res.exit_code, res.stdout, res.stderr)
        return res

    def run_json(self, argv: list[str], model: type[T], *, timeout: float | None = 60.0, input: str | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None, answer_codes: tuple[int, ...] = (0,),
                 log: Callable[[str], None] | None = None) -> T:
        """The one way the control plane asks the node something: run argv, read its answer.

        The answer is the last non-empty stdout line, JSON, validated into
        ``model``. Each stderr line goes to ``log``. An exit code outside
        ``answer_codes`` raises NodeCommandFailed (exit code and stderr in it);
        a missing or malformed answer raises NodeAnswerError; timeouts raise
        NodeCommandTimeout.
        """
        res = self.run(argv, timeout=timeout, input=input, env=env, cwd=cwd)
        return answer_of(self.name, argv, res, model, answer_codes, log)

    @property
    @abstractmethod
    def python(self) -> str:
        """The interpreter on the node that has eagleflow installed."""

    def eagleflow_argv(self, *args: str) -> list[str]:
        return [self.python, "-m", "eagleflow.cli", *args]

    def spawn_detached(self, argv: list[str], *, role: str, pid_file: str, log_file: str,
                       env: dict[str, str] | None = None, cwd: str | None = None,
                       lock_file: str | None = None, owned_roots: Iterable[object] = ()) -> ProcessRecord:
        """Start argv in its own session so it outlives this task; record it (``eagleflow.nodes.detach``).

        The record is on the node before this returns. With ``lock_file`` the
        start is exclusive: detach takes the lock, the process inherits it and
        holds it for its lifetime; when a live process already holds it this
        raises JobAlreadyRunning naming that PID, and nothing is started. ``owned_roots`` (the run's
        ``RunLayout.owned_roots``): the folders of the record, the log and the lock, from these down, must be
        this user's (``durable.owned_dir``); another user's is refused (NodeCommandFailed naming it).
        """
        cmd = [self.python, "-m", "eagleflow.nodes.detach", "--role", role, "--pid-file", pid_file,
               "--log-file", log_file]
        if cwd:
            cmd += ["--cwd", cwd]
        if lock_file:
            cmd += ["--lock", lock_file]
        for root in owned_roots:
            cmd += ["--owned-root", str(root)]
        for k, v in (env or {}).items():
            cmd += ["--env", f"{k}={v}"]
        ans = self.run_json(cmd + ["--", *argv], DetachAnswer, answer_codes=(0, EXIT_LOCKED))
        if not ans.started or ans.record is None:
            raise JobAlreadyRunning(f"on node {self.name}: {ans.detail}", ans.holder_pid, ans.lock_file)
        return ans.record

    def process_status(self, pid_file: str) -> RecordStatus:
        """Whether the recorded process still runs and is the one we started (checked on the node)."""
        return self.run_json(self.process_record_argv("status", "--pid-file", pid_file), RecordStatus, timeout=60)

    def live_record(self, pid_file: str) -> ProcessRecord | None:
        """The record when its process is alive and ours; None when absent, gone or stale."""
        st = self.process_status(pid_file)
        return st.record if st.alive else None

    def stop_recorded(self, pid_file: str, grace_s: float = 15.0, kill_wait_s: float = 5.0) -> StopResult:
        """The one stop (``eagleflow.nodes.process_record.stop``) run on the node: TERM, grace, KILL."""
        return self.run_json(self.process_record_argv("stop", "--pid-file", pid_file, "--grace", str(grace_s),
                                                      "--kill-wait", str(kill_wait_s)), StopResult,
                             timeout=grace_s + kill_wait_s + 60)

    def process_record_argv(self, *args: str) -> list[str]:
        """``eagleflow.nodes.process_record``'s command on the node (``-c``: the package imports the module
        itself, and ``-m`` would run a second copy of it)."""
        return [self.python, "-c", "import sys; from eagleflow.nodes.process_record import main; sys.exit(main())",
                *args]

    def read_text(self, path: str, *, missing_ok: bool = True) -> str | None:
        res = self.run(["cat", "--", path], timeout=30)
        if res.ok:
            return res.stdout
        if missing_ok and "No such file" in res.stderr:
            return None
        raise NodeError(f"on node {self.name}: cannot read {path}: {res.stderr.strip()}")

    def read_owned_text(self, path: str, limit: int = 1 << 20) -> str | None:
        """One of our own small files on the node, read the way pid records are (``durable.read_owned``: a regular
        file of this user that nobody else may write, no link followed, at most ``limit`` bytes); None when
        absent; NodeFileRefused naming the file and why when it is not one of ours."""
        res = self.run([self.python, "-m", "eagleflow.durable", "--read-owned", str(int(limit)), path], timeout=30)
        if res.ok:
            return res.stdout
        if res.exit_code == EXIT_ABSENT:
            return None
        if res.exit_code == 2:
            raise NodeFileRefused(f"on node {self.name}: {res.stderr.strip()[-1000:]}")
        raise NodeError(f"on node {self.name}: cannot read {path}: {(res.stderr or res.stdout).strip()[-1000:]}")

    def write_text(self, path: str, text: str) -> None:
        """Atomic write on the node (``eagleflow.durable.atomic_write``)."""
        self.check([self.python, "-m", "eagleflow.durable", path], input=text, timeout=30)

    def free_bytes(self, path: str) -> int:
        """Free space for an unprivileged writer at path (its nearest existing parent)."""
        return self.run_json([self.python, "-c",
                              "import os,sys;p=os.path.abspath(sys.argv[1])\n"
                              "while not os.path.exists(p): p=os.path.dirname(p)\n"
                              "s=os.statvfs(p);print(s.f_bavail*s.f_frsize)", path], int, timeout=30)

    # -- binary files (transfers between nodes: streamed, never through a command's stdout) --------
    @abstractmethod
    def open_file(self, path: str, mode: str) -> BinaryIO:
        """A binary file on the node ("rb", "wb" or "ab"), a context manager; read/write it in chunks."""

    @abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Atomically replace dst with src on the node (both on one filesystem)."""

    @abstractmethod
    def makedirs(self, path: str) -> None:
        """mkdir -p on the node."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
