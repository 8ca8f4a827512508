"""The run's Mooncake store on the training node: a metadata server, a master and a segment holder, each a
recorded process.

``start_store`` starts, through ``eagleflow.nodes.detach`` (own session, pid record written before it is
reported), the wheel's HTTP metadata server (``mooncake.http_metadata_server``), the wheel's ``mooncake_master``,
then the wheel's ``mooncake_client`` as the segment holder: the store's memory (``segment_bytes``) belongs to that
long-lived process, because a writer's own segment, and every object in it, vanishes when the writer exits
(notes/mooncake.md). All bind ``host`` (loopback on one machine) on free ports. The master's own metadata server
(``-enable_http_metadata_server``) is not used: in the 0.3.13 wheel it listens on 0.0.0.0 whatever
``-http_metadata_server_host`` says (seen in /proc/net/tcp), and anyone who reaches it can rewrite where a
segment's bytes go. The endpoint (addresses, ports, the records) is written atomically to ``endpoint_file``, which
sinks and sources read. ``stop_store`` stops them by their records (``process_record.stop``: TERM, grace, KILL;
PIDs only).

The master runs with a short object lease (``-default_kv_lease_ttl``): Mooncake refuses to remove an
object for its lease after a read, and the trainer removes each sample right after its last epoch.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from eagleflow import bounded_json
from eagleflow.durable import atomic_write
from eagleflow.nodes.process_record import StopResult, status, stop_file
from eagleflow.ports import free_port, free_ports

MASTER_ROLE = "mooncake-master"
SEGMENT_ROLE = "mooncake-segment"
METADATA_ROLE = "mooncake-metadata"
LEASE_TTL = "100ms"


class MooncakeStartError(RuntimeError):
    """The run's Mooncake master or segment holder did not come up; the message names it and its log."""


@dataclass(frozen=True)
class MooncakeEndpoint:
    host: str
    rpc_port: int
    metadata_port: int
    metrics_port: int
    segment_bytes: int
    master_pid_file: str = ""
    segment_pid_file: str = ""
    store_id: str = ""          # this incarnation: each start of the run's store gets a new one (manifest lines say
                                # which one holds their sample; a sample put into a dead one is lost)
    foreign_master: bool = False   # an existing master (stream.master) the run did not start: no pid record, judged
                                   # by its port only, never signalled
    protocol: str = "tcp"          # the transfer engine's transport (stream.protocol): every client of the store uses
    device_names: str = ""         # the segment holder's, so a capture node takes both from the endpoint it is handed
    metadata_pid_file: str = ""    # the run's metadata server (none on an existing master: it serves its own)

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def label(self) -> str:
        """How errors name the store."""
        return f"Mooncake store (master {self.master_address})"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def read(cls, path: str | os.PathLike) -> "MooncakeEndpoint":
        d = bounded_json.read(path, max_bytes=bounded_json.MAX_ANSWER_BYTES)
        for f in ("rpc_port", "metadata_port", "metrics_port"):   # a fleet node's copy was handed to it: checked
            if not 1 <= int(d[f]) <= 65535:
                raise ValueError(f"{f} {d[f]!r} is not a TCP port")
        protocol, devices = str(d.get("protocol", "tcp")), str(d.get("device_names", ""))
        check_transport(protocol, devices)
        return cls(host=str(d["host"]), rpc_port=int(d["rpc_port"]), metadata_port=int(d["metadata_port"]),
                   metrics_port=int(d["metrics_port"]), segment_bytes=int(d["segment_bytes"]),
                   master_pid_file=str(d.get("master_pid_file", "")),
                   segment_pid_file=str(d.get("segment_pid_file", "")), store_id=str(d.get("store_id", "")),
                   foreign_master=d.get("foreign_master", False) is True, protocol=protocol, device_names=devices,
                   metadata_pid_file=str(d.get("metadata_pid_file", "")))

    def recorded(self) -> list[tuple[str, str]]:
        """(role, pid record) of every process of this store the run started, in the order they are stopped."""
        return [(role, f) for role, f in ((SEGMENT_ROLE, self.segment_pid_file), (MASTER_ROLE, self.master_pid_file),
                                          (METADATA_ROLE, self.metadata_pid_file)) if f]


def reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def metrics(ep: MooncakeEndpoint, timeout_s: float = 2.0) -> dict[str, float]:
    """The master's own figures (``master_allocated_bytes``, ``master_total_capacity_bytes``, ``master_key_count``
    ...); OSError when the master does not answer."""
    with urllib.request.urlopen(f"http://{ep.host}:{ep.metrics_port}/metrics", timeout=timeout_s) as r:
        text = r.read(1 << 20).decode("utf-8", "replace")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("master_") and " " in line and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def binary(name: str) -> str:
    """A binary of the Mooncake wheel: beside this interpreter (a venv's bin), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if not found:
        raise MooncakeStartError(f"{name} not found beside {sys.executable} or on PATH: install the stream extra "
                                 "(pip install 'eagleflow[stream]': mooncake-transfer-engine-non-cuda, or the CUDA "
                                 "build on a GPU node) and Debian's libibverbs1 librdmacm1 libnuma1")
    return found


def _detach(role: str, pid_file: Path, log_file: Path, argv: list[str], env: dict[str, str] | None = None) -> None:
    res = subprocess.run([sys.executable, "-m", "eagleflow.nodes.detach", "--role", role, "--pid-file",
                          str(pid_file), "--log-file", str(log_file), "--", *argv],
                         capture_output=True, text=True, timeout=60, env=env)
    if res.returncode != 0:
        raise MooncakeStartError(f"{role} not started: {(res.stderr or res.stdout).strip()[-500:]}")


def tcp_bind_env(host: str) -> dict[str, str] | None:
    """The environment a Mooncake process needs to be reached at ``host`` from another machine: its TCP transport
    otherwise advertises the first interface's address (seen: eth0's, unreachable from a capture node on another
    link, every put failing with -800), whatever ``-host`` says. None on loopback (one machine: as before)."""
    if host.startswith("127.") or host in ("localhost", "::1"):
        return None
    return {**os.environ, "MC_TCP_BIND_ADDRESS": host}


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-800:]
    except OSError:
        return ""


PROTOCOLS = ("tcp", "rdma")
DEVICE_NAMES = re.compile(r"[A-Za-z0-9_.:-]{1,64}(,[A-Za-z0-9_.:-]{1,64}){0,63}")


def check_transport(protocol: str, device_names: str) -> None:
    """A transport the transfer engine takes (Mooncake's ``-protocol``, ``-device_names``); ValueError naming the
    field otherwise. An endpoint handed to a fleet node is checked as the config is."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    if device_names and not DEVICE_NAMES.fullmatch(device_names):
        raise ValueError("device_names is not a comma-separated list of RDMA device names (letters, digits, '_.:-')")


def new_store_id() -> str:
    """A fresh incarnation id: the time it started (readable in a manifest) and random bits (two starts in one
    second differ)."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"


def _start_segment(ep: MooncakeEndpoint, segment_pid: Path, segment_log: Path, *, capacity_before: int,
                   timeout_s: float, where: str = "") -> None:
    """The run's segment holder (mooncake_client, recorded in ``segment_pid``) against ``ep``'s master on
    ``ep.host``, waited for until the master's capacity is ``capacity_before`` plus its ``ep.segment_bytes``
    (whole MiB); MooncakeStartError naming ``where`` and the log when it does not mount in time."""
    host, mib = ep.host, ep.segment_bytes >> 20
    _detach(SEGMENT_ROLE, segment_pid, segment_log, [
        binary("mooncake_client"), "-global_segment_size", f"{max(1, mib)}MB",
        "-master_server_address", ep.master_address, "-metadata_server", ep.metadata_url,
        "-protocol", ep.protocol, *(["-device_names", ep.device_names] if ep.device_names else []),
        "-host", host, "-port", str(free_port(host))], env=tcp_bind_env(host))

    def mounted() -> bool:
        try:
            return metrics(ep).get("master_total_capacity_bytes", 0) >= capacity_before + (mib << 20)
        except OSError:
            return False
    _wait(mounted, timeout_s, segment_pid, f"{SEGMENT_ROLE} did not mount {mib} MiB{where}", segment_log)


def start_store(*, state_dir: str | os.PathLike, run_id: str, segment_bytes: int, endpoint_file: str | os.PathLike,
                host: str = "127.0.0.1", timeout_s: float = 60.0, protocol: str = "tcp",
                device_names: str = "") -> MooncakeEndpoint:
    """Start the run's metadata server, master and segment holder (recorded), wait until the store has its memory,
    write the endpoint; on failure stop whatever was started and raise MooncakeStartError naming the log."""
    state = Path(state_dir)
    roles = (MASTER_ROLE, SEGMENT_ROLE, METADATA_ROLE)
    pid = {role: state / "pids" / f"{run_id}.{role}.json" for role in roles}
    log = {role: state / "logs" / f"{run_id}.{role}.log" for role in roles}
    rpc_port, metadata_port, metrics_port = free_ports(3, host)
    ep = MooncakeEndpoint(host=host, rpc_port=rpc_port, metadata_port=metadata_port,
                          metrics_port=metrics_port, segment_bytes=segment_bytes,
                          master_pid_file=str(pid[MASTER_ROLE]), segment_pid_file=str(pid[SEGMENT_ROLE]),
                          metadata_pid_file=str(pid[METADATA_ROLE]),
                          store_id=new_store_id(), protocol=protocol, device_names=device_names)
    try:
        _detach(METADATA_ROLE, pid[METADATA_ROLE], log[METADATA_ROLE], [
            sys.executable, "-m", "mooncake.http_metadata_server", "--host", host, "--port", str(metadata_port),
            "--log-level", "WARNING"])
        _wait(lambda: reachable(host, metadata_port), timeout_s, pid[METADATA_ROLE],
              f"{METADATA_ROLE} did not listen on {host}:{metadata_port}", log[METADATA_ROLE])
        _detach(MASTER_ROLE, pid[MASTER_ROLE], log[MASTER_ROLE], [
            binary("mooncake_master"), "-rpc_port", str(ep.rpc_port), "-rpc_address", host,
            "-metrics_port", str(ep.metrics_port), "-metrics_host", host, "-default_kv_lease_ttl", LEASE_TTL])
        _wait(lambda: reachable(host, ep.rpc_port), timeout_s,
              pid[MASTER_ROLE], f"{MASTER_ROLE} did not listen on {ep.master_address}", log[MASTER_ROLE])
        _start_segment(ep, pid[SEGMENT_ROLE], log[SEGMENT_ROLE], capacity_before=0, timeout_s=timeout_s)
    except BaseException:
        stop_store(ep, grace_s=2.0)
        raise
    atomic_write(endpoint_file, ep.to_json())
    return ep


def start_segment_on_master(*, state_dir: str | os.PathLike, run_id: str, segment_bytes: int,
                            endpoint_file: str | os.PathLike, host: str, rpc_port: int, metadata_port: int,
                            metrics_port: int, timeout_s: float = 60.0, protocol: str = "tcp",
                            device_names: str = "") -> MooncakeEndpoint:
    """The run's store on an existing master (``stream.master``) it did not start: the master is checked to answer
    on its three ports (the probe the store uses), then the run's segment holder is started against it (recorded:
    the samples live in its memory) and waited for until the master's capacity grew by its segment. The endpoint
    names the master with no pid record (``foreign_master``) and a new store id: this segment holder is the
    incarnation. MooncakeStartError naming the field when the master does not answer."""
    state = Path(state_dir)
    segment_pid = state / "pids" / f"{run_id}.{SEGMENT_ROLE}.json"
    segment_log = state / "logs" / f"{run_id}.{SEGMENT_ROLE}.log"
    ep = MooncakeEndpoint(host=host, rpc_port=rpc_port, metadata_port=metadata_port, metrics_port=metrics_port,
                          segment_bytes=segment_bytes, segment_pid_file=str(segment_pid), store_id=new_store_id(),
                          foreign_master=True, protocol=protocol, device_names=device_names)
    silent = [f"{what} {port}" for what, port in (("rpc port (stream.master)", rpc_port),
                                                  ("stream.master_metadata_port", metadata_port),
                                                  ("stream.master_metrics_port", metrics_port))
              if not reachable(host, port, timeout_s=2.0)]
    if silent:
        raise MooncakeStartError(f"the existing Mooncake master stream.master {ep.master_address!r} does not answer "
                                 f"on {host}: {', '.join(silent)}; start it (mooncake_master "
                                 "-enable_http_metadata_server=true ...) or set stream.master: \"\" so the run starts "
                                 "its own")
    try:
        before = int(metrics(ep).get("master_total_capacity_bytes", 0))
    except OSError as e:
        raise MooncakeStartError(f"the existing Mooncake master {ep.master_address}: its metrics on "
                                 f"stream.master_metrics_port {metrics_port} did not answer ({e})") from None
    try:
        _start_segment(ep, segment_pid, segment_log, capacity_before=before, timeout_s=timeout_s,
                       where=f" on the existing master {ep.master_address}")
    except BaseException:
        stop_store(ep, grace_s=2.0)     # the segment holder only: the master has no record here
        raise
    atomic_write(endpoint_file, ep.to_json())
    return ep


def _wait(ready, timeout_s: float, pid_file: Path, what: str, log: Path) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if ready():
            return
        if not status(pid_file).alive:
            raise MooncakeStartError(f"{what}: it exited; its log {log} ends: {_tail(log)}")
        time.sleep(0.1)
    raise MooncakeStartError(f"{what} within {timeout_s:g} s; its log {log} ends: {_tail(log)}")


def stop_store(ep: MooncakeEndpoint, grace_s: float = 10.0) -> list[StopResult]:
    """Stop the segment holder, then the master, then the metadata server, each by its pid record only."""
    return [stop_file(f, grace_s=grace_s) for _, f in ep.recorded()]


SEGMENT_MARGIN_BYTES = 32 << 20


def segment_bytes_for(buffer_bytes: int) -> int:
    """The segment holder's memory for a buffer: Mooncake evicts objects once a segment is 90 % full, so the
    segment is a quarter larger than the buffer the sinks keep to, plus a margin for the allocator's rounding."""
    return int(buffer_bytes * 1.25) + SEGMENT_MARGIN_BYTES


