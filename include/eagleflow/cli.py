"""The `eagleflow` command: every pipeline phase is a CLI command first.

Each subsystem registers its own subcommands (``register(subparsers)`` in its
``commands`` module); this file only dispatches. Imports are lazy so that
`eagleflow --help` stays fast on a node without torch warmed up.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .config import ConfigError
from .durable import UnsafeFile
from .phases import KINDS, commands_module

# modules with register(subparsers), in the order of `eagleflow --help`: each sharded phase's node commands
# come from the phases' registry (eagleflow.phases: its folder's ``commands``), after the corpus
_COMMAND_MODULES = [
    "eagleflow.gpu.commands",
    "eagleflow.corpus_commands",
    *(commands_module(kind) for kind in KINDS.values()),
    "eagleflow.watchdog.commands",
    "eagleflow.train.commands",
    "eagleflow.store_commands",   # beside, not in, stores/: the registry sits below the config, its CLI above
    "eagleflow.evaluate.commands",
    "eagleflow.console.commands",
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="eagleflow",
        description="EAGLE-3 draft training pipeline: corpus, GPU gates, hidden-state capture, "
                    "stall watchdog, draft training. Each phase runs alone from here or as an Airflow task.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod_name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name == mod_name:
                continue  # subsystem not installed in this build
            raise
        mod.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"eagleflow: {e}", file=sys.stderr)
        return 2
    except UnsafeFile as e:   # a record, lock, log or key that is a symlink, not ours or writable by others
        print(f"eagleflow: refused: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
