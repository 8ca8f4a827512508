"""`eagleflow gpu ...`: status, wait-idle, free, baseline.

``status`` and ``wait-idle`` and ``baseline`` read the config's node (locally
or over its SSH connection). ``free`` signals processes, so it runs on the
node itself: FreeGpusOperator starts it there over SSH with ``--on-node``.
With ``node.has_gpu: false`` every command says so and succeeds. A node the
config gives GPUs whose driver is gone is not a CPU node: ``status`` reports
the configured GPUs unreadable, names the driver problem and exits non-zero.
"""
from __future__ import annotations

import json
import os
import sys

from eagleflow.cliargs import add_run_args, run_from_args, parse_overrides
from eagleflow.config import PipelineConfig, load_config, set_dotted
from eagleflow.layout import TRAINER_ROLE
from eagleflow.nodes import LocalNode, Node, NodeError, node_from_config
from eagleflow.stores import store_for

from .cleanup import free_recorded_processes
from .errors import GpuProbeError, NoGpuError
from .idle_gate import IdleGate, no_gpu_message
from .idle_policy import baseline_document
from .snapshot import format_table

EXIT_NOT_IDLE = 1
EXIT_PROBE_FAILED = 3


def register(subparsers) -> None:
    gpu = subparsers.add_parser("gpu", help="GPU state on the node: status, wait-idle, free, baseline")
    sub = gpu.add_subparsers(dest="gpu_command", metavar="ACTION", required=True)

    st = sub.add_parser("status", help="show each GPU (memory, utilisation, processes) like nvidia-smi")
    st.add_argument("--config", default=os.environ.get("EAGLEFLOW_CONFIG"),
                    help="pipeline config (default: $EAGLEFLOW_CONFIG; none = this machine, defaults)")
    st.add_argument("--node", metavar="CONN_ID", help="read this Airflow SSH connection's node instead")
    st.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.set_defaults(func=cmd_status)

    wi = sub.add_parser("wait-idle", help="wait until every selected GPU is at its idle baseline")
    add_run_args(wi)
    wi.add_argument("--timeout", type=float, help="seconds (default gpu.idle_timeout_s)")
    wi.add_argument("--json", action="store_true")
    wi.set_defaults(func=cmd_wait_idle)

    fr = sub.add_parser("free", help="stop the processes eagleflow recorded for this run on this node (TERM, grace, "
                                     "KILL); another run's live jobs are named and left running")
    add_run_args(fr)
    fr.add_argument("--force", action="store_true",
                    help="also kill processes NOT started by eagleflow, and other runs' live jobs, that hold the "
                         "selected GPUs")
    fr.add_argument("--on-node", action="store_true",
                    help="this machine is the config's node (how FreeGpusOperator runs it over SSH)")
    fr.add_argument("--keep-trainer", action="store_true",
                    help="leave this run's trainer (and its sentinel) running: a streaming run trains beside the "
                         "capture whose GPUs this frees (stream.storage)")
    fr.add_argument("--json", action="store_true")
    fr.set_defaults(func=cmd_free)

    bl = sub.add_parser("baseline", help="record each GPU's idle memory (per UUID) into gpu.baseline_file")
    add_run_args(bl)
    bl.add_argument("--out", help="where to write it on the node (default gpu.baseline_file)")
    bl.set_defaults(func=cmd_baseline)


def _status_config(args) -> PipelineConfig:
    overrides = parse_overrides(args.set)
    if args.node:
        overrides["node.conn_id"] = args.node
        overrides.setdefault("node.name", args.node)
    if args.config:
        return load_config(args.config, overrides)
    data: dict = {"target_model": "(none)"}
    for k, v in overrides.items():
        set_dotted(data, k, v)
    return load_config(data=data)


def _print(obj, as_json: bool, text: str) -> None:
    print(json.dumps(obj) if as_json else text)  # one line: the control plane reads the last line (Node.run_json)


def cmd_status(args) -> int:
    cfg = _status_config(args)
    if not cfg.node.has_gpu:
        _print({"node": cfg.node.name, "has_gpu": False, "gpus": [], "message": no_gpu_message(cfg)},
               args.json, no_gpu_message(cfg))
        return 0
    with node_from_config(cfg) as node:
        try:
            gate = IdleGate(node, cfg)
            snaps = gate.probe.snapshot()
        except NoGpuError as e:
            doc = unreadable_status(cfg, node.name, e, config_path=args.config)
            if args.json:
                _print(doc, True, "")
            print(f"eagleflow gpu status: {doc['message']}", file=sys.stderr)
            return EXIT_PROBE_FAILED
        except (GpuProbeError, NodeError, ValueError) as e:
            print(f"eagleflow gpu status: {e}", file=sys.stderr)
            return EXIT_PROBE_FAILED
        report = gate.policy.evaluate(snaps, cfg.gpu.select, node.name)
        _print({"node": node.name, "has_gpu": True, "readable": True, "gpus": [s.to_dict() for s in snaps],
                "idle": report.to_dict()}, args.json, format_table(snaps, node.name) + "\n" + report.message())
    return 0


