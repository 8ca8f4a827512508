"""Read GPUs with nvidia-smi on a node, in one round trip.

Queried with ``--format=csv,noheader,nounits``; the parser also accepts the
same output with units ("1 MiB", "69.84 W", "0 %") because people paste that
and older scripts ask for it. Cells the GPU does not support read ``[N/A]``
(newer drivers) or ``[Not Supported]`` (older) and become None. GPU and process
names are not quoted and may hold commas and spaces, so rows are split knowing
the field count: the fixed fields are taken from both ends and the name is
what is left in the middle (GPUs) or at the end (processes).

By default the probe runs ``python -m eagleflow.gpu.node_report`` on the node,
which runs both queries and adds each process's user and state from the
node's /proc, so one SSH channel gives the whole picture.
"""
from __future__ import annotations

import re
import shlex
from typing import Any, TypedDict, cast

from eagleflow.nodes import Node, NodeAnswerError, NodeCommandFailed, NodeError

from .errors import GpuProbeError, NoGpuError, SmiParseError
from .snapshot import GpuProcess, GpuSnapshot, GpuSnapshotDict
from .snapshot import snapshots_from_json


class CommandOutput(TypedDict):
    """One command's exit code and output, as the node report carries it."""
    rc: int
    out: str
    err: str


class NodeReport(TypedDict, total=False):
    """What ``eagleflow.gpu.node_report`` prints: ``smi``: both queries' raw output (``gpu``, ``apps``) and the
    listed PIDs' /proc facts (``procs``); ``nvml``: the snapshots (``gpus``); either: ``error`` (and ``no_gpu``)
    when it could not read the GPUs."""
    probe: str
    nvidia_smi: str
    taken_at: float
    gpu: CommandOutput
    apps: CommandOutput
    procs: dict[str, dict[str, Any]]
    gpus: list[GpuSnapshotDict]
    error: str
    no_gpu: bool

GPU_FIELDS = ("index", "uuid", "name", "memory.used", "memory.total", "utilization.gpu", "temperature.gpu",
              "power.draw", "ecc.errors.uncorrected.volatile.total")
APP_FIELDS = ("pid", "gpu_uuid", "used_memory", "process_name")  # name last: it may hold ", "
FORMAT = "--format=csv,noheader,nounits"


def gpu_query_argv(nvidia_smi: str = "nvidia-smi") -> list[str]:
    return [nvidia_smi, "--query-gpu=" + ",".join(GPU_FIELDS), FORMAT]


def apps_query_argv(nvidia_smi: str = "nvidia-smi") -> list[str]:
    return [nvidia_smi, "--query-compute-apps=" + ",".join(APP_FIELDS), FORMAT]


_UNSUPPORTED = {"[N/A]", "[Not Supported]", "N/A", "[Unknown Error]", "[Insufficient Permissions]", ""}
_UNIT = re.compile(r"^(-?\d+(?:\.\d+)?)\s*(MiB|W|%|C|GiB|KiB|MHz)?$")
_DRIVER_MISSING = ("couldn't communicate with the NVIDIA driver", "NVIDIA driver is not loaded",
                   "Driver Not Loaded", "No devices were found")


def _number(cell: str, line: str, field: str) -> float | None:
    cell = cell.strip()
    if cell in _UNSUPPORTED:
        return None
    m = _UNIT.match(cell)
    if not m:
        raise SmiParseError(f"nvidia-smi field {field} = {cell!r} is not a number in line {line!r}")
    value = float(m.group(1))
    if m.group(2) == "GiB":
        value *= 1024
    elif m.group(2) == "KiB":
        value /= 1024
    return value


def _int(cell: str, line: str, field: str) -> int | None:
    v = _number(cell, line, field)
    return None if v is None else int(round(v))


