"""A fleet streams (issue 53), the parts without a store: the config refuses a store capture nodes cannot reach, the
endpoint handed to a capture node is validated, its file is the node's own, and each node's sink keeps the headroom
the bound across nodes needs (stores.mooncake.store: MooncakeSink._room)."""
from __future__ import annotations

import json

import pytest

from eagleflow.config import ConfigError, load_config, stream_host_reachable
from eagleflow.fleet.stream import EndpointRefused, node_endpoint
from eagleflow.layout import RunLayout
from eagleflow.stores import run_store_settings


def fleet_cfg(host: str = "127.0.0.1", storage: str = "mooncake", b_conn: str | None = "node_b", **stream):
    return load_config(data={"target_model": "/m", "run_root": "/ra", "capture": {"shards": 4},
                             "server": {"dump_dir": "/d"},
                             "stream": {"storage": storage, "host": host, "buffer_gib": 1.0, **stream},
                             "fleet": {"nodes": [{"name": "a", "conn_id": "node_a"},
                                                 {"name": "b", "conn_id": b_conn}]}})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "localhost", "::1", "0.0.0.0"])
def test_a_loopback_store_host_with_a_capture_node_elsewhere_is_a_config_error(host):
    with pytest.raises(ConfigError, match=rf"stream\.host '{host}' is loopback or a wildcard, but fleet node\(s\) "
                                          r"b \(connection node_b\) put their samples into the training node a's "
                                          r"store over the network: set stream\.host to a's address"):
        fleet_cfg(host)


def test_a_reachable_host_or_no_remote_node_or_an_offline_run_is_fine():
    assert fleet_cfg("10.0.0.5").stream.host == "10.0.0.5"
    assert fleet_cfg("127.0.0.1", storage="disk").stream.storage == "disk"      # nothing streams
    assert fleet_cfg("127.0.0.1", b_conn="node_a").fleet.nodes[1].conn_id == "node_a"   # one machine
    assert not stream_host_reachable("127.0.0.1") and stream_host_reachable("gpu-node-1.cluster")


def answer(**kw):
    a = {"store": "mooncake", "started": True, "host": "10.0.0.5", "rpc_port": 50001, "metadata_port": 50002,
         "metrics_port": 50003, "segment_bytes": 1 << 30, "store_id": "20261206T113452-13d63ab5",
         "master_pid_file": "/state/pids/r.mooncake-master.json", "segment_pid_file": "/x"}
    a.update(kw)
    return a


def test_the_endpoint_handed_to_a_node_is_what_a_sink_needs_without_the_training_nodes_records():
    ep = node_endpoint(answer(), "10.0.0.5", source="S", remote=True)
    assert ep == {"host": "10.0.0.5", "rpc_port": 50001, "metadata_port": 50002, "metrics_port": 50003,
                  "segment_bytes": 1 << 30, "master_pid_file": "", "segment_pid_file": "",
                  "metadata_pid_file": "", "store_id": "20261206T113452-13d63ab5", "protocol": "tcp", "device_names": ""}


@pytest.mark.parametrize("bad, match", [
    ({"host": "10.6.6.6"}, r"S: host '10\.6\.6\.6' is not the store's configured address stream\.host '10\.0\.0\.5'"),
    ({"rpc_port": 0}, r"rpc_port 0 is not a TCP port"),
    ({"metrics_port": "50003"}, r"metrics_port '50003' is not a TCP port"),
    ({"metadata_port": 70000}, r"metadata_port 70000 is not a TCP port"),
    ({"metrics_port": True}, r"metrics_port True is not a TCP port"),
    ({"metrics_port": 50001}, r"rpc_port 50001 and the other ports \[50001, 50001, 50002\] are not distinct"),
    ({"segment_bytes": -1}, r"segment_bytes -1 is not a positive byte count"),
    ({"store_id": "../../x"}, r"store_id '\.\./\.\./x' is not a store incarnation id"),
    ({"store_id": None}, r"store_id None is not a store incarnation id"),
])
def test_a_bad_answer_is_refused_naming_the_field_and_value(bad, match):
    with pytest.raises(EndpointRefused, match=match + ".*restart the run's store"):
        node_endpoint(answer(**bad), "10.0.0.5", source="S", remote=True)


def test_a_loopback_endpoint_is_refused_for_a_remote_node_and_kept_for_one_on_this_machine():
    with pytest.raises(EndpointRefused, match=r"host '127\.0\.0\.1' is loopback or a wildcard, unreachable"):
        node_endpoint(answer(host="127.0.0.1"), "127.0.0.1", source="S", remote=True)
    assert node_endpoint(answer(host="127.0.0.1"), "127.0.0.1", source="S", remote=False)["host"] == "127.0.0.1"


