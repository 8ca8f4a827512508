"""`eagleflow store start|stop|status`: the run's hidden-state store server on the training node.

A top-level module, not ``stores/commands.py``: the store registry (``eagleflow.stores``) sits below the config
that validates ``stream.storage`` against it, and this CLI sits above the config (tests/unit/test_layers.py).

A streaming store (``stream.storage: mooncake``) runs as recorded processes (the master and its segment
holder: ``<state_dir>/pids/<run_id>.mooncake-*.json``), started before the capture workers and the trainer
and stopped, by their records only, once training is done; with ``stream.master`` (an existing master) only the
segment holder is the run's, and the master is judged by its port and never signalled. Its endpoint goes to the run's
``store_endpoint.json``, which every sink and source reads. The disk store has no server: start and stop
say so and do nothing.
"""
from __future__ import annotations

import json
import sys

from eagleflow.cliargs import add_run_args, run_from_args
from eagleflow.local_run import own_run_folders
from eagleflow.stores import run_store_settings, store_for
from eagleflow.stores.contract import StoreError


def register(sub) -> None:
    p = sub.add_parser("store", help="the run's hidden-state store (stream.storage): start, stop, status")
    ssub = p.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    s = ssub.add_parser("start", help="start the run's store server as recorded processes on this node (or name "
                                      "the one already running); prints its endpoint as JSON")
    add_run_args(s)
    s.add_argument("--timeout", type=float, default=60.0, help="seconds for the server to come up")
    s.set_defaults(func=_start)
    t = ssub.add_parser("stop", help="stop the run's store server by its pid records (TERM, grace, KILL)")
    add_run_args(t)
    t.add_argument("--grace", type=float, default=10.0)
    t.set_defaults(func=_stop)
    st = ssub.add_parser("status", help="exit 0 when the run's store answers (or it has no server)")
    add_run_args(st)
    st.set_defaults(func=_status)


def _settings(args):
    cfg, layout = run_from_args(args)
    return cfg, layout, store_for(cfg.stream.storage), run_store_settings(cfg, layout)


def _start(args) -> int:
    cfg, layout, store, settings = _settings(args)
    if not store.start:
        print(json.dumps({"store": store.name, "started": False, "detail": f"the {store.label} has no server"}))
        return 0
    own_run_folders(layout)
    try:
        info = store.start_server(settings, state_dir=str(layout.state_dir), host=cfg.stream.host,
                                  **_master_options(cfg.stream))
    except RuntimeError as e:         # MooncakeStartError: names the process and its log
        print(f"eagleflow store start: {e}", file=sys.stderr, flush=True)
        return 3
    print(json.dumps({"store": store.name, "endpoint_file": settings.endpoint_file, **info}), flush=True)
    return 0


def _master_options(stream) -> dict:
    """The transport (``stream.protocol``, ``stream.device_names``), and an existing master named by
    ``stream.master`` (the run then starts none; none named: the run starts its own)."""
    hp = stream.master_host_port
    transport = {"protocol": stream.protocol, "device_names": stream.device_names}
    return transport if hp is None else {**transport, "master": hp, "master_metadata_port": stream.master_metadata_port,
                                         "master_metrics_port": stream.master_metrics_port}


def _stop(args) -> int:
    _, _, store, settings = _settings(args)
    results = store.stop_server(settings, grace_s=args.grace)
    print(json.dumps({"store": store.name, "stopped": results}), flush=True)
    bad = [r for r in results if r["outcome"] in ("refused", "unkillable", "survived", "not_ours")]
    return 1 if bad else 0


def _status(args) -> int:
    _, _, store, settings = _settings(args)
    if not store.streaming:
        print(json.dumps({"store": store.name, "healthy": True}))
        return 0
    try:
        source = store.open_source(settings, log=lambda _m: None)
        source.close()
    except StoreError as e:
        print(json.dumps({"store": store.name, "healthy": False, "detail": str(e)}))
        return 1
    # how it is judged (an existing master, stream.master: by its port only, no pid record): said, as the watch says it
    h = store.server_health(settings) or {}
    said = {k: h[k] for k in ("detail", "foreign_master") if k in h}
    print(json.dumps({"store": store.name, "healthy": True, **said}))
    return 0
