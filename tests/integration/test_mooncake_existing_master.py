"""An existing Mooncake master named in the config (``stream.master``, issue 53): the test starts a master from the
wheel itself (on 127.0.0.1 free ports) and plays the operator who runs it; `eagleflow store start` starts no master,
only the run's segment holder against it, and names it in the endpoint; samples put and got through it; `eagleflow
store stop` removes the run's keys and its segment holder and leaves the master running (its PID still alive)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.local_run import LocalRun
from eagleflow.nodes.process_record import status
from eagleflow.stores import run_store_settings, store_for
from tests.fixtures.capture_corpus import write_run_config
from tests.fixtures.mooncake_master import existing_master as start_existing_master

pytest.importorskip("mooncake.store", reason="the stream extra (mooncake-transfer-engine-non-cuda) is not installed")

from eagleflow.stores.encoding import encode_sample  # noqa: E402
from eagleflow.stores.mooncake.master import MooncakeEndpoint, metrics, reachable  # noqa: E402
from eagleflow.ports import free_ports  # noqa: E402
from eagleflow.stores.mooncake.store import MooncakeClient  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagleflow.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _last_json(res: subprocess.CompletedProcess) -> dict:
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture
def existing_master(tmp_path):
    """A master the test starts and stops itself (the run must never signal it)."""
    with start_existing_master(tmp_path) as m:
        yield m


def _run_config(tmp_path, demo_assets, rpc: int, meta: int, mets: int):
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=1)
    data = yaml.safe_load(cfgp.read_text())
    data["stream"] = {"storage": "mooncake", "buffer_gib": (32 << 20) / (1 << 30), "master": f"127.0.0.1:{rpc}",
                      "master_metadata_port": meta, "master_metrics_port": mets}
    cfgp.write_text(yaml.safe_dump(data))
    cfg = load_config(cfgp)
    return cfgp, LocalRun(cfg=cfg, layout=RunLayout.for_run(cfg, "ext1"), config_path=str(cfgp))


def _enc(i: int):
    import torch
    g = torch.Generator().manual_seed(i)
    return encode_sample(index=i, sample_id=f"src:{i}", input_ids=torch.arange(32) + i, loss_mask=[1] * 32,
                         aux_hidden_states=torch.randn(32, 3 * 64, generator=g).to(torch.bfloat16),
                         hidden_states=torch.randn(32, 64, generator=g).to(torch.bfloat16), aux_layers=[1, 2, 3],
                         model="tiny")


def test_store_start_uses_the_existing_master_and_stop_leaves_it_running(tmp_path, demo_assets, existing_master):
    proc, rpc, meta, mets = existing_master
    cfgp, ctx = _run_config(tmp_path, demo_assets, rpc, meta, mets)
    run = ["--config", str(cfgp), "--run-id", ctx.layout.run_id]
    capacity_before = metrics(MooncakeEndpoint("127.0.0.1", rpc, meta, mets, 0))["master_total_capacity_bytes"]

    started = _cli("store", "start", *run)
    assert started.returncode == 0, started.stderr[-3000:]
    info = _last_json(started)
    assert info["started"] and info["master_started"] is False
    ep = MooncakeEndpoint.read(info["endpoint_file"])
    # the endpoint names the existing master: its ports, no pid record of it, a store id of this incarnation
    assert (ep.host, ep.rpc_port, ep.metadata_port, ep.metrics_port) == ("127.0.0.1", rpc, meta, mets)
    assert ep.foreign_master and ep.master_pid_file == "" and ep.store_id
    assert status(ep.segment_pid_file).alive
    # no master of the run's own: no record, and the master's capacity grew by the run's segment only
    assert not list((Path(ctx.layout.state_dir) / "pids").glob("*mooncake-master*"))
    assert metrics(ep)["master_total_capacity_bytes"] >= capacity_before + (ep.segment_bytes >> 20 << 20)

    again = _cli("store", "start", *run)           # one store per run: the live one is named, not doubled
    assert again.returncode == 0 and _last_json(again)["attached"], again.stderr[-2000:]

    st = _cli("store", "status", *run)
    said = _last_json(st)
    assert st.returncode == 0 and said["healthy"] and said["foreign_master"], st.stdout
    assert "judged by its port only" in said["detail"]
    h = store_for("mooncake").server_health(run_store_settings(ctx.cfg, ctx.layout))
    assert h is not None and h["ok"] and h["foreign_master"] and "no pid record" in h["detail"]

    settings = run_store_settings(ctx.cfg, ctx.layout)
    sink = store_for("mooncake").open_sink(settings, 0)
    sent = [_enc(i) for i in (0, 1, 2)]
    for e in sent:
        sink.put(e)
    sink.close()
    source = store_for("mooncake").open_source(settings, log=lambda _m: None)
    refs = source.scan()
    assert [r.path for r in refs] == [f"ext1/shard_00000/{i:08d}" for i in (0, 1, 2)]
    for ref, enc in zip(refs, sent):
        assert source.open(ref).read() == enc.to_bytes()
    source.release(refs[0])
    source.close()

    stopped = _cli("store", "stop", *run, "--grace", "5")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr[-2000:]
    by_role = {r["role"]: r for r in _last_json(stopped)["stopped"]}
    assert by_role["mooncake-master"]["outcome"] == "left_running" and by_role["mooncake-master"]["pid"] is None
    assert by_role["mooncake-keys"]["outcome"] == "removed", by_role
    assert by_role["mooncake-keys"]["detail"].startswith("2 keys ext1/* removed"), by_role   # 0 was released
    assert by_role["mooncake-segment"]["outcome"] in ("terminated", "killed"), by_role
    # the existing master is still running, its PID alive and answering; zero signals reached it
    assert proc.poll() is None
    os.kill(proc.pid, 0)
    assert reachable("127.0.0.1", rpc)
    assert not status(ep.segment_pid_file).alive
    assert not os.path.exists(info["endpoint_file"])
    check = MooncakeClient(ep)      # the master still serves clients
    try:
        assert check.get("ext1/shard_00000/00000001") == b""          # the run's keys are gone
    finally:
        check.close()


def test_store_start_refuses_an_existing_master_that_does_not_answer(tmp_path, demo_assets):
    rpc, meta, mets = free_ports(3)      # nothing listens there
    cfgp, ctx = _run_config(tmp_path, demo_assets, rpc, meta, mets)
    res = _cli("store", "start", "--config", str(cfgp), "--run-id", ctx.layout.run_id)
    assert res.returncode == 3
    assert f"stream.master '127.0.0.1:{rpc}' does not answer" in res.stderr, res.stderr[-2000:]
    assert not os.path.exists(ctx.layout.store_endpoint_file)
    pids = Path(ctx.layout.state_dir) / "pids"
    assert not pids.is_dir() or not list(pids.glob("*mooncake*"))     # nothing started, nothing recorded
