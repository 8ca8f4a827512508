"""A new sharded phase is its folder plus the files docs/phases.md lists ("Adding a sharded phase"): a dry run.

In a copy of the package (and of the pipeline DAG), a stub phase's folder ``phases/stub/`` (its descriptor, worker,
node commands and lifecycle, written on the shared skeletons) plus exactly the three listed edits (its line in
the registry ``phases/__init__.py``, its config section in ``config.py``, its placement in
``dags/eagle3_pipeline.py``) is registered everywhere: the descriptor is found by name and by a watched job's
name, the CLI offers its commands and runs a shard of it through the worker skeleton into the folder its
descriptor derives (no ``layout.py`` edit), and the DAG builds its chain of tasks.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.phases import KINDS, PACKAGES, PHASE_MODULES, commands_module

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "include" / "eagleflow"
DAG = REPO / "dags" / "eagle3_pipeline.py"

# the files outside a phase's folder that a new phase touches (docs/phases.md says the same, checked below)
LISTED = ["dags/eagle3_pipeline.py", "include/eagleflow/config.py", "include/eagleflow/phases/__init__.py"]

STUB_INIT = '''"""A stub phase's descriptor, written by tests/unit/test_phase_dry_run.py into a copy of the package."""
from __future__ import annotations

from eagleflow.phases.descriptor import ShardKind

STUB = "stub"

KIND = ShardKind(
    phase=STUB, noun="stubbing", unit="items", label="stub shard", watch_name="stub shard", server="stub server",
    server_role="stub_server", worker_prefix="stub_shard_", marker="reconcile-started-stub_server",
    started_dir="stubbed", shards_field="stub.shards", enabled_field="stub.enabled",
    shards_of=lambda cfg: cfg.stub.shards, enabled_of=lambda cfg: cfg.stub.enabled, takeover_key="stub_shards",
    prepared_key="stub_shards", shard_task="stub_shard", collect_task="collect_stubbed",
    takeover_task="take_over_stubbed", copy_last=("manifest.jsonl",), copy_skip=(),
    free_task="free_gpus_before_stub", idle_task="gpus_idle_before_stub", start_task="start_stub_server",
    ready_task="stub_server_ready", plan_task="plan_stub_shards", stop_task="stop_stub_server",
    free_after_task="free_gpus_after_stub", lifecycle_ref="eagleflow.phases.stub.phase_lifecycle:LIFECYCLE",
    command="stub", server_mode="stub", shard_starts_server=False, retry_advice="The retry redoes the shard.")
'''

STUB_WORKER = '''"""The stub phase's worker: one file per item of its shard, on the worker skeleton."""
from __future__ import annotations

import time
from typing import Callable

from eagleflow.heartbeat import Heartbeat, HeartbeatWriter
from eagleflow.phases.shared.worker import PhaseWorker

from . import KIND


class StubError(RuntimeError):
    pass


class StubWorker(PhaseWorker):
    kind = KIND
    error = StubError
    items = 10

    def _run(self, hbw: HeartbeatWriter) -> None:
        todo = [i for i in range(self.items) if i % self.num_shards == self.shard]

        def init(hb: Heartbeat) -> None:
            hb.state, hb.total, hb.started_at = "running", len(todo), time.time()
        hbw.update(init)

        def make_one() -> Callable[[int], None]:
            def one(i: int) -> None:
                (self.shard_dir / f"{i:08d}.item").write_text(str(i))

                def done(hb: Heartbeat) -> None:
                    hb.done += 1
                hbw.update(done)
            return one
        self._drive(todo, 3, self.kind.phase, make_one, lambda threads: self._stop.set())
        self._raise_failure()
'''

STUB_COMMANDS = '''"""`eagleflow stub ...`: the stub phase's node commands, all from the skeleton."""
from __future__ import annotations

from eagleflow.phases.shared import commands as skeleton
from eagleflow.phases.shared.commands import PhaseCommands

from . import KIND
from .worker import StubError, StubWorker


def _make_worker(cfg, layout, job, url):
    return StubWorker(job.shard, job.num_shards, job.shard_dir, 0.05, log=print)


COMMANDS = PhaseCommands(kind=KIND, help="a stub phase", serve=lambda args: 7, serve_help="serve nothing",
                         run_help="stub one shard", make_worker=_make_worker, errors=(StubError,),
                         kept="written items are kept")


def register(sub) -> None:
    skeleton.register(sub, COMMANDS)
'''

STUB_LIFECYCLE = '''"""The stub phase's PhaseLifecycle, on the shared lifecycle."""
from __future__ import annotations

from eagleflow.phase_jobs import wait_server_ready
from eagleflow.phases.shared import lifecycle as shared
from eagleflow.phases.descriptor import PhaseLifecycle

from . import KIND


def _wait(ctx, timeout_s=None, poll_s=1.0, log=None):
    return wait_server_ready(ctx, lambda: shared.check_ready(ctx, KIND), KIND.server, KIND.server_role,
                             timeout_s or 1.0, poll_s)


