"""Stall detection, mail and recovery latency, and false alarms on slow-but-healthy runs, in one run.

Fault cases (a real extraction: hf capture server with a tiny local model and the CLI worker, both
detached as in production, watched by the real ShardWatchTrigger, which recovers in the watch):

    frozen-server   SIGSTOP the capture server
    frozen-worker   SIGSTOP the shard's worker
    killed-worker   SIGKILL the worker
    killed-server   SIGKILL the capture server
    hung-generate   /generate hangs while /health_generate answers (EAGLEFLOW_HF_SERVER_HANG_FILE)

For each: detection = the watch's verdict - the fault; mail = the incident mail received by a local
SMTP server (aiosmtpd) - the fault; recovery = the first sample stored after the fault - the fault.

Slow-but-healthy cases run at the same time, each on its own server, watched without recovery, on a
fake GPU node (fake nvidia-smi: 8 GPUs holding 90 GB, busy in bursts, 45 % duty): per-forward delays
of 10, 20 and 30 s, and a duty-cycled server (alternating 60 s at 0.05 s and 60 s at 20 s per
forward); and two on a CPU node (no GPU signal at all): 16 s per forward, and duty-cycled 0.05 s / 16 s.
Every event that is not "complete" is a false alarm; reported per hour of watched run.

    .venv/bin/python bench/stall.py --real-defaults --slow-s 600   # poll 20, stall_after 15, health 20
    .venv/bin/python bench/stall.py --cycles 1 --slow-s 120        # same with --poll-s ... to taste

The same five faults hit a generation shard too (``--generation-faults``; the hf server in serving mode and
the CLI generation worker, watched by the same trigger with ``phase=generate`` and recovered in the watch
the same way): detection, mail, and recovery = the first record stored after the fault. Its source is
written here (the demo's generator, 2,000 records) so the shard outlasts every fault.

``--node-host`` (root) runs the fault cases on a node of its own (a network namespace behind a veth
link and a real sshd, tests/fixtures/node_host.py): the server and worker are started, watched and
recovered over SSH (the watch on one held asyncssh connection), the faults are injected there. It
adds the ``partition`` case: the link goes down mid-shard for ``--outage-s``; the watch must say
UNREACHABLE (not stalled), mail once and restart nothing; after the link is back it watches the
shard to completion, which must hold every sample exactly once. (The slow-but-healthy cases need
a per-server environment and run only locally.)

    .venv/bin/python bench/stall.py --node-host --real-defaults --slow-cases ''
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagleflow.airflow.runtime import RunContext  # noqa: E402
from eagleflow.airflow.shard_watch import ShardWatchTrigger  # noqa: E402
from eagleflow.engines.hf.server import DELAY_ENV, DELAY_FILE_ENV, HANG_FILE_ENV  # noqa: E402
from eagleflow.local_run import LocalRun
from eagleflow.config import load_config  # noqa: E402
from eagleflow.demo_assets import ensure_demo_assets, write_demo_sources  # noqa: E402
from eagleflow.phases import EXTRACT, GENERATE, KINDS, ShardKind  # noqa: E402
from eagleflow.heartbeat import Heartbeat  # noqa: E402
from eagleflow.layout import RunLayout  # noqa: E402
from eagleflow.watchdog.recovery import recover_after_stall  # noqa: E402
from tests.fixtures.capture_corpus import write_corpus  # noqa: E402
from tests.fixtures.gpu_scenarios import fake_smi_env, gpu, write_scenario  # noqa: E402
from tests.fixtures.smtp import SmtpSink  # noqa: E402

FAULTS = ["frozen-server", "frozen-worker", "killed-worker", "killed-server", "hung-generate"]
NODE: dict = {}   # node section overrides: the node host's SSH connection in --node-host mode


def extract_config(root: Path, model: str, run_id: str, watch: dict, has_gpu: bool = False) -> dict:
    """An extraction run's config: one shard, the hf capture server, two samples in flight; folders under
    ``root``. Its corpus is written apart (``write_corpus``): no source is read."""
    return {"run_root": str(root / "runs"), "target_model": model,
            "node": {"name": "bench-node", "has_gpu": has_gpu, "state_dir": str(root / "state"), **NODE},
            "gpu": {"probe": "smi"},
            "server": {"port": 0, "dump_dir": str(root / "dumps" / run_id), "ready_timeout_s": 180},
            "capture": {"backend": "hf", "shards": 1, "in_flight": 2, "heartbeat_interval_s": 2.0,
                        "request_timeout_base_s": 600},
            "watchdog": watch}


def make_run(root: Path, model: str, run_id: str, watch: dict, n: int, has_gpu: bool = False) -> LocalRun:
    data = extract_config(root, model, run_id, watch, has_gpu)
    cfgp = root / f"{run_id}.json"
    cfgp.write_text(json.dumps(data))
    cfg = load_config(cfgp)
    layout = RunLayout.for_run(cfg, run_id)
    RunContext(cfg=cfg, layout=layout).write_run_config()
    write_corpus(Path(str(layout.corpus_dir)) / "corpus.parquet", n, 300, seed=1)
    return LocalRun(cfg=cfg, layout=layout, config_path=str(layout.run_dir / "run-config.json"))


def generate_config(root: Path, model: str, watch: dict, n: int = 2000, shards: int = 1,
                    name: str = "generate") -> dict:
    """A generation run's config over a source of ``n`` demo records (the demo's own generator, its tokenizer's
    words) split into ``shards``, in the tiny target's serving mode: 16 new tokens a turn, two records in flight;
    its folders under ``root`` (``name`` tells runs sharing a root apart)."""
    sources = write_demo_sources(root / f"{name}-sources", n_per_source=n, seed=11)
    src = next(x for x in sources if x["name"] == "openai")
    return {"run_root": str(root / "runs"), "target_model": model,
            "node": {"name": "bench-node", "has_gpu": False, "state_dir": str(root / "state"), **NODE},
            "gpu": {"probe": "smi"},
            "corpus": {"sources": [src], "seed": 1, "max_length": 512},
            "server": {"port": 0, "dump_dir": str(root / "dumps" / name), "ready_timeout_s": 180},
            "capture": {"backend": "hf", "heartbeat_interval_s": 2.0},
            "generate": {"enabled": True, "shards": shards, "max_new_tokens": 16, "concurrency": 2},
            "watchdog": watch}


def make_generate_run(root: Path, model: str, watch: dict, n: int = 2000) -> LocalRun:
    """A generation run of one shard (``generate_config``), its run config written as the operators write it."""
    data = generate_config(root, model, watch, n)
    cfgp = root / "generate.json"
    cfgp.write_text(json.dumps(data))
    cfg = load_config(cfgp)
    layout = RunLayout.for_run(cfg, "generate-faults")
    RunContext(cfg=cfg, layout=layout).write_run_config()
    return LocalRun(cfg=cfg, layout=layout, config_path=str(layout.run_dir / "run-config.json"))


async def first_event(run: LocalRun, timeout_s: float, recoveries: int, phase: str = EXTRACT) -> dict:
    agen = ShardWatchTrigger(RunContext(cfg=run.cfg, layout=run.layout).serialize(), 0,
                             recoveries_left=recoveries, phase=phase).run()
    try:
        return (await asyncio.wait_for(agen.__anext__(), timeout_s)).payload
    finally:
        await agen.aclose()


def heartbeat(run: LocalRun, kind: ShardKind = KINDS[EXTRACT]) -> Heartbeat | None:
    try:
        return Heartbeat.read(str(kind.heartbeat_file(run.layout, 0)))
    except (ValueError, TypeError, KeyError):
        return None


def stored(run: LocalRun, kind: ShardKind = KINDS[EXTRACT]) -> int:
    """Shard 0's manifest lines: samples stored (extraction) or records finished (generation)."""
    p = Path(str(kind.shard_dir(run.layout, 0))) / "manifest.jsonl"
    return sum(1 for line in p.read_text().splitlines() if line.strip().endswith("}")) if p.exists() else 0


