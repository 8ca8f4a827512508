"""SSHNode: commands on a GPU node over an Airflow SSH connection.

The connection comes from apache-airflow-providers-ssh's ``SSHHook`` (so the
node is configured once, as an Airflow connection, with its key and host-key
settings) and is held open across calls: a fresh connection costs ~0.3-0.5 s,
a new channel on an open one ~0.2 s (see bench/probe.py). Every argv element
is quoted with shlex before it reaches the remote shell. Host keys are checked
(pinned ``host_key`` extra or ~/.ssh/known_hosts) unless the connection sets
``no_host_key_check``. With ssh_async.py, the only core module that imports
Airflow's SSH provider, inside ``_get_hook`` (only ``node_from_config`` imports
this module, lazily): it stays in nodes/ because the core's own CLI (``eagleflow
gpu status|wait-idle|baseline --node CONN_ID``) reaches a node through an Airflow
connection without the adapter package; tests/unit/test_airflow_boundary.py
holds the code to this.
"""
from __future__ import annotations

import shlex
import socket
import time
from typing import Any

from .base import CommandResult, Node, NodeCommandTimeout, NodeError, NodeUnreachable, check_file_mode

KILL_AFTER_S = 5.0  # after the TERM at the deadline, KILL whatever of the remote command is left
# A pulled cable leaves an open TCP connection silent, not closed: a keepalive every KEEPALIVE_S puts data
# on the wire and TCP_USER_TIMEOUT aborts the connection once data stays unacknowledged for DEAD_LINK_S,
# so a command waiting on a dead link ends within about KEEPALIVE_S + DEAD_LINK_S, not TCP's ~15 minutes.
KEEPALIVE_S = 3.0
DEAD_LINK_S = 10.0
# What one command may print, stdout and stderr each: node answers are one JSON line and read_text reads small
# state files; a node (or a file on it) that streams more is refused instead of filling this worker's memory.
MAX_OUTPUT_BYTES = 64 << 20


class NodeOutputTooLarge(NodeError):
    """A node command printed more than ``MAX_OUTPUT_BYTES``; it was not read further."""


def bound_dead_link(sock) -> None:
    """TCP_USER_TIMEOUT = DEAD_LINK_S on an SSH connection's socket (Linux), so a dead link errors out."""
    if sock is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(DEAD_LINK_S * 1000))
        except (OSError, AttributeError):  # a proxy command's socket is not TCP
            pass