def _stop(ctx, grace_s=30.0, log=None):
    return ctx.node.stop_recorded(str(ctx.layout.pid_file(KIND.server_role)), grace_s=grace_s).outcome


LIFECYCLE = PhaseLifecycle(
    start_server=lambda ctx, log=None: shared.start_server(ctx, KIND, KIND.server, log),
    check_ready=lambda ctx, health_timeout_s=20.0: shared.check_ready(ctx, KIND, health_timeout_s),
    wait_server_ready=_wait, stop_server=_stop,
    start_worker=lambda ctx, shard, log=None: shared.start_or_attach_worker(ctx, KIND, shard, log),
    before_retry=lambda ctx, shard, log: None, after_failed_watch=lambda ctx, shard, event: False,
    shard_expectation=lambda run, shard: (0, True), can_be_judged=lambda run: False)
'''

STUB_CONFIG_SECTION = '''class StubConfig(_Section):
    """The stub phase (tests/unit/test_phase_dry_run.py)."""
    enabled: bool = Field(default=False, description="run the stub phase")
    shards: int = Field(default=2, ge=1, le=1024, description="stub shards")


'''

STUB_DAG_PLACEMENT = '''        stub = phase_tasks(KINDS["stub"], node)   # the stub phase: after the node's capture
        ext.free_after >> stub.first
'''

CHECKS = '''
import io, json, runpy, sys
from contextlib import redirect_stdout
from pathlib import Path
import yaml
import eagleflow
from eagleflow.cli import build_parser, main
from eagleflow.config import load_config
from eagleflow.layout import RunLayout
from eagleflow.phases import KINDS, RUN_ORDER, PhaseLifecycle, kind_of, kind_of_job
from eagleflow.watchdog.signals import WatchedJob

tmp = Path(sys.argv[1])
assert Path(eagleflow.__file__).is_relative_to(tmp), eagleflow.__file__   # the copy, not the repository
assert list(KINDS) == ["extract", "generate", "stub"], list(KINDS)
assert RUN_ORDER[-1] == "stub", RUN_ORDER
stub = kind_of("stub")
assert isinstance(stub.lifecycle(), PhaseLifecycle)
assert kind_of_job("stub shard 1/2") is stub and WatchedJob(shard=1, num_shards=2, phase="stub").kind is stub

# the CLI: the registry's phases, each with the skeleton's actions
group = build_parser()._subparsers._group_actions[0].choices["stub"]
actions = set(group._subparsers._group_actions[0].choices)
assert actions == {"serve", "run", "start", "wait", "stop", "health"}, actions
base = {"target_model": "/models/t", "run_root": str(tmp / "runs"),
        "node": {"has_gpu": False, "state_dir": str(tmp / "state")}, "stub": {"enabled": True, "shards": 2}}
cfgp = tmp / "c.yaml"
cfgp.write_text(yaml.safe_dump(base))
cfg = load_config(cfgp)
assert stub.shards_to_run(cfg) == 2
assert main(["stub", "serve", "--config", str(cfgp), "--run-id", "s"]) == 7
# a shard through the skeleton's run: lock, hand-over check, worker skeleton, heartbeat, in the derived folder
out = io.StringIO()
with redirect_stdout(out):
    code = main(["stub", "run", "--config", str(cfgp), "--run-id", "s", "--shard", "1", "--url", "http://127.0.0.1:9"])
assert code == 0, out.getvalue()
layout = RunLayout.for_run(cfg, "s")
shard_dir = Path(str(layout.run_dir)) / "stubbed" / "shard_00001"
assert Path(str(stub.shard_dir(layout, 1))) == shard_dir
assert sorted(p.name for p in shard_dir.glob("*.item")) == [f"{i:08d}.item" for i in (1, 3, 5, 7, 9)]
hb = json.loads((shard_dir / "heartbeat.json").read_text())
assert (hb["state"], hb["job"], hb["unit"], hb["done"], hb["total"]) == ("complete", "stub shard 1/2", "items", 5, 5), hb
assert main(["stub", "run", "--config", str(cfgp), "--run-id", "s", "--shard", "2"]) == 2   # outside 0..1

# the DAG: its placement builds the phase's chain from the descriptor
dag = runpy.run_path(sys.argv[2])["dag"]
for task in ("free_gpus_before_stub", "gpus_idle_before_stub", "start_stub_server", "stub_server_ready",
             "plan_stub_shards", "stub_shard", "stop_stub_server", "free_gpus_after_stub"):
    dag.get_task(task)
