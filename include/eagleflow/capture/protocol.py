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

from eagleflow.durable import discard_temp

# The capture layers live in aux_layers (one place for the per-family sglang numbering too).
from .aux_layers import default_aux_layers, resolve_aux_layers  # noqa: F401

PROTOCOL_VERSION = "eagleflow-capture/1"
DUMP_SUFFIX = ".safetensors"
DUMP_TMP_PREFIX = ".tmp-"

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


def shard_dump_prefix(run_id: str, shard: int) -> str:
    return f"{run_id}.s{shard:05d}."


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
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{DUMP_TMP_PREFIX}{rid}.{os.getpid()}{DUMP_SUFFIX}"
    tensors = {DUMP_IDS: input_ids.detach().to("cpu").contiguous(),
               DUMP_AUX: aux_hidden_states.detach().to("cpu").contiguous(),
               DUMP_LAST: hidden_states.detach().to("cpu").contiguous()}
    meta = {"rid": rid, "aux_layers": json.dumps(list(aux_layers)), "model": model,
            "protocol": PROTOCOL_VERSION}
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, final)
    except BaseException:
        discard_temp(tmp)
        raise
    return final


def read_dump(path: str | os.PathLike) -> Dump:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        t = {k: f.get_tensor(k) for k in (DUMP_IDS, DUMP_AUX, DUMP_LAST)}
    return Dump(rid=meta.get("rid", ""), input_ids=t[DUMP_IDS], aux_hidden_states=t[DUMP_AUX],
                hidden_states=t[DUMP_LAST], aux_layers=json.loads(meta.get("aux_layers", "[]")),
                model=meta.get("model", ""))
