"""From an Airflow task context to the things every eagleflow task needs.

A run's config is the YAML named by the ``config_path`` Param with the other
Params laid over it (``PARAM_OVERRIDES``). The first task writes the resolved
config into the run directory on the node, so every CLI command started there
reads exactly what the control plane validated.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from eagleflow.config import PipelineConfig, load_config
from eagleflow.layout import RunLayout
from eagleflow.nodes import Node, node_from_config

# DAG Param name -> dotted config field. A Param left at None keeps the file's value.
PARAM_OVERRIDES: dict[str, str] = {
    "target_model": "target_model",
    "node_conn_id": "node.conn_id",
    "capture_backend": "capture.backend",
    "shards": "capture.shards",
    "force_free_gpus": "gpu.force_free",
    "delete_old_caches": "disk.delete_old_caches",
    "max_train_steps": "train.max_steps",
    "alert_emails": "watchdog.alert_emails",
}

DEFAULT_CONFIG_ENV = "EAGLEFLOW_CONFIG"


def config_from_params(params: dict[str, Any]) -> PipelineConfig:
    path = params.get("config_path") or os.environ.get(DEFAULT_CONFIG_ENV)
    if not path:
        from eagleflow.config import ConfigError
        raise ConfigError("no config: set the DAG Param 'config_path' (or $EAGLEFLOW_CONFIG) to a YAML file; "
                          "see configs/local-demo.yaml")
    # A boolean Param can only switch a setting on: False (its form default) keeps the file's value.
    overrides = {field: params[p] for p, field in PARAM_OVERRIDES.items()
                 if params.get(p) not in (None, "", [], False)}
    return load_config(path, overrides)


def resolved_config_dict(cfg: PipelineConfig) -> dict[str, Any]:
    """The config with every path made absolute, as JSON-safe data (for the node and triggers)."""
    data = cfg.model_dump(mode="json")
    data["run_root"] = str(cfg.resolve(cfg.run_root))
    data["target_model"] = str(cfg.resolve(cfg.target_model))
    data["node"]["state_dir"] = str(cfg.node_state_dir())
    for src in data["corpus"]["sources"]:
        src["path"] = str(cfg.resolve(src["path"]))
    if cfg.gpu.baseline_file:
        data["gpu"]["baseline_file"] = str(cfg.resolve(cfg.gpu.baseline_file))
    if cfg.disk.cache_root:
        data["disk"]["cache_root"] = str(cfg.resolve(cfg.disk.cache_root))
    data["disk"]["old_caches"] = [str(cfg.resolve(p)) for p in cfg.disk.old_caches]
    return data


@dataclass
class RunContext:
    """Config, file layout and node of one DAG run."""
    cfg: PipelineConfig
    layout: RunLayout
    _node: Node | None = None

    @classmethod
    def from_params(cls, params: dict[str, Any], run_id: str) -> "RunContext":
        cfg = config_from_params(params)
        cfg = load_config(data=resolved_config_dict(cfg))  # absolute paths from here on
        return cls(cfg=cfg, layout=RunLayout.for_run(cfg, run_id))

    @classmethod
    def from_airflow(cls, context) -> "RunContext":
        params = dict(context["params"])
        # run_name names the run directory when set (the demo knows it before the run starts)
        return cls.from_params(params, params.get("run_name") or context["run_id"])

    @classmethod
    def from_serialized(cls, config: dict[str, Any], run_id: str) -> "RunContext":
        """Rebuild in a trigger from what ``serialize()`` carried."""
        cfg = load_config(data=config)
        return cls(cfg=cfg, layout=RunLayout.for_run(cfg, run_id))

    def serialize(self) -> dict[str, Any]:
        return {"config": self.cfg.model_dump(mode="json"), "run_id": self.layout.run_id}

    @property
    def node(self) -> Node:
        if self._node is None:
            self._node = node_from_config(self.cfg)
        return self._node

    @property
    def run_config_path(self) -> str:
        return str(self.layout.run_dir / "run-config.json")

    def write_run_config(self) -> str:
        self.node.write_text(self.run_config_path, json.dumps(self.cfg.model_dump(mode="json"), indent=2))
        return self.run_config_path

    def eagleflow_argv(self, *args: str) -> list[str]:
        """`eagleflow ARGS --config <run config> --run-id <id>` for the node."""
        return self.node.eagleflow_argv(*args, "--config", self.run_config_path, "--run-id", self.layout.run_id)

    def close(self) -> None:
        if self._node is not None:
            self._node.close()
            self._node = None