class SSHNode(Node):
    def __init__(self, conn_id: str, name: str | None = None, python: str = "python3",
                 connect_timeout_s: float = 15.0):
        self.conn_id = conn_id
        self.name = name or conn_id
        self._python = python
        self.connect_timeout_s = connect_timeout_s
        # the provider's SSHHook, imported when first needed; Any: its timeouts are annotated int, paramiko takes
        # the float seconds we give them
        self._hook: Any = None
        self._sftp = None  # one SFTPClient per connection (open_file, rename, makedirs); closed in _drop
        self.connects = 0  # how many SSH connections this node opened (tests, bench)

    @property
    def python(self) -> str:
        return self._python

    # -- connection -----------------------------------------------------------------------------
    def _where(self) -> str:
        h = self._hook
        if h is None:
            return f"connection {self.conn_id!r}"
        return f"{h.username}@{h.remote_host}:{h.port} (connection {self.conn_id!r})"

    def _get_hook(self):
        if self._hook is None:
            try:
                from airflow.providers.ssh.hooks.ssh import SSHHook
            except ImportError:
                raise NodeError(f"node {self.name}: SSH needs apache-airflow-providers-ssh; install it or "
                                f"leave node.conn_id empty to run locally") from None
            try:
                # one attempt: auth or host-key failures do not get better by retrying in a loop
                hook: Any = SSHHook(ssh_conn_id=self.conn_id, conn_retry_attempts=1)
            except Exception as e:  # AirflowNotFoundException and bad extras
                if "isn't defined" in str(e) or "not found" in str(e).lower():
                    raise NodeError(f"node {self.name}: Airflow connection {self.conn_id!r} is not defined; create "
                                    f"it (Admin > Connections, or env AIRFLOW_CONN_{self.conn_id.upper()})") from None
                raise NodeError(f"node {self.name}: Airflow connection {self.conn_id!r} cannot be used: {e}") from None
            hook.conn_timeout = hook.conn_timeout or self.connect_timeout_s
            hook.auth_timeout = hook.auth_timeout or self.connect_timeout_s
            hook.banner_timeout = min(hook.banner_timeout or self.connect_timeout_s, self.connect_timeout_s)
            self._hook = hook
        return self._hook

    def _client(self):
        import paramiko
        hook = self._get_hook()
        fresh = hook.client is None or not (hook.client.get_transport() and hook.client.get_transport().is_active())
        try:
            client = hook.get_conn()
        except paramiko.BadHostKeyException as e:
            raise NodeError(
                f"node {self.name}: HOST KEY MISMATCH for {self._where()}: the server offered "
                f"{e.key.get_name()} {e.key.get_fingerprint().hex()} but the pinned key is "
                f"{e.expected_key.get_name()} {e.expected_key.get_fingerprint().hex()}. If the node was "
                f"reinstalled, update the connection's host_key extra (or known_hosts); otherwise do not "
                f"connect: this is what a man-in-the-middle looks like") from None
        except paramiko.AuthenticationException as e:
            raise NodeError(f"node {self.name}: SSH authentication failed for {self._where()}: {e}; check the "
                            f"connection's login and its key_file/private_key (is the public key in the node's "
                            f"authorized_keys?)") from None
        except paramiko.SSHException as e:
            if "known_hosts" in str(e):
                raise NodeError(f"node {self.name}: host key of {self._where()} is unknown ({e}); pin it in the "
                                f"connection's host_key extra or add it to ~/.ssh/known_hosts "
                                f"(no_host_key_check: true skips the check; not for shared networks)") from None
            raise NodeUnreachable(f"node {self.name}: SSH to {self._where()} failed: {e}") from None
        except (socket.timeout, TimeoutError) as e:
            raise NodeUnreachable(f"node {self.name}: SSH to {self._where()} got no answer within "
                                  f"{self._hook.conn_timeout} s ({e}); is the host up and the port right?") from None
        except (OSError, EOFError) as e:
            raise NodeUnreachable(f"node {self.name}: cannot reach {self._where()}: {e}") from None
        if fresh:
            self.connects += 1
            self._watch_link(client)
        return client

    @staticmethod
    def _watch_link(client) -> None:
        transport = client.get_transport()
        transport.set_keepalive(KEEPALIVE_S)
        bound_dead_link(getattr(transport, "sock", None))

    def _open_channel(self):
        import paramiko
        for attempt in (1, 2):
            client = self._client()
            try:
                return client.get_transport().open_session(timeout=self.connect_timeout_s)
            except (paramiko.SSHException, EOFError, OSError, AttributeError):
                if attempt == 2:
                    raise NodeUnreachable(f"node {self.name}: SSH connection to {self._where()} dropped and a "
                                          f"reconnect failed") from None
                self._drop()  # connection went stale (node rebooted, sshd restarted): reconnect once

    def _drop(self) -> None:
        sftp, self._sftp = self._sftp, None
        if sftp is not None:
            try:
                sftp.close()
            except Exception:
                pass
        if self._hook is not None and self._hook.client is not None:
            try:
                self._hook.client.close()
            except Exception:
                pass
            self._hook.client = None

    def close(self) -> None:
        self._drop()

    # -- files over SFTP (the connection's own subsystem: no command, no stdout in between) ---------
    def _sftp_client(self):
        import paramiko
        for attempt in (1, 2):
            client = self._client()
            transport = client.get_transport()
            if self._sftp is not None and self._sftp.get_channel().get_transport() is transport:
                return self._sftp
            try:
                self._sftp = paramiko.SFTPClient.from_transport(transport)
                if self._sftp is None:
                    raise paramiko.SSHException("the SFTP channel did not open")
                return self._sftp
            except (paramiko.SSHException, EOFError, OSError) as e:
                self._sftp = None
                if transport is not None and transport.is_active():   # connected, but no SFTP here
                    raise NodeError(f"node {self.name}: SFTP to {self._where()} failed ({e}); the node's sshd "
                                    f"needs `Subsystem sftp internal-sftp` (or sftp-server) in sshd_config") from None
                if attempt == 2:
                    raise NodeUnreachable(f"node {self.name}: SSH connection to {self._where()} dropped and a "
                                          f"reconnect for SFTP failed ({e})") from None
                self._drop()

    def _file_error(self, what: str, e: BaseException) -> NodeError:
        """An SFTP failure as NodeUnreachable (the connection is gone: dropped, to reconnect) or NodeError."""
        sftp = self._sftp
        transport = sftp.get_channel().get_transport() if sftp is not None else None
        if isinstance(e, (EOFError, ConnectionError)) or transport is None or not transport.is_active() \
                or sftp.get_channel().closed:
            self._drop()
            return NodeUnreachable(f"on node {self.name}: the SSH connection to {self._where()} dropped while "
                                   f"{what} ({type(e).__name__}: {e}); a new call reconnects")
        return NodeError(f"on node {self.name}: {what} failed: {e}")

    def open_file(self, path: str, mode: str):
        check_file_mode(self.name, path, mode)
        sftp = self._sftp_client()
        try:
            f = sftp.open(path, mode)
            size = f.stat().st_size if mode == "rb" else None
        except Exception as e:
            raise self._file_error(f"opening {path} ({mode})", e) from None
        return _SFTPFile(self, path, mode, f, size)

    def rename(self, src: str, dst: str) -> None:
        sftp = self._sftp_client()
        try:
            sftp.posix_rename(src, dst)
        except Exception as e:
            raise self._file_error(f"renaming {src} to {dst}", e) from None

    def makedirs(self, path: str) -> None:
        import stat
        sftp = self._sftp_client()
        missing, p = [], path.rstrip("/") or "/"
        try:
            while True:
                try:
                    if not stat.S_ISDIR(sftp.stat(p).st_mode):
                        raise NodeError(f"on node {self.name}: cannot create folder {path}: {p} is not a folder")
                    break
                except FileNotFoundError:
                    missing.append(p)
                    parent = p.rsplit("/", 1)[0] or "/"
                    if parent == p:
                        break
                    p = parent
            for d in reversed(missing):
                try:
                    sftp.mkdir(d)
                except OSError:
                    if not stat.S_ISDIR(sftp.stat(d).st_mode):   # made by someone else meanwhile: fine
                        raise
        except NodeError:
            raise
        except Exception as e:
            raise self._file_error(f"creating folder {path}", e) from None

    # -- commands -------------------------------------------------------------------------------
    @staticmethod
    def remote_command(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> str:
        """The shell line for argv: every element quoted, env through `env`, cwd through `cd`."""
        parts = list(argv)
        if env:
            parts = ["env", *[f"{k}={v}" for k, v in env.items()], *parts]
        cmd = shlex.join(parts)
        if cwd:
            cmd = f"cd {shlex.quote(cwd)} && {cmd}"
        return cmd

    @staticmethod
    def bounded_command(cmd: str, timeout: float) -> str:
        """``cmd`` with its time limit enforced by the node itself, even when this side is gone.

        Closing an SSH channel ends nothing on the node (no pty, no SIGHUP). So
        coreutils ``timeout`` runs the command in a process group of its own and,
        past ``timeout`` s, sends that group TERM (KILL ``KILL_AFTER_S`` later if
        the command is still there); what is left of the group after that (a
        child that ignores TERM while its parent exited) gets KILL once another
        ``KILL_AFTER_S`` has passed. The group id is ``timeout``'s own PID, so
        only the command's own processes are signalled; detached jobs start a
        session of their own and are not touched. stdin is passed through fd 3
        (an asynchronous command's stdin would be /dev/null).
        """
        k = f"{KILL_AFTER_S:g}"
        polls = int(KILL_AFTER_S * 10)
        wrapper = (f'exec 3<&0; timeout -s TERM -k {k} {max(timeout, 0.001):.3f} sh -c "$0" <&3 3<&- & t=$!; '
                   'exec 3<&-; wait $t; rc=$?; '
                   'if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then '
                   f'i=0; while [ $i -lt {polls} ] && kill -0 -$t 2>/dev/null; do sleep 0.1; i=$((i+1)); done; '
                   'kill -9 -$t 2>/dev/null; fi; exit $rc')
        return f"sh -c {shlex.quote(wrapper)} {shlex.quote(cmd)}"

    def run(self, argv, *, timeout=60.0, input=None, env=None, cwd=None) -> CommandResult:
        import paramiko
        argv = [str(a) for a in argv]
        cmd = self.remote_command(argv, env, cwd)
        chan = self._open_channel()
        # past the deadline, wait for the node to end the command (TERM, then KILL) before reporting it
        deadline = None if timeout is None else time.monotonic() + timeout
        give_up = None if deadline is None else deadline + 2 * KILL_AFTER_S + 10.0
        out, err = bytearray(), bytearray()
        try:
            chan.settimeout(0.2)
            chan.exec_command(cmd if timeout is None else self.bounded_command(cmd, timeout))
            if input is not None:
                chan.sendall(input.encode())
            chan.shutdown_write()
            while True:
                got = False
                while chan.recv_ready():
                    out += chan.recv(65536)
                    got = True
                    _check_size(self.name, cmd, out, err)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                    got = True
                    _check_size(self.name, cmd, out, err)
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if give_up is not None and time.monotonic() > give_up:
                    raise NodeCommandTimeout(f"on node {self.name}: `{cmd}` did not finish within {timeout} s, and "
                                             f"did not end {2 * KILL_AFTER_S + 10:.0f} s after TERM/KILL (stuck in D?)")
                if not got:
                    try:
                        data = chan.recv(65536)
                        if data:
                            out += data
                            _check_size(self.name, cmd, out, err)
                        elif not chan.exit_status_ready():
                            time.sleep(0.005)  # stdout closed, exit status not in yet
                    except socket.timeout:
                        pass
            code = chan.recv_exit_status()
            dropped = code == -1 and not (chan.get_transport() and chan.get_transport().is_active())
        except (paramiko.SSHException, EOFError, ConnectionError) as e:   # the connection died while starting it
            self._drop()
            raise NodeUnreachable(f"on node {self.name}: the SSH connection to {self._where()} failed while "
                                  f"starting `{cmd}`: {e}") from None
        finally:
            chan.close()
        if dropped:
            self._drop()
        return command_result(self.name, self._where(), argv, cmd, None if dropped else code,
                              out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), timeout,
                              past_deadline=deadline is not None and time.monotonic() > deadline)