def pid_of(run: LocalRun, role: str) -> int:
    return json.loads(Path(str(run.layout.pid_file(role))).read_text())["pid"]


def start(run: LocalRun, env: dict[str, str], kind: ShardKind = KINDS[EXTRACT]) -> None:
    """The phase's server and shard 0's detached worker, through the phase's own lifecycle (as its operators and
    the recovery start them), with ``env`` added for them."""
    life = kind.lifecycle()
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        life.start_server(run)
        life.wait_server_ready(run, timeout_s=180, poll_s=0.5)
        life.start_worker(run, 0)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stop(run: LocalRun, kind: ShardKind = KINDS[EXTRACT]) -> None:
    for role in (kind.worker_role(0), kind.server_role):
        try:
            os.killpg(pid_of(run, role), signal.SIGCONT)
        except (OSError, ValueError):
            pass
    run.node.stop_recorded(str(run.layout.pid_file(kind.worker_role(0))), grace_s=3)
    kind.lifecycle().stop_server(run, grace_s=3)


def wait_for(pred, timeout_s: float, what: str) -> float:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)
    return time.time()


def mail(smtp: SmtpSink, event: dict, task_id: str = "extract_shard") -> None:
    """The incident mail through the operator's own path (EagleflowNotifier, the SMTP provider) to real SMTP."""
    from types import SimpleNamespace

    from eagleflow.airflow.alerts import Recipients, send_mail, stall_mail
    os.environ.update(smtp.airflow_conn_env("smtp_bench"))
    ti = SimpleNamespace(dag_id="bench_stall", run_id="bench", task_id=task_id, map_index=0, try_number=1)
    context = {"ti": ti, "run_id": ti.run_id}
    send_mail(context, stall_mail(context, event, Recipients(("oncall@bench.test",), "smtp_bench",
                                                             "http://localhost:8080")))