def running_store(endpoint_file: str | os.PathLike) -> MooncakeEndpoint | None:
    """The store an endpoint file names, when its master and segment holder both run (by their records) and
    the master answers; else None."""
    try:
        ep = MooncakeEndpoint.read(endpoint_file)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not ep.segment_pid_file or not (ep.master_pid_file or ep.foreign_master):
        return None
    if not all(status(f).alive for _, f in ep.recorded()):
        return None     # an existing master (foreign_master) has no record: its port below is the only evidence
    return ep if reachable(ep.host, ep.rpc_port) else None


def run_store_health(settings) -> dict:
    """The run's store as the watch sees it (``Store.health``): ``ok`` False with true evidence when its master or
    segment holder is not running by its pid record (or the endpoint is gone while the run needs it); the master's
    port not answering is said (``answering``), not judged here: a loaded host answers late."""
    try:
        ep = MooncakeEndpoint.read(settings.endpoint_file)
    except FileNotFoundError:
        return {"ok": False, "label": "Mooncake store", "detail": f"no endpoint at {settings.endpoint_file}: the "
                "run's store is not running (never started, or stopped)"}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {"ok": False, "label": "Mooncake store", "detail": f"endpoint {settings.endpoint_file} unreadable: {e}"}
    down = []
    answering = reachable(ep.host, ep.rpc_port)
    if ep.foreign_master and not answering:   # no pid record of a master the run did not start: its port is the proof
        down.append(f"the existing master {ep.master_address} (stream.master, not started by the run: judged by its "
                    "port only, no pid record) does not answer on its port")
    for role, pid_file in (((SEGMENT_ROLE, ep.segment_pid_file),) if ep.foreign_master else
                           ((MASTER_ROLE, ep.master_pid_file), (SEGMENT_ROLE, ep.segment_pid_file),
                            *(((METADATA_ROLE, ep.metadata_pid_file),) if ep.metadata_pid_file else ()))):
        st = status(pid_file) if pid_file else None
        if st is None or not st.alive:
            down.append(f"its {role} is not running ({st.detail if st is not None and st.detail else 'no record'}"
                        f"{'; record ' + pid_file if pid_file else ''})")
    detail = "; ".join(down) if down else (f"master {ep.master_address} " + ("answering" if answering else
                                                                               "not answering on its port"))
    if ep.foreign_master and not down:
        detail += " (an existing master, stream.master: judged by its port only, no pid record)"
    out = {"ok": not down, "foreign_master": ep.foreign_master, "label": ep.label, "answering": answering, "detail": detail,
           "buffer_bytes": int(settings.buffer_bytes)}
    if answering and not down:   # how full the buffer is: a stopped consumer leaves it full, the producer waiting
        try:
            figures = metrics(ep)
            out["allocated_bytes"] = int(figures["master_allocated_bytes"])
            out["key_count"] = int(figures["master_key_count"])
        except (OSError, KeyError, ValueError):
            pass
    return out