class _SFTPFile:
    """A file open over SFTP: reads pipelined one call's length at a time (``readv``: bounded memory, not one
    round trip per 32 KiB), writes pipelined; every failure raised as NodeError/NodeUnreachable naming the file."""

    def __init__(self, node: SSHNode, path: str, mode: str, f, size: int | None):
        self._node, self.path, self.mode, self._f, self._size = node, path, mode, f, size
        self._pos = 0
        if mode != "rb":
            f.set_pipelined(True)

    def _fail(self, what: str, e: BaseException) -> NodeError:
        return self._node._file_error(f"{what} {self.path}", e)

    def _read_size(self) -> int:
        """The size seen at open; only a file opened "rb" has one (open_file stats only those)."""
        if self._size is None:
            raise NodeError(f"on node {self._node.name}: {self.path} is open for {self.mode!r}, not for reading; "
                            "open it with mode 'rb' to read or seek from its end")
        return self._size

    def read(self, n: int = -1) -> bytes:
        left = self._read_size() - self._pos
        n = left if n is None or n < 0 else min(n, left)
        if n <= 0:   # readv past the end would fail: the size is the one seen at open
            return b""
        try:
            data = b"".join(self._f.readv([(self._pos, n)]))
        except Exception as e:
            raise self._fail("reading", e) from None
        self._pos += len(data)
        return data

    def write(self, data: bytes) -> int:
        try:
            self._f.write(data)
        except Exception as e:
            raise self._fail("writing", e) from None
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        try:
            if self.mode == "rb":
                self._pos = {0: 0, 1: self._pos, 2: self._read_size()}[whence] + offset
            else:
                self._f.seek(offset, whence)
        except Exception as e:
            raise self._fail("seeking in", e) from None
        return self.tell()

    def tell(self) -> int:
        return self._pos if self.mode == "rb" else self._f.tell()

    def close(self) -> None:
        try:
            self._f.close()   # a pipelined write's errors come back here
        except Exception as e:
            raise self._fail("closing", e) from None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:   # the first error is the one to report
            try:
                self._f.close()
            except Exception:
                pass


