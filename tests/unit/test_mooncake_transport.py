"""The store's transport is config (issue 53: "how the master is run on a real cluster (RDMA)"): ``stream.protocol``
and ``stream.device_names`` reach the segment holder's command line, the endpoint every client reads, each client's
``setup`` and a fleet node's handed endpoint; a bad value is refused naming the field. No RDMA NIC here: the real
transport is exercised over TCP by the integration tests; these check what reaches Mooncake."""
from __future__ import annotations

import json
import types

import pytest

from eagleflow.config import ConfigError, load_config
from eagleflow.fleet.stream import EndpointRefused, node_endpoint
from eagleflow.stores.mooncake import master as m
from eagleflow.stores.mooncake import store as st


def _cfg(**stream):
    return load_config(data={"target_model": "/m", "stream": {"storage": "mooncake", **stream}})


def test_the_transport_is_config_with_tcp_by_default_and_bad_values_named():
    assert (_cfg().stream.protocol, _cfg().stream.device_names) == ("tcp", "")
    c = _cfg(protocol="rdma", device_names="mlx5_0,mlx5_1")
    assert (c.stream.protocol, c.stream.device_names) == ("rdma", "mlx5_0,mlx5_1")
    with pytest.raises(ConfigError, match="stream.protocol"):
        _cfg(protocol="udp")
    with pytest.raises(ConfigError, match="stream.device_names"):
        _cfg(protocol="rdma", device_names="mlx5_0; rm -rf /")


def test_the_segment_holder_is_started_with_the_transport(monkeypatch, tmp_path):
    argv: list[list[str]] = []
    monkeypatch.setattr(m, "_detach", lambda role, pid, log, cmd, env=None: argv.append(cmd))
    monkeypatch.setattr(m, "_wait", lambda *a, **k: None)
    ep = m.MooncakeEndpoint(host="127.0.0.1", rpc_port=5, metadata_port=6, metrics_port=7, segment_bytes=64 << 20,
                            protocol="rdma", device_names="mlx5_0,mlx5_1")
    m._start_segment(ep, tmp_path / "seg.json", tmp_path / "seg.log", capacity_before=0, timeout_s=1)
    cmd = argv[0]
    assert cmd[cmd.index("-protocol") + 1] == "rdma" and cmd[cmd.index("-device_names") + 1] == "mlx5_0,mlx5_1"
    argv.clear()
    m._start_segment(m.MooncakeEndpoint(host="127.0.0.1", rpc_port=5, metadata_port=6, metrics_port=7,
                                        segment_bytes=64 << 20), tmp_path / "seg.json", tmp_path / "seg.log",
                     capacity_before=0, timeout_s=1)
    assert argv[0][argv[0].index("-protocol") + 1] == "tcp" and "-device_names" not in argv[0]


def test_the_endpoint_carries_the_transport_and_refuses_a_bad_one(tmp_path):
    ep = m.MooncakeEndpoint(host="10.0.0.5", rpc_port=5, metadata_port=6, metrics_port=7, segment_bytes=1 << 20,
                            store_id="s1", protocol="rdma", device_names="mlx5_0")
    f = tmp_path / "store_endpoint.json"
    f.write_text(ep.to_json())
    back = m.MooncakeEndpoint.read(f)
    assert (back.protocol, back.device_names) == ("rdma", "mlx5_0")
    old = json.loads(ep.to_json())
    del old["protocol"], old["device_names"]            # an endpoint written before the field: tcp
    f.write_text(json.dumps(old))
    assert m.MooncakeEndpoint.read(f).protocol == "tcp"
    f.write_text(json.dumps({**old, "protocol": "carrier-pigeon"}))
    with pytest.raises(ValueError, match="protocol 'carrier-pigeon' is not one of tcp, rdma"):
        m.MooncakeEndpoint.read(f)


def test_each_client_sets_up_with_the_endpoints_transport(monkeypatch):
    calls: list[tuple] = []

    class FakeStore:                                   # records what the real MooncakeDistributedStore.setup gets
        def setup(self, *args):
            calls.append(args)
            return 0
    monkeypatch.setattr(st.importlib, "import_module",
                        lambda name: types.SimpleNamespace(MooncakeDistributedStore=FakeStore))
    monkeypatch.setattr(st.MooncakeClient, "unavailable_if_down", lambda self, *a, **k: None)
    ep = m.MooncakeEndpoint(host="127.0.0.1", rpc_port=5, metadata_port=6, metrics_port=7, segment_bytes=1 << 20,
                            protocol="rdma", device_names="mlx5_1")
    st.MooncakeClient(ep)
    assert calls[0][4:6] == ("rdma", "mlx5_1") and calls[0][6] == "127.0.0.1:5"


def test_a_fleet_node_is_handed_the_transport_checked():
    answer = {"host": "10.0.0.5", "rpc_port": 5001, "metadata_port": 5002, "metrics_port": 5003,
              "segment_bytes": 1 << 20, "store_id": "s1", "protocol": "rdma", "device_names": "mlx5_0"}
    ep = node_endpoint(answer, "10.0.0.5", source="n1's store start", remote=True)
    assert (ep["protocol"], ep["device_names"]) == ("rdma", "mlx5_0")
    older = {k: v for k, v in answer.items() if k not in ("protocol", "device_names")}
    assert node_endpoint(older, "10.0.0.5", source="n1", remote=True)["protocol"] == "tcp"
    with pytest.raises(EndpointRefused, match="protocol 'rdma2'"):
        node_endpoint({**answer, "protocol": "rdma2"}, "10.0.0.5", source="n1", remote=True)
    with pytest.raises(EndpointRefused, match="device_names"):
        node_endpoint({**answer, "device_names": "a b"}, "10.0.0.5", source="n1", remote=True)


def test_the_store_command_passes_the_transport_with_or_without_an_existing_master():
    from eagleflow.store_commands import _master_options
    own = _master_options(_cfg(protocol="rdma", device_names="mlx5_0").stream)
    assert own == {"protocol": "rdma", "device_names": "mlx5_0"}
    theirs = _master_options(_cfg(master="10.0.0.9:50051").stream)
    assert theirs["protocol"] == "tcp" and theirs["master"] == ("10.0.0.9", 50051)
