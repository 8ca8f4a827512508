"""The capture API both backends serve, and the dump they write per request.

- ``POST /generate`` {"input_ids": [...], "rid": "...", "sampling_params": {...}}:
  a prefill whose auxiliary and last hidden states are written to
  ``<dump_dir>/<rid>.safetensors`` (temp name, then rename: a dump either
  exists whole or not at all).
- ``GET /health_generate``: a real one-token generation; 200 when it ran.
- ``GET /get_server_info``: model, layers, version, hidden size, dtype.

Request ids carry the run and shard (``request_id``), so a worker can find and
remove its own orphaned dumps in a dump directory shared by all shards.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from eagleflow.durable import TEMP_PREFIX, atomic_replace

# The capture layers live in aux_layers (one place for the per-family sglang numbering too).
from .aux_layers import default_aux_layers, resolve_aux_layers  # noqa: F401

PROTOCOL_VERSION = "eagleflow-capture/1"
DUMP_SUFFIX = ".safetensors"
DUMP_TMP_PREFIX = TEMP_PREFIX  # eagleflow.durable's temp names: .tmp-<rid>.safetensors.<random>

# Keys inside a dump (one per request).
DUMP_AUX = "aux_hidden_states"      # [L, k*H], k aux layers concatenated in order
DUMP_LAST = "hidden_states"         # [L, H], the target's final (post-norm) hidden states
DUMP_IDS = "input_ids"              # [L] int64, what the server actually ran

# rid prefix of the launcher's self-check request (proves the capture hook writes dumps)
SELFCHECK_PREFIX = "eagleflow-selfcheck-"

_RID_RE = re.compile(r"^(?P<run>[A-Za-z0-9_.-]+)\.s(?P<shard>\d{5})\.(?P<index>\d{8})$")


def request_id(run_id: str, shard: int, index: int) -> str:
    return f"{run_id}.s{shard:05d}.{index:08d}"


def parse_request_id(rid: str) -> tuple[str, int, int] | None:
    m = _RID_RE.match(rid)
    if not m:
        return None
    return m["run"], int(m["shard"]), int(m["index"])


def check_rid(rid: object) -> str:
    """A rid becomes a file name: reject anything that could escape the dump dir."""
    if not isinstance(rid, str) or not rid or len(rid) > 200 or not re.fullmatch(r"[A-Za-z0-9_.-]+", rid) \
            or rid.startswith("."):
        raise ValueError(f"rid {rid!r} must be 1-200 characters of [A-Za-z0-9_.-], not starting with '.'")
    return rid


def dump_path(dump_dir: str | os.PathLike, rid: str) -> Path:
    return Path(dump_dir) / f"{check_rid(rid)}{DUMP_SUFFIX}"


def dump_rid(name: str) -> str | None:
    """The request id a dump file name belongs to, final (``<rid>.safetensors``) or temp
    (``.tmp-<rid>.safetensors.<random>``); None for any other file."""
    if name.startswith(DUMP_TMP_PREFIX):
        rest = name[len(DUMP_TMP_PREFIX):]
        head, dot, _ = rest.rpartition(".")
        if dot and head.endswith(DUMP_SUFFIX):
            return head[:-len(DUMP_SUFFIX)]
        rid, dot, pid = rest[:-len(DUMP_SUFFIX)].rpartition(".")  # older servers: .tmp-<rid>.<pid>.safetensors
        return rid if rest.endswith(DUMP_SUFFIX) and dot and pid.isdigit() else None
    return name[:-len(DUMP_SUFFIX)] if name.endswith(DUMP_SUFFIX) else None


def remove_dumps(dump_dir: str | os.PathLike, run_id: str, shard: int | None = None) -> int:
    """Delete the dumps of exactly this run (and shard), never another run's whose id merely starts the same.

    The dump dir is shared by every run on the node (default /dev/shm/eagleflow_hs):
    ``exp`` must not match ``exp.s2`` or ``exp2``, so each name is parsed back into
    (run, shard, index) and compared whole.
    """
    d = Path(dump_dir)
    if not d.is_dir():
        return 0
    n = 0
    for p in d.iterdir():
        rid = dump_rid(p.name)
        parsed = parse_request_id(rid) if rid else None
        if parsed is None or parsed[0] != run_id or (shard is not None and parsed[1] != shard):
            continue
        try:
            p.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return n


@dataclass(frozen=True)
class Dump:
    rid: str
    input_ids: "object"          # torch.Tensor [L] int64
    aux_hidden_states: "object"  # torch.Tensor [L, k*H]
    hidden_states: "object"      # torch.Tensor [L, H]
    aux_layers: list[int]
    model: str


def write_dump(dump_dir: str | os.PathLike, rid: str, *, input_ids, aux_hidden_states, hidden_states,
               aux_layers: list[int], model: str) -> Path:
    """Write one request's dump atomically (temp name in the same dir, then rename).

    No fsync: dumps live in /dev/shm and are consumed within seconds; a crash
    loses them and the worker re-requests the sample.
    """
    from safetensors.torch import save_file

    final = dump_path(dump_dir, rid)
    tensors = {DUMP_IDS: input_ids.detach().to("cpu").contiguous(),
               DUMP_AUX: aux_hidden_states.detach().to("cpu").contiguous(),
               DUMP_LAST: hidden_states.detach().to("cpu").contiguous()}
    meta = {"rid": rid, "aux_layers": json.dumps(list(aux_layers)), "model": model,
            "protocol": PROTOCOL_VERSION}
    with atomic_replace(final, fsync=False) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return final


def read_dump(path: str | os.PathLike) -> Dump:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        t = {k: f.get_tensor(k) for k in (DUMP_IDS, DUMP_AUX, DUMP_LAST)}
    return Dump(rid=meta.get("rid", ""), input_ids=t[DUMP_IDS], aux_hidden_states=t[DUMP_AUX],
                hidden_states=t[DUMP_LAST], aux_layers=json.loads(meta.get("aux_layers", "[]")),
                model=meta.get("model", ""))


def main(argv: list[str] | None = None) -> int:
    """``python -m eagleflow.capture.protocol remove-dumps --dump-dir D --run-id R [--shard S]``: one JSON line."""
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog="eagleflow.capture.protocol")
    sub = ap.add_subparsers(dest="cmd", required=True)
    rm = sub.add_parser("remove-dumps", help="delete exactly one run's dumps (or one shard's) from a dump dir")
    rm.add_argument("--dump-dir", required=True)
    rm.add_argument("--run-id", required=True)
    rm.add_argument("--shard", type=int)
    a = ap.parse_args(argv)
    print(json.dumps({"removed": remove_dumps(a.dump_dir, a.run_id, a.shard)}), flush=True)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
