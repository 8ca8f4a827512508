"""The capture API both backends serve, and the dump they write per request.

- ``POST /generate`` {"input_ids": [...], "rid": "...", "sampling_params": {...}}:
  a prefill whose auxiliary and last hidden states are written to
  ``<dump_dir>/<rid>.safetensors`` (temp name, then rename: a dump either
  exists whole or not at all).
- ``GET /health_generate``: a real one-token generation; 200 when it ran.
- ``GET /get_server_info``: model, layers, version, hidden size, dtype.

Request ids carry the run and shard (``request_id``), so a worker can find and
remove its own orphaned dumps in a dump directory shared by all shards.

Trust (issue 26): the dump folder is this user's own (``private_dump_dir``:
``{uid}`` in ``server.dump_dir`` is this user's id, created 0700, refused when
it is a symlink or someone else's), dumps are 0600, and every dump carries an
HMAC-SHA256 (metadata ``mac``) keyed by a secret of this node user
(``load_dump_key``, ``RunLayout.dump_key_file`` in the state folder, 0600; one
per state folder rather than per run, since one server may serve several runs'
workers), which the worker checks before a dump's hidden states are stored: a
dump replaced by anyone without the key is refused. Both backends write
through ``write_dump``.

Trust boundary of the servers (capture and generation, hf and sglang; docs/safety.md): they listen on a
loopback address only (``loopback_host``; their only clients are the node's own workers and commands) and
take no credential (sglang can only be given one on its command line, which every local user reads in
/proc). Any local user may therefore send them requests; what such a request can do is bounded: it spends
GPU time and may leave a dump in this user's 0700 folder, which it cannot read; a dump under a worker's
request id with other tokens is refused by that worker (MAC, rid, then its own token ids), so nothing but
the hidden states of the worker's own sample is ever stored.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagleflow.config import ConfigError
from eagleflow.durable import TEMP_PREFIX, atomic_replace, read_owned
from eagleflow.safetensors_format import RawTensor, as_raw, read_raw

# The capture layers live in aux_layers (one place for the per-family sglang numbering too).
from eagleflow.serving.aux_layers import default_aux_layers, resolve_aux_layers  # noqa: F401

if TYPE_CHECKING:  # torch only where a server writes a dump; the worker reads them without it
    import torch

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


# The one cap on a request body, for every server of ours (the hf server, the vLLM middleware): a /generate body
# is a list of token ids, and 64 MiB holds millions of them; a body announced or sent beyond it is refused (413)
# and never read past the cap.
MAX_BODY_BYTES = 64 << 20


class BodyTooLarge(ValueError):
    """A request body over ``MAX_BODY_BYTES``: the answer's error (status 413) names the size and the limit."""

    status = 413

    def __init__(self, size: int, limit: int = MAX_BODY_BYTES, *, so_far: bool = False):
        self.size, self.limit = size, limit
        super().__init__(f"request body of {'at least ' if so_far else ''}{size} bytes is over this server's limit "
                         f"of {limit} bytes (serving.dump_protocol.MAX_BODY_BYTES); send shorter samples")


def check_body_size(size: int, limit: int = MAX_BODY_BYTES, *, so_far: bool = False) -> int:
    """``size`` (a Content-Length, or with ``so_far`` the bytes received until now) when it is within the cap;
    else BodyTooLarge."""
    if size < 0 or size > limit:
        raise BodyTooLarge(size, limit, so_far=so_far)
    return size


def loopback_host(host: str, field: str = "server.host") -> str:
    """``host`` when it is a loopback address (127.0.0.0/8, ::1, localhost): the address every capture and
    generation server binds. Anything else (0.0.0.0, a LAN address, a name) would let other machines send
    unauthenticated requests, so it is refused naming ``field`` (a ConfigError)."""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{field} = {host!r}: the capture and generation servers answer without "
                          "authentication, so they listen on a loopback address only (their clients are the "
                          "node's own workers); set it to 127.0.0.1 (or ::1, localhost)")
    return host


UID_PLACEHOLDER = "{uid}"            # in server.dump_dir: this node user's uid, so each user has a folder
DUMP_MAC = "mac"                     # metadata key: HMAC-SHA256 of the dump under the dump key
ENV_DUMP_KEY = "EAGLEFLOW_CAPTURE_DUMP_KEY"   # the key (hex) for sglang's schedulers; environ is owner-only
KEY_BYTES = 32


class DumpTrustError(RuntimeError):
    """The dump folder, the dump key or a dump cannot be trusted; the message names the path and what to do."""


def expand_dump_dir(dump_dir: str | os.PathLike[str]) -> Path:
    """``server.dump_dir`` on this node: ``{uid}`` is this user's id (the default ``/dev/shm/eagleflow_hs-{uid}``)."""
    return Path(os.fspath(dump_dir).replace(UID_PLACEHOLDER, str(os.geteuid())))


