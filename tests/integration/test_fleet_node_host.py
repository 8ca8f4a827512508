"""A fleet over two network stacks: n1 is this machine (the training node), n2 the node host in its own network
namespace, reached only over the veth link and its sshd (tests/fixtures/node_host.py), with its own run root,
state dir, dump dir and fake GPUs.

One run of eagle3_pipeline under dag.test(): storage ``auto`` finds that n2's run root is not n1's (its probe
is not found on n1), so the corpus goes out to n2 over SFTP and n2's shards come back the same way; n2's GPU
gates read its fake nvidia-smi, its capture server and workers run inside its namespace, and the training
node verifies every shard of both. The GPU-gate and the partition runs end at verification
(``THROUGH_VERIFIED``): what they prove ends there. The two-hosts run is whole: n1 trains, exports and
evaluates on every shard of both.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.fixtures.gpu_scenarios import gpu, proc, write_scenario
from tests.fixtures.fleet_run import manifest_ids, stored, two_node_fleet, wait_for_stored, wait_for_watch
from tests.fixtures.node_host import node_host_fixture, record_spawns  # noqa: F401  (fixture)
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.pipeline_run import THROUGH_VERIFIED, run_pipeline

def fleet_config(tmp_path: Path, demo_assets, host, monkeypatch, idle_timeout_s: float, **sections) -> Path:
    """n1 here (training, no GPU), n2 the node host over its sshd with its own run root; 4 shards, 2 each."""
    monkeypatch.setenv("AIRFLOW_CONN_NODE_HOST_FLEET", host.airflow_conn())
    cfg_path = two_node_fleet(tmp_path, demo_assets, "node_host_fleet", idle_timeout_s=idle_timeout_s, **sections)
    monkeypatch.setenv("EAGLEFLOW_CONFIG", str(cfg_path))   # the task groups are fixed when the DAG is parsed
    return cfg_path


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_node_refusing_its_gpu_gate_hands_its_shards_to_the_training_node(tmp_path, airflow_db, demo_assets,
                                                                            node_host_fixture, monkeypatch, capfd):  # noqa: F811
    """A foreign process holds 88 GiB on n2's GPU 0: n2's gates fail naming it and nothing signals it; n1's
    shards are generated and extracted all the same. n2 is reachable and holds no lock of ours, so it hands its
    generation shard over before the corpus and its extraction shards after (marks beside their locks there),
    and the training node generates and extracts them: the run is green with every record and every sample
    once, and no worker of those shards ever ran on n2."""
    host = node_host_fixture
    scenario = host.env["FAKE_NVIDIA_SMI_SCENARIO"]
    regenerated = demo_assets["sources"][1]["name"]   # generation shard 0 is n1's, 1 n2's
    cfg_path = fleet_config(tmp_path, demo_assets, host, monkeypatch, idle_timeout_s=3,
                            generate={"enabled": True, "sources": [regenerated], "shards": 2, "max_new_tokens": 4,
                                      "concurrency": 2})
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        write_scenario(scenario, {"gpus": [gpu(0, 90000, util=0)] + [gpu(i, 3) for i in range(1, 8)],
                                  "processes": [proc(foreign.pid, 0, 89990, "python3 -m vllm.entrypoints", live=True)]})
        in_ns = record_spawns(monkeypatch, {"n2": host})["n2"]
        dr, states = run_pipeline(cfg_path, "fleet-gate", through=THROUGH_VERIFIED)
        assert foreign.poll() is None            # a gate never kills, and free_gpus only kills what we recorded
        assert dr.state == "success", states
        assert "failed" in (states.get(("n2.free_gpus", -1)), states.get(("n2.gpus_idle", -1))), states
        assert "failed" in (states.get(("n2.free_gpus_before_generation", -1)),
                            states.get(("n2.gpus_idle_before_generation", -1))), states
        assert states[("n1.generate_responses", 0)] == "success"
        assert not [k for k, v in states.items() if k[0] == "n2.generate_responses" and v == "success"]
        assert states[("take_over_generated_shard", 0)] == "success", states
        assert states[("release_generation_takeover_server", -1)] == "success", states
        assert not {"generate_shard_00001"} & in_ns, in_ns   # its generation worker never ran on n2
        assert states[("n1.extract_shard", 0)] == states[("n1.extract_shard", 1)] == "success"
        assert not [k for k, v in states.items() if k[0] == "n2.extract_shard" and v == "success"]
        assert states[("take_over_shard", 0)] == states[("take_over_shard", 1)] == "success", states
        assert states[("gpus_idle_before_takeover", -1)] == "success", states   # n1's GPUs again, first
        assert states[("release_takeover_server", -1)] == "success", states
        assert not {"worker_shard_00002", "worker_shard_00003"} & in_ns, in_ns   # never a worker of them on n2
        home = tmp_path / "runs" / "fleet-gate"
        stats = json.loads((home / "corpus" / "stats.json").read_text())
        ids = manifest_ids(home, range(4))
        assert len(ids) == len(set(ids)) == stats["records"]   # 0 lost, 0 duplicated
        assert json.loads((home / "takeover.json").read_text()) == {"shards": {"2": "n2", "3": "n2"},
                                                                     "generate_shards": {"1": "n2"}}
        for role in ("worker_shard_00002", "worker_shard_00003", "generate_shard_00001"):
            # n2 handed them over: its marks, beside the locks its workers would take
            mark = tmp_path / "state-n2" / "locks" / f"fleet-gate.{role}.handed-over"
            assert json.loads(mark.read_text())["to"] == "n1", role
        # both generation shards on the training node, each record once, the corpus built from both
        generated = manifest_ids(home, [0, 1], "generated")
        assert len(generated) == len(set(generated)) > 0
        assert json.loads((home / "generated" / "stats.json").read_text())["complete"]
        assert not (tmp_path / "runs-n2" / "fleet-gate" / "generated" / "shard_00001").exists()
        import pyarrow.parquet as pq
        rows = pq.read_table(home / "corpus" / "corpus.parquet", columns=["id", "source"]).to_pylist()
        corpus_regenerated = {r["id"] for r in rows if r["source"] == regenerated}
        assert corpus_regenerated <= set(generated)
        assert corpus_regenerated & set(manifest_ids(home, [1], "generated"))   # n2's share, generated on n1
        assert states[("verify_hidden_states", -1)] == "success" and ("train_draft", -1) not in states
        out, err = capfd.readouterr()   # dag.test() logs through structlog to stdout
        text = out + err
        assert f"pid {foreign.pid} (" in text and "python3 -m vllm.entrypoints" in text   # the gate names it
        assert "node n2 handed extract shard 2 over to n1" in text and "node n2 handed extract shard 3 over to n1" \
            in text
        assert "node n2 handed generate shard 1 over to n1" in text
    finally:
        foreign.kill()
        foreign.wait()
        write_scenario(scenario, {"gpus": [gpu(0)], "processes": []})


OUTAGE_S = 22.0   # longer than the unreachable bound (stall_after 4 + 2 x poll 1 = 6 s) plus dead-link detection


# paramiko's read-ahead thread dies with the connection and leaves a traceback: expected here
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_partition_mid_shard_and_a_cut_mid_transfer_lose_and_duplicate_nothing(tmp_path, airflow_db, demo_assets,
                                                                                 node_host_fixture, monkeypatch):  # noqa: F811
    """Two network faults of n2 in one run (n2's capture server and workers in the node host's namespace, the
    corpus out to n2 and n2's shards back to n1 over SFTP).

    n2's cable is pulled while one of its shards extracts, for longer than the unreachable bound: the watch
    mails UNREACHABLE naming the shard and n2 (never STALLED), n2's worker goes on storing, the shard completes
    in the same try once n2 answers again (REACHABLE again). Later n2's SSH connections are killed while
    collect_shards streams the third file of shard 3 (one piece of it written): that try fails (a retry mail),
    its retry continues the partial files instead of sending them again. The run is green, the training node
    holds every sample once and n2's files are identical there."""
    import hashlib
    import threading

    from eagleflow.engines.hf.server import DELAY_FILE_ENV
    from eagleflow.fleet import transfer
    from tests.fixtures.processes import kill_recorded
    from tests.fixtures.smtp import SmtpSink
    host = node_host_fixture
    write_scenario(host.env["FAKE_NVIDIA_SMI_SCENARIO"], {"gpus": [gpu(i, 3) for i in range(8)], "processes": []})
    cfg_path = fleet_config(tmp_path, demo_assets, host, monkeypatch, idle_timeout_s=30)
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["watchdog"] = {"poll_interval_s": 1.0, "stall_after_s": 4.0, "health_timeout_s": 2.0,
                       "startup_grace_s": 60.0, "alert_emails": ["oncall@example.test"],
                       "smtp_conn_id": "smtp_fleet_part"}
    cfg_path.write_text(yaml.safe_dump(cfg))
    other = tmp_path / "runs-n2" / "fleet-part"
    cut: dict = {}
    transfer_cut = cut_shard_transfer(monkeypatch, host, shard=3, nth_file=3)

    def partition():
        try:
            k = wait_for_stored(other, (2, 3), 3, done)
            if k is None or not wait_for_watch(tmp_path / "state-n2", k, done):
                return
            cut.update(shard=k, at=time.time(), stored=stored(other / "hidden_states" / f"shard_{k:05d}"))
            host.link_down()
            time.sleep(OUTAGE_S)
            cut["stored_at_restore"] = stored(other / "hidden_states" / f"shard_{k:05d}")
            host.link_up()
            cut["restored_at"] = time.time()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            cut["error"] = e

    done = threading.Event()
    # n2's forwards wait 0.7 s each (the node's sessions read this file): its shard spans the outage
    Path(host.env[DELAY_FILE_ENV]).write_text("0.7")
    thread = threading.Thread(target=partition, daemon=True)
    with SmtpSink() as smtp:
        for k, v in smtp.airflow_conn_env("smtp_fleet_part").items():
            monkeypatch.setenv(k, v)
        thread.start()
        try:
            in_ns = record_spawns(monkeypatch, {"n2": host})["n2"]
            dr, _ = run_pipeline(cfg_path, "fleet-part", through=THROUGH_VERIFIED)
        finally:
            done.set()
            thread.join(OUTAGE_S + 10)
            Path(host.env[DELAY_FILE_ENV]).write_text("")
            host.link_up()
            kill_recorded(tmp_path / "state-n2")
            kill_recorded(tmp_path / "state-n1")
    assert "error" not in cut, cut
    assert cut.get("shard") in (2, 3), "the partition never started: n2's shards finished before 3 samples?"
    tis = {(ti.task_id, ti.map_index): ti for ti in dr.get_task_instances()}
    assert dr.state == "success", {k: t.state for k, t in tis.items()}
    hit = tis[("n2.extract_shard", cut["shard"] - 2)]
    assert hit.try_number == 1, "a partition must not cost a task try"
    assert tis[("n1.extract_shard", 0)].state == tis[("n1.extract_shard", 1)].state == "success"
    assert states(tis)[("n2.gpus_idle", -1)] == "success"
    # n2's capture server and both its shard workers ran inside the node host's namespace
    assert {"capture_server", "worker_shard_00002", "worker_shard_00003"} <= in_ns, in_ns
    subjects = [m["Subject"] for m in smtp.messages]
    assert not [s for s in subjects if "STALLED" in s or "DEAD" in s or "FAILED" in s], subjects
    assert f"[eagleflow] UNREACHABLE shard {cut['shard']}/4 on n2" in subjects, subjects
    assert [s for s in subjects if s.startswith(f"[eagleflow] REACHABLE again: shard {cut['shard']}/4 on n2, ")], \
        subjects
    assert cut["stored_at_restore"] > cut["stored"], cut    # n2's worker stored on while nobody could see it
    home = tmp_path / "runs" / "fleet-part"
    # the cut: the first try of n2's collect failed, its retry continued the partial files
    assert transfer_cut.get("sessions"), f"the cut never happened (files of shard 3 seen: {transfer_cut['seen']})"
    # in 4 MiB pieces the whole file is read before the cut, the dead link reads as its end: nothing fails
    assert transfer_cut["chunk"] == 8 << 10, f"the cut was not made in 8 KiB pieces: {transfer_cut}"
    assert tis[("n2.collect_shards", -1)].try_number == 2, "the cut should have failed the first try"
    assert "[eagleflow] RETRYING task n2.collect_shards of eagle3_pipeline" in subjects, subjects
    assert not [k for k, t in tis.items() if k[0] == "take_over_shard" and t.state == "success"]  # nothing to take
    assert (other / "corpus" / "corpus.parquet").is_file()            # the corpus went out to n2
    assert not (other / "hidden_states" / "shard_00000").exists()     # n1's shards never did
    shard3 = [rep for src_dir, rep in transfer_cut["reports"] if src_dir.endswith("shard_00003")]
    assert len(shard3) == 1, transfer_cut["reports"]   # the first try's copy of shard 3 raised: no report
    sizes = sum(p.stat().st_size for p in (other / "hidden_states" / "shard_00003").glob("*.safetensors"))
    # the retry sent only what the cut try had not: the partials (two whole files and a piece) were continued
    assert shard3[0].bytes_resumed >= transfer_cut["written"] and shard3[0].bytes_copied < sizes, (shard3, sizes)
    assert not (home / "hidden_states" / "shard_00003" / transfer.PARTIAL).exists() or \
        not list((home / "hidden_states" / "shard_00003" / transfer.PARTIAL).iterdir())
    for k in (2, 3):
        src = other / "hidden_states" / f"shard_{k:05d}"
        for f in src.iterdir():
            if f.is_file() and f.name != "heartbeat.json":
                got = home / "hidden_states" / f"shard_{k:05d}" / f.name
                assert hashlib.sha256(got.read_bytes()).digest() == hashlib.sha256(f.read_bytes()).digest(), got
    stats = json.loads((home / "corpus" / "stats.json").read_text())
    ids = manifest_ids(home, range(4))
    assert len(ids) == len(set(ids)) == stats["records"]   # 0 lost, 0 duplicated, on the training node
    assert tis[("verify_hidden_states", -1)].state == "success" and ("train_draft", -1) not in tis


def states(tis: dict) -> dict:
    return {k: t.state for k, t in tis.items()}


def cut_shard_transfer(monkeypatch, host, *, shard: int, nth_file: int) -> dict:
    """Kill the node host's SSH connections once, while the fleet's copy streams the ``nth_file``-th file of
    ``shard``'s folder (one piece of it written first); copies run in 8 KiB pieces so the cut lands inside a
    file. Returns what happened: the files seen, the sessions killed, the bytes written, each copy's report."""
    from eagleflow.airflow import fleet_operators
    from eagleflow.fleet import transfer
    real_copy, real_stream = transfer.copy_dir, transfer._stream
    cut: dict = {"seen": [], "reports": []}
    tag = f"shard_{shard:05d}"

    def copy_in_small_pieces(src, src_dir, dst, dst_dir, **kw):
        kw["chunk_bytes"] = 8 << 10   # the shard files are 20-130 KB: the cut lands inside one
        rep = real_copy(src, src_dir, dst, dst_dir, **kw)
        cut["reports"].append((src_dir, rep))
        return rep

    def stream_and_cut(inp, out, chunk_bytes):
        name = str(getattr(out, "name", ""))   # n1 is local: a plain file with its path
        if "sessions" not in cut and tag in name:
            cut["seen"].append(name)
            if len(cut["seen"]) == nth_file:
                piece = inp.read(chunk_bytes)
                out.write(piece)
                cut.update(file=name, sessions=host.drop_connections(), written=len(piece), chunk=chunk_bytes)
                return len(piece) + real_stream(inp, out, chunk_bytes)   # the next read meets a dead link
        return real_stream(inp, out, chunk_bytes)

    # the operators call the copy_dir their module imported: patch that name (transfer's own for other callers)
    monkeypatch.setattr(transfer, "copy_dir", copy_in_small_pieces)
    monkeypatch.setattr(fleet_operators, "copy_dir", copy_in_small_pieces)
    monkeypatch.setattr(transfer, "_stream", stream_and_cut)
    return cut


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_one_run_over_two_node_hosts(tmp_path, airflow_db, demo_assets, node_host_fixture, monkeypatch):  # noqa: F811
    """Both nodes are node hosts, each in its own network namespace behind its own sshd with its own fake GPUs:
    n1 (host A) prepares, trains and exports; n2 (host B) extracts its half; the control plane reaches them
    only over SSH. Every sample is verified once on n1."""
    from tests.fixtures.node_host import node_host, node_host_env
    host_a = node_host_fixture
    work_b = tmp_path / "host-b"
    work_b.mkdir()
    with node_host(work_b / "node", node_host_env(work_b)) as host_b:
        for h in (host_a, host_b):
            write_scenario(h.env["FAKE_NVIDIA_SMI_SCENARIO"], {"gpus": [gpu(i, 3) for i in range(8)], "processes": []})
        assert host_a.netns != host_b.netns and host_a.node_ip != host_b.node_ip
        monkeypatch.setenv("AIRFLOW_CONN_NODE_HOST_A", host_a.airflow_conn())
        monkeypatch.setenv("AIRFLOW_CONN_NODE_HOST_B", host_b.airflow_conn())
        regenerated = demo_assets["sources"][1]["name"]   # generation shard 0 on host A, 1 on host B
        cfg_path = write_short_config(tmp_path, demo_assets, capture={"shards": 4},
                                      gpu={"probe": "smi", "poll_interval_s": 0.5, "idle_timeout_s": 30},
                                      generate={"enabled": True, "sources": [regenerated], "shards": 2,
                                                "max_new_tokens": 4, "concurrency": 2})
        cfg = yaml.safe_load(cfg_path.read_text())
        del cfg["node"]
        cfg["fleet"] = {"training_node": "n1", "storage": "auto", "nodes": [
            {"name": "n1", "conn_id": "node_host_a", "python": sys.executable, "has_gpu": True,
             "state_dir": str(tmp_path / "state-n1"), "dump_dir": str(tmp_path / "dumps-n1"), "gpu_slots": 1},
            {"name": "n2", "conn_id": "node_host_b", "python": sys.executable, "has_gpu": True,
             "state_dir": str(tmp_path / "state-n2"), "dump_dir": str(tmp_path / "dumps-n2"),
             "run_root": str(tmp_path / "runs-n2"), "gpu_slots": 1}]}
        cfg_path.write_text(yaml.safe_dump(cfg))
        monkeypatch.setenv("EAGLEFLOW_CONFIG", str(cfg_path))

        where = record_spawns(monkeypatch, {"A": host_a, "B": host_b})
        dr, states = run_pipeline(cfg_path, "two-hosts")
    assert dr.state == "success", states
    # host A: its capture server, its shards 0-1 and the trainer; host B: its server and shards 2-3, nothing else
    assert {"capture_server", "worker_shard_00000", "worker_shard_00001", "trainer"} <= where["A"], where
    assert where["B"] >= {"capture_server", "worker_shard_00002", "worker_shard_00003"}, where
    assert not {"worker_shard_00000", "worker_shard_00001", "trainer"} & where["B"], where
    home, other = tmp_path / "runs" / "two-hosts", tmp_path / "runs-n2" / "two-hosts"
    stats = json.loads((home / "corpus" / "stats.json").read_text())
    ids = manifest_ids(home, range(4))
    assert len(ids) == len(set(ids)) == stats["records"]   # 0 lost, 0 duplicated, on the training node
    assert sorted(manifest_ids(other, [2, 3])) == sorted(manifest_ids(home, [2, 3]))
    assert (other / "corpus" / "corpus.parquet").is_file()          # the corpus went out to host B
    assert not (other / "hidden_states" / "shard_00000").exists()    # n1's shards never went there
    # generation: each host its own share and server; B's shard came back to A whole, file for file
    assert {"generate_server", "generate_shard_00000"} <= where["A"] and "generate_shard_00001" not in where["A"]
    assert {"generate_server", "generate_shard_00001"} <= where["B"] and "generate_shard_00000" not in where["B"]
    assert not (other / "generated" / "shard_00000").exists()
    for f in (other / "generated" / "shard_00001").iterdir():
        if f.is_file():
            assert (home / "generated" / "shard_00001" / f.name).read_bytes() == f.read_bytes(), f.name
    generated = manifest_ids(home, [0, 1], "generated")
    assert len(generated) == len(set(generated)) > 0
    assert json.loads((home / "generated" / "stats.json").read_text())["per_source"][regenerated]["records"] == \
        len(generated)
    import pyarrow.parquet as pq
    rows = pq.read_table(home / "corpus" / "corpus.parquet", columns=["id", "source"]).to_pylist()
    corpus_regenerated = {r["id"] for r in rows if r["source"] == regenerated}
    # the source's rows are the target's records, from both hosts' shards
    assert corpus_regenerated <= set(generated)
    assert corpus_regenerated & set(manifest_ids(home, [0], "generated"))
    assert corpus_regenerated & set(manifest_ids(other, [1], "generated"))
    assert (home / "draft" / "export" / "model.safetensors").is_file()
