"""The trigger form as a person reads it (issue 50): no ``null`` in a dropdown, every empty field says it takes the
config's value, a setting the config decides is never a switch that reads *off* while the config says on, and the
config file the form starts from is named as the docs name it (``configs/local-demo.yaml``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleflow.airflow.trigger_form import FROM_CONFIG, shown_choices

REPO = Path(__file__).resolve().parents[2]


def _parse(monkeypatch, config: str | None):
    from airflow.dag_processing.dagbag import DagBag
    if config is None:
        monkeypatch.delenv("EAGLEFLOW_CONFIG", raising=False)
    else:
        monkeypatch.setenv("EAGLEFLOW_CONFIG", config)
    bag = DagBag(dag_folder=str(REPO / "dags" / "eagle3_pipeline.py"))
    assert bag.import_errors == {}
    return bag.dags["eagle3_pipeline"]


@pytest.fixture(scope="module")
def params():
    with pytest.MonkeyPatch.context() as mp:
        # as `make airflow` sets it: an absolute path to the demo config (deploy/home.py)
        return _parse(mp, str(REPO / "configs" / "local-demo.yaml")).params


def _schemas(params) -> dict[str, dict]:
    """Each Param's schema as the UI receives it (the serialized DAG's params, JSON)."""
    return {name: json.loads(json.dumps(params.get_param(name).dump()))["schema"] for name in params.keys()}


def test_no_dropdown_shows_null_and_each_empty_choice_reads_from_the_config(params):
    dropdowns = {name: s for name, s in _schemas(params).items() if "enum" in s}
    assert {"node_conn_id", "capture_backend", "generate_enabled", "generate_reasoning"} <= set(dropdowns)
    for name, schema in dropdowns.items():
        labels = shown_choices(schema)
        assert "null" not in labels and "None" not in labels, (name, labels)
        if None in schema["enum"]:
            assert labels[schema["enum"].index(None)] == FROM_CONFIG, (name, labels)
    assert shown_choices(dropdowns["capture_backend"]) == [FROM_CONFIG, "hf", "sglang", "vllm"]


def test_every_field_has_a_title_and_says_what_empty_means(params):
    for name in params.keys():
        p = params.get_param(name)
        assert p.schema.get("title") and p.description, f"Param {name} lacks title/description"
        if p.value is None and name != "run_name":   # run_name's empty is the Airflow run id, said so
            assert f"Empty: {FROM_CONFIG}" in p.description, (name, p.description)
    assert "Empty: the Airflow run id" in params.get_param("run_name").description


def test_settings_the_config_decides_are_three_way_not_a_switch_reading_off(params):
    s = _schemas(params)
    gen = s["generate_enabled"]
    # not a boolean (the form draws any boolean as a switch showing "off" for None)
    assert "boolean" not in (gen["type"] if isinstance(gen["type"], list) else [gen["type"]])
    assert gen["enum"] == [None, "on", "off"] and params["generate_enabled"] is None
    assert shown_choices(gen) == [FROM_CONFIG, "on", "off"]
    # the two switches that stay switches (REST callers send true) say what off means
    for name, field in (("force_free_gpus", "gpu.force_free"), ("delete_old_caches", "disk.delete_old_caches")):
        p = params.get_param(name)
        assert "off: as the config says" in p.schema["title"] and f"Off: {FROM_CONFIG}, {field}" in p.description


def test_the_form_starts_from_the_documented_relative_config(params, monkeypatch):
    assert params["config_path"] == "configs/local-demo.yaml"
    assert "configs/local-demo.yaml" in (REPO / "README.md").read_text()
    # no $EAGLEFLOW_CONFIG: the demo's, as written
    from eagleflow.airflow.trigger_form import form_config_path
    monkeypatch.delenv("EAGLEFLOW_CONFIG", raising=False)
    assert form_config_path() == "configs/local-demo.yaml"
    # a deployment's config outside the project keeps the absolute path it was named by
    monkeypatch.setenv("EAGLEFLOW_CONFIG", "/etc/eagleflow/prod.yaml")
    assert form_config_path() == "/etc/eagleflow/prod.yaml"


@pytest.mark.parametrize("choice, configured, expected", [(None, True, True), ("on", False, True), ("off", True, False)])
def test_the_three_way_choice_reaches_the_config(tmp_path, choice, configured, expected):
    import yaml

    from eagleflow.airflow.runtime import RunContext
    cfg = yaml.safe_load((REPO / "configs" / "local-demo.yaml").read_text())
    cfg.setdefault("generate", {})["enabled"] = configured
    cfg["generate"]["reasoning"] = configured
    for s in cfg["corpus"]["sources"]:
        s["path"] = str((REPO / "configs" / s["path"]).resolve())
    cfg["target_model"] = str((REPO / "configs" / cfg["target_model"]).resolve())
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    ctx = RunContext.from_params({"config_path": str(p), "generate_enabled": choice, "generate_reasoning": choice},
                                 "r")
    assert ctx.cfg.generate.enabled is expected and ctx.cfg.generate.reasoning is expected


def test_the_storage_param_offers_the_stores_registry_and_starts_from_the_config(params):
    """Issue 53: a run streams when the form says so (``storage``), else as its config says."""
    from eagleflow.stores import STORES
    schema = _schemas(params)["storage"]
    assert schema["enum"] == [None, *STORES] and params.get_param("storage").value is None
    assert shown_choices(schema) == [FROM_CONFIG, "disk (offline)", "mooncake (streaming)"]
    assert "stream.storage" in params.get_param("storage").description


@pytest.mark.parametrize("choice, configured, expected", [(None, "disk", "disk"), ("mooncake", "disk", "mooncake"),
                                                          ("disk", "mooncake", "disk"), (None, "mooncake", "mooncake")])
def test_the_storage_choice_reaches_the_frozen_run_config(tmp_path, choice, configured, expected):
    import yaml

    from eagleflow.airflow.runtime import RunContext
    cfg = yaml.safe_load((REPO / "configs" / "local-demo.yaml").read_text())
    cfg.setdefault("stream", {})["storage"] = configured
    for s in cfg["corpus"]["sources"]:
        s["path"] = str((REPO / "configs" / s["path"]).resolve())
    cfg["target_model"] = str((REPO / "configs" / cfg["target_model"]).resolve())
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    ctx = RunContext.from_params({"config_path": str(p), "storage": choice}, "r")
    assert ctx.cfg.stream.storage == expected
    # what write_run_config freezes is what every later task and the node read
    assert RunContext.from_frozen(json.loads(json.dumps(ctx.frozen()))).cfg.stream.storage == expected
