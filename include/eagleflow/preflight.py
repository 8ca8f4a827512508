"""Inputs a run needs, checked on the node before anything costly starts (the pipeline's first task).

``python -m eagleflow.preflight RUN_ID`` reads the run's resolved config (JSON)
on stdin and prints one JSON line: the problems found, each naming the config
field, its value and what to do. Checked: the target model directory (config
and tokenizer files present and readable, weights present), every corpus
source, ``run_root`` and ``server.dump_dir`` writable, and free space at
``dump_dir`` for the dumps in flight. Airflow-free: the node runs it.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from eagleflow.serving.dump_protocol import DumpTrustError, expand_dump_dir, private_dump_dir

from .config import ConfigError, PipelineConfig, load_config
from .corpus.budget import BudgetError, bytes_per_token, target_shape

# one of these makes a tokenizer AutoTokenizer can load (fast, sentencepiece, tiktoken, BPE vocab)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "spiece.model")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass
class InputProblem:
    field: str
    value: str
    message: str

    def line(self) -> str:
        return f"{self.field} = {self.value!r}: {self.message}"


@dataclass
class PreflightReport:
    problems: list[InputProblem] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, fld: str, value, message: str) -> None:
        self.problems.append(InputProblem(fld, str(value), message))


def _readable_file(p: Path) -> str | None:
    if not p.is_file():
        return "is missing"
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as e:
        return f"is not readable ({e.strerror})"
    return None


def check_target_model(cfg: PipelineConfig, rep: PreflightReport) -> None:
    path = cfg.resolve(cfg.target_model)
    fld = "target_model"
    if not path.exists():
        rep.add(fld, path, "does not exist on the node; give the local directory of the target model "
                           "(config.json, weights, tokenizer); nothing is downloaded from a model hub")
        return
    if not path.is_dir():
        rep.add(fld, path, "is not a directory; give the model's directory, not a file in it")
        return
    if not os.access(path, os.R_OK | os.X_OK):
        rep.add(fld, path, "is not readable by this user; fix its permissions")
        return
    why = _readable_file(path / "config.json")
    if why:
        rep.add(fld, path, f"config.json {why}; a Hugging Face model directory holds config.json")
    else:
        try:
            json.loads((path / "config.json").read_text())
        except ValueError as e:
            rep.add(fld, path, f"config.json is not valid JSON ({e})")
    toks = [n for n in TOKENIZER_FILES if (path / n).is_file()]
    if not toks:
        rep.add(fld, path, f"has no tokenizer file (one of {', '.join(TOKENIZER_FILES)}); copy the tokenizer "
                           "into the model directory")
    for n in toks + [n for n in ("tokenizer_config.json",) if (path / n).exists()]:
        why = _readable_file(path / n)
        if why:
            rep.add(fld, path, f"{n} {why}")
    if not any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()):
        rep.add(fld, path, f"has no weights (*{', *'.join(WEIGHT_SUFFIXES)}); the capture server cannot load it")
    rep.checked.append(f"target model {path}")


def check_sources(cfg: PipelineConfig, rep: PreflightReport) -> None:
    if not cfg.corpus.sources:
        rep.add("corpus.sources", "[]", "no sources; list at least one chat dataset (name, path)")
    for i, src in enumerate(cfg.corpus.sources):
        p = cfg.resolve(src.path)
        fld = f"corpus.sources[{i}].path ({src.name})"
        if not p.exists():
            rep.add(fld, p, "does not exist on the node; fix the path")
        elif p.is_dir():
            if not os.access(p, os.R_OK | os.X_OK):
                rep.add(fld, p, "is a directory this user cannot read; fix its permissions")
        else:
            why = _readable_file(p)
            if why:
                rep.add(fld, p, why)
        rep.checked.append(f"source {src.name} {p}")


def _writable_dir(path: Path) -> str | None:
    """Create ``path`` if needed and prove a file can be written in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tmp-preflight-"):
            pass
    except OSError as e:
        return f"is not writable ({e.strerror or e}); fix its permissions or choose another directory"
    return None


def dump_bytes_in_flight(cfg: PipelineConfig) -> int | None:
    """Worst case of dumps on disk at once: every worker's requests in flight at max_length tokens."""
    cpath = cfg.resolve(cfg.target_model) / "config.json"
    try:
        shape = target_shape(cpath.read_text(), str(cpath), cfg.server.dtype)
    except (OSError, BudgetError):
        return None   # reported by check_target_model
    return cfg.capture.shards * cfg.capture.in_flight * cfg.corpus.max_length * bytes_per_token(shape)


def check_dirs(cfg: PipelineConfig, run_id: str, rep: PreflightReport) -> None:
    root = cfg.resolve(cfg.run_root)
    why = _writable_dir(root)
    if why:
        rep.add("run_root", root, why)
    else:
        rep.checked.append(f"run_root {root} writable")
    dump = expand_dump_dir(cfg.server.dump_dir)   # {uid}: this node user's folder
    try:
        private_dump_dir(dump)                     # 0700, ours, no symlink: nobody else reads or swaps a dump
    except DumpTrustError as e:
        rep.add("server.dump_dir", dump, str(e).removeprefix(f"server.dump_dir {dump} "))
        return
    except OSError:
        pass                                       # cannot be created: _writable_dir names why
    why = _writable_dir(dump)
    if why:
        rep.add("server.dump_dir", dump, why)
        return
    need = dump_bytes_in_flight(cfg)
    free = shutil.disk_usage(dump).free
    if need is not None and free < need:
        rep.add("server.dump_dir", dump,
                f"has {free / 2**20:.1f} MiB free but the dumps in flight can take {need / 2**20:.1f} MiB "
                f"({cfg.capture.shards} shard(s) x {cfg.capture.in_flight} in flight x {cfg.corpus.max_length} "
                "tokens); free space there, point dump_dir at a bigger filesystem, or lower capture.in_flight")
    rep.checked.append(f"dump_dir {dump} writable, {free / 2**20:.1f} MiB free")


def preflight(cfg: PipelineConfig, run_id: str) -> PreflightReport:
    rep = PreflightReport()
    try:
        cfg.run_dir(run_id)
    except ConfigError as e:
        rep.add("run id", run_id, str(e))
    check_target_model(cfg, rep)
    if cfg.fleet.training_node in (None, cfg.node.name):   # only the training node reads the sources
        check_sources(cfg, rep)
    check_dirs(cfg, run_id, rep)
    return rep


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m eagleflow.preflight RUN_ID < resolved-config.json", file=sys.stderr)
        return 2
    try:
        cfg = load_config(data=json.loads(sys.stdin.read()))
    except (ValueError, ConfigError) as e:
        print(json.dumps({"problems": [asdict(InputProblem("(config)", "", str(e)))], "checked": []}))
        return 0
    print(json.dumps(asdict(preflight(cfg, args[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
