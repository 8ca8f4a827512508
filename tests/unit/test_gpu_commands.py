"""`eagleflow gpu ...` on this machine with the fake nvidia-smi, and the no-GPU path of commands and gates."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from eagleflow.cli import main
from tests.fixtures.gpu_scenarios import FIXTURES, gpu, proc, write_scenario

pytestmark = pytest.mark.timeout(60)  # runs the fake nvidia-smi


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A local 'GPU node': fake nvidia-smi on PATH, a config with probe smi and a baseline file."""
    sc = write_scenario(tmp_path / "scenario.json", {"gpus": [gpu(0, 3), gpu(1, 250)], "processes": []})
    monkeypatch.setenv("PATH", f"{FIXTURES / 'bin'}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_SCENARIO", str(sc))
    monkeypatch.setenv("FAKE_NVIDIA_SMI_PYTHON", sys.executable)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"run_root": "runs", "target_model": "m", "node": {"name": "box", "has_gpu": True},
                                   "gpu": {"probe": "smi", "baseline_file": "state/baseline.json",
                                           "poll_interval_s": 0.2, "idle_timeout_s": 0.5}}))
    return {"cfg": str(cfg), "scenario": sc, "dir": tmp_path}


def test_baseline_then_status_and_wait_idle_use_it(node, capsys):
    assert main(["gpu", "wait-idle", "--config", node["cfg"]]) == 1  # GPU 1 carries 250 MiB (a display)
    assert "GPU 1 (GPU-00000001-1111-2222-3333-444455556666): 250 MiB used (idle allows <= 16 MiB)" in capsys.readouterr().out
    assert main(["gpu", "baseline", "--config", node["cfg"]]) == 0
    doc = json.loads((node["dir"] / "state" / "baseline.json").read_text())
    assert doc["gpus"]["GPU-00000001-1111-2222-3333-444455556666"]["memory_used_mib"] == 250
    capsys.readouterr()
    assert main(["gpu", "wait-idle", "--config", node["cfg"]]) == 0
    assert "all 2 selected GPU(s) idle" in capsys.readouterr().out
    assert main(["gpu", "status", "--config", node["cfg"], "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["idle"]["all_idle"] and [g["allowed_mib"] for g in data["idle"]["gpus"]] == [19, 266]


def test_baseline_refused_while_a_process_runs(node, capsys):
    write_scenario(node["scenario"], {"gpus": [gpu(0, 900)], "processes": [proc(4242, 0, 890)]})
    assert main(["gpu", "baseline", "--config", node["cfg"]]) == 3
    assert "free the GPUs first" in capsys.readouterr().err


def test_free_reports_foreign_without_killing(node, capsys):
    write_scenario(node["scenario"], {"gpus": [gpu(0, 900)], "processes": [proc(999999, 0, 890, "x, y")]})
    assert main(["gpu", "free", "--config", node["cfg"], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["outcomes"] == [] and out["force"] is False  # pid 999999 is not alive on this machine


def test_free_refuses_to_run_off_node(node, tmp_path, capsys):
    cfg = yaml.safe_load(open(node["cfg"]))
    cfg["node"]["conn_id"] = "gpu_node"
    (tmp_path / "remote.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit, match="run it on that node with --on-node"):
        main(["gpu", "free", "--config", str(tmp_path / "remote.yaml")])


def test_status_of_configured_gpus_whose_driver_is_gone_fails_naming_it(node, capsys):
    """A GPU node with its driver unloaded is not a CPU node: status says which GPUs it cannot read and why."""
    cfg = yaml.safe_load(open(node["cfg"]))
    cfg["gpu"]["select"] = ["0", "GPU-00000001-1111-2222-3333-444455556666"]
    (node["dir"] / "sel.yaml").write_text(yaml.safe_dump(cfg))
    write_scenario(node["scenario"], {"driver": False, "gpus": [gpu(0, 3)], "processes": []})
    assert main(["gpu", "status", "--config", str(node["dir"] / "sel.yaml"), "--json"]) == 3
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["has_gpu"] is True and doc["readable"] is False and doc["gpus"] == []
    assert [u["gpu"] for u in doc["unreadable"]] == ["0", "GPU-00000001-1111-2222-3333-444455556666"]
    assert "the NVIDIA driver is not loaded" in doc["driver_error"]
    assert "couldn't communicate with the NVIDIA driver" in doc["driver_error"]   # nvidia-smi's own words
    assert f"gpu.select: 0, GPU-00000001-1111-2222-3333-444455556666 in {node['dir'] / 'sel.yaml'}" in doc["message"]
    assert "set node.has_gpu: false if this is a CPU node" in out.err


def test_status_without_nvidia_smi_fails_naming_it(node, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")   # the driver's tools are gone with it
    assert main(["gpu", "status", "--config", node["cfg"]]) == 3
    out = capsys.readouterr()
    assert out.out == ""
    assert "node box: GPUs configured (node.has_gpu: true, gpu.select: all in" in out.err
    assert "nvidia-smi is not on PATH" in out.err


def test_no_gpu_node_says_so_and_passes(tmp_path, capsys):
    cfg = tmp_path / "cpu.yaml"
    cfg.write_text(yaml.safe_dump({"target_model": "m", "node": {"name": "cpu-box", "has_gpu": False}}))
    for argv in (["gpu", "status", "--config", str(cfg)], ["gpu", "wait-idle", "--config", str(cfg)],
                 ["gpu", "baseline", "--config", str(cfg)]):
        assert main(argv) == 0
        assert "node cpu-box has no GPU (node.has_gpu is false" in capsys.readouterr().out
    # the demo's own config is such a node
    demo = str(Path(__file__).resolve().parents[2] / "configs" / "local-demo.yaml")
    assert main(["gpu", "status", "--config", demo, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["has_gpu"] is False


def test_gates_pass_on_a_node_without_gpu(tmp_path, capfd):
    from eagleflow.airflow.gpu_operators import FreeGpusOperator, GpuIdleSensor
    from eagleflow.airflow.gpu_triggers import GpuIdleTrigger
    cfg = tmp_path / "cpu.yaml"
    cfg.write_text(yaml.safe_dump({"target_model": "m", "run_root": str(tmp_path / "runs"),
                                   "node": {"name": "cpu-box", "has_gpu": False}}))
    context = {"params": {"config_path": str(cfg)}, "run_id": "r1"}
    assert GpuIdleSensor(task_id="gpus_idle", deferrable=True).execute(context) is None
    assert FreeGpusOperator(task_id="free_gpus").execute(context)["outcomes"] == []
    assert capfd.readouterr().out.count("node cpu-box has no GPU") >= 2  # Airflow logs via structlog to stdout
    # the trigger round-trips every argument (the triggerer rebuilds it from this)
    trig = GpuIdleTrigger(run={"conn_id": "gpu_node", "run_config": "/runs/r1/run-config.json", "run_id": "r1"},
                          end_at=123.5, poll_interval_s=2)
    path, kwargs = trig.serialize()
    assert path == "eagleflow.airflow.gpu_triggers.GpuIdleTrigger"
    assert GpuIdleTrigger(**kwargs).serialize() == (path, kwargs)
    assert kwargs == {"run": {"conn_id": "gpu_node", "run_config": "/runs/r1/run-config.json", "run_id": "r1"},
                      "end_at": 123.5, "poll_interval_s": 2.0}