def _check_size(node: str, cmd: str, out: bytearray, err: bytearray) -> None:
    for name, buf in (("stdout", out), ("stderr", err)):
        if len(buf) > MAX_OUTPUT_BYTES:
            raise output_too_large(node, cmd, name)


def output_too_large(node: str, cmd: str, stream: str) -> NodeOutputTooLarge:
    """The error for a command that printed more than MAX_OUTPUT_BYTES on ``stream`` (both SSH nodes)."""
    return NodeOutputTooLarge(f"on node {node}: `{cmd[:300]}` printed more than {MAX_OUTPUT_BYTES} bytes on "
                              f"{stream} (eagleflow.nodes.ssh.MAX_OUTPUT_BYTES); not read further. A node "
                              "command answers in one JSON line: look at what made it print this much")


def command_result(node: str, where: str, argv: list[str], cmd: str, code: int | None, stdout: str, stderr: str,
                   timeout: float | None, past_deadline: bool) -> CommandResult:
    """What a finished SSH command means (SSHNode and AsyncSSHNode alike): its result, or the error to raise.

    ``code`` None: no exit status came back, the connection died under the command (link, sshd).
    """
    if code is None:   # it may still run on the node: unreachable, not failed
        raise NodeUnreachable(f"on node {node}: the SSH connection to {where} dropped while `{cmd}` ran (no exit "
                              f"status); it may have finished or still run on the node")
    if past_deadline and code in (124, 137):
        raise NodeCommandTimeout(f"on node {node}: `{cmd}` did not finish within {timeout} s; the node "
                                 f"ended it (TERM to its process group, KILL {KILL_AFTER_S:g} s later if needed)")
    if code == 127 and ("not found" in stderr or "No such file" in stderr):
        raise NodeError(f"on node {node}: {argv[0]!r} is not on PATH ({stderr.strip()[:300]}); "
                        f"install it there or give its full path")
    return CommandResult(tuple(argv), code, stdout, stderr)
