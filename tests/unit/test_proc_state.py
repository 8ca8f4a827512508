"""The one /proc reading (``eagleflow.nodes.proc.ProcState``) on real processes this test starts and stops by PID.

A zombie with its exit code or killing signal, a stopped process, a gone one, and the group and start time
every caller (pid records, the watch, the sentinel, gpu cleanup) reads from the same type.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from eagleflow.nodes.proc import read_proc_state, read_start_ticks, read_stat
from tests.fixtures.waiting import wait_until

pytestmark = pytest.mark.slow   # each test starts a Python subprocess


def _unreaped(code: str) -> subprocess.Popen:
    """A child that ends on its own and stays a zombie until the test reaps it (Popen reaps only when asked)."""
    return subprocess.Popen([sys.executable, "-c", code])


def _zombie(pid: int):
    return wait_until(lambda: (st := read_stat(pid)) is not None and st.zombie and st, 10, every_s=0.02,
                      what=f"pid {pid} a zombie", describe=lambda: read_stat(pid))


def test_a_zombie_says_how_it_exited_and_is_not_alive_then_gone_once_reaped():
    p = _unreaped("import sys; sys.exit(3)")
    try:
        st = _zombie(p.pid)
        assert (st.alive, st.stopped, st.exit_code, st.exit_signal) == (False, False, 3, None), st
        full = read_proc_state(p.pid)   # the fuller read carries the same facts
        assert full is not None and full.zombie and full.exit_code == 3 and full.start_ticks == st.start_ticks
    finally:
        assert p.wait(timeout=10) == 3
    assert read_stat(p.pid) is None and read_proc_state(p.pid) is None and read_start_ticks(p.pid) is None


def test_a_zombie_killed_by_a_signal_names_the_signal_not_a_code():
    p = _unreaped("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    try:
        st = _zombie(p.pid)
        assert (st.exit_code, st.exit_signal) == (None, signal.SIGKILL), st
    finally:
        assert p.wait(timeout=10) == -signal.SIGKILL


def test_stopped_is_alive_and_stopped_until_continued_and_group_and_start_time_are_read():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        st = read_stat(p.pid)
        assert st is not None and st.alive and not st.stopped and not st.zombie, st
        assert st.pgid == p.pid != os.getpgrp() and st.ppid == os.getpid()   # its own group (setsid), our child
        assert st.start_ticks == read_start_ticks(p.pid) > 0 and st.exit_code is None and st.exit_signal is None
        os.kill(p.pid, signal.SIGSTOP)
        st = wait_until(lambda: (s := read_stat(p.pid)) is not None and s.stopped and s, 10, every_s=0.02,
                        what=f"pid {p.pid} stopped", describe=lambda: read_stat(p.pid))
        assert st.alive and st.state in ("T", "t") and not st.zombie
        os.kill(p.pid, signal.SIGCONT)
        wait_until(lambda: (s := read_stat(p.pid)) is not None and not s.stopped, 10, every_s=0.02,
                   what=f"pid {p.pid} continued", describe=lambda: read_stat(p.pid))
    finally:
        p.kill()
        p.wait(timeout=10)
    assert read_stat(p.pid) is None
