"""Issue 52's drill: generation faults and a killed triggerer through a real Airflow deployment, then a healthy run
under a load of its own, with the real-run watch defaults and a real SMTP server.

Airflow runs as ``make airflow`` runs it (``eagleflow.airflow.deploy.standalone``: the supervisor, the scheduler
and its LocalExecutor, the DAG processor, the API server and the triggerer, with the deployment's own settings,
the triggerer's included; the operators deferrable, so every watch lives in the triggerer). The drill's DAGs are
the phases' real operators (``DAGS`` below: generation with two shards one after the other, so there is a moment
"just before the next shard starts"; an extraction shard; training). Each fault case is one DAG run of
``drill_generate`` (the hf server in serving mode, the CLI generation worker, 16 new tokens a turn, two records
in flight) with its own node state folder, run to its end:

    server-stopped-mid-shard        SIGSTOP the generation server once shard 0 has stored some records under its watch
    server-stopped-before-next      SIGSTOP it the moment shard 0's watch has seen the shard complete, so shard 1's
                                    check before its start finds it stopped (eagleflow.airflow.shard_start)
    worker-killed                   SIGKILL shard 0's generation worker mid-shard
    triggerer-killed                SIGKILL Airflow's triggerer mid-shard (the supervisor starts another)

For each: seconds from the fault to the incident mail received (STALLED; for the triggerer, the sentinel's WATCH
SILENT if the watch stayed silent that long: with the watch back sooner there is no mail to wait for), to the
first record stored after the fault, and (triggerer) to the watch's first look from the new triggerer; each held
to 60 s. The run must end green with every record stored once.

The healthy run (``--slow-s``, default 600): ``--burn N`` busy-loop processes of the bench's own (normal
priority, stopped by PID at the end, killed with the bench if it dies) bring the 2 cores to a load of 40 or more
first; then a generation shard, an extraction shard and a trainer run at once, each under its real watch, for
``--slow-s`` seconds from the moment all three are watched. Every mail, every look that is not starting, healthy,
slow or complete, and every task retry in that window is a false alarm; the load average is sampled all along.

    .venv/bin/python bench/drill.py --real-defaults --slow-s 600 --burn 44 --json bench/results/drill.json
    .venv/bin/python bench/drill.py --real-defaults --cases worker-killed --slow-s 60 --burn 8   # a smoke
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from bench.stall import extract_config, generate_config  # noqa: E402
from eagleflow.airflow.deploy import standalone  # noqa: E402
from eagleflow.engines.hf.server import DELAY_ENV  # noqa: E402
from eagleflow.config import load_config  # noqa: E402
from eagleflow.demo_assets import ensure_demo_assets  # noqa: E402
from eagleflow.phases import GENERATE, KINDS  # noqa: E402
from eagleflow.watchdog.sentinel import look_cost_s, look_interval_s, watched_until  # noqa: E402
from tests.fixtures.processes import kill_recorded  # noqa: E402
from tests.fixtures.smtp import SmtpSink  # noqa: E402
from tests.integration.test_prestart_fault_airflow import _StopBeforeNextShard  # noqa: E402
from tests.integration.test_watcher_watched import _call, _parts  # noqa: E402

BOUND_S = 60.0   # issue 52: every fault mailed and recovered, and every watch back, within a minute
CASES = ["server-stopped-mid-shard", "server-stopped-before-next", "worker-killed", "triggerer-killed"]
GEN = KINDS[GENERATE]
SMTP_CONN = "smtp_drill"
QUIET_VERDICTS = {"starting", "healthy", "slow", "complete"}

DAGS = """
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, Param, task

from eagleflow.airflow.alerts import pipeline_failure_callbacks
from eagleflow.airflow.base import RunOperator
from eagleflow.airflow.shard_operators import ServerReadySensor, ShardOperator, StartServerOperator, StopServerOperator
from eagleflow.airflow.shard_operators import ShardOperator, StartServerOperator, StopServerOperator
from eagleflow.airflow.pipeline_operators import WriteRunConfigOperator
from eagleflow.airflow.train_operators import TrainDraftOperator

