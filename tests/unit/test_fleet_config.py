"""The fleet in the config: complete node entries, each node's view, the shard assignment, the DAG's groups."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagleflow.config import ConfigError, load_config
from eagleflow.fleet.assign import assign_shards, run_assignment, shards_of
from eagleflow.layout import RunLayout

REPO = Path(__file__).resolve().parents[2]


def fleet_cfg(**fleet):
    fleet.setdefault("nodes", [{"name": "a", "gpu_slots": 8, "conn_id": "node_a"},
                               {"name": "b", "gpu_slots": 4, "conn_id": "node_b", "run_root": "/rb",
                                "gpus": ["1", "2"]}])
    return load_config(data={"target_model": "/m", "run_root": "/ra", "capture": {"shards": 6},
                             "server": {"dump_dir": "/d"},
                             "fleet": fleet})


def test_shards_go_in_proportion_to_gpu_slots_and_every_shard_once():
    assert assign_shards(6, {"a": 8, "b": 4}) == {"a": [0, 1, 2, 3], "b": [4, 5]}
    assert assign_shards(3, {"a": 1, "b": 1}) == {"a": [0, 1], "b": [2]}   # tie: the earlier node
    assert assign_shards(1, {"a": 1, "b": 1, "c": 1}) == {"a": [0], "b": [], "c": []}
    for n in range(0, 40):
        plan = assign_shards(n, {"x": 3, "y": 5, "z": 1})
        got = sorted(s for shards in plan.values() for s in shards)
        assert got == list(range(n))
        assert abs(len(plan["y"]) - n * 5 / 9) < 1
    with pytest.raises(ValueError, match="at least 1 GPU slot"):
        assign_shards(4, {"a": 0})


def test_a_fleet_node_entry_is_completed_and_the_top_level_is_the_training_node():
    cfg = fleet_cfg()
    assert cfg.fleet.training_node == "a" and cfg.node.name == "a" and cfg.node.conn_id == "node_a"
    a, b = cfg.fleet.nodes
    assert (a.run_root, a.dump_dir, a.gpus) == ("/ra", "/d", [])
    assert b.state_dir == "/rb/.node-state/b"   # per node: nodes that share a run root never share records
    view = cfg.node_view("b")
    assert (view.node.name, view.node.conn_id, view.run_root, view.gpu.select) == ("b", "node_b", "/rb", ["1", "2"])
    assert str(view.node_state_dir()) == "/rb/.node-state/b"
    # the frozen form (what write_run_config stores) loads to the same views
    again = load_config(data=cfg.model_dump(mode="json"))
    assert again.node.name == "a" and again.node_view("b").run_root == "/rb"
    # a node's own frozen view (run-config.b.json) loads as that node's view, not the training node's
    b_again = load_config(data=view.model_dump(mode="json"))
    assert (b_again.node.name, b_again.run_root, str(b_again.node_state_dir())) == ("b", "/rb", "/rb/.node-state/b")
    assert run_assignment(cfg) == {"a": [0, 1, 2, 3], "b": [4, 5]} and shards_of(view, "b") == [4, 5]


def test_the_fleet_is_resolved_as_data_before_validation_never_written_into_a_validated_config():
    """No validator changes a config after validation (issue 39: the old one wrote the node view into
    ``__dict__``): the input is left as it was, each view is a config of its own that dumps and validates back to
    itself, and asking for one view leaves the config it came from as it was."""
    import ast
    import copy
    data = {"target_model": "/m", "run_root": "/ra", "server": {"dump_dir": "/d"},
            "fleet": {"nodes": [{"name": "a", "conn_id": "node_a"}, {"name": "b", "run_root": "/rb"}]}}
    before = copy.deepcopy(data)
    cfg = load_config(data=data)
    assert data == before
    training = cfg.model_dump()
    view = cfg.node_view("b")
    assert cfg.model_dump() == training and view is not cfg
    for c in (cfg, view):
        assert type(c).model_validate(c.model_dump()).model_dump() == c.model_dump()
    assert (view.node.name, view.run_root, view.server.dump_dir) == ("b", "/rb", "/d")
    source = (REPO / "include" / "eagleflow" / "config.py").read_text()
    writes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Subscript)
              and isinstance(n.value, ast.Attribute) and n.value.attr == "__dict__"]
    assert not writes, "a validator writes __dict__ again"


def test_generation_shards_are_shared_out_by_the_same_rule_only_when_generation_is_on():
    off = fleet_cfg()
    assert run_assignment(off, "generate") == {"a": [], "b": []}
    data = off.model_dump(mode="json")
    data["generate"] = {**data["generate"], "enabled": True, "shards": 3}
    on = load_config(data=data)
    assert run_assignment(on, "generate") == {"a": [0, 1], "b": [2]}
    assert shards_of(on.node_view("b"), "b", "generate") == [2]
    assert run_assignment(on) == {"a": [0, 1, 2, 3], "b": [4, 5]}   # extraction unchanged
    with pytest.raises(ValueError, match="phase 'train'"):
        run_assignment(on, "train")


def test_node_files_carry_the_node_name_off_the_training_node():
    cfg = fleet_cfg(nodes=[{"name": "a"}, {"name": "b"}])   # one run root: the nodes share it
    home, other = RunLayout.for_run(cfg, "r1"), RunLayout.for_run(cfg.node_view("b"), "r1")
    assert home.run_dir == other.run_dir
    assert home.run_config_file.name == "run-config.json" and other.run_config_file.name == "run-config.b.json"
    assert home.server_info_file != other.server_info_file and home.logs_dir != other.logs_dir
    # each node runs its own generation server, in the one run dir
    assert home.generate_server_info_file != other.generate_server_info_file
    assert home.generate_shard_dir(1) == other.generate_shard_dir(1)
    assert home.pids_dir != other.pids_dir and home.shard_dir(3) == other.shard_dir(3)


def test_fleet_nodes_a_run_may_use():
    cfg = fleet_cfg(use=["a"])
    assert [n.name for n in cfg.nodes_in_use()] == ["a"] and run_assignment(cfg) == {"a": list(range(6))}
    with pytest.raises(ConfigError, match="leaves out the training node 'a'"):
        fleet_cfg(use=["b"])
    with pytest.raises(ConfigError, match="'c', not in fleet.nodes"):
        fleet_cfg(use=["a", "c"])


@pytest.mark.parametrize("fleet, message", [
    ({"nodes": [{"name": "a"}, {"name": "a"}]}, "repeated: a"),
    ({"nodes": [{"name": "a"}, {"name": "b/c"}]}, "not 'b/c'"),
    ({"nodes": [{"name": "a"}], "training_node": "z"}, "training_node 'z' is not one of fleet.nodes"),
    ({"nodes": [{"name": "a", "gpu_slots": 0}]}, "gpu_slots"),
])
def test_a_bad_fleet_is_named(fleet, message):
    with pytest.raises(ConfigError, match=message):
        load_config(data={"target_model": "/m", "fleet": fleet})


def test_without_a_fleet_one_node_takes_every_shard():
    cfg = load_config(data={"target_model": "/m", "capture": {"shards": 3}, "node": {"name": "solo"}})
    assert cfg.fleet_node_names() == ["solo"] and not cfg.is_fleet
    assert run_assignment(cfg) == {"solo": [0, 1, 2]}
    assert RunLayout.for_run(cfg, "r").run_config_file.name == "run-config.json"


def test_the_dag_parses_one_task_group_per_fleet_node_on_its_queue_and_pool(tmp_path):
    """Parsed in a fresh interpreter with $EAGLEFLOW_CONFIG = the shipped two-node example."""
    code = (
        "from airflow.dag_processing.dagbag import DagBag\n"
        "b = DagBag(dag_folder='dags/eagle3_pipeline.py')\n"
        "assert not b.import_errors, b.import_errors\n"
        "d = b.dags['eagle3_pipeline']\n"
        "import json\n"
        "out = {t.task_id: [t.queue, t.pool, (t.partial_kwargs if hasattr(t, 'partial_kwargs') else "
        "vars(t)).get('fleet_node'), sorted(t.upstream_task_ids)] for t in d.tasks}\n"
        "out['_param'] = d.params.get_param('fleet_nodes').schema['items']['enum']\n"
        "from eagleflow.config import load_config\n"
        "from eagleflow.airflow.routing import routing_mismatches\n"
        "out['_mismatches'] = routing_mismatches(d, load_config('configs/fleet.example.yaml'))\n"
        "print(json.dumps(out))\n")
    env = {"PATH": "/usr/bin:/bin", "AIRFLOW_HOME": str(tmp_path), "EAGLEFLOW_HOME": str(REPO),
           "EAGLEFLOW_CONFIG": "configs/fleet.example.yaml", "PYTHONPATH": str(REPO / "include")}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    import json
    tasks = json.loads(res.stdout.strip().splitlines()[-1])
    assert tasks.pop("_param") == ["gpu-node-1", "gpu-node-2"]
    assert tasks.pop("_mismatches") == []   # the run's first task accepts a run of the config the DAG was parsed with
    for node in ("gpu-node-1", "gpu-node-2"):
        assert tasks[f"{node}.extract_shard"][:3] == [node, node, node]
        assert tasks[f"{node}.gpus_idle"][:3] == [node, node, node]
        assert tasks[f"{node}.prepare_node"][3] == ["write_run_config"]
        # each node generates its share behind its own gates, on its queue and pool
        assert tasks[f"{node}.generate_responses"][:3] == [node, node, node]
        assert tasks[f"{node}.gpus_idle_before_generation"][:2] == [node, node]
        assert tasks[f"{node}.free_gpus_before_generation"][3] == [f"{node}.prepare_node"]
    assert "gpu-node-1.collect_shards" not in tasks and "gpu-node-2.capture_held_out" not in tasks
    assert "gpu-node-1.collect_generated" not in tasks and "gpu-node-1.receive_corpus" not in tasks
    # the corpus waits for every node's generation (n2's copied back) and for the generation shards the
    # training node took over; n2's capture for the corpus
    assert set(tasks["prepare_corpus"][3]) == {"gpu-node-1.generate_responses", "gpu-node-1.free_gpus_after_generation",
                                               "gpu-node-2.collect_generated", "release_generation_takeover_server"}
    assert set(tasks["take_over_generated"][3]) == {"gpu-node-1.generate_responses",
                                                    "gpu-node-1.free_gpus_after_generation",
                                                    "gpu-node-2.collect_generated"}
    assert tasks["take_over_generated_shard"][:2] == ["gpu-node-1", "gpu-node-1"]
    assert tasks["gpus_idle_before_generation_takeover"][3] == ["take_over_generated"]
    assert set(tasks["gpu-node-2.collect_generated"][3]) == {"gpu-node-2.generate_responses",
                                                             "gpu-node-2.free_gpus_after_generation"}
    assert set(tasks["gpu-node-2.receive_corpus"][3]) == {"check_disk", "gpu-node-2.prepare_node"}
    assert set(tasks["gpu-node-2.free_gpus"][3]) == {"gpu-node-2.receive_corpus"}
    assert set(tasks["gpu-node-1.free_gpus"][3]) == {"check_disk", "gpu-node-1.prepare_node"}
    assert tasks["train_draft"][:2] == ["gpu-node-1", "gpu-node-1"]
    assert set(tasks["verify_hidden_states"][3]) == {"gpu-node-1.extract_shard", "gpu-node-2.extract_shard",
                                                      "gpu-node-2.collect_shards", "release_takeover_server"}
    # the takeover looks once every node's group is done, on the training node's queue
    assert set(tasks["take_over_shards"][3]) >= {"gpu-node-2.collect_shards", "gpu-node-2.free_gpus_after_capture",
                                                 "gpu-node-1.free_gpus_after_capture"}
    assert tasks["take_over_shard"][:2] == ["gpu-node-1", "gpu-node-1"]


def test_a_run_whose_fleet_differs_from_the_parsed_dag_is_refused():
    from types import SimpleNamespace

    from eagleflow.airflow.routing import routing_mismatches

    def task(tid, queue, pool, node):
        return SimpleNamespace(task_id=tid, queue=queue, pool=pool, fleet_node=node)

    cfg = fleet_cfg(nodes=[{"name": "a", "queue": "qa", "pool": "pa"}, {"name": "b", "queue": "qb", "pool": "pb"}])
    fits = SimpleNamespace(tasks=[task("train_draft", "qa", "pa", None), task("b.extract_shard", "qb", "pb", "b")])
    assert routing_mismatches(fits, cfg) == []
    wrong_queue = SimpleNamespace(tasks=[task("train_draft", "qa", "pa", None), task("b.extract_shard", "qa", "pb", "b")])
    assert routing_mismatches(wrong_queue, cfg) == \
        ["task b.extract_shard runs on queue 'qa', the run's node.queue is 'qb'"]
    no_group = SimpleNamespace(tasks=[task("train_draft", "qa", "pa", None)])
    assert routing_mismatches(no_group, cfg) == ["the run's fleet has node 'b', for which this DAG has no tasks"]
    foreign = SimpleNamespace(tasks=[task("c.extract_shard", "qc", "pc", "c"), task("b.x", "qb", "pb", "b")])
    assert "talks to node 'c', which the run's fleet lacks (a, b)" in routing_mismatches(foreign, cfg)[0]


def test_reconcile_on_a_fleet_node_looks_only_at_its_own_shards(tmp_path):
    from types import SimpleNamespace

    from eagleflow.phases import EXTRACT
    from eagleflow.watchdog.reconcile import claim, own_shards
    cfg = fleet_cfg()   # a: shards 0-3, b: 4-5
    run = SimpleNamespace(cfg=cfg, layout=RunLayout.for_run(cfg, "r1"))
    assert own_shards(run, EXTRACT) == [0, 1, 2, 3]
    other = SimpleNamespace(cfg=cfg.node_view("b"), layout=RunLayout.for_run(cfg.node_view("b"), "r1"))
    assert own_shards(other, EXTRACT) == [4, 5]
    got = claim(run, 5, log=lambda *a: None)
    assert got["action"] == "skipped" and "belongs to another fleet node" in got["reason"]


def test_each_nodes_route_says_what_its_place_in_the_fleet_makes_of_its_tasks():
    """The DAG's node wiring reads these (one declared source), never the fleet's size or the config."""
    from eagleflow.airflow.routing import fleet_routing
    alone = fleet_routing(str(REPO / "configs" / "local-demo.yaml"))
    (node,) = alone.nodes
    assert not alone.grouped and alone.training is node and node.training
    assert (node.prefix, node.fleet_node, node.ships_to_training) == ("", None, False)
    from airflow.sdk import DAG
    fleet = fleet_routing(str(REPO / "configs" / "fleet.example.yaml"))
    assert fleet.grouped and len(fleet.nodes) >= 2
    with DAG("routes"):
        for route in fleet:
            assert route.prefix == f"{route.name}." and route.fleet_node == route.name
            assert route.ships_to_training is not route.training
            with route.task_group() as group:
                assert group.group_id == route.name and group.default_args["fleet_node"] == route.name
    assert [r.name for r in fleet if r.training] == [fleet.training.name]