def parse_gpu_rows(text: str) -> list[dict]:
    """Rows of ``--query-gpu`` in GPU_FIELDS order; the name may contain ', '."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(", ")]  # nvidia-smi separates cells with ", "
        if len(parts) < len(GPU_FIELDS):
            raise SmiParseError(f"nvidia-smi --query-gpu line has {len(parts)} fields, expected "
                                f"{len(GPU_FIELDS)} ({','.join(GPU_FIELDS)}): {line!r}")
        tail = len(GPU_FIELDS) - 3  # fields after the name
        index_cell, uuid = parts[0], parts[1]
        name = ", ".join(parts[2:len(parts) - tail])
        used, total, util, temp, power, ecc = parts[len(parts) - tail:]
        idx = _int(index_cell, line, "index")
        if idx is None or not uuid.startswith(("GPU-", "MIG-")):
            raise SmiParseError(f"nvidia-smi --query-gpu line does not start with index and GPU UUID: {line!r}")
        rows.append({
            "index": idx, "uuid": uuid, "name": name,
            "memory_used_mib": _int(used, line, "memory.used"),
            "memory_total_mib": _int(total, line, "memory.total"),
            "utilization_pct": _int(util, line, "utilization.gpu"),
            "temperature_c": _int(temp, line, "temperature.gpu"),
            "power_w": _number(power, line, "power.draw"),
            "ecc_uncorrected": _int(ecc, line, "ecc.errors.uncorrected.volatile.total"),
        })
    return rows


def parse_app_rows(text: str) -> list[dict]:
    """Rows of ``--query-compute-apps`` in APP_FIELDS order; empty output = no process."""
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.strip().lower().startswith("no running"):
            continue
        parts = line.split(", ", len(APP_FIELDS) - 1)
        if len(parts) < len(APP_FIELDS):
            raise SmiParseError(f"nvidia-smi --query-compute-apps line has {len(parts)} fields, expected "
                                f"{len(APP_FIELDS)} ({','.join(APP_FIELDS)}): {line!r}")
        pid = _int(parts[0], line, "pid")
        if pid is None:
            raise SmiParseError(f"nvidia-smi --query-compute-apps line has no pid: {line!r}")
        rows.append({"pid": pid, "gpu_uuid": parts[1].strip(),
                     "used_mib": _int(parts[2], line, "used_memory"),
                     "name": parts[3].strip()})
    return rows


def smi_failure(node: str, argv: list[str], exit_code: int, stdout: str, stderr: str) -> GpuProbeError:
    """The error for a failed nvidia-smi call, naming the likely cause."""
    text = (stderr or stdout).strip()
    cmd = shlex.join(argv)
    if exit_code == 127 or "command not found" in text or "No such file or directory" in text:
        return NoGpuError(f"on node {node}: nvidia-smi is not on PATH (`{cmd}` exited {exit_code}); "
                          f"install the NVIDIA driver there, or set node.has_gpu: false for a CPU node")
    if any(s in text for s in _DRIVER_MISSING):
        return NoGpuError(f"on node {node}: the NVIDIA driver is not loaded (`{cmd}` exited {exit_code}: "
                          f"{text[:300]}); check `nvidia-smi` on the node, or set node.has_gpu: false")
    return GpuProbeError(f"on node {node}: `{cmd}` exited {exit_code}: {text[:500]}")


def build_snapshots(gpu_text: str, apps_text: str, procs: dict[str, dict] | None = None,
                    taken_at: float | None = None) -> list[GpuSnapshot]:
    """Join GPU rows and process rows by UUID; add /proc facts per PID when the node gave them."""
    gpus = parse_gpu_rows(gpu_text)
    apps = parse_app_rows(apps_text)
    procs = procs or {}
    by_uuid: dict[str, list[GpuProcess]] = {g["uuid"]: [] for g in gpus}
    for a in apps:
        info = procs.get(str(a["pid"]), {})
        by_uuid.setdefault(a["gpu_uuid"], []).append(GpuProcess(
            pid=a["pid"], name=a["name"], used_mib=a["used_mib"], user=info.get("user"),
            state=info.get("state"), pgid=info.get("pgid"), wchan=info.get("wchan")))
    extra: dict[str, Any] = {}
    if taken_at is not None:
        extra["taken_at"] = taken_at
    return [GpuSnapshot(**g, processes=tuple(by_uuid[g["uuid"]]), source="smi", **extra) for g in gpus]


class SmiProbe:
    """nvidia-smi on ``node``; with ``helper`` (default) one round trip that also names users."""

    def __init__(self, node: Node, *, nvidia_smi: str = "nvidia-smi", helper: bool = True, timeout_s: float = 30.0):
        self.node = node
        self.nvidia_smi = nvidia_smi
        self.helper = helper
        self.timeout_s = timeout_s

    def snapshot(self) -> list[GpuSnapshot]:
        return self._via_helper() if self.helper else self._direct()

    def _direct(self) -> list[GpuSnapshot]:
        out = []
        for argv in (gpu_query_argv(self.nvidia_smi), apps_query_argv(self.nvidia_smi)):
            try:
                res = self.node.run(argv, timeout=self.timeout_s)
            except NodeError as e:
                if "not on PATH" in str(e):
                    raise NoGpuError(f"on node {self.node.name}: nvidia-smi is not on PATH; install the NVIDIA "
                                     f"driver there, or set node.has_gpu: false for a CPU node") from None
                raise
            if not res.ok:
                raise smi_failure(self.node.name, argv, res.exit_code, res.stdout, res.stderr)
            out.append(res.stdout)
        return build_snapshots(out[0], out[1])

    def _via_helper(self) -> list[GpuSnapshot]:
        argv = [self.node.python, "-m", "eagleflow.gpu.node_report", "--probe", "smi",
                "--nvidia-smi", self.nvidia_smi]
        return snapshots_from_report(self.node.name, read_node_report(self.node, argv, self.timeout_s))


def read_node_report(node, argv: list[str], timeout_s: float) -> NodeReport:
    """Run ``eagleflow.gpu.node_report`` on the node and return its document; GpuProbeError says what failed."""
    try:
        return cast(NodeReport, node.run_json(argv, dict[str, Any], timeout=timeout_s))
    except NodeCommandFailed as e:
        err = (e.stderr or e.stdout).strip()
        if "No module named" in err:
            raise GpuProbeError(f"on node {node.name}: {node.python} cannot import eagleflow "
                                f"({err[-200:]}); install the package on the node or set node.python") from None
        raise GpuProbeError(f"on node {node.name}: `{shlex.join(argv)}` exited {e.exit_code}: {err[-500:]}") from None
    except NodeAnswerError as e:
        raise GpuProbeError(f"on node {node.name}: node_report gave no report: {e}") from None


def snapshots_from_report(node: str, rep: NodeReport) -> list[GpuSnapshot]:
    """Turn node_report's document into snapshots, raising the error it carried."""
    if rep.get("error"):
        cls = NoGpuError if rep.get("no_gpu") else GpuProbeError
        raise cls(f"on node {node}: {rep['error']}")
    if rep.get("probe") == "nvml":
        return snapshots_from_json(rep["gpus"])
    smi = rep.get("nvidia_smi", "nvidia-smi")
    for key, argv in (("gpu", gpu_query_argv(smi)), ("apps", apps_query_argv(smi))):
        r = rep["gpu"] if key == "gpu" else rep["apps"]   # in order: a failed first query is the error
        if r["rc"] != 0:
            raise smi_failure(node, argv, r["rc"], r["out"], r["err"])
    return build_snapshots(rep["gpu"]["out"], rep["apps"]["out"], rep.get("procs"), rep.get("taken_at"))
