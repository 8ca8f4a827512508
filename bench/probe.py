"""Benchmark: the cost of one GPU poll over SSH, connection reused vs a fresh connection per poll.

Starts a private sshd on 127.0.0.1 (as the tests do) whose sessions find the
fake nvidia-smi first on PATH (8 GPUs, one busy), then measures in one run:

- reused: one SSHNode, SmiProbe with the node-side helper (one channel per poll);
- fresh:  a new SSHNode (new TCP + key exchange + auth) for every poll;
- reused, no helper: the two nvidia-smi queries as two channels, users unknown.

Prints the median of each and the ratios. With a real GPU here it also times
NvmlProbe against SmiProbe on this machine (no SSH).

``--node-host`` (root) polls a node in its own network namespace over a veth
link instead (tests/fixtures/node_host.py), and adds what a trigger pays per
poll with the SSH provider's async hook: one held asyncssh connection
(AsyncSSHNode) against a fresh one per poll.

    .venv/bin/python bench/probe.py --polls 20
    .venv/bin/python bench/probe.py --polls 20 --node-host
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="eagleflow-bench-airflow-"))


def timed(fn, polls: int) -> list[float]:
    out = []
    for _ in range(polls):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--polls", type=int, default=15)
    ap.add_argument("--out", default=None, help="default bench/results/probe.json (probe-node-host.json)")
    ap.add_argument("--node-host", action="store_true",
                    help="the node in its own network namespace behind a veth link (needs root)")
    a = ap.parse_args()
    a.out = a.out or str(REPO / "bench" / "results" / ("probe-node-host.json" if a.node_host else "probe.json"))

    from tests.fixtures.gpu_scenarios import fake_smi_env, gpu, proc, write_scenario
    from tests.fixtures.sshd import start_sshd

    from eagleflow.gpu.smi_probe import SmiProbe
    from eagleflow.nodes.ssh import SSHNode

    work = Path(tempfile.mkdtemp(prefix="eagleflow-bench-probe-"))
    scenario = write_scenario(work / "scenario.json", {"gpus": [gpu(i) for i in range(8)],
                                                        "processes": [proc(os.getpid(), 3, 90000, "python3", live=True)]})
    results: dict[str, float] = {}
    if a.node_host:
        from tests.fixtures.node_host import node_host
        server_cm = node_host(work / "node", fake_smi_env(scenario, sys.executable))
    else:
        server_cm = start_sshd(work / "sshd", env=fake_smi_env(scenario, sys.executable))
    where = "a node host over a veth link" if a.node_host else "127.0.0.1"
    with server_cm as server:
        os.environ["AIRFLOW_CONN_BENCH_NODE"] = server.airflow_conn()
        import logging
        logging.getLogger("paramiko").setLevel(logging.WARNING)

        node = SSHNode("bench_node", python=sys.executable)
        probe = SmiProbe(node)
        probe.snapshot()  # warm: the first call also imports Airflow's SSH hook
        reused = timed(probe.snapshot, a.polls)
        two_channels = timed(SmiProbe(node, helper=False).snapshot, a.polls)
        # the node-side time limit (timeout + group KILL wrapper) against a bare channel: what bounding costs
        bounded = timed(lambda: node.run(["true"], timeout=60), a.polls)
        unbounded = timed(lambda: node.run(["true"], timeout=None), a.polls)
        assert node.connects == 1, node.connects
        node.close()

        def fresh_poll():
            with SSHNode("bench_node", python=sys.executable) as n:
                SmiProbe(n).snapshot()
        fresh = timed(fresh_poll, a.polls)

        results = {"where": where, "polls": a.polls, "reused_median_s": statistics.median(reused),
                   "fresh_median_s": statistics.median(fresh),
                   "reused_no_helper_median_s": statistics.median(two_channels),
                   "bounded_command_median_s": statistics.median(bounded),
                   "unbounded_command_median_s": statistics.median(unbounded)}
        if a.node_host:
            results.update(async_polls(a.polls, sys.executable))
    results["fresh_over_reused"] = results["fresh_median_s"] / results["reused_median_s"]
    results["no_helper_over_helper"] = results["reused_no_helper_median_s"] / results["reused_median_s"]
    print(f"SSH poll of 8 fake GPUs on {where}, {a.polls} polls each, medians:")
    print(f"  reused connection, helper (1 channel) : {results['reused_median_s'] * 1000:7.1f} ms")
    print(f"  reused connection, 2 nvidia-smi calls : {results['reused_no_helper_median_s'] * 1000:7.1f} ms")
    print(f"  fresh connection per poll             : {results['fresh_median_s'] * 1000:7.1f} ms")
    print(f"  fresh / reused = {results['fresh_over_reused']:.2f}x;  2 calls / helper = {results['no_helper_over_helper']:.2f}x")
    results["bounded_over_unbounded"] = results["bounded_command_median_s"] / results["unbounded_command_median_s"]
    print(f"`true` with its time limit enforced on the node: {results['bounded_command_median_s'] * 1000:.1f} ms, "
          f"without: {results['unbounded_command_median_s'] * 1000:.1f} ms, "
          f"bounded / unbounded = {results['bounded_over_unbounded']:.2f}x")

    if "async_held_median_s" in results:
        results["async_fresh_over_held"] = results["async_fresh_median_s"] / results["async_held_median_s"]
        print(f"trigger-style async poll (SSHHookAsync, one `eagleflow watch`-sized command): held connection "
              f"{results['async_held_median_s'] * 1000:.1f} ms, fresh per poll {results['async_fresh_median_s'] * 1000:.1f}"
              f" ms, fresh / held = {results['async_fresh_over_held']:.2f}x")

    from eagleflow.gpu.errors import NoGpuError
    from eagleflow.gpu.nvml_probe import NvmlProbe
    from eagleflow.gpu.probes import _LocalSmiProbe
    from eagleflow.nodes import LocalNode
    try:
        nv = NvmlProbe()
        nv.snapshot()
        smi = _LocalSmiProbe(LocalNode())
        smi.snapshot()
        results["local_nvml_median_s"] = statistics.median(timed(nv.snapshot, a.polls))
        results["local_smi_median_s"] = statistics.median(timed(smi.snapshot, a.polls))
        results["smi_over_nvml"] = results["local_smi_median_s"] / results["local_nvml_median_s"]
        print(f"local, real driver: NVML {results['local_nvml_median_s'] * 1000:.1f} ms, nvidia-smi "
              f"{results['local_smi_median_s'] * 1000:.1f} ms, smi / nvml = {results['smi_over_nvml']:.1f}x")
    except NoGpuError as e:
        print(f"local NVML vs nvidia-smi: skipped, no GPU here ({str(e)[:80]}...)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=2))
    print(f"written to {a.out}")
    return 0


def async_polls(polls: int, python: str) -> dict:
    """One nvidia-smi query per poll from an event loop: AsyncSSHNode held for all polls vs one per poll."""
    import asyncio

    from eagleflow.nodes.ssh_async import AsyncSSHNode
    argv = ["nvidia-smi", "--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader,nounits"]

    async def held() -> list[float]:
        node, out = AsyncSSHNode("bench_node"), []
        await node.run(argv, timeout=30)   # the connection is opened once, before the polls
        for _ in range(polls):
            t = time.perf_counter()
            await node.run(argv, timeout=30)
            out.append(time.perf_counter() - t)
        assert node.connects == 1, node.connects
        node.close()
        return out

    async def fresh() -> list[float]:
        out = []
        for _ in range(polls):
            t = time.perf_counter()
            node = AsyncSSHNode("bench_node")
            await node.run(argv, timeout=30)
            node.close()
            out.append(time.perf_counter() - t)
        return out
    return {"async_held_median_s": statistics.median(asyncio.run(held())),
            "async_fresh_median_s": statistics.median(asyncio.run(fresh()))}


if __name__ == "__main__":
    sys.exit(main())
