"""Which sample ids each epoch consumed: an append-only ledger, and the check that each was trained exactly once.

One JSON line per event, appended and fsynced (``durable.open_owned``, the way manifests are appended):
``{"epoch": 0, "event": "taken", "ids": [...], "at": T}`` when the loader hands samples to the trainer, and
``{"epoch": 0, "event": "trained", "ids": [...], "step": 12, "at": T}`` once the optimizer step that used
them is committed (``at``: the event's wall-clock time, so a run's records say when training drew samples
against when capture wrote its manifests; nothing else reads it). A trainer killed between the two leaves
samples taken but not trained: ``LedgerState.pending`` names them and a resumed loader serves them again
(0 lost); a sample already trained in an epoch is never served again in it (0 twice). A cut-off last line
(a crash mid-append) is ignored and sealed. ``{"event": "plan", "epochs": E}`` is written each time a trainer
opens the ledger: how many epochs the run trains (a streaming store's resume keeps a lost store's sample only
when the run's last epoch trained it).
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eagleflow import bounded_json
from eagleflow.durable import open_owned


class LedgerError(ValueError):
    """An epoch whose samples were not each trained exactly once; the message names epoch and ids."""


@dataclass
class EpochRecord:
    taken: set[str] = field(default_factory=set)
    trained: Counter = field(default_factory=Counter)

    @property
    def pending(self) -> set[str]:
        """Taken but not trained (a trainer killed in between): to be served again."""
        return self.taken - set(self.trained)


@dataclass
class LedgerState:
    epochs: dict[int, EpochRecord] = field(default_factory=dict)
    bad_lines: list[int] = field(default_factory=list)
    planned_epochs: int | None = None    # the last plan line's; None: no trainer has opened the ledger

    def trained_in_last_epoch(self) -> set[str]:
        """The ids the run's last epoch trained (they need their sample no more); a ledger with no plan (an
        older trainer's) counts one epoch."""
        return set(self.epoch((self.planned_epochs or 1) - 1).trained)

    def epoch(self, e: int) -> EpochRecord:
        return self.epochs.setdefault(e, EpochRecord())


class EpochLedger:
    def __init__(self, path: str | os.PathLike, fsync: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        fd = open_owned(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644, narrow=True)
        self._f = os.fdopen(fd, "ab", buffering=0)
        size = os.fstat(fd).st_size
        if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
            self._f.write(b"\n")       # seal a cut-off line so it stays one bad line

    def _append(self, record: dict) -> None:
        record["at"] = round(time.time(), 3)
        self._f.write((json.dumps(record, separators=(",", ":")) + "\n").encode())
        if self.fsync:
            os.fsync(self._f.fileno())

    def taken(self, epoch: int, ids: list[str]) -> None:
        self._append({"epoch": epoch, "event": "taken", "ids": list(ids)})

    def plan(self, epochs: int) -> None:
        self._append({"event": "plan", "epochs": int(epochs)})

    def trained(self, epoch: int, ids: list[str], step: int) -> None:
        self._append({"epoch": epoch, "event": "trained", "ids": list(ids), "step": step})

    def close(self) -> None:
        self._f.close()

    def read(self) -> LedgerState:
        return read_ledger(self.path)


def read_ledger(path: str | os.PathLike) -> LedgerState:
    state = LedgerState()
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return state
    lines = data.split(b"\n")
    for n, raw in enumerate(lines[:-1], start=1):     # the last piece has no newline: cut off, or empty
        if not raw.strip():
            continue
        try:
            d = bounded_json.loads(raw, source=f"{path} line {n}", max_bytes=len(raw))
            if d.get("event") == "plan":
                if int(d["epochs"]) < 1:
                    raise ValueError("a plan of no epoch")
                state.planned_epochs = int(d["epochs"])
                continue
            epoch, event, ids = int(d["epoch"]), str(d["event"]), [str(i) for i in d["ids"]]
        except (ValueError, KeyError, TypeError, AttributeError):
            state.bad_lines.append(n)
            continue
        rec = state.epoch(epoch)
        if event == "taken":
            rec.taken.update(ids)
        elif event == "trained":
            rec.trained.update(ids)
        else:
            state.bad_lines.append(n)
    return state


@dataclass
class LedgerCheck:
    ok: bool
    duplicates: dict[int, list[str]]
    missing: dict[int, list[str]]
    unknown: dict[int, list[str]]

    def summary(self) -> str:
        if self.ok:
            return "every sample trained exactly once in every epoch"

        def few(xs: list[str]) -> str:
            return ", ".join(xs[:5]) + (f" (+{len(xs) - 5})" if len(xs) > 5 else "")
        parts = [f"epoch {e}: {len(v)} trained twice or more ({few(v)})" for e, v in sorted(self.duplicates.items())]
        parts += [f"epoch {e}: {len(v)} never trained ({few(v)})" for e, v in sorted(self.missing.items())]
        parts += [f"epoch {e}: {len(v)} not in the corpus ({few(v)})" for e, v in sorted(self.unknown.items())]
        return "; ".join(parts)


def check_exactly_once(state: LedgerState, corpus_ids: set[str], epochs: int) -> LedgerCheck:
    """Each of ``corpus_ids`` trained exactly once in each of epochs 0 .. epochs-1, and nothing else."""
    dup: dict[int, list[str]] = {}
    missing: dict[int, list[str]] = {}
    unknown: dict[int, list[str]] = {}
    for e in range(epochs):
        rec = state.epochs.get(e, EpochRecord())
        if d := sorted(i for i, n in rec.trained.items() if n > 1):
            dup[e] = d
        if m := sorted(corpus_ids - set(rec.trained)):
            missing[e] = m
        if u := sorted(set(rec.trained) - corpus_ids):
            unknown[e] = u
    return LedgerCheck(not (dup or missing or unknown), dup, missing, unknown)


def require_exactly_once(path: str | os.PathLike, corpus_ids: set[str], epochs: int) -> None:
    check = check_exactly_once(read_ledger(path), corpus_ids, epochs)
    if not check.ok:
        raise LedgerError(f"{path}: not green: {check.summary()}")
