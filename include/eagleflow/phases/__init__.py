"""The sharded phases: one folder each (``phases/extract``, ``phases/generate``), registered here.

Past the CLI's parsing a phase is its descriptor, a ``ShardKind`` (``phases.descriptor``), looked up by name in
``KINDS``: the operators, the DAG, the watch, the recovery, reconcile and the fleet read it and never branch on
which phase it is (tests/unit/test_phase_names.py). Each phase is a package ``eagleflow.phases.<name>`` whose
``__init__`` holds its ``KIND`` and nothing heavier; beside it its worker, node commands and ``PhaseLifecycle``.
What both phases share is here: the worker skeleton (``phases.shared.worker``) and the node-command skeleton
(``phases.shared.commands``), each taking the descriptor.

A new sharded phase is a folder ``phases/<name>/`` plus its line in ``PHASE_MODULES`` and its place in
``RUN_ORDER`` (docs/phases.md lists the other files: its DAG placement, its config section). The CLI registers
each phase's ``commands`` from this list.
"""
from __future__ import annotations

from .descriptor import PhaseLifecycle, ShardKind, load_phases

__all__ = ["EXTRACT", "GENERATE", "KINDS", "PACKAGES", "PHASE_MODULES", "RUN_ORDER", "PhaseLifecycle",
           "ShardKind", "commands_module", "kind_of", "kind_of_job", "unit_of_job"]

# The phases' packages, in registration order (the order of every list of phases).
PHASE_MODULES: tuple[str, ...] = ("eagleflow.phases.extract", "eagleflow.phases.generate")

KINDS: dict[str, ShardKind] = load_phases(PHASE_MODULES)
PACKAGES: dict[str, str] = dict(zip(KINDS, PHASE_MODULES))   # a phase's name -> its folder's package

# the names the existing phases' callers default to (a new phase needs no constant: its KIND.phase is its name),
# read from the loaded descriptors: an import of the phases' folders here would close a circle (they import this)
_BY_PACKAGE = {module: kind for module, kind in zip(PHASE_MODULES, KINDS.values())}
EXTRACT: str = _BY_PACKAGE["eagleflow.phases.extract"].phase
GENERATE: str = _BY_PACKAGE["eagleflow.phases.generate"].phase

# the sharded phases in the order a run runs them
RUN_ORDER: tuple[str, ...] = (GENERATE, EXTRACT)


def commands_module(kind: ShardKind) -> str:
    """The module whose ``register(subparsers)`` adds the phase's node commands (its folder's ``commands``)."""
    return PACKAGES[kind.phase] + ".commands"


def kind_of(phase: str) -> ShardKind:
    try:
        return KINDS[phase]
    except KeyError:
        raise ValueError(f"phase {phase!r} is not one of {sorted(KINDS)}") from None


def kind_of_job(job_name: str) -> ShardKind | None:
    """The sharded phase of a watched job, from the name the watch gives it ("generate shard 3/8": generation);
    None for a job of no sharded phase (the trainer's "training")."""
    for kind in sorted(KINDS.values(), key=lambda k: -len(k.watch_name)):
        if job_name.startswith(kind.watch_name + " "):
            return kind
    return None


def unit_of_job(job_name: str, default: str = "samples") -> str:
    """What a watched job's manifest counts, from the name the watch gives it ("generate shard 3/8": records)."""
    kind = kind_of_job(job_name)
    return kind.unit if kind else default
