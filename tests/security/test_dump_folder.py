"""Issue 26 item 4: the dump folder is this user's own, dumps are 0600, and a replaced dump is never stored.

The break: `/dev/shm/eagleflow_hs` was created with exist_ok (a folder another user made first was used), dumps
were 0644 in a 0755 folder, and the worker compared only input_ids, so another user could read the hidden states
or swap a dump and have forged hidden states trained on. A second Unix user is real here where the machine
allows it (root runs `setpriv` as uid 65534 "nobody"); otherwise those tests skip.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml

from eagleflow.engines.hf.server import CaptureModel, CaptureServer
from eagleflow.serving.dump_protocol import (DUMP_MAC, DumpTrustError, expand_dump_dir, load_dump_key, private_dump_dir,
                                        read_dump, request_id, verify_dump, write_dump)
from eagleflow.config import ServerConfig
from eagleflow.layout import RunLayout
from tests.fixtures.capture_corpus import write_corpus, write_run_config

pytestmark = pytest.mark.timeout(180)
OTHER_UID = 65534


def as_other_user(*argv: str) -> subprocess.CompletedProcess:
    """argv run as a second Unix user (uid 65534); skips the test where this machine cannot do that."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to act as a second Unix user")
    return subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


@pytest.fixture
def shm():
    """A world-writable sticky folder like /dev/shm itself, private to this test."""
    base = Path(f"/dev/shm/eagleflow-sec-{secrets.token_hex(4)}")
    base.mkdir()
    os.chmod(base, 0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _dump(dump_dir, rid="r.s00000.00000001", key=None, hidden=None):
    return write_dump(dump_dir, rid, input_ids=torch.arange(4), aux_hidden_states=torch.ones(4, 6),
                      hidden_states=torch.zeros(4, 2) if hidden is None else hidden, aux_layers=[1, 2, 3],
                      model="m", key=key)


def test_the_default_dump_folder_is_per_user_0700_and_dumps_are_0600(shm):
    assert expand_dump_dir(ServerConfig().dump_dir) == \
        Path(f"/dev/shm/eagleflow_hs-{os.geteuid()}")
    d = private_dump_dir(str(shm / "eagleflow_hs-{uid}"))
    assert d == shm / f"eagleflow_hs-{os.geteuid()}"
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    p = _dump(d)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    if os.geteuid() == 0 and shutil.which("setpriv"):
        out = as_other_user("cat", str(p))
        assert out.returncode != 0 and "Permission denied" in out.stderr, "another user read a dump"
        out = as_other_user("touch", str(d / "r.s00000.00000002.safetensors"))
        assert out.returncode != 0 and "Permission denied" in out.stderr, "another user placed a dump"


def test_a_folder_another_user_made_first_is_refused(shm, demo_assets):
    made = as_other_user("mkdir", "-m", "0777", str(shm / "eagleflow_hs"))
    assert made.returncode == 0, made.stderr
    assert os.lstat(shm / "eagleflow_hs").st_uid == OTHER_UID
    with pytest.raises(DumpTrustError, match=f"belongs to uid {OTHER_UID}, not to this user"):
        private_dump_dir(shm / "eagleflow_hs")
    model = CaptureModel(demo_assets["target_model"], model_name="tiny")
    with pytest.raises(DumpTrustError, match="someone else made it first"):   # the server's own start
        CaptureServer(("127.0.0.1", 0), model, str(shm / "eagleflow_hs"))
    with pytest.raises(DumpTrustError):
        _dump(shm / "eagleflow_hs")
    assert os.listdir(shm / "eagleflow_hs") == [], "nothing was written into the other user's folder"


def test_a_folder_owned_by_another_uid_is_refused_by_the_preflight(tmp_path, demo_assets):
    if os.geteuid() != 0:
        pytest.skip("needs root to hand a folder to another uid")
    from eagleflow.preflight import check_dirs, PreflightReport
    from eagleflow.config import load_config
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], dump_dir=str(tmp_path / "theirs"))
    (tmp_path / "theirs").mkdir()
    os.chown(tmp_path / "theirs", OTHER_UID, OTHER_UID)
    rep = PreflightReport()
    check_dirs(load_config(cfgp), "r", rep)
    (prob,) = [p for p in rep.problems if p.field == "server.dump_dir"]
    assert f"belongs to uid {OTHER_UID}" in prob.message and prob.value == str(tmp_path / "theirs")


def test_a_symlinked_dump_folder_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", tmp_path / "dumps")
    with pytest.raises(DumpTrustError, match="is a symbolic link"):
        private_dump_dir(tmp_path / "dumps")
    with pytest.raises(DumpTrustError, match="is a symbolic link"):
        _dump(tmp_path / "dumps")
    assert os.listdir(tmp_path / "elsewhere") == []


def test_a_folder_of_ours_with_wide_modes_is_narrowed_to_0700(tmp_path):
    (tmp_path / "dumps").mkdir()
    os.chmod(tmp_path / "dumps", 0o777)
    private_dump_dir(tmp_path / "dumps")
    assert stat.S_IMODE(os.lstat(tmp_path / "dumps").st_mode) == 0o700