def fault_cycle(run: LocalRun, fault: str, hang_file: Path, smtp: SmtpSink, bound: float,
                kind: ShardKind = KINDS[EXTRACT]) -> dict:
    wait_for(lambda: (heartbeat(run, kind) or Heartbeat(job="", pid=0)).state == "running"
             and stored(run, kind) >= 1, 180, f"the worker to store a {kind.unit[:-1]}")
    time.sleep(3)  # some pace history
    result: dict = {"fault": fault, "phase": kind.phase}
    server, worker = kind.server_role, kind.worker_role(0)

    async def cycle() -> dict:
        watch = asyncio.create_task(first_event(run, bound * 3 + 240, recoveries=1, phase=kind.phase))
        await asyncio.sleep(1.0)
        before = stored(run, kind)
        if fault == "frozen-server":
            os.kill(pid_of(run, server), signal.SIGSTOP)
        elif fault == "frozen-worker":
            os.kill(pid_of(run, worker), signal.SIGSTOP)
        elif fault == "killed-worker":
            os.kill(pid_of(run, worker), signal.SIGKILL)
        elif fault == "killed-server":
            os.kill(pid_of(run, server), signal.SIGKILL)
        elif fault == "hung-generate":
            hang_file.write_text("hang")
        result["t_fault"] = time.time()
        result["stored_at_fault"] = before
        return await watch

    n_mails = len(smtp.messages)
    ev = asyncio.run(cycle())
    hang_file.unlink(missing_ok=True)
    t0 = result["t_fault"]
    result["verdict"] = ev.get("verdict", ev.get("status"))
    result["status"] = ev.get("status")
    result["cause"] = ev.get("cause")
    result["detect_s"] = ev.get("detected_at", time.time()) - t0
    result["headline"] = (ev.get("diagnosis") or "").splitlines()[0][:400]
    if ev.get("status") == "recovering":
        # what the ShardOperator does with this event: mail (this shard opened the incident), then recover
        base = ev_stored(ev)
        if (ev.get("incident") or {}).get("opened"):
            mail(smtp, ev, task_id=kind.shard_task)
            wait_for(lambda: len(smtp.messages) > n_mails, 30, "the mail")
            result["mail_s"] = smtp.received_at[-1] - t0
            result["subject"] = smtp.messages[-1]["Subject"]
        rec = recover_after_stall(RunContext(cfg=run.cfg, layout=run.layout), 0, ev, lambda m: None, kind=kind)
        result["recovery"] = rec.get("summary", "")
        # the first sample (record) stored after the fault, by the recovered server/worker
        t_new = wait_for(lambda: stored(run, kind) > max(result["stored_at_fault"], base), 240,
                         f"the first new {kind.unit[:-1]}")
        result["recover_s"] = t_new - t0
    return result