def test_each_capture_node_reads_its_own_endpoint_file_and_keeps_room_for_the_other_nodes():
    cfg = fleet_cfg("10.0.0.5")
    home, other = RunLayout.for_run(cfg, "r"), RunLayout.for_run(cfg.node_view("b"), "r")
    assert str(home.store_endpoint_file) == "/ra/r/store_endpoint.json"
    assert str(other.store_endpoint_file) == "/ra/r/store_endpoint.b.json"       # never the training node's file
    s = run_store_settings(cfg.node_view("b"), other)
    # two nodes, max_sample_mib unset: a quarter of the buffer per node share, the other node's kept free
    assert (s.writer_nodes, s.max_sample_bytes, s.headroom_bytes) == (2, (1 << 30) // 8, (1 << 30) // 8)
    s = run_store_settings(fleet_cfg("10.0.0.5", max_sample_mib=16), other)
    assert (s.max_sample_bytes, s.headroom_bytes) == (16 << 20, 16 << 20)
    one = load_config(data={"target_model": "/m", "run_root": "/ra", "server": {"dump_dir": "/d"},
                            "stream": {"storage": "mooncake"}})
    s = run_store_settings(one, RunLayout.for_run(one, "r"))
    assert (s.writer_nodes, s.headroom_bytes) == (1, 0)                           # one node: the plain check


def test_a_capture_node_sharing_the_run_root_shows_no_store_line_of_the_training_nodes_store(tmp_path):
    """The GPU view: on n2, the run dir it shares holds n1's endpoint, whose records are n1's: no (false DOWN)
    store line there; on n1 the same endpoint is its own store's (DOWN here: no process runs)."""
    from eagleflow.health.node_activity import _store
    rd = tmp_path / "runs" / "r"
    rd.mkdir(parents=True)
    (rd / "run-config.json").write_text(json.dumps({"stream": {"storage": "mooncake", "buffer_gib": 0.001}}))
    (rd / "store_endpoint.json").write_text(json.dumps(
        {"host": "10.0.0.5", "rpc_port": 1, "metadata_port": 2, "metrics_port": 3, "segment_bytes": 4,
         "master_pid_file": str(tmp_path / "state-n1" / "pids" / "r.mooncake-master.json"),
         "segment_pid_file": str(tmp_path / "state-n1" / "pids" / "r.mooncake-segment.json"), "store_id": "s1"}))
    assert _store(rd, "r", {"worker_shard_00001"}, [], tmp_path / "state-n2") is None
    home = _store(rd, "r", set(), [], tmp_path / "state-n1")
    assert home is not None and not home.ok and "mooncake-master is not running" in home.detail


def test_each_capture_node_gets_the_endpoint_and_a_restarted_stores_new_one(tmp_path):
    """hand_endpoint_to_capture_nodes (start_store, and the trainer's retry after restarting a lost store): every
    other node with extraction shards gets the store's endpoint in its own file, a new incarnation replacing the
    old; the training node's own file is never written; outside a fleet, nothing."""
    from eagleflow.airflow.runtime import RunContext
    from eagleflow.fleet.stream import hand_endpoint_to_capture_nodes
    nodes = [{"name": n, "has_gpu": False, "state_dir": str(tmp_path / f"state-{n}")} for n in ("n1", "n2", "n3")]
    cfg = load_config(data={"target_model": "/m", "run_root": str(tmp_path / "runs"), "capture": {"shards": 2},
                            "server": {"dump_dir": "/d"}, "stream": {"storage": "mooncake"},
                            "fleet": {"nodes": nodes, "training_node": "n1"}})
    ctx = RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, "r"))
    said: list[str] = []
    got = hand_endpoint_to_capture_nodes(ctx, answer(host="127.0.0.1", store_id="one"), said.append)
    run_dir = tmp_path / "runs" / "r"
    assert got == {"n2": f"written to {run_dir / 'store_endpoint.n2.json'}"}     # n3 has no shard of 2
    assert not (run_dir / "store_endpoint.json").exists() and not (run_dir / "store_endpoint.n3.json").exists()
    hand_endpoint_to_capture_nodes(ctx, answer(host="127.0.0.1", store_id="two", rpc_port=50011), said.append)
    assert json.loads((run_dir / "store_endpoint.n2.json").read_text())["store_id"] == "two"
    assert json.loads((run_dir / "store_endpoint.n2.json").read_text())["rpc_port"] == 50011
    assert any("store two" in line and "handed to node n2" in line for line in said), said
    one = load_config(data={"target_model": "/m", "run_root": str(tmp_path / "runs"), "server": {"dump_dir": "/d"},
                            "stream": {"storage": "mooncake"}})
    assert hand_endpoint_to_capture_nodes(RunContext(cfg=one, layout=RunLayout.for_run(one, "r")), answer(),
                                          said.append) == {}


def test_a_capture_node_knows_the_running_store_by_its_master_answering(tmp_path):
    """The Mooncake resume on a fleet's capture node: the training node's pid records are not provable there (its
    processes run on another machine), so the store running now is the one whose master answers at the endpoint;
    a master that does not answer is no store (every line kept, as before)."""
    import socket
    from eagleflow.stores.mooncake.store import _current_store_id
    ep_file = tmp_path / "store_endpoint.json"
    with socket.socket() as rpc, socket.socket() as met:
        for s in (rpc, met):
            s.bind(("127.0.0.1", 0))
            s.listen()
        ep = {"host": "127.0.0.1", "rpc_port": rpc.getsockname()[1], "metadata_port": 1,
              "metrics_port": met.getsockname()[1], "segment_bytes": 4, "store_id": "B",
              "master_pid_file": str(tmp_path / "n1-state" / "pids" / "r.mooncake-master.json"),
              "segment_pid_file": str(tmp_path / "n1-state" / "pids" / "r.mooncake-segment.json")}
        ep_file.write_text(json.dumps(ep))
        assert _current_store_id(ep_file) == "B"
    assert _current_store_id(ep_file) == ""                                     # nothing answers there now
