"""Arguments every phase command shares: which config, which run."""
from __future__ import annotations

import argparse

from .config import PipelineConfig, check_run_name, load_config
from .layout import RunLayout


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="pipeline config (YAML or the run's run-config.json)")
    p.add_argument("--run-id", default="manual", help="run directory name under run_root (default: manual)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field, e.g. --set capture.shards=4 (value parsed as YAML)")


def parse_overrides(sets: list[str]) -> dict:
    """``--set FIELD=VALUE`` pairs as dotted overrides, each value parsed as YAML."""
    import yaml
    overrides = {}
    for kv in sets:
        k, sep, v = kv.partition("=")
        if not sep:
            raise SystemExit(f"--set {kv!r}: expected FIELD=VALUE")
        overrides[k] = yaml.safe_load(v)
    return overrides


def run_from_args(args: argparse.Namespace) -> tuple[PipelineConfig, RunLayout]:
    check_run_name(args.run_id, "--run-id")
    cfg = load_config(args.config, parse_overrides(args.set))
    return cfg, RunLayout.for_run(cfg, args.run_id)
