"""nvidia-smi output as real drivers print it -> GpuSnapshot, and the errors for what does not parse."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eagleflow.gpu.errors import GpuProbeError, NoGpuError, SmiParseError
from eagleflow.gpu.smi_probe import (SmiProbe, build_snapshots, parse_app_rows, parse_gpu_rows, smi_failure,
                                     read_node_report, snapshots_from_report)
from eagleflow.nodes import LocalNode
from tests.fixtures.gpu_scenarios import FIXTURES, gpu, proc, write_scenario

pytestmark = pytest.mark.timeout(60)  # runs the fake nvidia-smi and child processes

H200_UUIDS = [f"GPU-3e2b6a43-7a1c-9d41-0b38-1f8a4a2f4e1{i}" for i in range(8)]

# `nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw,
#  ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits` on an 8x H200 node, one job on GPU 3
EIGHT_NOUNITS = "".join(
    f"{i}, {u}, NVIDIA H200, {used}, 143771, {util}, {29 + i}, {75.93 + i:.2f}, 0\n"
    for i, (u, used, util) in enumerate(zip(H200_UUIDS, [0, 1, 3, 90000, 4, 0, 1, 3], [0, 0, 0, 97, 0, 0, 0, 0])))


def test_eight_gpus_without_units():
    rows = parse_gpu_rows(EIGHT_NOUNITS)
    assert [r["index"] for r in rows] == list(range(8))
    assert [r["memory_used_mib"] for r in rows] == [0, 1, 3, 90000, 4, 0, 1, 3]
    assert rows[3]["utilization_pct"] == 97 and rows[3]["uuid"] == H200_UUIDS[3]
    assert rows[0]["memory_total_mib"] == 143771 and rows[0]["power_w"] == pytest.approx(75.93)
    assert rows[7]["temperature_c"] == 36 and rows[7]["ecc_uncorrected"] == 0


def test_one_gpu_with_units():
    # the same query with --format=csv,noheader (units kept)
    line = "0, GPU-5a0e4f2c-6b1d-4c5e-8f9a-0b1c2d3e4f50, NVIDIA H100 80GB HBM3, 1 MiB, 81559 MiB, 0 %, 31, 69.84 W, 0\n"
    (r,) = parse_gpu_rows(line)
    assert (r["memory_used_mib"], r["memory_total_mib"], r["utilization_pct"], r["power_w"]) == (1, 81559, 0, 69.84)
    assert r["name"] == "NVIDIA H100 80GB HBM3"


def test_unsupported_cells_are_none_not_zero():
    # GB10 (unified memory) prints [N/A] for memory; older drivers say [Not Supported]
    text = ("0, GPU-aa11bb22-cc33-dd44-ee55-ff6677889900, NVIDIA GB10, [N/A], [N/A], 0, 41, 4.68, [N/A]\n"
            "1, GPU-bb11bb22-cc33-dd44-ee55-ff6677889900, NVIDIA GeForce GTX 1080 Ti, 3, 11178, [Not Supported], "
            "34, [Not Supported], [N/A]\n")
    gb10, gtx = parse_gpu_rows(text)
    assert gb10["memory_used_mib"] is None and gb10["memory_total_mib"] is None and gb10["ecc_uncorrected"] is None
    assert gb10["utilization_pct"] == 0  # a real 0 stays 0
    assert gtx["power_w"] is None and gtx["utilization_pct"] is None and gtx["memory_used_mib"] == 3


def test_gpu_name_with_commas_and_spaces():
    (r,) = parse_gpu_rows("2, GPU-cc11bb22-cc33-dd44-ee55-ff6677889900, Weird, Card 9000 (rev, b), 0, 1024, 0, 30, 10.00, 0")
    assert r["name"] == "Weird, Card 9000 (rev, b)" and r["memory_total_mib"] == 1024


def test_compute_apps_names_with_commas_spaces_and_units():
    text = ("4242, GPU-3e2b6a43-7a1c-9d41-0b38-1f8a4a2f4e13, 90000, python3 -m sglang.launch_server --model a,b\n"
            "77, GPU-3e2b6a43-7a1c-9d41-0b38-1f8a4a2f4e10, 3 MiB, /usr/lib/xorg/Xorg\n"
            "78, GPU-3e2b6a43-7a1c-9d41-0b38-1f8a4a2f4e10, [N/A], my tool, v2\n")
    a, b, c = parse_app_rows(text)
    assert (a["pid"], a["used_mib"], a["name"]) == (4242, 90000, "python3 -m sglang.launch_server --model a,b")
    assert (b["used_mib"], b["name"]) == (3, "/usr/lib/xorg/Xorg")
    assert c["used_mib"] is None and c["name"] == "my tool, v2"


def test_empty_compute_apps_list():
    assert parse_app_rows("") == [] and parse_app_rows("\n") == []
    snaps = build_snapshots(EIGHT_NOUNITS, "")
    assert len(snaps) == 8 and all(s.processes == () for s in snaps)


def test_processes_joined_by_uuid_not_index():
    apps = f"4242, {H200_UUIDS[3]}, 90000, python3\n"
    snaps = build_snapshots(EIGHT_NOUNITS, apps, {"4242": {"user": "bob", "state": "D", "pgid": 4242,
                                                           "wchan": "nvidia_wait"}})
    (p,) = snaps[3].processes
    assert (p.pid, p.user, p.state, p.wchan, p.used_mib) == (4242, "bob", "D", "nvidia_wait", 90000)
    assert all(not s.processes for i, s in enumerate(snaps) if i != 3)


@pytest.mark.parametrize("line", [
    "0, GPU-aa, NVIDIA H100, lots, 81559, 0, 31, 69.84, 0",
    "0, GPU-aa, NVIDIA H100, 1, 81559",
    "NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4, a, b, c, d, e, f, g, h",
])
def test_bad_lines_are_quoted_in_the_error(line):
    with pytest.raises(SmiParseError) as e:
        parse_gpu_rows(line)
    assert repr(line) in str(e.value)


def test_driver_missing_and_not_on_path_are_named():
    msg = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
           "Make sure that the latest NVIDIA driver is installed and running.\n")
    e = smi_failure("gpu-node-1", ["nvidia-smi", "-L"], 9, msg, "")
    assert isinstance(e, NoGpuError) and "driver is not loaded" in str(e) and "gpu-node-1" in str(e)
    e = smi_failure("gpu-node-1", ["nvidia-smi"], 127, "", "bash: line 1: nvidia-smi: command not found")
    assert isinstance(e, NoGpuError) and "not on PATH" in str(e)
    e = smi_failure("n", ["nvidia-smi"], 2, 'Field "bogus" is not a valid field to query.', "")
    assert type(e) is GpuProbeError and "bogus" in str(e)


def _fake_env(monkeypatch, scenario):
    monkeypatch.setenv("PATH", f"{FIXTURES / 'bin'}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_SCENARIO", str(scenario))
    monkeypatch.setenv("FAKE_NVIDIA_SMI_PYTHON", sys.executable)


def test_fake_nvidia_smi_formats_round_trip(tmp_path, monkeypatch):
    """The fake prints what the parser reads: units, [N/A], names with commas, empty process list."""
    sc = write_scenario(tmp_path / "s.json", {"gpus": [gpu(0, 90000), gpu(1, "[N/A]", name="NVIDIA GB10, x")],
                                              "processes": [proc(4242, 0, 90000, "python3 -m x, y")]})
    _fake_env(monkeypatch, sc)
    with_units = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,power.draw", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout
    assert with_units.splitlines()[0] == "0, 90000 MiB, 70.00 W"
    header = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv"],
                            capture_output=True, text=True, check=True).stdout
    assert header.splitlines()[0] == "index, memory.used [MiB]"
    snaps = SmiProbe(LocalNode(), helper=False).snapshot()
    assert [s.memory_used_mib for s in snaps] == [90000, None] and snaps[1].name == "NVIDIA GB10, x"
    assert snaps[0].processes[0].name == "python3 -m x, y"
    write_scenario(sc, {"gpus": [gpu(0, 0)], "processes": []})
    assert SmiProbe(LocalNode(), helper=False).snapshot()[0].processes == ()


def test_fake_driver_missing_exit_code_and_probe_error(tmp_path, monkeypatch):
    sc = write_scenario(tmp_path / "s.json", {"driver": False, "gpus": [gpu(0)]})
    _fake_env(monkeypatch, sc)
    p = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv"], capture_output=True, text=True)
    assert p.returncode == 9 and "couldn't communicate with the NVIDIA driver" in p.stdout
    with pytest.raises(NoGpuError, match="driver is not loaded"):
        SmiProbe(LocalNode(), helper=False).snapshot()


def test_nvidia_smi_missing_from_path(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(NoGpuError, match="nvidia-smi is not on PATH"):
        SmiProbe(LocalNode(name="cpu-box"), helper=False).snapshot()


def test_node_report_one_round_trip_adds_user_and_state(tmp_path, monkeypatch):
    """The helper runs both queries on the node and adds /proc facts; the caller parses."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sc = write_scenario(tmp_path / "s.json", {"gpus": [gpu(0, 5)], "processes": [proc(child.pid, 0, 500, live=True)]})
        _fake_env(monkeypatch, sc)
        node = LocalNode(name="n1")
        snaps = SmiProbe(node, helper=True).snapshot()
        (p,) = snaps[0].processes
        import getpass
        assert p.pid == child.pid and p.user == getpass.getuser() and p.state in ("S", "R")
        assert snaps[0].memory_used_mib == 505  # live process memory counted by the fake
    finally:
        child.kill()
        child.wait()
    assert SmiProbe(node, helper=True).snapshot()[0].processes == ()


def test_report_error_is_raised_with_node_name():
    with pytest.raises(NoGpuError, match="on node n7: NVML library"):
        snapshots_from_report("n7", {"error": "NVML library not found", "no_gpu": True})
    node = LocalNode(name="n7")
    with pytest.raises(GpuProbeError, match="on node n7: node_report gave no report: .*is not JSON.*Traceback"):
        read_node_report(node, ["sh", "-c", "echo 'Traceback ...'"], 10)
    with pytest.raises(GpuProbeError, match="on node n7: .* exited 3: boom"):
        read_node_report(node, ["sh", "-c", "echo boom >&2; exit 3"], 10)
