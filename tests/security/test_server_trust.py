"""Issue 38, item 8: the capture and generation servers' trust boundary (docs/safety.md).

They take no credential (sglang could be given one only on its command line, which every local user reads in
/proc), so: they listen on a loopback address only, whatever starts them (the hf server's own CLI,
`eagleflow capture serve`, `eagleflow generate serve`, the sglang launcher), and a request that is not the
run's is harmless: here a foreign client answers the real server under the worker's own request id with other
tokens, between the worker's request and its read of the dump; the real `eagleflow capture run` refuses that
dump and stores nothing of it.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from eagleflow.engines.hf import server as hf_server
from eagleflow.engines.hf.server import CaptureModel, CaptureServer
from eagleflow.serving.dump_protocol import load_dump_key, loopback_host, request_id
from eagleflow.config import ConfigError, load_config
from eagleflow.layout import RunLayout
from tests.fixtures.capture_corpus import write_corpus, write_run_config

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_addresses_are_accepted(host):
    assert loopback_host(host) == host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "gpu-node-1", "example.com"])
def test_other_addresses_are_refused_naming_the_field_and_value(host):
    with pytest.raises(ConfigError, match=rf"server\.host = {host!r}: .*loopback address only"):
        loopback_host(host)


def test_the_hf_server_cli_refuses_to_listen_on_all_interfaces(tmp_path, demo_assets):
    port = _free_port()
    res = subprocess.run([sys.executable, "-m", "eagleflow.engines.hf.server", "--model", demo_assets["target_model"],
                          "--host", "0.0.0.0", "--port", str(port), "--dump-dir", str(tmp_path / "dumps")],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 2 and "--host = '0.0.0.0'" in res.stderr, res.stderr
    assert not _listening(port)


@pytest.mark.parametrize("phase", ["capture", "generate"])
def test_the_serve_commands_refuse_a_config_whose_capture_host_is_not_loopback(tmp_path, demo_assets, phase):
    cfgp = write_run_config(tmp_path, demo_assets["target_model"])
    data = yaml.safe_load(cfgp.read_text())
    port = _free_port()
    data["server"].update(host="0.0.0.0", port=port)
    data.setdefault("generate", {})["port"] = port
    cfgp.write_text(yaml.safe_dump(data))
    res = subprocess.run([sys.executable, "-m", "eagleflow.cli", phase, "serve", "--config", str(cfgp),
                          "--run-id", "trust"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 2 and "server.host = '0.0.0.0'" in res.stderr, res.stderr
    assert not _listening(port)


def test_the_sglang_launcher_refuses_before_starting_sglang(tmp_path, demo_assets, monkeypatch):
    from eagleflow.serving import launch as server_launch
    from eagleflow.engines.sglang import launcher as sglang_launcher
    cfgp = write_run_config(tmp_path, demo_assets["target_model"])
    data = yaml.safe_load(cfgp.read_text())
    data["capture"]["backend"] = "sglang"
    data["server"]["host"] = "0.0.0.0"
    data["node"]["has_gpu"] = True
    cfgp.write_text(yaml.safe_dump(data))
    cfg = load_config(cfgp)
    started = []
    monkeypatch.setattr(server_launch.subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(sglang_launcher.os, "execv", lambda *a: started.append(a))
    with pytest.raises(ConfigError, match=r"server\.host = '0\.0\.0\.0'"):
        sglang_launcher.launch(cfg, RunLayout.for_run(cfg, "trust"))
    assert not started


def test_a_foreign_request_under_the_workers_request_id_is_refused_by_the_worker(tmp_path, demo_assets, monkeypatch):
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=1, in_flight=1)
    cfg = load_config(cfgp)
    lay = RunLayout.for_run(cfg, "trust")
    write_corpus(Path(lay.corpus_dir) / "corpus.parquet", 2, 300, seed=3)
    key = load_dump_key(lay.dump_key_file, create=True)
    model = CaptureModel(demo_assets["target_model"], model_name="tiny")
    srv = CaptureServer(("127.0.0.1", 0), model, str(tmp_path / "dumps"), key)
    assert srv.server_address[0] == "127.0.0.1"
    victim = request_id("trust", 0, 0)
    foreign_sent, foreign_answers = [], []
    genuine_write = hf_server.write_dump

    def foreign_request(rid):
        # any local user: no credential, the worker's predictable request id, tokens of its own choosing
        body = json.dumps({"rid": rid, "input_ids": [7, 8, 9, 10, 11]}).encode()
        req = urllib.request.Request(f"{srv.url}/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            foreign_answers.append(json.loads(r.read()))

    def racing_write(dump_dir, rid, **kw):
        path = genuine_write(dump_dir, rid, **kw)
        if rid == victim and not foreign_sent:
            # the foreign request lands after the worker's dump is written, before the worker reads it
            foreign_sent.append(rid)
            t = threading.Thread(target=foreign_request, args=(rid,))
            t.start()
            t.join()
        return path

    monkeypatch.setattr(hf_server, "write_dump", racing_write)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        res = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "run", "--config", str(cfgp),
                              "--run-id", "trust", "--shard", "0", "--url", srv.url],
                             capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    finally:
        srv.shutdown()
        srv.server_close()
    # the foreign request was served (a dump was written under the worker's rid, with the server's own MAC)...
    assert foreign_answers and foreign_answers[0]["meta_info"]["id"] == victim
    # ...and the worker refused it: its tokens are not the sample's; nothing of it reached the store
    assert res.returncode != 0 and "differ from sample" in res.stderr, res.stderr
    shard = Path(lay.shard_dir(0))
    assert not list(shard.glob("*.safetensors"))
    manifest = shard / "manifest.jsonl"
    assert not manifest.exists() or not manifest.read_text().strip()
