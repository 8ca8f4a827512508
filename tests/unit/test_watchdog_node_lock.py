"""The node lock: held across processes, names its holder, released by the kernel when the holder dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from eagleflow.nodes.locks import NodeLock, NodeLockTimeout

HOLD = ("import sys,time\nfrom eagleflow.nodes.locks import NodeLock\n"
        "NodeLock(sys.argv[1], 'test holder').acquire()\nprint('held', flush=True)\ntime.sleep(60)\n")


@pytest.mark.timeout(30)
def test_lock_excludes_other_processes_and_dies_with_its_holder(tmp_path):
    path = tmp_path / "locks" / "run.capture_server.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        mine = NodeLock(path, "test waiter")
        assert not mine.try_acquire()
        assert f'"pid": {holder.pid}' in mine.holder() and "test holder" in mine.holder()
        t0 = time.monotonic()
        with pytest.raises(NodeLockTimeout, match="run.capture_server.lock"):
            mine.acquire(timeout_s=0.3)
        assert time.monotonic() - t0 < 2
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        assert mine.acquire(timeout_s=5) in (False, True)
        assert "test waiter" in mine.holder()
        mine.release()
        with NodeLock(path, "again"):
            pass
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
