"""One run of eagle3_pipeline over a fleet of two nodes: each extracts its share of the shards under its own
task group (capture server, watch), and the training node verifies every shard of both. The runs end at
verification (``THROUGH_VERIFIED``): what the fleet changes ends there, and training on verified shards is
proven by the whole runs.

The two nodes are this machine seen through two node views (one shared run root, own pid records, dump dir
and capture server): what differs between nodes in a fleet is the view, which this drives for real under
dag.test(). Storage shared: both run roots are one folder (the probe passes, nothing moves). Copied storage
(the corpus out, the shards back over SFTP) is proven where it is real, across network namespaces:
test_fleet_node_host's two-hosts run (generation and extraction shards) and its cut transfer.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.fixtures.fleet_run import manifest_ids
from tests.fixtures.pipeline_config import write_short_config
from tests.fixtures.pipeline_run import THROUGH_VERIFIED, run_pipeline


def fleet_config(tmp_path: Path, demo_assets, storage: str, **sections) -> Path:
    path = write_short_config(tmp_path, demo_assets, capture={"shards": 4}, **sections)
    cfg = yaml.safe_load(path.read_text())
    del cfg["node"]
    nodes = []
    for name in ("n1", "n2"):
        entry = {"name": name, "has_gpu": False, "state_dir": str(tmp_path / f"state-{name}"),
                 "dump_dir": str(tmp_path / f"dumps-{name}"), "gpu_slots": 1}
        if storage == "copy" and name == "n2":
            entry["run_root"] = str(tmp_path / "runs-n2")
        nodes.append(entry)
    cfg["fleet"] = {"nodes": nodes, "training_node": "n1", "storage": storage}
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_one_run_spreads_its_shards_over_two_nodes(tmp_path, airflow_db, demo_assets, monkeypatch):
    storage = "shared"
    # the target regenerates one source first: generation shard 0 on n1, 1 on n2, each with its own server
    regenerated = demo_assets["sources"][1]["name"]
    cfg_path = fleet_config(tmp_path, demo_assets, storage,
                            generate={"enabled": True, "sources": [regenerated], "shards": 2, "max_new_tokens": 4,
                                      "concurrency": 2})
    monkeypatch.setenv("EAGLEFLOW_CONFIG", str(cfg_path))   # the task groups are fixed when the DAG is parsed
    dr, states = run_pipeline(cfg_path, f"fleet-{storage}", through=THROUGH_VERIFIED)
    assert dr.state == "success", states
    assert states[("verify_hidden_states", -1)] == "success" and ("train_draft", -1) not in states
    # each node extracted its half (shards 0-1 on n1, 2-3 on n2), every shard once
    assert {k for k, v in states.items() if k[0].endswith("extract_shard") and v == "success"} == \
        {("n1.extract_shard", 0), ("n1.extract_shard", 1), ("n2.extract_shard", 0), ("n2.extract_shard", 1)}
    home = other = tmp_path / "runs" / f"fleet-{storage}"   # one run root, seen by both nodes
    # each node ran its own capture server (its info file is removed when the server stops), logged apart
    assert (other / "logs" / "n2" / "capture_server.log").is_file() and (home / "logs" / "capture_server.log").is_file()
    assert all(ti.state == "success" for ti in dr.get_task_instances() if ti.task_id.startswith("n2."))
    assert (other / "run-config.n2.json").is_file()
    assert json.loads((other / "run-config.n2.json").read_text())["node"]["name"] == "n2"
    # n2's workers logged in n2's log folder and held their locks in n2's state dir
    assert list((other / "logs" / "n2").glob("*2*")) and list((other / "logs" / "n2").glob("*3*"))
    assert (tmp_path / "state-n2" / "locks" / f"fleet-{storage}.worker_shard_00002.lock").exists()
    # and nothing of n1's ever took an n2 shard (the watch and its recovery work in n2's view too)
    assert not list((tmp_path / "state-n1" / "locks").glob(f"fleet-{storage}.*worker_shard_00002.lock"))
    # the watch of n2's shard looked in n2's state dir, and what it says (the mails' diagnosis) names n2
    looks = [json.loads(line) for line in (tmp_path / "state-n2" / "watch" /
                                           f"fleet-{storage}.worker_shard_00002.looks.jsonl").read_text().splitlines()]
    assert looks and all(" shard 2/4 on n2" in x["summary"] for x in looks if x.get("by") == "watch"), looks
    # generation: each node its own share, server and worker lock; the corpus took every generated record
    assert states[("n1.generate_responses", 0)] == states[("n2.generate_responses", 0)] == "success"
    assert (other / "logs" / "n2" / "generate_server.log").is_file() and (home / "logs" / "generate_server.log").is_file()
    assert (tmp_path / "state-n2" / "locks" / f"fleet-{storage}.generate_shard_00001.lock").exists()
    assert not (tmp_path / "state-n1" / "locks" / f"fleet-{storage}.generate_shard_00001.lock").exists()
    assert not (tmp_path / "state-n2" / "locks" / f"fleet-{storage}.generate_shard_00000.lock").exists()
    generated = manifest_ids(home, [0, 1], "generated")
    assert len(generated) == len(set(generated)) > 0
    assert (home / "generated" / "shard_00001" / "manifest.jsonl").read_bytes() == \
        (other / "generated" / "shard_00001" / "manifest.jsonl").read_bytes()
    gen_stats = json.loads((home / "generated" / "stats.json").read_text())
    assert gen_stats["complete"] and gen_stats["per_source"][regenerated]["records"] == len(generated)
    import pyarrow.parquet as pq
    rows = pq.read_table(home / "corpus" / "corpus.parquet", columns=["id", "source"]).to_pylist()
    corpus_regenerated = {r["id"] for r in rows if r["source"] == regenerated}
    # the source's rows are the target's records, from both nodes' shards (n2's: copied or shared)
    assert corpus_regenerated <= set(generated)
    assert corpus_regenerated & set(manifest_ids(home, [0], "generated"))
    assert corpus_regenerated & set(manifest_ids(other, [1], "generated"))
    stats = json.loads((home / "corpus" / "stats.json").read_text())
    ids = manifest_ids(home, range(4))   # on the training node: every shard of both nodes
    assert len(ids) == len(set(ids)) == stats["records"]   # 0 lost, 0 duplicated
    assert set(manifest_ids(other, [2, 3])) <= set(ids)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_fleet_said_to_share_storage_that_does_not_fails_that_node_and_the_run(tmp_path, airflow_db, demo_assets,
                                                                                monkeypatch):
    """storage: shared, but n2's run root is another folder: n2's probe is not found on n1, so n2's group
    fails at prepare_node naming both folders; n1's shards still run, and verification fails the run
    naming n2's missing shards (nothing trains on half the data). fleet.take_over is off: n2's shards wait
    for it (with it on, the training node would take them over: test_fleet_node_host)."""
    cfg_path = fleet_config(tmp_path, demo_assets, "copy")
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["fleet"]["storage"] = "shared"
    cfg["fleet"]["take_over"] = False
    cfg["train"]["max_steps"] = 2
    cfg_path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("EAGLEFLOW_CONFIG", str(cfg_path))
    dr, states = run_pipeline(cfg_path, "not-shared")
    assert dr.state == "failed", states
    assert states[("n2.prepare_node", -1)] == "failed"
    assert states[("n1.extract_shard", 0)] == states[("n1.extract_shard", 1)] == "success"
    assert states[("verify_hidden_states", -1)] == "failed" and states[("train_draft", -1)] != "success"
    assert states[("take_over_shards", -1)] == "success" and states.get(("take_over_shard", 0)) is None, states
    home = tmp_path / "runs" / "not-shared"
    assert manifest_ids(home, [0, 1]) and not (home / "hidden_states" / "shard_00002").exists()