_private_dirs: dict[str, tuple[int, int]] = {}   # folder -> (device, inode) proven ours: one lstat a dump after


def private_dump_dir(dump_dir: str | os.PathLike[str]) -> Path:
    """This user's dump folder, created 0700 if missing; DumpTrustError when it is a symlink or not ours.

    Opened with O_NOFOLLOW | O_DIRECTORY and checked with fstat (lstat's answer, without the race): a folder
    another user made first (``exist_ok`` accepted it before) is refused, a folder of ours with wider modes is
    narrowed to 0700, so nobody else can read the hidden states or place a dump in it.
    """
    d = expand_dump_dir(dump_dir)
    known = _private_dirs.get(str(d))
    if known is not None:
        try:
            st = os.lstat(d)
            if stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == known:
                return d
        except FileNotFoundError:
            pass
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        lst = os.lstat(d) if os.path.lexists(d) else None
        what = ("is a symbolic link" if lst is not None and stat.S_ISLNK(lst.st_mode)
                else "is not a directory" if e.errno == errno.ENOTDIR else f"cannot be opened ({e.strerror})")
        raise DumpTrustError(f"server.dump_dir {d} {what}; eagleflow keeps dumps only in a folder of its own "
                             "user: remove it or point server.dump_dir elsewhere") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise DumpTrustError(f"server.dump_dir {d} belongs to uid {st.st_uid}, not to this user (uid "
                                 f"{os.geteuid()}): someone else made it first and could read or replace the dumps. "
                                 "Use a folder of your own (the default /dev/shm/eagleflow_hs-{uid} is per user)")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    _private_dirs[str(d)] = (st.st_dev, st.st_ino)
    return d


def load_dump_key(path: str | os.PathLike[str], *, create: bool = False) -> bytes:
    """The dump key; with ``create``, made first (random, 0600, published whole by a hard link) if absent.

    The capture server creates it at start; the worker only reads it. Read with ``durable.read_owned``: a key
    file that is a symlink, someone else's or writable by others is refused.
    """
    path = Path(path)
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TEMP_PREFIX}{path.name}.")
        try:
            os.write(fd, secrets.token_hex(KEY_BYTES).encode())
            os.fsync(fd)
            os.close(fd)
            try:
                os.link(tmp, path)        # all or nothing, and never over a key another process made first
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    try:
        text = read_owned(path, limit=4 * KEY_BYTES).decode().strip()
    except FileNotFoundError:
        raise DumpTrustError(f"no capture dump key at {path}: the capture server creates it when it starts; "
                             "start it (`eagleflow capture serve`) before the workers") from None
    except (OSError, ValueError) as e:
        raise DumpTrustError(f"capture dump key {e}") from None
    mode = os.lstat(path).st_mode & 0o777
    if mode & 0o077:   # anyone who can read the key can sign a dump
        raise DumpTrustError(f"capture dump key {path} is readable by others (mode {mode:04o}): remove it and "
                             "restart the capture server (it makes a new one, 0600)")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise DumpTrustError(f"capture dump key {path} does not hold {KEY_BYTES} hex-encoded bytes; remove it and "
                             "restart the capture server (it makes a new one)")
    return key


def dump_key_from_env(env: dict[str, str] | None = None) -> bytes | None:
    """The dump key as the sglang launcher hands it to its schedulers (``ENV_DUMP_KEY``); None without one."""
    raw = (os.environ if env is None else env).get(ENV_DUMP_KEY, "")
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        key = b""
    if raw and len(key) != KEY_BYTES:
        raise DumpTrustError(f"{ENV_DUMP_KEY} is not {KEY_BYTES} hex-encoded bytes; start sglang through "
                             "`eagleflow capture serve --backend sglang`, which sets it")
    return key or None


def dump_mac(key: bytes, metadata: dict[str, str], tensors: Mapping[str, RawTensor | torch.Tensor]) -> str:
    """HMAC-SHA256 over the metadata (sorted JSON, ``mac`` left out) and each tensor's name, dtype (torch's
    name), shape and bytes; tensors as RawTensor or torch tensors, the same MAC either way."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    h.update(json.dumps({k: v for k, v in metadata.items() if k != DUMP_MAC}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = as_raw(tensors[name])
        h.update(f"\0{name}\0{t.torch_name}\0{list(t.shape)}\0".encode())
        if t.nbytes:
            h.update(t.data)
    return h.hexdigest()


def dump_path(dump_dir: str | os.PathLike[str], rid: str) -> Path:
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


def remove_dumps(dump_dir: str | os.PathLike[str], run_id: str, shard: int | None = None) -> int:
    """Delete the dumps of exactly this run (and shard), never another run's whose id merely starts the same.

    The dump dir is shared by every run on the node (default /dev/shm/eagleflow_hs-{uid}, per user):
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
    input_ids: RawTensor          # [L] int64 (``.tolist()``; ``.to_torch()`` where torch is wanted)
    aux_hidden_states: RawTensor  # [L, k*H]
    hidden_states: RawTensor      # [L, H]
    aux_layers: list[int]
    model: str
    metadata: dict[str, str] | None = None  # as stored, the MAC included (what verify_dump checks)


