"""Benchmark: one run's extraction on one fleet node and on two, side by side in one run (issue 24 item 6).

The same corpus and shards run twice per round, alternating: once with the run's nodes limited to the
first (``fleet.use``: every shard assigned to it) and once over both (``eagleflow.fleet.assign`` shares
them out by GPU slots). Each node is what the pipeline makes of it: its own view of the frozen config
(``run-config.<node>.json``), its own detached capture server (``capture_server.<node>.json``, its own
dump dir and state dir) and a pool of ``gpu_slots`` workers (``eagleflow capture run`` processes, one per
shard), the pool the node's Airflow pool would allow. The forward's time is spent waiting
(``EAGLEFLOW_HF_SERVER_FORWARD_DELAY_S`` sleeps inside it, under the server's one-forward lock, as one
node's GPUs are one resource), not on the two shared cores, so two nodes can be twice as fast.

Prints the wall-time ratio one node / two nodes (goal >= 1.8) and the scheduling overhead per shard:
the wall time beyond the busiest node's forward time (its samples x the delay), per shard run after
another on one slot of that node (worker start, corpus read, resume scan, manifest, exit).
Not Airflow's own scheduling: tests/integration/test_fleet_pipeline.py drives the DAG.

    .venv/bin/python bench/fleet.py [--samples 160] [--shards 8] [--slots 2] [--delay 0.25] [--rounds 2]
                                    [--json bench/results/fleet.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "include"))

NODES = ("n1", "n2")


def fleet_yaml(root: Path, model_dir: Path, shards: int, slots: int) -> dict:
    return {"run_root": str(root / "runs"), "target_model": str(model_dir),
            "server": {"port": 0},
            "capture": {"backend": "hf", "shards": shards, "in_flight": 2, "heartbeat_interval_s": 1.0},
            "fleet": {"training_node": NODES[0], "storage": "shared",
                      "nodes": [{"name": n, "has_gpu": False, "state_dir": str(root / f"state-{n}"),
                                 "dump_dir": f"/dev/shm/eagleflow-bench-fleet-{os.getpid()}-{n}",
                                 "gpu_slots": slots} for n in NODES]}}


def run_once(root: Path, cfg_path: Path, corpus: Path, run_id: str, nodes: list[str], slots: int) -> dict:
    """One run over ``nodes``: each node's server, then its shards through a pool of its GPU slots."""
    import shutil

    import yaml

    from eagleflow.phases.extract.lifecycle import start_capture_server, stop_capture_server, wait_capture_server_ready
    from eagleflow.local_run import LocalRun
    from eagleflow.config import load_config
    from eagleflow.fleet.assign import run_assignment
    from eagleflow.layout import RunLayout

    data = yaml.safe_load(cfg_path.read_text())
    data["fleet"]["use"] = nodes
    run_cfg = root / f"{run_id}.yaml"
    run_cfg.write_text(yaml.safe_dump(data))
    cfg = load_config(run_cfg)
    plan = run_assignment(cfg)
    lay = RunLayout.for_run(cfg, run_id)
    Path(lay.corpus_dir).mkdir(parents=True, exist_ok=True)
    shutil.copy(corpus, Path(lay.corpus_dir) / corpus.name)
    ctxs = {}
    for name in nodes:                       # each node's frozen view, as prepare_node writes it
        view = cfg.node_view(name)
        vl = RunLayout.for_run(view, run_id)
        Path(vl.run_config_file).write_text(json.dumps(view.model_dump(mode="json")))
        ctxs[name] = LocalRun(cfg=load_config(str(vl.run_config_file)), layout=vl, config_path=str(vl.run_config_file))
    try:
        for c in ctxs.values():
            start_capture_server(c)
        urls = {}
        for name, c in ctxs.items():
            wait_capture_server_ready(c, timeout_s=300, poll_s=0.2)
            urls[name] = json.loads(Path(c.layout.server_info_file).read_text())["url"]

        def shard(name: str, k: int) -> float:
            c = ctxs[name]
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "run", "--config", c.config_path,
                                  "--run-id", run_id, "--shard", str(k), "--url", urls[name]],
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "include")})
            if res.returncode != 0:
                raise SystemExit(f"node {name} shard {k} failed: {res.stderr[-2000:]}")
            return time.perf_counter() - t0

        pools = {name: ThreadPoolExecutor(max_workers=slots) for name in nodes}
        t0 = time.perf_counter()
        futures = [(name, k, pools[name].submit(shard, name, k)) for name in nodes for k in plan.get(name, [])]
        per_shard = {k: f.result() for _, k, f in futures}
        wall = time.perf_counter() - t0
        for p in pools.values():
            p.shutdown()
    finally:
        for c in ctxs.values():
            stop_capture_server(c, grace_s=10)
    ids, per_node = [], {}
    for name in nodes:
        for k in plan.get(name, []):
            # every line, not the reader's by-index view: a duplicate must count
            lines = (Path(lay.shard_dir(k)) / "manifest.jsonl").read_text().splitlines()
            shard_ids = [json.loads(line)["id"] for line in lines if line.strip()]
            ids += shard_ids
            per_node[name] = per_node.get(name, 0) + len(shard_ids)
    return {"nodes": nodes, "plan": plan, "wall_s": wall, "samples": len(ids), "distinct": len(set(ids)),
            "samples_per_node": per_node, "shard_s": per_shard}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2, help="GPU slots per node (its pool's size)")
    ap.add_argument("--delay", type=float, default=0.25, help="seconds each forward waits")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from bench.capture import build_model
    from eagleflow.engines.hf.server import DELAY_ENV
    from tests.fixtures.capture_corpus import write_corpus

    import yaml

    os.environ[DELAY_ENV] = str(a.delay)     # the servers inherit it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="eagleflow-bench-fleet-") as tmp:
        root = Path(tmp)
        build_model(root / "model", 64, 8, vocab=512)
        corpus = root / "corpus.parquet"
        write_corpus(corpus, a.samples, 512, seed=3, min_len=16, max_len=48)
        cfg_path = root / "fleet.yaml"
        cfg_path.write_text(yaml.safe_dump(fleet_yaml(root, root / "model", a.shards, a.slots)))
        rounds = []
        for r in range(a.rounds):           # alternate: the shared machine's load drifts between rounds
            one = run_once(root, cfg_path, corpus, f"one{r}", list(NODES[:1]), a.slots)
            two = run_once(root, cfg_path, corpus, f"two{r}", list(NODES), a.slots)
            for res in (one, two):
                if res["samples"] != a.samples or res["distinct"] != a.samples:
                    raise SystemExit(f"{res['nodes']}: {res['samples']} samples, {res['distinct']} distinct, "
                                     f"expected {a.samples}: lost or duplicated")
            rounds.append({"one": one, "two": two, "ratio": one["wall_s"] / two["wall_s"]})

    def overhead(res: dict) -> float:
        # beyond the busiest node's forward time, per shard that ran after another on one of its slots
        busiest = max(res["samples_per_node"], key=res["samples_per_node"].get)
        waves = len(res["plan"][busiest]) / a.slots
        return (res["wall_s"] - res["samples_per_node"][busiest] * a.delay) / waves

    ratios = sorted(x["ratio"] for x in rounds)
    out = {"samples": a.samples, "shards": a.shards, "slots_per_node": a.slots, "forward_delay_s": a.delay,
           "rounds": rounds, "ratios": ratios, "ratio": statistics.median(ratios),
           "overhead_per_shard_s": {"one": [overhead(x["one"]) for x in rounds],
                                    "two": [overhead(x["two"]) for x in rounds]}}
    for i, x in enumerate(rounds):
        print(f"round {i}: one node {x['one']['wall_s']:.1f} s, two nodes {x['two']['wall_s']:.1f} s "
              f"(plan {x['two']['plan']}): ratio {x['ratio']:.2f}")
    print(f"wall-time ratio one node / two nodes: {out['ratio']:.2f} (goal >= 1.8), every sample stored once")
    print("scheduling overhead per shard: one node "
          + ", ".join(f"{v:.2f}" for v in out["overhead_per_shard_s"]["one"]) + " s; two nodes "
          + ", ".join(f"{v:.2f}" for v in out["overhead_per_shard_s"]["two"]) + " s")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