# eagle3_pipeline's: one retry 30 s later for every task, two for each shard, its failure and retry mails
ARGS = {"retries": 1, "retry_delay": timedelta(seconds=30), **pipeline_failure_callbacks()}
PARAMS = {"config_path": Param("", type="string"), "samples": Param(0, type="integer")}


class WriteDrillCorpus(RunOperator):
    def run(self, ctx, context):
        from tests.fixtures.capture_corpus import write_corpus
        write_corpus(Path(ctx.layout.corpus_dir) / "corpus.parquet", context["params"]["samples"], 300, seed=5)


@task
def synthetic_hidden_states(**context):
    from eagleflow.airflow.runtime import RunContext
    from tests.fixtures.train_hidden_states import write_synthetic_hidden_states
    ctx = RunContext.from_airflow(context)
    write_synthetic_hidden_states(ctx.layout.hidden_states_dir, ctx.cfg.target_model, samples=48)


with DAG("drill_generate", schedule=None, catchup=False, default_args=ARGS, params=PARAMS) as drill_generate:
    start = StartServerOperator(phase="generate", task_id="start_generate_server")
    (WriteRunConfigOperator(task_id="write_run_config") >> start
     >> ShardOperator(phase="generate", task_id="generate_shard_0", shard=0, retries=2)
     >> ShardOperator(phase="generate", task_id="generate_shard_1", shard=1, retries=2)
     >> StopServerOperator(phase="generate", task_id="stop_generate_server").as_teardown(setups=start))

with DAG("drill_extract", schedule=None, catchup=False, default_args=ARGS, params=PARAMS) as drill_extract:
    start = StartServerOperator(phase="extract", task_id="start_capture_server")
    (WriteRunConfigOperator(task_id="write_run_config") >> WriteDrillCorpus(task_id="write_corpus") >> start
     >> ServerReadySensor(phase="extract", task_id="capture_server_ready")
     >> ShardOperator(phase="extract", task_id="extract_shard_0", shard=0, retries=2)
     >> StopServerOperator(phase="extract", task_id="stop_capture_server").as_teardown(setups=start))

with DAG("drill_train", schedule=None, catchup=False, default_args=ARGS, params=PARAMS) as drill_train:
    (WriteRunConfigOperator(task_id="write_run_config") >> synthetic_hidden_states()
     >> TrainDraftOperator(task_id="train_draft"))
