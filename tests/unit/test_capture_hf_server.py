"""The hf capture server in-process: the API both backends serve."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from eagleflow.serving.client import CaptureServerError, CaptureTimeout, generate, health_generate, server_info
from eagleflow.engines.hf.server import CaptureModel, CaptureServer, write_info_file
from eagleflow.serving.dump_protocol import read_dump, request_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # starts HTTP capture servers


@pytest.fixture(scope="module")
def served(demo_assets, tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("dumps")
    model = CaptureModel(demo_assets["target_model"], model_name="tiny")
    srv = CaptureServer(("127.0.0.1", 0), model, str(dump_dir))
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv, dump_dir
    srv.shutdown()
    srv.server_close()


def test_server_info_reports_model_layers_version(served):
    srv, dump_dir = served
    info = server_info(srv.url)
    assert info["model"] == "tiny" and info["num_layers"] == 8 and info["aux_layers"] == [1, 3, 4]
    assert info["hidden_size"] == 64 and info["dtype"] == "float32" and info["backend"] == "hf"
    assert info["version"] and info["dump_dir"] == str(dump_dir)


def test_generate_writes_one_whole_dump_per_rid(served):
    srv, dump_dir = served
    rid = request_id("unit", 0, 3)
    out = generate(srv.url, [7, 8, 9, 10, 11], rid, timeout_s=30)
    assert out["meta_info"]["id"] == rid and out["meta_info"]["prompt_tokens"] == 5 and len(out["output_ids"]) == 1
    d = read_dump(dump_dir / f"{rid}.safetensors")
    assert d.input_ids.tolist() == [7, 8, 9, 10, 11]
    assert tuple(d.aux_hidden_states.shape) == (5, 192) and tuple(d.hidden_states.shape) == (5, 64)
    with torch.inference_mode():
        hs = srv.capture.model(torch.tensor([[7, 8, 9, 10, 11]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(d.hidden_states.to_torch(), hs[-1][0])
    assert not [p for p in dump_dir.iterdir() if p.name.startswith(".")], "no temp dump left behind"


def test_bad_requests_are_refused_with_a_reason(served):
    srv, _ = served
    with pytest.raises(CaptureServerError, match="HTTP 400.*rid"):
        generate(srv.url, [1, 2], "../etc/passwd", timeout_s=10)
    with pytest.raises(CaptureServerError, match=r"HTTP 400.*input_ids must be .*bad values: \[99999\]"):
        generate(srv.url, [1, 99999], request_id("unit", 0, 1), timeout_s=10)


def test_health_generate_runs_a_real_generation(served):
    srv, _ = served
    assert len(health_generate(srv.url, 10)["output_ids"]) == 1


def test_forward_delay_env_simulates_a_slow_model(served, monkeypatch):
    srv, _ = served
    monkeypatch.setenv("EAGLEFLOW_HF_SERVER_FORWARD_DELAY_S", "1.5")
    t0 = time.monotonic()
    with pytest.raises(CaptureTimeout, match="no answer within 0.5 s"):
        health_generate(srv.url, 0.5)
    assert time.monotonic() - t0 < 1.4
    monkeypatch.delenv("EAGLEFLOW_HF_SERVER_FORWARD_DELAY_S")
    time.sleep(1.2)     # let the delayed forward finish before the next test


def test_delay_file_slows_a_running_server(served, monkeypatch, tmp_path):
    srv, _ = served
    f = tmp_path / "delay"
    monkeypatch.setenv("EAGLEFLOW_HF_SERVER_DELAY_FILE", str(f))
    assert health_generate(srv.url, 5)            # no file yet: no delay
    f.write_text("1.0")
    with pytest.raises(CaptureTimeout):
        health_generate(srv.url, 0.3)
    f.write_text("0")
    time.sleep(1.0)
    assert health_generate(srv.url, 5)


def test_info_file_is_written_atomically(tmp_path):
    p = tmp_path / "run" / "capture_server.json"
    write_info_file(str(p), {"url": "http://127.0.0.1:1"})
    assert json.loads(p.read_text())["url"] == "http://127.0.0.1:1" and [x.name for x in p.parent.iterdir()] == [p.name]