def start_run_store(settings, *, state_dir: str | os.PathLike, host: str = "127.0.0.1",
                    timeout_s: float = 60.0, master: tuple[str, int] | None = None, master_metadata_port: int = 8080,
                    master_metrics_port: int = 9003, protocol: str = "tcp", device_names: str = "") -> dict:
    """The run's store (``Store.start``): the running one its endpoint names, else a new master and segment
    holder sized for ``settings.buffer_bytes``. One store per run: never a second master beside a live one.
    ``master`` (``stream.master``, host and rpc port): an existing master the run uses instead of starting one;
    only the segment holder is started (``start_segment_on_master``)."""
    ep = running_store(settings.endpoint_file)
    if ep is not None and (ep.foreign_master if master is None else (ep.host, ep.rpc_port) != tuple(master)):
        ep = None       # the config names another master than the running store's: that store is replaced
    if ep is not None:
        return {"started": False, "attached": True, **json.loads(ep.to_json())}
    # a store lost mid-run (its master killed): what is left of it (the segment holder, dead records) is stopped by
    # its records only (a PID now someone else's is never signalled: process_record proves it ours first), then a
    # new incarnation starts (a new store id: the samples of the dead one are captured again, stores.mooncake.store)
    cleaned = _clean_dead_store(settings.endpoint_file)
    if master is not None:
        ep = start_segment_on_master(state_dir=state_dir, run_id=settings.run_id,
                                     segment_bytes=segment_bytes_for(settings.buffer_bytes),
                                     endpoint_file=settings.endpoint_file, host=master[0], rpc_port=int(master[1]),
                                     metadata_port=master_metadata_port, metrics_port=master_metrics_port,
                                     timeout_s=timeout_s, protocol=protocol, device_names=device_names)
        return {"started": True, "attached": False, "master_started": False,
                **({"replaced": cleaned} if cleaned else {}), **json.loads(ep.to_json())}
    ep = start_store(state_dir=state_dir, run_id=settings.run_id, segment_bytes=segment_bytes_for(settings.buffer_bytes),
                     endpoint_file=settings.endpoint_file, host=host, timeout_s=timeout_s, protocol=protocol,
                     device_names=device_names)
    return {"started": True, "attached": False, **({"replaced": cleaned} if cleaned else {}),
            **json.loads(ep.to_json())}


