"""Free TCP ports on one address, for the servers we start (and the tests' own)."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports on ``host``. Every socket stays bound until all are chosen: closing one before
    asking for the next lets the kernel hand the same port out twice (a mooncake master once got its metadata and
    metrics servers on one port and died)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
