"""Training checkpoints without pickle: safetensors for tensors, JSON for everything else.

    <draft_dir>/checkpoints/step_00000050/
        model.safetensors       draft weights (not the frozen target embedding)
        optimizer.safetensors   every optimizer state tensor (``state.<param>.<key>``) and RNG states
        trainer_state.json      step, data position, optimizer param groups and scalars, RNG, config

A checkpoint is written into a temporary directory, fsynced, then renamed:
a directory named ``step_*`` is always complete. The newest ``keep`` remain.
``trainer_state.json`` records each tensor file's sha256, so a checkpoint
damaged later (a zeroed or flipped file) is found at load; a resume then
falls back to the newest intact one and says which it skipped and why.
Temp directories a killed writer left behind are removed at the next start.
"""
from __future__ import annotations

import errno
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from eagleflow.durable import atomic_dir
from eagleflow.capture.storage import file_sha256

STATE_FILE = "trainer_state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_", 1)[1]))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def optimizer_to_flat(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for key, val in st.items():
            if torch.is_tensor(val):
                tensors[f"state.{pid}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = val
    return tensors, {"param_groups": sd["param_groups"], "state_scalars": scalars}


def optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        if not name.startswith("state."):
            continue
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = t
    for pid, d in meta.get("state_scalars", {}).items():
        state.setdefault(int(pid), {}).update(d)
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["rng.cuda"] = torch.cuda.get_rng_state()
    return out


def restore_rng(tensors: dict[str, torch.Tensor], python_state: list | None) -> None:
    if "rng.torch_cpu" in tensors:
        torch.set_rng_state(tensors["rng.torch_cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    if python_state is not None:
        version, internal, gauss = python_state
        random.setstate((version, tuple(internal), gauss))


def save_checkpoint(root: str | Path, step: int, model_state: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer, state: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically; returns its directory."""
    from safetensors.torch import save_file
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    try:
        # never a half checkpoint left behind; a rerun of the same step replaces it whole
        with atomic_dir(final) as tmp:
            opt_tensors, opt_meta = optimizer_to_flat(optimizer)
            save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items()}, str(tmp / MODEL_FILE))
            save_file({**opt_tensors, **rng_tensors()}, str(tmp / OPTIMIZER_FILE))
            files = {name: file_sha256(tmp / name) for name in (MODEL_FILE, OPTIMIZER_FILE)}
            full_state = dict(state, step=step, optimizer=opt_meta, python_rng=list(random.getstate()), files=files)
            (tmp / STATE_FILE).write_text(json.dumps(full_state, indent=1))
    except BaseException as e:
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        if not full and "No space left" not in str(e):   # safetensors reports ENOSPC in its own error text
            raise
        before = list_checkpoints(root)
        raise CheckpointWriteError(
            f"disk full (ENOSPC) writing checkpoint step {step} in {root} ({shutil.disk_usage(root).free / 2**20:.1f}"
            f" MiB free there); free space (or lower train.keep_checkpoints) and re-run: training resumes from "
            f"{before[-1].name if before else 'the start'}, which is intact") from None
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng: dict[str, torch.Tensor]
    state: dict[str, Any]


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    from safetensors.torch import load_file
    path = Path(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
        _check_recorded_digests(path, state)
        model_state = load_file(str(path / MODEL_FILE))
        opt_all = load_file(str(path / OPTIMIZER_FILE))
        rng = {k: v for k, v in opt_all.items() if k.startswith("rng.")}
        opt_tensors = {k: v for k, v in opt_all.items() if k.startswith("state.")}
        return LoadedCheckpoint(path=path, step=int(state["step"]), model_state=model_state,
                                optimizer_state=optimizer_from_flat(opt_tensors, state["optimizer"]), rng=rng,
                                state=state)
    except CheckpointDamaged:
        raise
    except Exception as e:  # OSError, JSON errors, safetensors' own SafetensorError on a damaged header
        raise CheckpointDamaged(f"checkpoint {path} cannot be read ({type(e).__name__}: {e})") from None


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (the disk is full); the previous ones are untouched."""


class CheckpointDamaged(ValueError):
    """A checkpoint directory whose files cannot be read or do not match their recorded sha256."""


def verify_checkpoint_files(path: str | Path) -> dict[str, Any]:
    """The checkpoint's state, after checking its tensor files against their recorded sha256 (export uses it)."""
    path = Path(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"checkpoint {path} cannot be read ({type(e).__name__}: {e})") from None
    _check_recorded_digests(path, state)
    return state


def _check_recorded_digests(path: Path, state: dict[str, Any]) -> None:
    for name, digest in (state.get("files") or {}).items():   # older checkpoints recorded none
        try:
            actual = file_sha256(path / name)
        except OSError as e:
            raise CheckpointDamaged(f"checkpoint {path}: {name} cannot be read ({e.strerror or e})") from None
        if actual != digest:
            raise CheckpointDamaged(f"checkpoint {path}: {name} does not match the sha256 recorded when it was "
                                    "written (the file was changed or damaged)")


def load_newest_intact_checkpoint(root: str | Path, log: Callable[[str], None] = print) -> LoadedCheckpoint | None:
    """The newest checkpoint that loads and matches its digests; each damaged newer one is named and skipped."""
    for path in reversed(list_checkpoints(root)):
        try:
            return load_checkpoint(path)
        except CheckpointDamaged as e:
            log(f"skipping damaged checkpoint {path.name}: {e}; falling back to the one before it")
    return None


def remove_leftover_temp_dirs(root: str | Path, log: Callable[[str], None] = print) -> list[str]:
    """Delete ``.tmp-step_*`` directories a killed writer left (never complete, never read)."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for p in sorted(root.glob(".tmp-step_*")):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    if removed:
        log(f"removed {len(removed)} leftover temporary checkpoint dir(s) in {root}: {', '.join(removed)}")
    return removed