def _clean_dead_store(endpoint_file: str | os.PathLike) -> list[dict]:
    """Stop by its records what an endpoint file's store left running (not answering, or one process dead);
    MooncakeStartError when a record's process cannot be proven gone (a second master would share its ports'
    records and its memory would be counted twice)."""
    try:
        old = MooncakeEndpoint.read(endpoint_file)
    except (OSError, ValueError, KeyError, TypeError):
        return []
    results = stop_store(old, grace_s=2.0)
    bad = [r for r in results if r.outcome in ("refused", "unkillable", "survived")]
    if bad:
        raise MooncakeStartError("the run's previous store is not running whole but could not be stopped: "
                                 + "; ".join(f"{r.role or r.record} pid {r.pid}: {r.outcome} ({r.detail})" for r in bad)
                                 + f" (endpoint {endpoint_file}); stop it by hand, then start the store again")
    return [{"role": r.role, "pid": r.pid, "outcome": r.outcome, "store_id": old.store_id} for r in results]


def stop_run_store(settings, *, grace_s: float = 10.0,
                   remove_keys: Callable[[MooncakeEndpoint, str], dict] | None = None) -> list[dict]:
    """Stop the run's store by the records its endpoint names (``Store.stop``: stores.mooncake.store's, which gives
    ``remove_keys``, the run's keys removed from an existing master); the endpoint file is removed once both are
    gone, so no sink reaches for a dead store's ports."""
    try:
        ep = MooncakeEndpoint.read(settings.endpoint_file)
    except FileNotFoundError:
        return []
    # an existing master outlives the run: the run's keys go first (its objects may sit in other segments of that
    # master), then the run's segment holder; the master itself is never signalled (it has no record here)
    kept = {"role": "mooncake-keys", "pid": None, "outcome": "not_removed", "detail": "no client to remove them"}
    extra = [remove_keys(ep, settings.run_id) if remove_keys is not None else kept,
             {"role": MASTER_ROLE, "pid": None, "outcome": "left_running", "detail": f"the existing master "
              f"{ep.master_address} (stream.master) is not the run's: not signalled"}] if ep.foreign_master else []
    results = stop_store(ep, grace_s=grace_s)
    if all(r.outcome in ("terminated", "killed", "already_gone", "not_recorded", "stale_record") for r in results):
        try:
            os.unlink(settings.endpoint_file)
        except FileNotFoundError:
            pass
    return extra + [{"role": r.role, "pid": r.pid, "outcome": r.outcome, "detail": r.detail} for r in results]