def partition_cycle(run: LocalRun, host, smtp: SmtpSink, outage_s: float, watch: dict) -> dict:
    """Link down mid-shard for outage_s: expect UNREACHABLE (one mail, nothing restarted), then the shard
    watched to completion with every sample stored exactly once."""
    wait_for(lambda: stored(run) >= 3, 180, "the worker to store 3 samples")
    time.sleep(3)
    pids = (pid_of(run, "capture_server"), pid_of(run, "worker_shard_00000"))
    r: dict = {"fault": "partition", "outage_s": outage_s,
               "unreachable_bound_s": watch["stall_after_s"] + 2 * watch["poll_interval_s"]}
    n_mails = len(smtp.messages)

    async def cycle() -> dict:
        first = asyncio.create_task(first_event(run, outage_s + 120, recoveries=1))
        seen, deadline = False, time.time() + 60   # cut after the watch's first look: it has seen the node
        while time.time() < deadline:
            looking = any(b"\0watch\0" in _cmdline(p) for p in host.pids())
            if seen and not looking:
                break
            seen = seen or looking
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        r["t_fault"], r["stored_at_cut"] = time.time(), stored(run)
        await asyncio.to_thread(host.link_down)
        ev = await first
        r["t_event"] = time.time()
        if ev.get("status") == "unreachable" and ev.get("mail"):   # what the ShardOperator does
            await asyncio.to_thread(mail, smtp, ev)
        await asyncio.sleep(max(0.0, r["t_fault"] + outage_s - time.time()))
        r["stored_while_down"] = stored(run) - r["stored_at_cut"]
        await asyncio.to_thread(host.link_up)
        r["t_up"] = time.time()
        # watch again as the operator does after an unreachable event, until the shard completes
        again = ShardWatchTrigger(RunContext(cfg=run.cfg, layout=run.layout).serialize(), 0, recoveries_left=1,
                                  unreachable_since=ev.get("since"))
        agen = again.run()
        try:
            back = asyncio.create_task(agen.__anext__())
            while not back.done() and "back_s" not in r:
                if any(b"\0watch\0" in _cmdline(p) for p in host.pids()):
                    r["back_s"] = time.time() - r["t_up"]
                await asyncio.sleep(0.1)
            r["final"] = (await back).payload
        finally:
            await agen.aclose()
        return ev

    ev = asyncio.run(cycle())
    r["status"] = ev.get("status")
    r["detect_s"] = r["t_event"] - r["t_fault"]
    r["headline"] = (ev.get("diagnosis") or "").splitlines()[0][:400]
    if len(smtp.messages) > n_mails:
        r["mail_s"] = smtp.received_at[-1] - r["t_fault"]
    r["restarts"] = int((pid_of(run, "capture_server"), pid_of(run, "worker_shard_00000")) != pids)
    entries = [json.loads(line) for line in Path(str(run.layout.manifest_file(0))).read_text().splitlines()
               if line.strip()]
    idx = [e["index"] for e in entries]
    r["total"] = len(_corpus_indices(run))   # one shard: the whole corpus
    r["stored"], r["duplicated"] = len(set(idx)), len(idx) - len(set(idx))
    r["missing"] = len(set(_corpus_indices(run)) - set(idx))
    r["final_status"] = (r.get("final") or {}).get("status")
    return r


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _corpus_indices(run: LocalRun) -> list[int]:
    import pyarrow.parquet as pq
    return pq.read_table(str(Path(str(run.layout.corpus_dir)) / "corpus.parquet"), columns=["index"]).column(
        "index").to_pylist()


def ev_stored(ev: dict) -> int:
    try:
        return int(str((ev.get("incident") or {}).get("shards", {}).get("0", "0")).split("/")[0].replace(",", ""))
    except ValueError:
        return 0


