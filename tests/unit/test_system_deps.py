"""`make test` on a machine that lacks a system package and cannot install it stops at once, saying what
to install (.ci/system-deps; as root it installs them with apt-get, as .ci/run does)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / ".ci" / "system-deps"


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("runuser") is None,
                    reason="needs root to run the script as an unprivileged user")
def test_without_root_it_stops_at_once_naming_the_packages(tmp_path):
    # as `nobody`, with a PATH on which redis-server, docker(-compose) and sudo cannot be found
    t0 = time.monotonic()
    res = subprocess.run([shutil.which("runuser"), "-u", "nobody", "--", "/bin/bash", str(SCRIPT)], capture_output=True,
                         text=True, timeout=60, env={"PATH": str(tmp_path), "HOME": str(tmp_path)}, cwd="/")
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert time.monotonic() - t0 < 10
    assert "redis-server" in res.stderr and "docker-compose" in res.stderr
    assert "apt-get install -y --no-install-recommends" in res.stderr
    assert "installing" not in res.stderr          # it never tried


def test_with_everything_present_it_does_nothing():
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stderr == "", res.stderr   # this machine has them (make test put them)