"""


# --------------------------------------------------------------------------- what the node shows
def pid_of(state_dir: Path, role: str) -> int | None:
    for rec in (state_dir / "pids").glob(f"*.{role}.json"):
        try:
            return int(json.loads(rec.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None
    return None


def looks(state_dir: Path, role: str = "") -> list[dict]:
    """The watch's looks at ``role`` (every watched job when empty), from the node's look logs."""
    out: list[dict] = []
    for f in (state_dir / "watch").glob(f"*{'.' + role if role else ''}.looks.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError):
                if (x := json.loads(line)).get("by") == "watch":
                    out.append(x | {"job": f.name[: -len(".looks.jsonl")]})
    return sorted(out, key=lambda x: x.get("at", 0))


def manifest_ids(run_root: Path, folder: str, shard: int) -> list[str]:
    out: list[str] = []
    for m in run_root.glob(f"*/{folder}/shard_{shard:05d}/manifest.jsonl"):
        for line in m.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line)["id"])
    return out


def trainer_steps(run_root: Path) -> int:
    for hb in run_root.glob("*/draft/heartbeat.json"):
        with contextlib.suppress(OSError, ValueError):
            return int(json.loads(hb.read_text()).get("done") or 0)
    return 0


# --------------------------------------------------------------------------- load: the burner and the readings
class Burner:
    """``n`` busy loops at normal priority (a shell's ``while :``), each killed with the bench if it dies
    (PR_SET_PDEATHSIG) and stopped by its PID at the end."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    @staticmethod
    def _die_with_parent() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG

    def __enter__(self) -> "Burner":
        for _ in range(self.n):
            self.procs.append(subprocess.Popen(["/bin/sh", "-c", "while :; do :; done"],
                                               preexec_fn=self._die_with_parent, stdin=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()
        self.procs = []


class LoadLog(threading.Thread):
    """/proc/loadavg's 1-minute figure every 5 s, for the whole drill."""

    def __init__(self):
        super().__init__(daemon=True)
        self.readings: list[tuple[float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.readings.append((time.time(), float(Path("/proc/loadavg").read_text().split()[0])))
            self.done.wait(5.0)

    def between(self, t0: float, t1: float) -> dict:
        xs = [v for t, v in self.readings if t0 <= t <= t1] or [float(Path("/proc/loadavg").read_text().split()[0])]
        return {"min": min(xs), "median": round(statistics.median(xs), 1), "max": max(xs), "readings": len(xs)}


# --------------------------------------------------------------------------- the deployment
class Deployment:
    """The supervised Airflow of ``make airflow`` in a home of the drill's, its DAG folder the drill's; the REST API
    asked again when the loaded machine answers late."""

    def __init__(self, root: Path, smtp: SmtpSink, env: dict[str, str]):
        self.home, self.dags, self.configs = root / "airflow_home", root / "dags", root / "configs"
        self.dags.mkdir(parents=True)
        self.configs.mkdir(parents=True)
        (self.dags / "drill_dags.py").write_text(DAGS)
        self.port = standalone.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # the deployment's own settings (the triggerer's included), only where the drill's DAGs and configs are
        self.env = {"AIRFLOW__CORE__DAGS_FOLDER": str(self.dags), "PYTHONPATH": str(REPO),
                    "EAGLEFLOW_CONFIG_DIRS": str(self.configs), **smtp.airflow_conn_env(SMTP_CONN), **env}
        assert not [k for k in os.environ if k.startswith("AIRFLOW__TRIGGERER__")], "the triggerer's settings: keep"
        self.token = ""

    def start(self) -> float:
        t0 = time.time()
        info = standalone.start(self.home, self.port, wait_s=600, extra_env=self.env)
        self.token = self.api("/auth/token", "POST", {"username": "admin", "password": info["password"]},
                              auth=False)["access_token"]
        for dag in ("drill_generate", "drill_extract", "drill_train"):
            wait(lambda d=dag: self.api(f"/api/v2/dags/{d}", missing_ok=True), 600, f"Airflow parsed {dag}", 2.0)
            self.api(f"/api/v2/dags/{dag}", "PATCH", {"is_paused": False})
        return time.time() - t0

    def api(self, path: str, method: str = "GET", body=None, *, auth: bool = True, missing_ok: bool = False):
        for attempt in range(6):
            try:
                return _call(self.base + path, method, body, self.token if auth else None)
            except urllib.error.HTTPError as e:
                if e.code == 404 and missing_ok:
                    return None
                if e.code < 500:
                    raise
            except (urllib.error.URLError, TimeoutError, ConnectionError):
                pass
            time.sleep(2 + 3 * attempt)
        raise RuntimeError(f"Airflow's API did not answer {method} {path}")

    def trigger(self, dag: str, config: Path, samples: int = 0) -> str:
        return self.api(f"/api/v2/dags/{dag}/dagRuns", "POST",
                        {"logical_date": None, "conf": {"config_path": str(config), "samples": samples}})["dag_run_id"]

    def run_state(self, dag: str, run_id: str) -> str:
        return self.api(f"/api/v2/dags/{dag}/dagRuns/{run_id}")["state"]

    def tries(self, dag: str, run_id: str) -> dict[str, tuple[str, int]]:
        tis = self.api(f"/api/v2/dags/{dag}/dagRuns/{run_id}/taskInstances")["task_instances"]
        return {t["task_id"]: (t["state"], t["try_number"]) for t in tis}

    def triggerer(self) -> dict:
        return _parts(self.home).get("triggerer") or {}

    def stop(self) -> None:
        standalone.stop(self.home)


def wait(pred, timeout_s: float, what: str, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if v := pred():
            return v
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def write_config(dep: Deployment, name: str, data: dict) -> Path:
    path = dep.configs / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    load_config(path)   # refused here, naming the field, rather than by the run
    return path


def mail_settings(smtp: SmtpSink) -> dict:
    """Who is mailed, through which connection; the node's sentinel mails WATCH SILENT through the same server."""
    return {"alert_emails": ["oncall@drill.test"], "smtp_conn_id": SMTP_CONN, "node_smtp": f"127.0.0.1:{smtp.port}"}


# --------------------------------------------------------------------------- the fault cases
class Fault(_StopBeforeNextShard):
    """The fault of one case, done from here while the run goes on in Airflow. ``server-stopped-before-next`` is
    test_prestart_fault_airflow's own (the server stopped the moment shard 0's watch has seen it complete); the
    others wait until shard 0 has stored ``after`` records under at least ``looks`` looks of its watch, then stop
    the server, kill the worker or kill the triggerer, and note the first record stored after."""

    def __init__(self, case: str, state_dir: Path, run_root: Path, dep: Deployment, per_shard: int, after: int,
                 min_looks: int, after_look_s: float = 0.0):
        super().__init__(state_dir, run_root, GEN.server_role, "generated")
        self.case, self.dep, self.per_shard, self.after, self.min_looks = case, dep, per_shard, after, min_looks
        self.after_look_s = after_look_s   # the fault this long after the watch's last look (the triggerer's kill)
        self.shard = 1 if case == "server-stopped-before-next" else 0
        self.old_lookers: set[int] = set()
        self.looks_before: list[dict] = []
        self.triggerer_back_at: float | None = None
        self.watch_back_at: float | None = None
        self.at_fault = 0
        self.error: str | None = None

    def run(self) -> None:
        try:
            if self.case == "server-stopped-before-next":
                return super().run()
            self._mid_shard()
        except Exception as e:   # noqa: BLE001 - said in the result, never left as a silent thread death
            self.error = f"{type(e).__name__}: {e}"

    def _mid_shard(self) -> None:
        worker = GEN.worker_role(0)
        while not self.done.is_set() and self.stopped_at is None:
            seen, done = looks(self.state_dir, worker), self.records(0)
            # mid-shard: with at least 20 records left, so the shard outlasts the watch's return
            if self.after <= done <= self.per_shard - 20 and len(seen) >= self.min_looks \
                    and time.time() - seen[-1]["at"] >= self.after_look_s:
                self.at_fault = self.records(0)
                if self.case == "server-stopped-mid-shard":
                    self.stopped_pid = pid_of(self.state_dir, GEN.server_role)
                    os.kill(self.stopped_pid, signal.SIGSTOP)
                elif self.case == "worker-killed":
                    os.kill(pid_of(self.state_dir, worker), signal.SIGKILL)
                elif self.case == "triggerer-killed":
                    self.looks_before = looks(self.state_dir, worker)
                    self.old_lookers = {x["pid"] for x in self.looks_before}
                    self.triggerer_pid = self.dep.triggerer()["pid"]
                    os.kill(self.triggerer_pid, signal.SIGKILL)
                self.stopped_at = time.time()
            time.sleep(0.05)
        server = pid_of(self.state_dir, GEN.server_role)
        while not self.done.is_set():
            now = pid_of(self.state_dir, GEN.server_role)
            if self.replaced_at is None and now is not None and now != server:
                self.replaced_at = time.time()
            if self.first_new_at is None and self.records(0) > self.at_fault:
                self.first_new_at = time.time()
            if self.case == "triggerer-killed":
                t = self.dep.triggerer()
                if self.triggerer_back_at is None and t.get("pid") not in (None, self.triggerer_pid):
                    self.triggerer_back_at = t.get("started_at") or time.time()
                back = [x for x in looks(self.state_dir, worker)
                        if x["at"] > self.stopped_at and x["pid"] not in self.old_lookers]
                if self.watch_back_at is None and back:
                    self.watch_back_at = back[0]["at"]
                if self.first_new_at and self.watch_back_at:
                    return
            elif self.first_new_at:
                return
            time.sleep(0.05)


def run_case(case: str, dep: Deployment, smtp: SmtpSink, root: Path, model: str, watch: dict,
             per_shard: int, load: LoadLog) -> dict:
    croot = root / case
    if case == "triggerer-killed":   # the shard outlasts the kill, the new triggerer's start and a look
        per_shard *= 2
    data = generate_config(croot, model, watch | mail_settings(smtp), n=2 * per_shard, shards=2, name=case)
    state_dir, run_root = Path(data["node"]["state_dir"]), Path(data["run_root"])
    cfgp = write_config(dep, f"{case}-{root.name}", data)
    n_mails = len(smtp.messages)
    t0 = time.time()
    run_id = dep.trigger("drill_generate", cfgp)
    # the triggerer is killed half a poll interval after its second look at the shard (at most 10 s): between
    # two looks, as by chance
    poll = load_config(cfgp).watchdog.poll_interval_s
    fault = Fault(case, state_dir, run_root, dep, per_shard, after=5, min_looks=2 if case == "triggerer-killed" else 1,
                  after_look_s=min(poll / 2, 10.0) if case == "triggerer-killed" else 0.0)
    fault.start()
    r: dict = {"case": case, "run_id": run_id, "records_per_shard": per_shard}
    try:
        r["state"] = wait(lambda: (s := dep.run_state("drill_generate", run_id)) in ("success", "failed") and s,
                          1800, f"{case}: the run's end", 3.0)
        fault.join(timeout=60)
    finally:
        fault.done.set()
        if fault.stopped_pid and case.startswith("server-stopped"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(fault.stopped_pid, signal.SIGCONT)
        kill_recorded(state_dir)
    t_fault = fault.stopped_at
    r["seconds"] = round(time.time() - t0, 1)
    r["load"] = load.between(t0, time.time())
    r["tries"] = dep.tries("drill_generate", run_id)
    r["fault_error"] = fault.error
    mails = list(zip(smtp.messages[n_mails:], smtp.received_at[n_mails:]))
    r["mails"] = [{"subject": m["Subject"], "at_s": None if t_fault is None else round(t - t_fault, 1)}
                  for m, t in mails]
    if t_fault is None:
        r["ok"], r["why"] = False, "the fault was never made (the shard ended first?)"
        return r
    r["fault_at"] = datetime.fromtimestamp(t_fault, timezone.utc).isoformat(timespec="seconds")
    r["records_at_fault"] = fault.at_fault if fault.shard == 0 else 0

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - t_fault, 1)
    word = "WATCH SILENT" if case == "triggerer-killed" else "STALLED"
    first = next((t for m, t in mails if word in m["Subject"] and t >= t_fault), None)
    r["mail_s"] = since(first)
    r["recovered_mail_s"] = since(next((t for m, t in mails if "RECOVERED" in m["Subject"]), None))
    r["first_new_s"] = since(fault.first_new_at)
    r["server_replaced_s"] = since(fault.replaced_at)
    ids = {s: manifest_ids(run_root, "generated", s) for s in (0, 1)}
    r["records"] = {str(s): len(v) for s, v in ids.items()}
    r["duplicated"] = sum(len(v) - len(set(v)) for v in ids.values())
    others = [m["subject"] for m in r["mails"]
              if not any(w in m["subject"] for w in ("STALLED", "RECOVERED", "WATCH SILENT", "WATCH BACK"))]
    # recovered in the watch, in the shard task's first try: an Airflow retry is the fallback, not the road
    r["retried"] = sorted(t for t, (_, n) in r["tries"].items() if n > 1)
    checks = [r["state"] == "success", r["duplicated"] == 0, not others, not r["retried"],
              all(len(v) == per_shard for v in ids.values()),
              r["first_new_s"] is not None and r["first_new_s"] <= BOUND_S]
    if case == "triggerer-killed":
        r["triggerer_restarted_s"] = since(fault.triggerer_back_at)
        r["watch_back_s"] = since(fault.watch_back_at)
        # when the sentinel would have alarmed (WATCH SILENT): past 3 look intervals after the last look
        cfg, last = load_config(cfgp), fault.looks_before[-1]
        due = watched_until(last, look_interval_s(fault.looks_before, cfg.watchdog.poll_interval_s), look_cost_s(cfg))
        r["last_look_before_s"], r["sentinel_alarm_due_s"] = since(last["at"]), since(due)
        # the sentinel alarms only past 3 look intervals of silence: with the watch back sooner, no mail is due
        checks += [r["watch_back_s"] is not None and r["watch_back_s"] <= BOUND_S,
                   r["mail_s"] is None or r["mail_s"] <= BOUND_S]
    else:
        stalled = [m for m in r["mails"] if "STALLED" in m["subject"]]
        checks += [r["mail_s"] is not None and r["mail_s"] <= BOUND_S, len(stalled) == 1,
                   r["recovered_mail_s"] is not None]
        r["stalled_subject"] = stalled[0]["subject"] if stalled else None
    r["ok"] = all(checks)
    return r


# --------------------------------------------------------------------------- the healthy run
def healthy_run(dep: Deployment, smtp: SmtpSink, root: Path, model: str, watch: dict, window_s: float,
                load: LoadLog) -> dict:
    """A generation shard, an extraction shard and a trainer at once on one node (one state folder), each under its
    watch, for ``window_s`` from the moment all three are watched; every mail, alarming look and retry from the
    trigger on is a false alarm."""
    hroot = root / "healthy"
    state = hroot / "state"
    w = watch | mail_settings(smtp)
    gen = generate_config(hroot / "generate", model, w, n=4000, shards=2, name="healthy-generate")
    ext = extract_config(hroot / "extract", model, "healthy-extract", w)
    source = hroot / "source.jsonl"   # the run config's pre-flight wants a source that exists; the corpus is written
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "hello"}]}) + "\n")
    ext["corpus"] = {"sources": [{"name": "drill", "path": str(source)}]}
    tr = {"run_root": str(hroot / "train" / "runs"), "target_model": model,
          "node": {"name": "bench-node", "has_gpu": False},
          "corpus": {"sources": [{"name": "drill", "path": str(source)}]}, "watchdog": w,
          "train": {"device": "cpu", "max_steps": 1_000_000, "batch_size": 4, "lr": 3e-3, "warmup_steps": 3,
                    "ttt_length": 3, "draft_vocab_size": 64, "checkpoint_every": 500, "log_every": 10}}
    for d in (gen, ext, tr):
        d["node"]["state_dir"] = str(state)   # one node: its state folder holds every job's records and looks
    runs = {"drill_generate": (write_config(dep, "healthy-generate", gen), 0),
            "drill_extract": (write_config(dep, "healthy-extract", ext), 20_000),
            "drill_train": (write_config(dep, "healthy-train", tr), 0)}
    n_mails = len(smtp.messages)
    t_trigger = time.time()
    run_ids = {dag: dep.trigger(dag, cfg, samples) for dag, (cfg, samples) in runs.items()}
    jobs = (GEN.worker_role(0), "worker_shard_00000", "trainer")
    r: dict = {"window_s": window_s, "run_ids": run_ids}
    # its jobs are left running to the drill's end: the deployment is stopped first, so no watch restarts them
    wait(lambda: all(looks(state, j) for j in jobs), 1800, "a watch look at each job", 2.0)
    t0 = time.time()
    r["watched_after_s"] = round(t0 - t_trigger, 1)
    before = (len(manifest_ids(Path(gen["run_root"]), "generated", 0)),
              len(manifest_ids(Path(ext["run_root"]), "hidden_states", 0)), trainer_steps(Path(tr["run_root"])))
    print(f"  all three watched {r['watched_after_s']:.0f} s after the trigger; watching {window_s:.0f} s",
          flush=True)
    while time.time() < t0 + window_s:
        time.sleep(min(30.0, t0 + window_s - time.time()))
        left = [m["Subject"] for m in smtp.messages[n_mails:]]
        print(f"  +{time.time() - t0:4.0f} s: load {float(Path('/proc/loadavg').read_text().split()[0]):.1f}, "
              f"mails {len(left)}{': ' + '; '.join(left) if left else ''}", flush=True)
    t1 = time.time()
    after = (len(manifest_ids(Path(gen["run_root"]), "generated", 0)),
             len(manifest_ids(Path(ext["run_root"]), "hidden_states", 0)), trainer_steps(Path(tr["run_root"])))
    r["progress_in_window"] = {"generation records": after[0] - before[0],
                               "extraction samples": after[1] - before[1], "training steps": after[2] - before[2]}
    r["load"], r["load_from_trigger"] = load.between(t0, t1), load.between(t_trigger, t1)
    # false alarms are counted from the trigger on: the jobs' starts under the load are part of the healthy run
    in_window = [(m, t) for m, t in zip(smtp.messages[n_mails:], smtp.received_at[n_mails:]) if t <= t1]
    r["mails"] = [m["Subject"] for m, _ in in_window]
    seen = [x for x in looks(state) if x["at"] <= t1]
    verdicts = [str(x.get("verdict")) for x in seen]
    r["looks"] = {v: verdicts.count(v) for v in sorted(set(verdicts))}
    r["alarming_looks"] = [f"{x['job']}: {x.get('verdict')}: {x.get('summary', '')[:200]}" for x in seen
                           if x.get("verdict") not in QUIET_VERDICTS]
    r["retries"] = {f"{dag}.{task}": n for dag, rid in run_ids.items()
                    for task, (_, n) in dep.tries(dag, rid).items() if n > 1}
    r["false_alarms"] = len(r["mails"]) + len(r["alarming_looks"]) + len(r["retries"])
    return r


# --------------------------------------------------------------------------- report
def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real-defaults", action="store_true",
                    help="the shipped watch defaults (poll 20 s, stall_after 15 s, health 20 s, startup grace 120 s)")
    ap.add_argument("--poll-s", type=float, default=5.0)
    ap.add_argument("--stall-after-s", type=float, default=5.0)
    ap.add_argument("--health-timeout-s", type=float, default=5.0)
    ap.add_argument("--cases", default=",".join(CASES), help=f"fault cases, comma-separated ('' for none): {CASES}")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each fault case")
    ap.add_argument("--records-per-shard", type=int, default=80)
    ap.add_argument("--slow-s", type=float, default=600.0, help="the healthy run's watched window (0: none)")
    ap.add_argument("--burn", type=int, default=0, help="busy-loop processes during the healthy run (started once "
                    "Airflow is up)")
    ap.add_argument("--burn-faults", action="store_true", help="keep the burner on during the fault cases too")
    ap.add_argument("--min-load", type=float, default=40.0, help="the load the healthy run waits for under --burn")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if unknown := set(cases) - set(CASES):
        ap.error(f"unknown cases {sorted(unknown)}; known: {CASES}")
    watch = {} if args.real_defaults else {"poll_interval_s": args.poll_s, "stall_after_s": args.stall_after_s,
                                           "health_timeout_s": args.health_timeout_s, "startup_grace_s": 60.0}
    wd = load_config(data={"target_model": "x", "watchdog": watch}).watchdog
    assets = ensure_demo_assets(str(REPO / ".cache" / "test-assets"), n_per_source=24, fit_target=False)
    root = Path(tempfile.mkdtemp(prefix="eagleflow-drill-"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    out: dict = {"command": " ".join(["python", "bench/drill.py", *sys.argv[1:]]), "commit": commit,
                 "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cores": os.cpu_count(),
                 "watch": {"poll_interval_s": wd.poll_interval_s, "stall_after_s": wd.stall_after_s,
                           "health_timeout_s": wd.health_timeout_s, "startup_grace_s": wd.startup_grace_s,
                           "detection_bound_s": wd.detection_bound_s},
                 "bound_s": BOUND_S, "cases": [], "healthy": None}
    print(f"drill at {commit}: watch poll {wd.poll_interval_s:g} s, stall_after {wd.stall_after_s:g} s, health "
          f"{wd.health_timeout_s:g} s, startup grace {wd.startup_grace_s:g} s; workdir {root}", flush=True)
    logging.getLogger("mail.log").setLevel(logging.WARNING)   # aiosmtpd's line per connection
    load = LoadLog()
    load.start()
    ok = True
    with contextlib.ExitStack() as stack:
        smtp = stack.enter_context(SmtpSink())
        # the hf server's forward delay reaches the servers the runs start (they inherit the deployment's env)
        dep = Deployment(root, smtp, {DELAY_ENV: "0.05"})
        burner = Burner(args.burn)

        def burn() -> None:
            """The burner on (once), and the load it brings waited for (at most 5 min)."""
            if not args.burn or burner.procs:
                return
            t_burn = time.time()
            stack.enter_context(burner)
            with contextlib.suppress(TimeoutError):
                wait(lambda: float(Path("/proc/loadavg").read_text().split()[0]) >= args.min_load, 300, "load", 5.0)
            out["burner"] = {"busy_loops": args.burn, "load_after": float(Path("/proc/loadavg").read_text().split()[0]),
                             "after_s": round(time.time() - t_burn)}
            print(f"burner: {args.burn} busy loops, load {out['burner']['load_after']} after "
                  f"{out['burner']['after_s']} s", flush=True)
        try:
            out["airflow_start_s"] = round(dep.start(), 1)
            print(f"Airflow up in {out['airflow_start_s']:.0f} s (port {dep.port})", flush=True)
            if args.burn_faults and cases:
                burn()
            for case in [c for c in cases for _ in range(args.repeat)]:
                n = sum(1 for x in out["cases"] if x["case"] == case)
                r = run_case(case, dep, smtp, root / f"{n + 1}", assets["target_model"], watch,
                             args.records_per_shard, load)
                out["cases"].append(r)
                ok = ok and r["ok"]
                print(f"  {case:<28} {'ok  ' if r['ok'] else 'MISS'} mail {fmt(r.get('mail_s')):>5} s, first new "
                      f"record {fmt(r.get('first_new_s')):>5} s"
                      + (f", watch back {fmt(r.get('watch_back_s'))} s (last look before "
                         f"{fmt(r.get('last_look_before_s'))} s, WATCH SILENT due at "
                         f"{fmt(r.get('sentinel_alarm_due_s'))} s), triggerer restarted "
                         f"{fmt(r.get('triggerer_restarted_s'))} s" if case == "triggerer-killed" else
                         f", server replaced {fmt(r.get('server_replaced_s'))} s, RECOVERED mailed "
                         f"{fmt(r.get('recovered_mail_s'))} s")
                      + f" | run {r['state']}, records {r.get('records')}, load {r['load']['median']:.0f} "
                      f"({r['load']['min']:.0f}-{r['load']['max']:.0f}) | {r.get('stalled_subject') or ''}"
                      + (f" | {r['why']}" if r.get("why") else ""), flush=True)
            if args.slow_s > 0:
                burn()
                h = healthy_run(dep, smtp, root, assets["target_model"], watch, args.slow_s, load)
                h["burn"] = args.burn
                out["healthy"] = h
                ok = ok and h["false_alarms"] == 0 and (not args.burn or h["load"]["min"] >= args.min_load)
        finally:
            burner.__exit__(None, None, None)
            dep.stop()   # Airflow's parts, then the node jobs its runs detached here
            for state_dir in root.glob("**/state"):
                kill_recorded(state_dir)
            load.done.set()

    print()
    print(f"{'fault case (generation, through Airflow)':<44}{'mail (s)':>10}{'first new record (s)':>22}"
          f"{'watch back (s)':>16}{'load':>12}{'bound':>7}  ok")
    for r in out["cases"]:
        print(f"{r['case']:<44}{fmt(r.get('mail_s')):>10}{fmt(r.get('first_new_s')):>22}"
              f"{fmt(r.get('watch_back_s')):>16}{r['load']['min']:>6.0f}-{r['load']['max']:<5.0f}{BOUND_S:>7.0f}  "
              f"{'yes' if r['ok'] else 'NO'}")
    if (h := out["healthy"]) is not None:
        print()
        print(f"healthy run ({args.burn} busy loops): {h['window_s']:.0f} s watched, load {h['load']['median']} "
              f"median ({h['load']['min']}-{h['load']['max']}); progress {h['progress_in_window']}; looks "
              f"{h['looks']}; false alarms {h['false_alarms']} (mails {h['mails']}, alarming looks "
              f"{h['alarming_looks']}, retries {h['retries']})")
    out["ok"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if not args.keep:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