assert "free_gpus_before_stub" in dag.get_task("free_gpus_after_capture").downstream_task_ids
assert "stub_shard" in dag.get_task("plan_stub_shards").downstream_task_ids
assert dag.get_task("stop_stub_server").is_teardown
print("STUB PHASE OK")
'''


def _edit(path: Path, anchor: str, new: str) -> None:
    text = path.read_text()
    assert text.count(anchor) == 1, f"{path}: the anchor {anchor!r} is not there once"
    path.write_text(text.replace(anchor, new))


def _changed(root: Path, orig: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if "__pycache__" not in p.parts and "stub" not in p.relative_to(root).parts[:-1]
                  and p.read_bytes() != (orig / p.relative_to(root)).read_bytes())


@pytest.mark.timeout(240)
def test_a_stub_phase_is_its_folder_and_the_listed_files(tmp_path):
    orig = tmp_path / "orig"   # one snapshot: other edits to the repository meanwhile change nothing here
    shutil.copytree(PKG, orig / "include" / "eagleflow", ignore=shutil.ignore_patterns("__pycache__"))
    (orig / "dags").mkdir()
    shutil.copy(DAG, orig / "dags" / DAG.name)
    tree = tmp_path / "tree"
    shutil.copytree(orig, tree)
    pkg = tree / "include" / "eagleflow"
    stub = pkg / "phases" / "stub"
    stub.mkdir()
    for name, text in (("__init__.py", STUB_INIT), ("worker.py", STUB_WORKER), ("commands.py", STUB_COMMANDS),
                       ("phase_lifecycle.py", STUB_LIFECYCLE)):
        (stub / name).write_text(text)
    # 1. the registry: its line in PHASE_MODULES and its place in RUN_ORDER
    registry = pkg / "phases" / "__init__.py"
    _edit(registry, '"eagleflow.phases.generate")', '"eagleflow.phases.generate",\n'
                                                     '                                  "eagleflow.phases.stub")')
    _edit(registry, "RUN_ORDER: tuple[str, ...] = (GENERATE, EXTRACT)",
          'RUN_ORDER: tuple[str, ...] = (GENERATE, EXTRACT, "stub")')
    # 2. its config section
    config = pkg / "config.py"
    _edit(config, "\nclass PipelineConfig(_Section):\n", "\n" + STUB_CONFIG_SECTION + "class PipelineConfig(_Section):\n")
    _edit(config, "    generate: GenerateConfig = Field(default_factory=GenerateConfig)\n",
          "    generate: GenerateConfig = Field(default_factory=GenerateConfig)\n"
          "    stub: StubConfig = Field(default_factory=StubConfig)\n")
    # 3. its placement in the DAG
    dag = tree / "dags" / DAG.name
    _edit(dag, "        ext = phase_tasks(EXT, node, after_shards=held_out)\n",
          "        ext = phase_tasks(EXT, node, after_shards=held_out)\n" + STUB_DAG_PLACEMENT)

    assert _changed(tree, orig) == LISTED
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EAGLEFLOW_CONFIG")}
    res = subprocess.run([sys.executable, "-c", CHECKS, str(tmp_path), str(dag)],
                         env={**env, "PYTHONPATH": str(pkg.parent), "EAGLEFLOW_HOME": str(REPO)},
                         cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert res.returncode == 0 and "STUB PHASE OK" in res.stdout, res.stdout[-3000:] + res.stderr[-5000:]


def test_the_docs_list_the_files_the_dry_run_touches():
    """docs/phases.md's "Adding a sharded phase" names exactly the files the dry run above edits."""
    text = (REPO / "docs" / "phases.md").read_text()
    section = text[text.index("## Adding a sharded phase"):]
    section = section[:section.index("\n## ", 3)]
    listed = [line for line in section.splitlines() if line[:3] in ("1. ", "2. ", "3. ", "4. ", "5. ")]
    assert len(listed) == len(LISTED) <= 3, listed
    named = {m.group(1) for line in listed if (m := re.search(r"`([\w/.]+\.py)`", line))}
    assert named == {path.removeprefix("include/") for path in LISTED}, listed


def test_each_phase_is_its_folder_and_its_paths_are_the_layouts():
    """Every registered phase is a package under phases/ with its worker's commands there, and the folders its
    descriptor derives by default (what a new phase gets) are where the layout already puts the existing ones."""
    assert [PACKAGES[k] for k in KINDS] == list(PHASE_MODULES)
    for kind in KINDS.values():
        assert PACKAGES[kind.phase] == f"eagleflow.phases.{kind.phase}"
        assert commands_module(kind) == f"eagleflow.phases.{kind.phase}.commands"
        assert (PKG / "phases" / kind.phase / "commands.py").is_file()
    cfg = load_config(data={"target_model": "/models/t"})
    for layout in (RunLayout.for_run(cfg, "r"), RunLayout(run_id="r", run_dir=RunLayout.for_run(cfg, "r").run_dir,
                                                           state_dir=RunLayout.for_run(cfg, "r").state_dir,
                                                           node_tag="n2")):
        for kind in KINDS.values():
            default = type(kind)(**{**kind.__dict__, "shard_dir_in": None, "server_info_in": None})
            assert default.shard_dir(layout, 7) == kind.shard_dir(layout, 7), kind.phase
            assert default.server_info_file(layout) == kind.server_info_file(layout), kind.phase
