"""The node-side half of a GPU reading: one command, one JSON line on stdout.

Run on the node as ``python -m eagleflow.gpu.node_report --probe smi|nvml``.
For ``smi`` it runs both nvidia-smi queries and returns their raw output and
exit codes (parsed by the caller, so parsing is one code path) plus, for every
listed PID, its user, state, process group and wchan from this node's /proc.
For ``nvml`` it returns NvmlProbe's snapshots. Either way a probe over SSH
costs one channel.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any, cast

from .errors import GpuProbeError, NoGpuError
from .process_info import describe_pid
from .smi_probe import NodeReport, apps_query_argv, gpu_query_argv, parse_app_rows
from .nvml_probe import NvmlProbe


def _run(argv: list[str]) -> dict:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return {"rc": 127, "out": "", "err": f"{argv[0]}: command not found"}
    except subprocess.TimeoutExpired:
        return {"rc": 124, "out": "", "err": f"{argv[0]} did not answer within 60 s"}
    return {"rc": p.returncode, "out": p.stdout, "err": p.stderr}


def smi_report(nvidia_smi: str) -> NodeReport:
    rep: dict[str, Any] = {"probe": "smi", "nvidia_smi": nvidia_smi, "taken_at": time.time(),
                           "gpu": _run(gpu_query_argv(nvidia_smi))}
    rep["apps"] = _run(apps_query_argv(nvidia_smi)) if rep["gpu"]["rc"] == 0 else {"rc": 0, "out": "", "err": ""}
    procs = {}
    if rep["apps"]["rc"] == 0:
        try:
            for row in parse_app_rows(rep["apps"]["out"]):
                procs[str(row["pid"])] = describe_pid(row["pid"])
        except GpuProbeError:
            pass  # the caller parses the same text and reports the bad line
    rep["procs"] = procs
    return cast(NodeReport, rep)


def nvml_report() -> NodeReport:
    probe = NvmlProbe(node_name="this node")
    try:
        return {"probe": "nvml", "gpus": [s.to_dict() for s in probe.snapshot()]}
    except NoGpuError as e:
        return {"error": str(e).replace("on node this node: ", ""), "no_gpu": True}
    except GpuProbeError as e:
        return {"error": str(e).replace("on node this node: ", "")}
    finally:
        probe.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagleflow.gpu.node_report")
    ap.add_argument("--probe", choices=["smi", "nvml"], default="smi")
    ap.add_argument("--nvidia-smi", default="nvidia-smi")
    a = ap.parse_args(argv)
    rep = smi_report(a.nvidia_smi) if a.probe == "smi" else nvml_report()
    print(json.dumps(rep), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
