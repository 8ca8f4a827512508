from pathlib import Path

import pytest

from eagleflow.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
BASE = {"target_model": "/models/t"}


def _err(data=None, **over) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(data={**BASE, **(data or {})}, overrides=over or None)
    return str(ei.value)


def test_demo_config_loads_and_resolves_relative_paths():
    cfg = load_config(REPO / "configs" / "local-demo.yaml")
    assert cfg.capture.backend == "hf"
    assert cfg.resolve(cfg.target_model) == (REPO / ".cache" / "demo" / "tiny-llama").absolute()
    assert cfg.run_dir("manual__2026-01-01T00:00:00+00:00").name == "manual__2026-01-01T00_00_00_00_00"


def test_example_gpu_config_loads():
    cfg = load_config(REPO / "configs" / "gpu-node.example.yaml")
    assert cfg.capture.backend == "sglang" and cfg.server.tp == 8


def test_unknown_field_is_named():
    msg = _err({"capture": {"shardz": 3}})
    assert "capture.shardz" in msg and "unknown field" in msg


def test_bad_enum_names_field_value_and_choices():
    msg = _err({"capture": {"backend": "vllmm"}})
    assert "capture.backend" in msg and "'hf'" in msg and "'sglang'" in msg
    assert "vllmm" not in msg   # the wrong value itself is never echoed (docs/safety.md)
    # every registered engine is offered (vllm captures, generates and evaluates: issue 40)
    assert "'hf' or 'sglang' or 'vllm'" in msg


def test_bound_violation_names_field_and_bound():
    msg = _err({"capture": {"shards": 0}})
    assert "capture.shards:" in msg and "greater than or equal to 1" in msg


def test_missing_required_field():
    with pytest.raises(ConfigError, match="target_model = \\(absent\\): required field is missing"):
        load_config(data={})


def test_wrong_type():
    msg = _err({"watchdog": {"poll_interval_s": "soon"}})
    assert "watchdog.poll_interval_s:" in msg and "valid number" in msg and "soon" not in msg


def test_duplicate_source_names():
    msg = _err({"corpus": {"sources": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}})
    assert "corpus.sources" in msg and "repeated: a" in msg


def test_sglang_on_cpu_node_refused():
    msg = _err({"node": {"has_gpu": False}, "capture": {"backend": "sglang"}})
    assert "needs a GPU node" in msg


def test_dotted_override_applies_and_validates():
    cfg = load_config(data=dict(BASE), overrides={"capture.shards": 4, "gpu.force_free": True})
    assert cfg.capture.shards == 4 and cfg.gpu.force_free
    assert "capture.shards:" in _err(**{"capture.shards": -1})


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(lst)


# The target server's settings have their own section (issue 48); their old names under capture: are still read.

def test_server_section_is_read_and_capture_keeps_its_own_fields():
    cfg = load_config(data={**BASE, "server": {"port": 31000, "tp": 2, "dtype": "bfloat16", "host": "127.0.0.2",
                                               "ready_timeout_s": 60, "extra_server_args": ["--mem-fraction-static",
                                                                                            "0.8"]},
                            "capture": {"shards": 3}})
    assert (cfg.server.port, cfg.server.tp, cfg.server.dtype, cfg.server.host, cfg.server.ready_timeout_s) \
        == (31000, 2, "bfloat16", "127.0.0.2", 60)
    assert cfg.server.extra_server_args == ["--mem-fraction-static", "0.8"] and cfg.capture.shards == 3
    assert "port" not in type(cfg.capture).model_fields   # one home per setting
    assert "capture.port" in _err({"capture": {"port": 1}, "server": {"port": 2}})  # (and not silently dropped)


def test_old_capture_names_are_read_as_server_with_a_note_naming_the_file(tmp_path, caplog):
    path = tmp_path / "old.yaml"
    path.write_text("target_model: /m\ncapture:\n  port: 31001\n  tp: 4\n  dump_dir: /dev/shm/x\n  shards: 2\n")
    with caplog.at_level("WARNING", logger="eagleflow.config"):
        cfg = load_config(path)
        load_config(path)                                  # read again: no second note
    assert (cfg.server.port, cfg.server.tp, cfg.server.dump_dir, cfg.capture.shards) == (31001, 4, "/dev/shm/x", 2)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 3, notes
    for old in ("port", "tp", "dump_dir"):
        (note,) = [n for n in notes if f"capture.{old} " in n]
        assert str(path) in note and f"read as server.{old}" in note and "move it under server:" in note
    # the same value under both names is one setting, not a conflict; the caller's data is left as it was
    raw = {**BASE, "capture": {"tp": 2, "shards": 3}, "server": {"tp": 2}}
    assert load_config(data=raw).server.tp == 2
    assert raw == {**BASE, "capture": {"tp": 2, "shards": 3}, "server": {"tp": 2}}
    # a fleet's nodes take the old capture.dump_dir as their default dump dir (read before the fleet resolves)
    fleet = load_config(data={**BASE, "capture": {"dump_dir": "/old"},
                              "fleet": {"nodes": [{"name": "a"}, {"name": "b", "dump_dir": "/b"}]}})
    assert [n.dump_dir for n in fleet.fleet.nodes] == ["/old", "/b"] and fleet.server.dump_dir == "/old"


