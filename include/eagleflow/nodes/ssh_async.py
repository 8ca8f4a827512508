"""AsyncSSHNode: node commands from a trigger's event loop, over ONE held asynchronous SSH connection.

The SSH provider's own ``SSHHookAsync`` (asyncssh) opens it from the same
Airflow connection as SSHNode (key, pinned ``host_key`` checked, port), so a
trigger never blocks its event loop on SSH and pays the handshake once per
run, not per poll (a fresh connection costs ~0.3-0.5 s, a channel ~0.2 s:
bench/probe.py). Commands are the same shell lines as SSHNode's (argv quoted,
time limit enforced on the node by ``SSHNode.bounded_command``) and their
results mean the same (``command_result``).

A dead connection is dropped and the next call reconnects; a channel that
cannot be opened is retried once on a fresh connection (the command never
started). A connection lost while a command runs raises ``NodeUnreachable``
(not retried: the command may have run); the caller decides when to look
again (the shard watch backs off, bounded). asyncssh's keepalive (every
``KEEPALIVE_S``, 3 unanswered = dead) and ``TCP_USER_TIMEOUT`` end a call on a
dead link within seconds. Like ssh.py this imports Airflow's SSH provider
only when a connection is opened.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

from .base import NodeCommandTimeout, NodeError, NodeUnreachable, answer_of
from . import ssh
from .ssh import KEEPALIVE_S, KILL_AFTER_S, NodeOutputTooLarge, SSHNode, bound_dead_link, command_result

T = TypeVar("T")


class AsyncSSHNode:
    def __init__(self, conn_id: str, name: str | None = None, connect_timeout_s: float = 15.0):
        self.conn_id = conn_id
        self.name = name or conn_id
        self.connect_timeout_s = connect_timeout_s
        self._conn = None
        self._where = f"connection {conn_id!r}"
        self.connects = 0  # connections opened (tests, bench): one per trigger run while the node answers

    async def _connection(self):
        transport = getattr(self._conn, "_transport", None)   # None once asyncssh saw the connection lost
        if self._conn is not None and not self._conn.is_closed() and transport is not None \
                and not transport.is_closing():
            return self._conn
        self._drop()
        import asyncssh
        try:
            from airflow.providers.ssh.hooks.ssh import SSHHookAsync
        except ImportError:
            raise NodeError(f"node {self.name}: SSH needs apache-airflow-providers-ssh") from None
        import logging
        logging.getLogger("asyncssh").setLevel(logging.WARNING)   # not five INFO lines per poll in the triggerer
        hook = SSHHookAsync(ssh_conn_id=self.conn_id, keepalive_interval=int(KEEPALIVE_S))
        try:
            conn = await asyncio.wait_for(hook.get_conn(), self.connect_timeout_s)
        except asyncssh.HostKeyNotVerifiable as e:
            raise NodeError(f"node {self.name}: HOST KEY not verified for {self._where}: {e}. If the node was "
                            f"reinstalled, update the connection's host_key extra (or known_hosts); otherwise do "
                            f"not connect: this is what a man-in-the-middle looks like") from None
        except asyncssh.PermissionDenied as e:
            raise NodeError(f"node {self.name}: SSH authentication failed for {self._where}: {e}; check the "
                            f"connection's login and key_file/private_key") from None
        except (asyncio.TimeoutError, TimeoutError) as e:
            raise NodeUnreachable(f"node {self.name}: SSH to {self._where} got no answer within "
                                  f"{self.connect_timeout_s:g} s ({e or 'timeout'})") from None
        except (OSError, asyncssh.Error) as e:
            raise NodeUnreachable(f"node {self.name}: cannot reach {self._where}: {e}") from None
        except Exception as e:  # AirflowNotFoundException, bad extras
            raise NodeError(f"node {self.name}: Airflow connection {self.conn_id!r} cannot be used: {e}") from None
        host, port = conn.get_extra_info("peername")[:2]
        self._where = f"{conn.get_extra_info('username') or hook.username or ''}@{host}:{port} (connection {self.conn_id!r})"
        bound_dead_link(conn.get_extra_info("socket"))
        self._conn = conn
        self.connects += 1
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.abort()
            except Exception:
                pass
            self._conn = None

    def close(self) -> None:
        self._drop()

    async def run(self, argv, *, timeout: float | None = 60.0, input: str | None = None,
                  env: dict[str, str] | None = None, cwd: str | None = None):
        import asyncssh
        argv = [str(a) for a in argv]
        cmd = SSHNode.remote_command(argv, env, cwd)
        line = cmd if timeout is None else SSHNode.bounded_command(cmd, timeout)
        # past the deadline, the node ends the command (TERM, then KILL); wait for that before giving up
        give_up = None if timeout is None else timeout + 2 * KILL_AFTER_S + 10.0
        for attempt in (1, 2):
            conn = await self._connection()
            try:
                proc = await conn.create_process(line, encoding="utf-8", errors="replace")
            except (asyncssh.ChannelOpenError, asyncssh.Error, OSError) as e:
                self._drop()   # a stale connection (node rebooted, sshd restarted): one fresh try
                if attempt == 2:
                    raise NodeUnreachable(f"node {self.name}: no SSH channel to {self._where}: {e}") from None
                continue
            break
        started = time.monotonic()
        # read as it comes, bounded as SSHNode.run is: proc.wait() alone would keep all of it
        reads = [asyncio.ensure_future(_bounded(proc.stdout, "stdout", self.name, cmd)),
                 asyncio.ensure_future(_bounded(proc.stderr, "stderr", self.name, cmd))]
        try:
            if input is not None:
                proc.stdin.write(input)
            proc.stdin.write_eof()
            out, err = await asyncio.wait_for(asyncio.gather(*reads), give_up)
            left = None if give_up is None else max(give_up - (time.monotonic() - started), 1.0)
            res = await asyncio.wait_for(proc.wait(check=False), left)
        except NodeOutputTooLarge:
            proc.close()
            raise
        except asyncio.TimeoutError:
            proc.close()
            raise NodeCommandTimeout(f"on node {self.name}: `{cmd}` did not finish within {timeout} s, and did not "
                                     f"end {2 * KILL_AFTER_S + 10:.0f} s after TERM/KILL (stuck in D?)") from None
        except (asyncssh.Error, OSError, BrokenPipeError):
            self._drop()
            res, out, err = None, "", ""
        finally:
            for t in reads:
                t.cancel()   # the other stream's read, when one failed; a no-op once done
        if res is None or (res.exit_status is None and res.exit_signal is None):
            self._drop()
            code = None    # no exit status: the connection died under the command
        else:
            code = res.returncode   # exit status, or minus the signal number
        return command_result(self.name, self._where, argv, cmd, code, out, err,
                              timeout, past_deadline=timeout is not None and time.monotonic() - started > timeout)

    async def run_json(self, argv, model: type[T], *, timeout: float | None = 60.0, input: str | None = None,
                       answer_codes: tuple[int, ...] = (0,), log: Callable[[str], None] | None = None) -> T:
        """As ``Node.run_json``: the last stdout line as JSON, validated into ``model``."""
        res = await self.run(argv, timeout=timeout, input=input)
        return answer_of(self.name, argv, res, model, answer_codes, log)

    async def read_text(self, path: str) -> str | None:
        res = await self.run(["cat", "--", path], timeout=30)
        if res.ok:
            return res.stdout
        if "No such file" in res.stderr:
            return None
        raise NodeError(f"on node {self.name}: cannot read {path}: {res.stderr.strip()}")


async def _bounded(stream, name: str, node: str, cmd: str) -> str:
    """One output stream of a command, read to its end; NodeOutputTooLarge past ``ssh.MAX_OUTPUT_BYTES``."""
    parts: list[str] = []
    size = 0
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return "".join(parts)
        parts.append(chunk)
        size += len(chunk)   # characters: the decoded text, at least that many bytes
        if size > ssh.MAX_OUTPUT_BYTES:
            raise ssh.output_too_large(node, cmd, name)