class SlowCase(threading.Thread):
    """A slow-but-healthy extraction watched (no recovery) for ``duration_s``; non-complete events are false alarms."""

    def __init__(self, name: str, run: LocalRun, duration_s: float, delay_file: Path, schedule):
        super().__init__(daemon=True, name=name)
        self.run_, self.duration_s, self.delay_file, self.schedule = run, duration_s, delay_file, schedule
        self.false_alarms: list[str] = []
        self.watched_s = 0.0
        self.done_in_run = 0
        self.error: str | None = None

    def run(self) -> None:
        t0 = time.monotonic()
        stop_flag = threading.Event()

        def drive():  # the per-forward delay over time (duty-cycled servers change it while running)
            while not stop_flag.is_set():
                self.delay_file.write_text(str(self.schedule(time.monotonic() - t0)))
                stop_flag.wait(1.0)
        threading.Thread(target=drive, daemon=True).start()
        try:
            before = stored(self.run_)
            while (left := self.duration_s - (time.monotonic() - t0)) > 0:
                try:
                    ev = asyncio.run(first_event(self.run_, left, recoveries=0))
                except (asyncio.TimeoutError, TimeoutError):
                    break
                if ev["status"] == "complete":
                    break
                self.false_alarms.append((ev.get("diagnosis") or "").splitlines()[0][:600])
                print(f"  FALSE ALARM ({self.name}): {self.false_alarms[-1]}", flush=True)
            self.done_in_run = stored(self.run_) - before
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            stop_flag.set()
            self.watched_s = time.monotonic() - t0


def gpu_duty(scenario: Path, stop_flag: threading.Event, period_s: float = 10.0, duty: float = 0.45) -> None:
    """8 GPUs holding 90 GB, busy (97 %) for 45 % of every 10 s and at 0 % otherwise, like a bursty real load."""
    while not stop_flag.is_set():
        busy = (time.time() % period_s) < duty * period_s
        write_scenario(scenario, {"driver": True, "gpus": [gpu(i, 92_262, total=97_887, util=97 if busy else 0)
                                                           for i in range(8)]})
        stop_flag.wait(0.5)


