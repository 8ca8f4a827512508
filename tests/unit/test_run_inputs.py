"""Inputs refused before anything runs: run names outside run_root, unusable model/source/dirs (preflight)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagleflow.config import ConfigError, check_run_name, load_config
from eagleflow.layout import RunLayout
from eagleflow.preflight import preflight


def _cfg(tmp_path: Path, **extra):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 4,
                                                   "torch_dtype": "float32"}))
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    src = tmp_path / "a.jsonl"
    src.write_text("{}\n")
    data = {"run_root": str(tmp_path / "runs"), "target_model": str(model),
            "corpus": {"sources": [{"name": "a", "path": str(src)}], "max_length": 64},
            "server": {"dump_dir": str(tmp_path / "dumps")}}
    for k, v in extra.items():
        data[k] = v
    return load_config(data=data)


@pytest.mark.parametrize("bad", ["..", ".", "/etc", "a/b", "a\\b", "", "~root"])
def test_run_names_that_leave_run_root_are_refused_naming_the_field(tmp_path, bad):
    with pytest.raises(ConfigError, match="--run-id"):
        check_run_name(bad, "--run-id")
    cfg = _cfg(tmp_path)
    with pytest.raises(ConfigError):
        RunLayout.for_run(cfg, bad)


def test_plain_names_and_airflow_run_ids_stay_under_run_root(tmp_path):
    cfg = _cfg(tmp_path)
    for ok in ("exp-01", "a.b", "...", "manual__2026-12-01T03:39:40.767398+00:00"):
        lay = RunLayout.for_run(cfg, ok)
        assert Path(lay.run_dir).parent == tmp_path / "runs"


def test_preflight_passes_a_usable_run(tmp_path):
    rep = preflight(_cfg(tmp_path), "exp")
    assert rep.ok, rep.problems
    assert (tmp_path / "dumps").is_dir() and (tmp_path / "runs").is_dir()


def test_preflight_names_every_problem_with_its_field(tmp_path):
    cfg = _cfg(tmp_path)
    model = Path(cfg.target_model)
    (model / "tokenizer.json").unlink()
    (model / "model.safetensors").unlink()
    data = cfg.model_dump(mode="json")
    data["corpus"]["sources"].append({"name": "gone", "path": str(tmp_path / "gone.jsonl")})
    (tmp_path / "file").write_text("x")
    data["server"]["dump_dir"] = str(tmp_path / "file" / "dumps")   # under a file: cannot be created
    rep = preflight(load_config(data=data), "exp")
    lines = "\n".join(p.line() for p in rep.problems)
    assert "target_model" in lines and "no tokenizer file" in lines and "no weights" in lines, lines
    assert "corpus.sources[1].path (gone)" in lines and "does not exist" in lines, lines
    assert "server.dump_dir" in lines and "not writable" in lines, lines
    missing = load_config(data={**data, "target_model": str(tmp_path / "nope")})
    assert any(p.field == "target_model" and "does not exist" in p.message
               for p in preflight(missing, "exp").problems)


def test_preflight_counts_the_dumps_in_flight(tmp_path):
    cfg = _cfg(tmp_path)
    data = cfg.model_dump(mode="json")
    data["capture"].update(shards=1024, in_flight=256)
    data["corpus"]["max_length"] = 1_048_576          # 1024 x 256 x 1 Mi tokens x 137 B: no disk holds that
    rep = preflight(load_config(data=data), "exp")
    assert any(p.field == "server.dump_dir" and "dumps in flight" in p.message for p in rep.problems), rep.problems


def test_preflight_command_answers_json_on_stdin(tmp_path):
    cfg = _cfg(tmp_path)
    res = subprocess.run([sys.executable, "-m", "eagleflow.preflight", ".."], input=json.dumps(
        cfg.model_dump(mode="json")), capture_output=True, text=True, timeout=60)
    answer = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0 and [p["field"] for p in answer["problems"]] == ["run id"]