def test_old_and_new_name_with_different_values_is_an_error_naming_both():
    msg = _err({"capture": {"port": 31000}, "server": {"port": 32000}})
    assert "capture.port and server.port are both set" in msg and "31000" in msg and "32000" in msg
    assert "keep server.port only" in msg
    # a value the field would not take may be a pasted secret: its type only
    msg = _err({"capture": {"host": "127.0.0.1"}, "server": {"host": ["hunter2"]}})
    assert "capture.host = '127.0.0.1'" in msg and "server.host = a value of type list, not shown" in msg
    assert "hunter2" not in msg
    # flags may carry a key: named, never shown
    msg = _err({"capture": {"extra_server_args": ["--api-key", "s3cret"]},
                "server": {"extra_server_args": ["--api-key", "other"]}})
    assert "capture.extra_server_args and server.extra_server_args" in msg
    assert "s3cret" not in msg and "other" not in msg


def test_a_bad_value_is_named_by_the_name_the_config_used():
    old = _err({"capture": {"port": 70000, "tp": 0}})
    assert "capture.port" in old and "capture.tp" in old and "server.port" not in old, old
    new = _err({"server": {"port": 70000}})
    assert "server.port" in new and "capture.port" not in new, new
    # our own validators' words too: the refused flag is named under the field as written
    flag = _err({"capture": {"extra_server_args": ["--port", "1"]}})
    assert "capture.extra_server_args: " in flag and "capture.extra_server_args sets --port" in flag, flag
    assert "server.extra_server_args" not in flag
    # a dotted override by the old name is read the same way
    assert "capture.dtype" in _err(**{"capture.dtype": "float8"})


def test_stream_master_names_an_existing_mooncake_master():
    cfg = load_config(data={**BASE, "stream": {"storage": "mooncake", "master": "10.0.0.5:50051",
                                               "master_metadata_port": 8081, "master_metrics_port": 9004}})
    assert cfg.stream.master_host_port == ("10.0.0.5", 50051)
    assert (cfg.stream.master_metadata_port, cfg.stream.master_metrics_port) == (8081, 9004)
    assert load_config(data={**BASE, "stream": {"storage": "mooncake"}}).stream.master_host_port is None


@pytest.mark.parametrize("value, said", [
    ("10.0.0.5", "stream.master has no ':rpc_port'"),
    ("10.0.0.5:0", "stream.master has port 0, not a TCP port (1-65535)"),
    ("10.0.0.5:65536", "stream.master has port 65536, not a TCP port (1-65535)"),
    ("10.0.0.5:rpc", "stream.master has a port that is not a number"),
    (":50051", "stream.master has a host with characters other than letters"),
    ("hunter 2:50051", "stream.master has a host with characters other than letters"),
])
def test_a_bad_stream_master_names_the_field_and_what_is_wrong(value, said):
    msg = _err({"stream": {"storage": "mooncake", "master": value}})
    assert "stream.master:" in msg and said in msg and "host:rpc_port" in msg
    assert "hunter" not in msg          # a value that is no address is never echoed (docs/safety.md)


def test_stream_master_needs_a_store_with_a_server_and_distinct_ports():
    msg = _err({"stream": {"master": "10.0.0.5:50051"}})
    assert "stream.master '10.0.0.5:50051'" in msg and "stream.storage 'disk' has no server" in msg
    msg = _err({"stream": {"storage": "mooncake", "master": "10.0.0.5:8080"}})
    assert "ports must differ" in msg and "stream.master_metadata_port 8080" in msg
    msg = _err({"stream": {"storage": "mooncake", "master": "h:5", "master_metrics_port": 70000}})
    assert "stream.master_metrics_port:" in msg and "less than or equal to 65535" in msg
