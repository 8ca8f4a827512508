"""A fleet streams (issue 53): two capture nodes put into the training node's Mooncake store.

The nodes are this machine seen through two fleet node views (one shared run root, each its own state dir,
dump dir, capture server and run config), as in test_fleet_pipeline: what a fleet changes is the view. The
fleet's own tasks are driven directly (``prepare_node``, ``start_store`` with its hand-over of the endpoint,
``collect_shards``, ``stop_store``: the real operators' ``run``), the node work through the node CLI
(``capture run`` per node with its own run config, ``train`` on the training node), not through a whole DAG
run: ``dag.test()`` runs one task at a time, so its shards would end before training starts and a buffer
smaller than the corpus could not drain. Real network namespaces are not used here (both nodes reach the
store on 127.0.0.1; the loopback refusal for nodes behind another connection is a config test in
tests/unit/test_fleet_stream.py).

And the bound across nodes with the real master: each node serialises only its own writers, so two nodes
reading the master's allocated bytes at the same moment both admit a put; the headroom keeps the store under
its buffer even then (and without it, it does not: the test's own control).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from airflow.sdk.exceptions import AirflowFailException

from eagleflow.airflow.fleet_operators import CollectShardsOperator, PrepareNodeOperator
from eagleflow.airflow.runtime import RunContext
from eagleflow.airflow.store_operators import StartStoreOperator, StopStoreOperator
from eagleflow.config import load_config
from eagleflow.fleet.assign import shards_of
from eagleflow.layout import RunLayout
from eagleflow.nodes.process_record import status
from eagleflow.phases.extract.lifecycle import start_capture_server, stop_capture_server, wait_capture_server_ready
from eagleflow.stores import StoreSettings, store_for
from eagleflow.stores.encoding import encode_sample
from eagleflow.stores.ledger import require_exactly_once
from tests.fixtures.capture_corpus import write_corpus, write_run_config
from tests.fixtures.node_host import IP, node_host_fixture  # noqa: F401  (fixture)
from tests.fixtures.stream_run import Peak, cli as _cli, kill_workers

pytest.importorskip("mooncake.store", reason="the stream extra (mooncake-transfer-engine-non-cuda) is not installed")

from eagleflow.stores.mooncake.master import MooncakeEndpoint, metrics, start_store, stop_store  # noqa: E402
from eagleflow.stores.mooncake.store import MooncakeSource  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SAMPLES = 24
BUFFER_BYTES = 128 << 10         # a few samples (up to 25 KiB here): both nodes' capture waits for the trainer
MAX_SAMPLE_BYTES = 32 << 10      # stream.max_sample_mib: each node keeps this free for the other's put
MAX_LEN = 24                     # tokens a record: its sample stays under MAX_SAMPLE_BYTES


# -- the bound across nodes, the real master, the worst interleaving forced -----------------------------------

def _enc(i: int, n: int = 64, h: int = 256):
    g = torch.Generator().manual_seed(i)
    return encode_sample(index=i, sample_id=f"src:{i}", input_ids=torch.arange(n) + i, loss_mask=[1] * n,
                         aux_hidden_states=torch.randn(n, 3 * h, generator=g).to(torch.bfloat16),
                         hidden_states=torch.randn(n, h, generator=g).to(torch.bfloat16), aux_layers=[1, 2, 3],
                         model="tiny")


def _together(sink, barrier: threading.Barrier) -> None:
    """The sink's first look at the master's allocated bytes waits for the other node's: both read the same
    figure before either puts (the race two nodes' unserialised room checks can always lose)."""
    real = sink.client.allocated_bytes
    first = [True]

    def allocated() -> int:
        value = real()
        if first[0]:
            first[0] = False
            # wait after reading, not before: a node scheduled late would otherwise read the other's put
            # (seen at load 5-10: the control's second node waited)
            barrier.wait(30)
        return value
    sink.client.allocated_bytes = allocated


@pytest.mark.parametrize("headroom", [True, False], ids=["headroom", "control-without-headroom"])
def test_two_nodes_checking_at_once_never_pass_the_buffer(tmp_path, headroom):
    state = tmp_path / "n1-state"
    ep_file = tmp_path / "n1" / "store_endpoint.json"
    ep = start_store(state_dir=state, run_id="r1", segment_bytes=64 << 20, endpoint_file=ep_file)
    try:
        # each node its own copy of the endpoint, so its own lock file beside it, as on two machines
        files = {}
        for node in ("n1", "n2"):
            files[node] = tmp_path / node / "store_endpoint.json"
            if node != "n1":
                files[node].parent.mkdir(parents=True)
                shutil.copy(ep_file, files[node])
        base = metrics(ep)["master_allocated_bytes"]
        probe = store_for("mooncake").open_sink(StoreSettings(run_id="r1", root=str(tmp_path / "hs"), fsync=False,
                                                              buffer_bytes=64 << 20, endpoint_file=str(ep_file)), 9)
        probe.put(_enc(99))
        one = int(metrics(ep)["master_allocated_bytes"] - base)      # what one sample takes in the master
        src = MooncakeSource(StoreSettings(run_id="r1", root=str(tmp_path / "hs"), endpoint_file=str(ep_file)))
        src.release(src.scan()[0])
        probe.close()
        buffer_bytes = 3 * one + one // 2                              # three samples fit, never four

        def settings(node: str) -> StoreSettings:
            return StoreSettings(run_id="r1", root=str(tmp_path / node / "hs"), fsync=False,
                                 buffer_bytes=buffer_bytes, endpoint_file=str(files[node]), put_timeout_s=60,
                                 writer_nodes=2 if headroom else 1, max_sample_bytes=one if headroom else 0)
        sinks = {n: store_for("mooncake").open_sink(settings(n), 0 if n == "n1" else 1) for n in ("n1", "n2")}
        sinks["n1"].put(_enc(0))
        sinks["n1"].put(_enc(1))                                       # the store holds two: room for one more
        peak = Peak(ep, every=0.005)
        barrier = threading.Barrier(2)
        for s in sinks.values():
            _together(s, barrier)
        errors: list[BaseException] = []

        def put(node: str, i: int) -> None:
            try:
                sinks[node].put(_enc(i))
            except BaseException as e:   # noqa: BLE001 - reported by the test
                errors.append(e)
        threads = [threading.Thread(target=put, args=("n1", 2)), threading.Thread(target=put, args=("n2", 3))]
        for t in threads:
            t.start()
        time.sleep(1.5)                                                # both have looked at the same figure
        waiting = sum(t.is_alive() for t in threads)
        # the trainer takes the two first samples, one at a time: room for whatever still waits
        reader = MooncakeSource(settings("n1"))
        for ref in sorted(reader.scan(), key=lambda r: r.index)[:2]:
            reader.open(ref).read()
            reader.release(ref)
            time.sleep(0.5)
        for t in threads:
            t.join(60)
        top = peak.stop()
        assert not errors, errors
        if headroom:
            # both saw 2 samples held; 2 + 1 passes buffer - headroom (2.5): both waited, then came in under it
            assert waiting == 2, waiting
            assert peak.samples > 50 and top <= buffer_bytes, (top, buffer_bytes, one)
        else:
            # the plain check: both saw room for one and both put: four samples in a buffer for three and a half
            assert waiting == 0
            assert top >= 4 * one > buffer_bytes, (top, buffer_bytes, one)
        for s in sinks.values():
            s.close()
        reader.close()
        src.close()
    finally:
        for res in stop_store(ep, grace_s=2.0):
            assert res.outcome in ("terminated", "killed", "already_gone", "not_recorded"), res.describe()


# -- two capture nodes, one store on the training node, the trainer on the stream -------------------------------

class _Ti:
    """What collect_shards pulls from its node's prepare_node (the real operator's answer, kept by the test)."""

    def __init__(self, ready: dict):
        self.ready = ready

    def xcom_pull(self, task_ids: str):
        return self.ready


def _fleet_config(tmp_path: Path, demo_assets, n2: dict | None = None, host: str = "127.0.0.1") -> Path:
    cfgp = write_run_config(tmp_path, demo_assets["target_model"], shards=2)
    data = yaml.safe_load(cfgp.read_text())
    del data["node"]
    data["fleet"] = {"training_node": "n1", "storage": "shared", "nodes": [
        {"name": n, "has_gpu": False, "state_dir": str(tmp_path / f"state-{n}"),
         "dump_dir": str(tmp_path / f"dumps-{n}"), "gpu_slots": 1} for n in ("n1", "n2")]}
    data["fleet"]["nodes"][1].update(n2 or {})
    data["stream"] = {"storage": "mooncake", "host": host, "buffer_gib": BUFFER_BYTES / (1 << 30), "shuffle_window": 4,
                      "put_timeout_s": 300, "max_sample_mib": MAX_SAMPLE_BYTES / (1 << 20)}
    data["train"] = {"device": "cpu", "max_steps": SAMPLES // 2, "batch_size": 2, "ttt_length": 2,
                     "draft_vocab_size": 64, "checkpoint_every": 3, "log_every": 1, "warmup_steps": 1}
    cfgp.write_text(yaml.safe_dump(data))
    return cfgp


def test_two_capture_nodes_stream_into_the_training_nodes_store(tmp_path, demo_assets):
    _stream_over_two_nodes(tmp_path, _fleet_config(tmp_path, demo_assets), "127.0.0.1", [])


def test_a_capture_node_in_its_own_network_namespace_streams_over_its_link(tmp_path, demo_assets, node_host_fixture,
                                                                           monkeypatch):  # noqa: F811
    """n2 is the node host (tests/fixtures/node_host.py): reached over its sshd (prepare_node, the endpoint's
    hand-over, its capture server), its worker in its own network namespace, putting into the store on n1 at
    the control plane's end of the veth link (stream.host): the real network path."""
    host = node_host_fixture
    monkeypatch.setenv("AIRFLOW_CONN_NODE_HOST_STREAM", host.airflow_conn())
    cfgp = _fleet_config(tmp_path, demo_assets, n2={"conn_id": "node_host_stream", "python": sys.executable},
                         host=host.host_ip)
    _stream_over_two_nodes(tmp_path, cfgp, host.host_ip, [IP, "netns", "exec", host.netns])


def _stream_over_two_nodes(tmp_path: Path, cfgp: Path, store_host: str, n2_prefix: list[str]) -> None:
    """The fleet's store tasks driven directly, each node's worker from the node CLI (n2's behind
    ``n2_prefix``: its network namespace), the trainer on n1; every check of the issue's fleet bullet."""
    run_id = "fleet-stream"
    home = RunContext.from_frozen({"run_id": run_id, "config": load_config(cfgp).model_dump(mode="json")})
    assert home.cfg.node.name == "n1"
    home.write_run_config()                                            # write_run_config's frozen copy
    other = home.for_node("n2")
    node_shards = {n: shards_of(home.cfg, n) for n in ("n1", "n2")}
    assert node_shards == {"n1": [0], "n2": [1]}, node_shards
    rows = write_corpus(Path(home.layout.corpus_dir) / "corpus.parquet", SAMPLES, 300, max_len=MAX_LEN)
    ids = {r["id"] for r in rows}
    # n2's prepare_node: its view of the frozen config, the storage probe (one run root: shared)
    ready = PrepareNodeOperator(task_id="prepare_node").run(other, {})
    assert ready["shared"] and ready["shards"] == [1] and Path(other.run_config_path).is_file()
    # start_store on the training node: the store from the wheel, its endpoint handed to n2
    info = StartStoreOperator(task_id="start_store").run(home, {})
    ep = MooncakeEndpoint.read(home.layout.store_endpoint_file)
    try:
        assert info["started"] and info["handed_to"] == {"n2": f"written to {other.layout.store_endpoint_file}"}
        handed = json.loads(Path(other.layout.store_endpoint_file).read_text())
        assert Path(other.layout.store_endpoint_file).name == "store_endpoint.n2.json"
        assert handed == {"host": store_host, "rpc_port": ep.rpc_port, "metadata_port": ep.metadata_port,
                          "metrics_port": ep.metrics_port, "segment_bytes": ep.segment_bytes,
                          "master_pid_file": "", "segment_pid_file": "", "metadata_pid_file": "",
                          "store_id": ep.store_id,
                          "protocol": "tcp", "device_names": ""}
        views = {"n1": home, "n2": other}                              # n2's server over its own connection
        procs: list[subprocess.Popen] = []
        try:
            for v in views.values():                                   # each node its own capture server
                start_capture_server(v)
            for v in views.values():
                wait_capture_server_ready(v, timeout_s=180, poll_s=0.3)
            peak = Peak(ep, every=0.005)
            trainer = subprocess.Popen(_cli("train", "--config", home.run_config_path, "--run-id", run_id),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(trainer)
            workers = {n: subprocess.Popen((n2_prefix if n == "n2" else []) + _cli(
                                               "capture", "run", "--config", views[n].run_config_path, "--run-id",
                                               run_id, "--shard", str(node_shards[n][0])),
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                       for n in ("n1", "n2")}
            procs.extend(workers.values())
            for n, w in workers.items():
                out, err = w.communicate(timeout=400)
                assert w.returncode == 0, f"{n}: {out[-1500:]}{err[-1500:]}"
            out, err = trainer.communicate(timeout=400)
            top = peak.stop()
        finally:
            kill_workers(procs)                                        # only ours, by PID
            for v in views.values():
                stop_capture_server(v, grace_s=10)
        assert trainer.returncode == 0, out[-3000:] + err[-3000:]
        assert "exactly once: every sample trained exactly once in every epoch" in out, out[-3000:]
        # the store never held more than its buffer, though the corpus is several buffers and two nodes put
        assert peak.samples > 10 and 0 < top <= BUFFER_BYTES, (top, BUFFER_BYTES)
        print(f"store peak {top} of {BUFFER_BYTES} bytes ({peak.samples} readings)")
        assert int(metrics(ep)["master_key_count"]) == 0              # each sample removed after its last epoch
        # n2's samples went into the training node's store: its manifest lines name that store's incarnation
        hs = Path(home.layout.hidden_states_dir)
        lines = {s: [json.loads(x) for x in (hs / f"shard_{s:05d}" / "manifest.jsonl").read_text().splitlines()]
                 for s in (0, 1)}
        assert lines[1] and all(e["store_id"] == ep.store_id and e["file"].startswith(f"{run_id}/shard_00001/")
                                for e in lines[1])
        assert sum(e["bytes"] for s in lines for e in lines[s]) > BUFFER_BYTES
        assert max(e["bytes"] for s in lines for e in lines[s]) <= MAX_SAMPLE_BYTES
        # collect_shards of n2 moves nothing: the manifests are in the training node's run dir already
        collected = CollectShardsOperator(task_id="collect_shards").run(other, {"ti": _Ti(ready)})
        assert collected == {"node": "n2", "copied": 0}
    finally:
        StopStoreOperator(task_id="stop_store").run(home, {})
    for f in (ep.master_pid_file, ep.segment_pid_file):
        assert not status(f).alive, status(f).detail
    require_exactly_once(home.layout.stream_ledger_file, ids, epochs=1)
    record = json.loads(Path(home.layout.stream_verified_file).read_text())
    assert record["ok"] and record["samples"] == SAMPLES and record["trained_per_epoch"] == {"0": SAMPLES}
    # no hidden-state file on either node's disk, nor anywhere the test (the Airflow side) wrote
    files = sorted(p.relative_to(hs).as_posix() for p in hs.rglob("*") if p.is_file())
    assert files == ["shard_00000/heartbeat.json", "shard_00000/manifest.jsonl", "shard_00001/heartbeat.json",
                     "shard_00001/manifest.jsonl", "stream_verified.json"], files
    stray = [p for p in tmp_path.rglob("*.safetensors") if "draft" not in p.parts]
    assert not stray, stray


def test_a_streaming_run_refuses_a_capture_node_off_the_training_nodes_storage(tmp_path, demo_assets):
    cfgp = _fleet_config(tmp_path, demo_assets)
    data = yaml.safe_load(cfgp.read_text())
    data["fleet"]["storage"] = "copy"
    data["fleet"]["nodes"][1]["run_root"] = str(tmp_path / "runs-n2")
    cfgp.write_text(yaml.safe_dump(data))
    home = RunContext.from_frozen({"run_id": "copied", "config": load_config(cfgp).model_dump(mode="json")})
    home.write_run_config()
    with pytest.raises(AirflowFailException, match=r"stream\.storage is 'mooncake' \(streaming\), but node n2's run "
                                                   r"root is not the training node n1's \(fleet\.storage 'copy'\): "
                                                   r"the trainer reads every shard's manifest in its own run dir"):
        PrepareNodeOperator(task_id="prepare_node").run(home.for_node("n2"), {})
    data["stream"]["storage"] = "disk"                                    # offline: copied as before
    cfgp.write_text(yaml.safe_dump(data))
    home = RunContext.from_frozen({"run_id": "copied", "config": load_config(cfgp).model_dump(mode="json")})
    assert PrepareNodeOperator(task_id="prepare_node").run(home.for_node("n2"), {})["shared"] is False
