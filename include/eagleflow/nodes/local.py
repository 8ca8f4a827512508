"""LocalNode: commands on this machine, without a shell."""
from __future__ import annotations

import os
import subprocess
import sys

from .base import CommandResult, Node, NodeCommandTimeout, NodeError


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
            p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input,
                               env=full_env, cwd=cwd)
        except FileNotFoundError as e:
            raise NodeError(f"on node {self.name}: {argv[0]!r} is not on PATH ({e})") from None
        except subprocess.TimeoutExpired:
            raise NodeCommandTimeout(f"on node {self.name}: `{' '.join(argv)}` did not finish within {timeout} s") from None
        return CommandResult(tuple(argv), p.returncode, p.stdout, p.stderr)