def write_dump(dump_dir: str | os.PathLike[str], rid: str, *, input_ids: torch.Tensor,
               aux_hidden_states: torch.Tensor, hidden_states: torch.Tensor, aux_layers: list[int], model: str,
               key: bytes | None = None) -> Path:
    """Write one request's dump atomically (temp name in the same dir, then rename), 0600 in this user's
    folder (``private_dump_dir``), with its MAC under ``key`` (the dump key; without one the worker
    refuses the dump).

    No fsync: dumps live in /dev/shm and are consumed within seconds; a crash
    loses them and the worker re-requests the sample.
    """
    from safetensors.torch import save_file

    final = dump_path(private_dump_dir(dump_dir), rid)
    tensors = {DUMP_IDS: input_ids.detach().to("cpu").contiguous(),
               DUMP_AUX: aux_hidden_states.detach().to("cpu").contiguous(),
               DUMP_LAST: hidden_states.detach().to("cpu").contiguous()}
    meta = {"rid": rid, "aux_layers": json.dumps(list(aux_layers)), "model": model,
            "protocol": PROTOCOL_VERSION}
    if key is not None:
        meta[DUMP_MAC] = dump_mac(key, meta, tensors)
    with atomic_replace(final, fsync=False, mode=0o600) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return final


def read_dump(path: str | os.PathLike[str]) -> Dump:
    """The dump at ``path``, its tensors as raw bytes (no torch: the worker moves them unchanged); a dump
    that is no readable safetensors file with the three keys is a DumpTrustError naming it."""
    try:
        meta, t = read_raw(path, (DUMP_IDS, DUMP_AUX, DUMP_LAST))
    except FileNotFoundError:
        raise
    except (ValueError, OSError) as e:
        raise DumpTrustError(f"the dump {path} is not a readable safetensors file ({e}); refusing to store "
                             "it") from None
    missing = [k for k in (DUMP_IDS, DUMP_AUX, DUMP_LAST) if k not in t]
    if missing:
        raise DumpTrustError(f"the dump {path} lacks {', '.join(missing)}; refusing to store it")
    return Dump(rid=meta.get("rid", ""), input_ids=t[DUMP_IDS], aux_hidden_states=t[DUMP_AUX],
                hidden_states=t[DUMP_LAST], aux_layers=json.loads(meta.get("aux_layers", "[]")),
                model=meta.get("model", ""), metadata=dict(meta))


def verify_dump(dump: Dump, key: bytes, path: str | os.PathLike[str], rid: str) -> None:
    """DumpTrustError unless the dump is the one our server wrote for ``rid`` (its MAC under ``key``)."""
    if not key:
        raise DumpTrustError(f"no capture dump key to check the dump {path} with: the worker was started without "
                             "one; refusing to store it")
    meta = dump.metadata or {}
    mac = meta.get(DUMP_MAC, "")
    tensors = {DUMP_IDS: dump.input_ids, DUMP_AUX: dump.aux_hidden_states, DUMP_LAST: dump.hidden_states}
    why = ("carries no MAC" if not mac
           else f"is for request {meta.get('rid')!r}, not {rid!r}" if meta.get("rid") != rid
           else None if hmac.compare_digest(mac, dump_mac(key, meta, tensors)) else "has a MAC that does not match")
    if why:
        raise DumpTrustError(f"the dump {path} {why} under the dump key: it was not written by this user's "
                             "capture server (replaced, forged, or from a server started without the key); refusing "
                             "to store it. Check who can write server.dump_dir, then restart the capture server "
                             "(`eagleflow capture serve`) and re-run the shard: stored samples are kept")


def main(argv: list[str] | None = None) -> int:
    """``python -m eagleflow.serving.dump_protocol remove-dumps --dump-dir D --run-id R [--shard S]``: one JSON line."""
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog="eagleflow.serving.dump_protocol")
    sub = ap.add_subparsers(dest="cmd", required=True)
    rm = sub.add_parser("remove-dumps", help="delete exactly one run's dumps (or one shard's) from a dump dir")
    rm.add_argument("--dump-dir", required=True)
    rm.add_argument("--run-id", required=True)
    rm.add_argument("--shard", type=int)
    a = ap.parse_args(argv)
    print(json.dumps({"removed": remove_dumps(expand_dump_dir(a.dump_dir), a.run_id, a.shard)}), flush=True)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