def dist(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):5.1f} / {max(values):5.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real-defaults", action="store_true",
                    help="the shipped defaults: poll 20 s, stall_after 15 s, health timeout 20 s")
    ap.add_argument("--cycles", type=int, default=1, help="injections per fault case")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--generation-faults", default=",".join(FAULTS),
                    help="the fault cases on a generation shard ('' for none)")
    ap.add_argument("--poll-s", type=float, default=5.5)
    ap.add_argument("--stall-after-s", type=float, default=3.0)
    ap.add_argument("--health-timeout-s", type=float, default=5.0)
    ap.add_argument("--slow-s", type=float, default=600.0, help="how long each slow-but-healthy case is watched")
    ap.add_argument("--slow-cases", default="slow-10s,slow-20s,slow-30s,duty-cycled")
    ap.add_argument("--node-host", action="store_true", help="fault cases on a node in its own network "
                    "namespace over SSH (root), plus the partition case")
    ap.add_argument("--outage-s", type=float, default=45.0, help="how long the partition case keeps the link down")
    args = ap.parse_args()
    if args.real_defaults:
        args.poll_s, args.stall_after_s, args.health_timeout_s = 20.0, 15.0, 20.0

    watch = {"poll_interval_s": args.poll_s, "stall_after_s": args.stall_after_s,
             "health_timeout_s": args.health_timeout_s, "startup_grace_s": 120.0}
    bound = load_config(data={"target_model": "x", "watchdog": watch}).watchdog.detection_bound_s
    assets = ensure_demo_assets(str(REPO / ".cache" / "test-assets"), n_per_source=24, fit_target=False)
    root = Path(tempfile.mkdtemp(prefix="eagleflow-bench-stall-"))
    print(f"watch config: poll {args.poll_s:g} s, stall_after {args.stall_after_s:g} s, health timeout "
          f"{args.health_timeout_s:g} s -> detection bound {bound:.1f} s; workdir {root}", flush=True)

    # fake GPU node for the slow cases
    scenario = root / "gpus.json"
    gpu_stop = threading.Event()
    gpu_duty_thread = threading.Thread(target=gpu_duty, args=(scenario, gpu_stop), daemon=True)
    write_scenario(scenario, {"driver": True, "gpus": [gpu(i, 92_262, total=97_887, util=97) for i in range(8)]})
    gpu_duty_thread.start()
    os.environ.update(fake_smi_env(scenario, sys.executable) | {"PATH": fake_smi_env(scenario, sys.executable)["PATH"]
                                                                 + os.pathsep + os.environ.get("PATH", "")})

    schedules = {"slow-10s": lambda t: 10.0, "slow-20s": lambda t: 20.0, "slow-30s": lambda t: 30.0,
                 "duty-cycled": lambda t: 0.05 if int(t // 60) % 2 == 0 else 20.0,
                 # a CPU node (no GPU signal, so no busy exemption): only the run's pace and honest ages help
                 "cpu-16s": lambda t: 16.0, "cpu-duty-cycled": lambda t: 0.05 if int(t // 60) % 2 == 0 else 16.0}
    slow_runs: list[SlowCase] = []
    fault_results: list[dict] = []
    hang_file = root / "hang"
    partition_results: list[dict] = []
    with contextlib.ExitStack() as stack:
        smtp = stack.enter_context(SmtpSink())
        host = None
        if args.node_host:
            from tests.fixtures.node_host import node_host
            # the servers' environment on the node comes from its sshd (SetEnv), not from this process
            host = stack.enter_context(node_host(root / "node", {**fake_smi_env(scenario, sys.executable),
                                                                 DELAY_ENV: "0.05", HANG_FILE_ENV: str(hang_file)}))
            os.environ["AIRFLOW_CONN_BENCH_NODE_HOST"] = host.airflow_conn()
            NODE.update({"name": "node-host", "conn_id": "bench_node_host", "python": sys.executable})
            if args.slow_cases:
                print("slow-but-healthy cases: not in --node-host mode (each needs its own server environment)")
                args.slow_cases = ""
            print(f"node host: {host.node_ip}:{host.port} in network namespace {host.netns}", flush=True)
        try:
            for name in [c for c in args.slow_cases.split(",") if c]:
                delay_file = root / f"{name}.delay"
                delay_file.write_text("0")  # fast until ready; the case's schedule starts with its watch
                run = make_run(root, assets["target_model"], name, watch, n=3000, has_gpu=not name.startswith("cpu-"))
                start(run, {DELAY_FILE_ENV: str(delay_file)})
                slow_runs.append(SlowCase(name, run, args.slow_s, delay_file, schedules[name]))
            for c in slow_runs:
                c.start()

            faults = [f for f in args.faults.split(",") if f]
            if faults:
                a = make_run(root, assets["target_model"], "faults", watch, n=20000)
                # kept for the whole phase: the recovery restarts the server from this environment
                os.environ.update({DELAY_ENV: "0.05", HANG_FILE_ENV: str(hang_file)})
                start(a, {})
                try:
                    for fault in faults:
                        for i in range(args.cycles):
                            r = fault_cycle(a, fault, hang_file, smtp, bound)
                            fault_results.append(r)
                            print(f"  {fault:<14} #{i + 1}: {r['status']:<9} cause {r.get('cause') or '-':<15} "
                                  f"detect {r['detect_s']:5.1f} s, mail {r.get('mail_s', float('nan')):5.1f} s, "
                                  f"first new sample {r.get('recover_s', float('nan')):5.1f} s | {r['headline'][:160]}",
                                  flush=True)
                finally:
                    # HANG_FILE_ENV reached the restarted server too: recovery starts it from this environment
                    stop(a)
            gen_faults = [f for f in args.generation_faults.split(",") if f]
            if gen_faults:
                g, gen = make_generate_run(root, assets["target_model"], watch), KINDS[GENERATE]
                os.environ.update({DELAY_ENV: "0.05", HANG_FILE_ENV: str(hang_file)})
                start(g, {}, gen)
                try:
                    for fault in gen_faults:
                        for i in range(args.cycles):
                            r = fault_cycle(g, fault, hang_file, smtp, bound, gen)
                            fault_results.append(r)
                            print(f"  generate {fault:<14} #{i + 1}: {r['status']:<9} cause "
                                  f"{r.get('cause') or '-':<15} detect {r['detect_s']:5.1f} s, mail "
                                  f"{r.get('mail_s', float('nan')):5.1f} s, first new record "
                                  f"{r.get('recover_s', float('nan')):5.1f} s | {r.get('subject', '')} | "
                                  f"{r['headline'][:120]}", flush=True)
                finally:
                    stop(g, gen)
            if host is not None:
                p = make_run(root, assets["target_model"], "partition", watch, n=400)
                start(p, {})
                try:
                    r = partition_cycle(p, host, smtp, args.outage_s, watch)
                    partition_results.append(r)
                    print(f"  partition      #1: {r['status']:<11} detect {r['detect_s']:5.1f} s, mail "
                          f"{r.get('mail_s', float('nan')):5.1f} s, {r['stored_while_down']} samples stored while "
                          f"unreachable, watch back {r.get('back_s', float('nan')):4.1f} s after the link | "
                          f"{r['headline'][:140]}", flush=True)
                finally:
                    host.link_up()
                    stop(p)
            for c in slow_runs:
                c.join()
        finally:
            gpu_stop.set()
            for c in slow_runs:
                stop(c.run_)

    print()
    print(f"{'fault case':<26}{'caught':>8}{'detect med/max (s)':>22}{'mail med/max (s)':>20}"
          f"{'first new sample/record (s)':>31}{'bound':>8}")
    ok = True
    for phase, fault in dict.fromkeys((r["phase"], r["fault"]) for r in fault_results):
        rs = [r for r in fault_results if (r["phase"], r["fault"]) == (phase, fault)]
        caught = sum(1 for r in rs if r["status"] == "recovering")
        rec = [r["recover_s"] for r in rs if "recover_s" in r]
        print(f"{phase + ' ' + fault:<26}{caught:>5}/{len(rs):<2}{dist([r['detect_s'] for r in rs]):>22}"
              f"{dist([r['mail_s'] for r in rs if 'mail_s' in r]):>20}{dist(rec):>31}{60.0:>8.0f}")
        ok = ok and caught == len(rs) and all(x <= 60.0 for x in rec) and len(rec) == len(rs)
    for r in partition_results:
        print()
        print(f"partition ({r['outage_s']:.0f} s link down mid-shard): verdict {r['status']} (stalled: "
              f"{'yes' if r['status'] != 'unreachable' else 'no'}), detected {r['detect_s']:.1f} s after the cut "
              f"(bound: stall_after + 2 x poll = {r['unreachable_bound_s']:.0f} s from the last answer, or the "
              f"dead-link detection), mail {r.get('mail_s', float('nan')):.1f} s, restarts on the node: "
              f"{r['restarts']}, {r['stored_while_down']} samples stored while unreachable; at completion "
              f"{r['stored']}/{r['total']} stored, {r['missing']} missing, {r['duplicated']} duplicated")
        ok = ok and r["status"] == "unreachable" and r["restarts"] == 0 and r["missing"] == 0 \
            and r["duplicated"] == 0 and r["stored"] == r["total"]
    print()
    print(f"{'slow-but-healthy case':<24}{'watched (s)':>12}{'samples':>9}{'false alarms':>14}{'per hour':>10}")
    total_s, total_fa = 0.0, 0
    for c in slow_runs:
        total_s += c.watched_s
        total_fa += len(c.false_alarms)
        print(f"{c.name:<24}{c.watched_s:>12.0f}{c.done_in_run:>9}{len(c.false_alarms):>14}"
              f"{len(c.false_alarms) / max(c.watched_s, 1) * 3600:>10.1f}" + (f"  ERROR {c.error}" if c.error else ""))
    if slow_runs:
        print(f"{'all':<24}{total_s:>12.0f}{'':>9}{total_fa:>14}{total_fa / max(total_s, 1) * 3600:>10.1f}")
    return 0 if ok and total_fa == 0 and not any(c.error for c in slow_runs) else 1


if __name__ == "__main__":
    sys.exit(main())