def unreadable_status(cfg: PipelineConfig, node_name: str, error: NoGpuError, *,
                      config_path: str | None = None) -> dict:
    """Status of a node whose config says it has GPUs but whose driver stack answers nothing."""
    selected = [str(s) for s in cfg.gpu.select] or ["all"]
    where = f" in {config_path}" if config_path else " by default: no --config given"
    msg = (f"node {node_name}: GPUs configured (node.has_gpu: true, gpu.select: {', '.join(selected)}{where}) "
           f"but none is readable: {error}. Repair the NVIDIA driver there (`nvidia-smi` must list the GPUs), or "
           f"set node.has_gpu: false if this is a CPU node")
    return {"node": node_name, "has_gpu": True, "readable": False, "gpus": [],
            "unreadable": [{"gpu": s, "reason": str(error)} for s in selected],
            "probe": cfg.gpu.probe, "driver_error": str(error), "message": msg}


def cmd_wait_idle(args) -> int:
    cfg, _ = run_from_args(args)
    if not cfg.node.has_gpu:
        print(no_gpu_message(cfg))
        return 0
    timeout = args.timeout if args.timeout is not None else cfg.gpu.idle_timeout_s
    with node_from_config(cfg) as node:
        try:
            report = IdleGate(node, cfg).wait(timeout, cfg.gpu.poll_interval_s,
                                              log=lambda m: print(m, file=sys.stderr, flush=True))
        except (GpuProbeError, NodeError, ValueError) as e:
            print(f"eagleflow gpu wait-idle: {e}", file=sys.stderr)
            return EXIT_PROBE_FAILED
    _print(report.to_dict(), args.json, report.message() if report.all_idle
           else f"GPUs still not idle after {timeout:.0f} s:\n{report.message()}")
    return 0 if report.all_idle else EXIT_NOT_IDLE


def node_for_free(cfg, on_node: bool) -> Node:
    if cfg.node.conn_id and not on_node:
        raise SystemExit(f"eagleflow gpu free: the config's node is {cfg.node.name} (connection "
                         f"{cfg.node.conn_id!r}); `gpu free` signals processes, so run it on that node with "
                         f"--on-node (FreeGpusOperator does this over SSH)")
    return LocalNode(name=cfg.node.name, python=cfg.node.python or None)


def cmd_free(args) -> int:
    cfg, layout = run_from_args(args)
    node = node_for_free(cfg, args.on_node)
    force = bool(args.force or cfg.gpu.force_free)
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    gpu_procs = None   # not read: no other run's job is stopped, even with force
    note = None
    if cfg.node.has_gpu:
        try:
            snaps = IdleGate(node, cfg).check()
            gpu_procs = [p for v in snaps.verdicts for p in v.snapshot.processes]
        except NoGpuError as e:
            note = f"no GPU readable ({e}); only this run's recorded processes are stopped"
            log(note)
    else:
        note = no_gpu_message(cfg).replace("the GPU gate passes", "only this run's recorded processes are stopped")
        log(note)
    # this run's records only (the state dir is the node's, every run's): another run's live job is named, left.
    # The run's store server is stopped by `eagleflow store stop` only (it lives from start_store to stop_store)
    keep = set(store_for(cfg.stream.storage).roles)
    if getattr(args, "keep_trainer", False):
        keep |= {TRAINER_ROLE, f"sentinel_{TRAINER_ROLE}"}
    report = free_recorded_processes(str(layout.state_dir), run_id=layout.run_id, grace_s=cfg.gpu.kill_grace_s,
                                     force=force, gpu_processes=gpu_procs, log=log, keep_roles=keep)
    out = report.to_dict() | {"node": node.name, "force": force, "note": note}
    _print(out, args.json, report.message())
    return 0


def cmd_baseline(args) -> int:
    cfg, _ = run_from_args(args)
    if not cfg.node.has_gpu:
        print(no_gpu_message(cfg).replace("the GPU gate passes", "no baseline to record"))
        return 0
    out = args.out or (str(cfg.resolve(cfg.gpu.baseline_file)) if cfg.gpu.baseline_file else None)
    if not out:
        raise SystemExit("eagleflow gpu baseline: set gpu.baseline_file in the config or pass --out PATH")
    with node_from_config(cfg) as node:
        try:
            snaps = IdleGate(node, cfg).probe.snapshot()
            doc = baseline_document(snaps, node.name)
        except (GpuProbeError, NodeError, ValueError) as e:
            print(f"eagleflow gpu baseline: {e}", file=sys.stderr)
            return EXIT_PROBE_FAILED
        node.write_text(out, json.dumps(doc, indent=2))
    for uuid, g in doc["gpus"].items():
        print(f"GPU {g['index']} {uuid}: idle baseline {g['memory_used_mib']} MiB")
    print(f"written to {out} on node {node.name}")
    return 0