def test_a_dump_key_others_can_read_and_an_empty_key_are_refused(tmp_path):
    path = tmp_path / "state" / "keys" / "capture_dump.key"
    key = load_dump_key(path, create=True)
    os.chmod(path, 0o644)                                      # copied or restored without its mode
    with pytest.raises(DumpTrustError, match="readable by others"):
        load_dump_key(path)
    p = _dump(tmp_path / "dumps", "r.s00000.00000001", key=key)
    with pytest.raises(DumpTrustError, match="without one"):
        verify_dump(read_dump(p), b"", p, "r.s00000.00000001")   # HMAC(b"") would be a key anyone knows


def test_verify_dump_refuses_a_replaced_dump_even_with_the_genuine_mac_copied(tmp_path):
    key = load_dump_key(tmp_path / "state" / "keys" / "capture_dump.key", create=True)
    assert stat.S_IMODE(os.stat(tmp_path / "state" / "keys" / "capture_dump.key").st_mode) == 0o600
    assert load_dump_key(tmp_path / "state" / "keys" / "capture_dump.key") == key   # the worker reads the same
    d = tmp_path / "dumps"
    rid = "r.s00000.00000001"
    p = _dump(d, rid, key=key)
    verify_dump(read_dump(p), key, p, rid)                     # the genuine one passes
    genuine_mac = read_dump(p).metadata[DUMP_MAC]
    from safetensors.torch import save_file
    forged = {"input_ids": torch.arange(4), "aux_hidden_states": torch.ones(4, 6),
              "hidden_states": torch.full((4, 2), 7.0)}        # same tokens, other hidden states
    meta = {k: v for k, v in read_dump(p).metadata.items()}
    save_file(forged, str(p), metadata=meta | {DUMP_MAC: genuine_mac})
    with pytest.raises(DumpTrustError, match="MAC that does not match"):
        verify_dump(read_dump(p), key, p, rid)
    save_file(forged, str(p), metadata={k: v for k, v in meta.items() if k != DUMP_MAC})
    with pytest.raises(DumpTrustError, match="carries no MAC"):
        verify_dump(read_dump(p), key, p, rid)
    other = _dump(d, "r.s00000.00000002", key=key)             # a genuine dump of another sample, renamed
    os.replace(other, p)
    with pytest.raises(DumpTrustError, match="is for request 'r.s00000.00000002'"):
        verify_dump(read_dump(p), key, p, rid)


def test_the_worker_refuses_dumps_not_made_under_the_dump_key(tmp_path, demo_assets):
    """The real `eagleflow capture run` against a server writing dumps without this user's dump key (an impostor,
    or anyone who swapped a dump): the shard fails naming the dump, and nothing reaches the store."""
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=1, in_flight=1)
    from eagleflow.config import load_config
    cfg = load_config(cfgp)
    lay = RunLayout.for_run(cfg, "sec")
    write_corpus(Path(lay.corpus_dir) / "corpus.parquet", 3, 300, seed=5)
    user_key = load_dump_key(lay.dump_key_file, create=True)
    model = CaptureModel(demo_assets["target_model"], model_name="tiny")

    def run_worker(server_key):
        srv = CaptureServer(("127.0.0.1", 0), model, str(tmp_path / "dumps"), server_key)
        t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        try:
            return subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "run", "--config", str(cfgp),
                                   "--run-id", "sec", "--shard", "0", "--url", srv.url],
                                  capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        finally:
            srv.shutdown()
            srv.server_close()

    shard = Path(lay.shard_dir(0))
    for impostor_key in (secrets.token_bytes(32), None):
        res = run_worker(impostor_key)
        assert res.returncode != 0
        assert "under the dump key" in res.stderr and request_id("sec", 0, 0) in res.stderr, res.stderr
        assert not list(shard.glob("*.safetensors")), "a forged dump was stored"
        manifest = shard / "manifest.jsonl"
        assert not manifest.exists() or not manifest.read_text().strip()
    res = run_worker(user_key)                                  # our own server: every sample stored
    assert res.returncode == 0, res.stderr
    assert len(list(shard.glob("*.safetensors"))) == 3
    assert not list((tmp_path / "dumps").iterdir()), "every consumed dump was removed"


def test_a_key_file_that_is_a_symlink_or_not_ours_is_refused(tmp_path):
    real = tmp_path / "real.key"
    real.write_text(secrets.token_hex(32))
    os.chmod(real, 0o600)
    os.symlink(real, tmp_path / "link.key")
    with pytest.raises(DumpTrustError, match="is a symbolic link"):
        load_dump_key(tmp_path / "link.key")
    os.chmod(real, 0o644 | 0o020)
    with pytest.raises(DumpTrustError, match="writable by group or others"):
        load_dump_key(real)
    with pytest.raises(DumpTrustError, match="no capture dump key"):
        load_dump_key(tmp_path / "missing.key")
