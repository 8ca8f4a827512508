"""From an Airflow task context to the things every eagleflow task needs.

A run's config is resolved ONCE and then frozen:

* the run's first task (``freezes_run_config = True``: ``write_run_config`` in
  the pipeline) reads the YAML named by the ``config_path`` Param, lays the
  other Params over it (``PARAM_OVERRIDES``), makes every path absolute, writes
  the result into the run directory on the node (``run-config.json``) and pushes
  the same data to XCom (key ``RUN_CONFIG_XCOM_KEY``);
* every later task and callback reads that XCom, every trigger and every node
  command reads ``run-config.json``; none of them reads the YAML again, so
  editing it mid-run changes nothing for that run.

A relative ``config_path`` (or ``$EAGLEFLOW_CONFIG``) is resolved against the
project root: ``$EAGLEFLOW_HOME`` when set, else the folder holding Airflow's
DAG folder (the checkout under ``make airflow``, /opt/eagleflow in the image);
never against the worker's current directory. A ``config_path`` from the Params must lie in one of the
deployment's config folders (``$EAGLEFLOW_CONFIG_DIRS``, default configs/; ``checked_config_path``).

Triggers carry a ``RunRef`` (connection id, path of run-config.json on the
node, run id, the ``ControlPlane`` settings and the ``WatchHints``): small and stable across upgrades, unlike
the whole config; plain values on the wire (``RunPayload``), typed models in the code.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any, TypedDict, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eagleflow import bounded_json
from eagleflow.airflow.project import PROJECT_ROOT_ENV, project_root, resolve_config_path
from eagleflow.airflow.routing import task_node_name
from eagleflow.config import ConfigError, PipelineConfig, load_config
from eagleflow.layout import RunLayout
from eagleflow.nodes import Node, node_from_config
from eagleflow.phases import ShardKind
from eagleflow.config import NodeConfig

# DAG Param name -> dotted config field. A Param left at None keeps the file's value.
PARAM_OVERRIDES: dict[str, str] = {
    "target_model": "target_model",
    "node_conn_id": "node.conn_id",
    "capture_backend": "capture.backend",
    "shards": "capture.shards",
    "force_free_gpus": "gpu.force_free",
    "delete_old_caches": "disk.delete_old_caches",
    "max_train_steps": "train.max_steps",
    "storage": "stream.storage",
    "alert_emails": "watchdog.alert_emails",
    "generate_enabled": "generate.enabled",
    "generate_temperature": "generate.temperature",
    "generate_top_p": "generate.top_p",
    "generate_max_new_tokens": "generate.max_new_tokens",
    "generate_seed": "generate.seed",
    "generate_reasoning": "generate.reasoning",
    "fleet_nodes": "fleet.use",
}

class RunParams(TypedDict, total=False):
    """The run's conf: the DAG Params a trigger gives (the form, the REST API's conf), read by the run's first task
    (``config_from_params``). Each of ``PARAM_OVERRIDES`` may be absent or None (the file's value is kept); a
    value is checked where it is laid over the config, never trusted for its type here."""
    config_path: str | None
    config_paths: list[str]         # DAGs that look at several nodes (the first one names the run's config)
    run_name: str | None
    target_model: str | None
    node_conn_id: str | None
    capture_backend: str | None
    shards: int | None
    force_free_gpus: bool
    delete_old_caches: bool
    max_train_steps: int | None
    alert_emails: list[str] | None
    generate_enabled: bool
    generate_temperature: float | None
    generate_top_p: float | None
    generate_max_new_tokens: int | None
    generate_seed: int | None
    generate_reasoning: str | None
    fleet_nodes: list[str] | None


def run_params(raw: Mapping[str, object]) -> RunParams:
    """The Params of an Airflow context (``context["params"]``) as the run's conf: a copy, checked where used."""
    return cast(RunParams, dict(raw))


class FrozenRun(TypedDict):
    """The XCom form of a run's frozen config (``RunContext.frozen()``): its id and the config, paths absolute."""
    run_id: str
    config: dict[str, Any]


# A path the trigger form gives (DAG Param target_model; TRIGGER_PATH_PARAMS): what a node path holds and no more,
# letters, digits and . _ - + / ~ (no space, colon, comma, quote or line break), so the text names a folder and
# cannot say a sentence: it reaches node commands, their answers, logs and mails (issue 52 item 3). The form
# checks it (the Param's pattern) and the run's first task again (config_from_params), whatever the form let in.
TRIGGER_PATH_PATTERN = r"^[A-Za-z0-9_.+/~-]{1,4096}$"
TRIGGER_PATH_PARAMS = ("target_model",)

DEFAULT_CONFIG_ENV = "EAGLEFLOW_CONFIG"
HEALTH_CONFIGS_ENV = "EAGLEFLOW_HEALTH_CONFIGS"
CONFIG_DIRS_ENV = "EAGLEFLOW_CONFIG_DIRS"
NODE_CONN_IDS_ENV = "EAGLEFLOW_NODE_CONN_IDS"
ALERT_DOMAINS_ENV = "EAGLEFLOW_ALERT_DOMAINS"
ALLOW_FORCE_FREE_ENV = "EAGLEFLOW_ALLOW_FORCE_FREE"
RUN_CONFIG_XCOM_KEY = "eagleflow_run_config"
RUN_CONFIG_FILE = "run-config.json"


def allowed_config_dirs() -> list[Path]:
    """The folders a DAG Param may name a config in: $EAGLEFLOW_CONFIG_DIRS (os.pathsep-separated, relative
    entries against the project root), else the project's configs/ folder."""
    raw = os.environ.get(CONFIG_DIRS_ENV, "")
    return [resolve_config_path(e) for e in (raw.split(os.pathsep) if raw.strip() else ["configs"]) if e.strip()]


def deployment_config_files() -> list[Path]:
    """Configs the deployment itself names ($EAGLEFLOW_CONFIG, $EAGLEFLOW_HEALTH_CONFIGS): allowed wherever they are."""
    named = [os.environ.get(DEFAULT_CONFIG_ENV, "")] + os.environ.get(HEALTH_CONFIGS_ENV, "").split(os.pathsep)
    return [resolve_config_path(n) for n in named if n.strip()]


def checked_config_path(path: str | os.PathLike, field: str) -> Path:
    """``path`` from a DAG Param (the trigger form, the REST API's conf) as a file eagleflow may read.

    Only a file under one of ``allowed_config_dirs()`` or one the deployment names itself: whoever may trigger
    a DAG must not make it read (and report on) any file the Airflow worker can read. ``..`` is refused by
    name, and the real path counts, so a symbolic link out of an allowed folder is refused too. Errors name
    the Param and the path, never the file's content.
    """
    text = os.fspath(path)
    allowed = allowed_config_dirs()
    fix = (f"put the config in one of this deployment's config folders ({', '.join(map(str, allowed))}) and "
           f"name it relative to the project root {project_root()}, e.g. configs/local-demo.yaml; another "
           f"folder is allowed only by the deployment's settings (${CONFIG_DIRS_ENV}), not from a trigger")
    if ".." in Path(text).parts:
        raise ConfigError(f"{field} = {text!r}: '..' is not allowed in a config path; {fix}")
    full = Path(os.path.normpath(resolve_config_path(text)))
    real = full.resolve()
    if real in {f.resolve() for f in deployment_config_files()}:
        return full
    for d in allowed:
        if real.is_relative_to(d.resolve()):
            return full
    if any(full.is_relative_to(os.path.normpath(d)) for d in allowed):
        raise ConfigError(f"{field} = {text!r}: it is a symbolic link (or lies under one) that leads to {real}, "
                          f"outside the allowed config folders; {fix}")
    raise ConfigError(f"{field} = {text!r}: {full} is outside the allowed config folders; {fix}")


def config_from_params(params: RunParams) -> PipelineConfig:
    given: Mapping[str, object] = params     # read by the Param names PARAM_OVERRIDES and TRIGGER_PATH_PARAMS list
    path = params.get("config_path") or os.environ.get(DEFAULT_CONFIG_ENV)
    if not path:
        raise ConfigError("no config: set the DAG Param 'config_path' (or $EAGLEFLOW_CONFIG) to a YAML file; "
                          "see configs/local-demo.yaml")
    full = checked_config_path(path, "DAG Param config_path")
    if not full.is_file() and not Path(path).is_absolute():
        raise ConfigError(f"config file {str(path)!r} (Param config_path / ${DEFAULT_CONFIG_ENV}) not found at "
                          f"{full}: a relative path is resolved against the project root {project_root()} "
                          f"(${PROJECT_ROOT_ENV}, else the folder above Airflow's DAG folder); give an absolute "
                          f"path or set ${PROJECT_ROOT_ENV}")
    for name in TRIGGER_PATH_PARAMS:
        checked_trigger_path(given.get(name), name)
    # A boolean Param can only switch a setting on: False (its form default) keeps the file's value.
    overrides = {field: given[p] for p, field in PARAM_OVERRIDES.items()
                 # False is never an override (a boolean Param only switches on); numeric 0 is (temperature 0)
                 if given.get(p) not in (None, "", []) and given.get(p) is not False}
    conn_id = overrides.pop("node.conn_id", None)
    emails = overrides.pop("watchdog.alert_emails", None)
    if overrides.get("gpu.force_free") and not force_free_allowed():
        raise ConfigError("DAG Param force_free_gpus = true is refused: this deployment does not let a trigger kill "
                          "processes eagleflow did not start (GPU nodes are shared). Leave it off; to force-free a "
                          "node you own, set gpu.force_free: true in that node's config file, or allow the Param "
                          f"in the deployment's settings (${ALLOW_FORCE_FREE_ENV}=1)")
    cfg = load_config(full, overrides)
    if conn_id is not None and conn_id != cfg.node.conn_id:
        allowed = allowed_node_conn_ids()
        if conn_id not in allowed:
            raise ConfigError(
                f"DAG Param node_conn_id = {conn_id!r} is refused: a trigger may choose only among the node "
                f"connections this deployment allows ({', '.join(map(repr, allowed)) or 'none'}; "
                f"${NODE_CONN_IDS_ENV} in the deployment's settings). Leave it empty to run on the config's node "
                f"{cfg.node.name!r} (connection {cfg.node.conn_id or 'none: this machine'}), or pick an allowed one")
        cfg.node.conn_id = conn_id
    if emails is not None:
        cfg.watchdog.alert_emails = checked_alert_emails(emails, cfg.watchdog.alert_emails)
    return cfg


def checked_trigger_path(value: Any, name: str) -> None:
    """A path the trigger form gave (``name``: its DAG Param) fits ``TRIGGER_PATH_PATTERN``, or ConfigError naming
    the Param, never its value: the trigger's words are not repeated in a log line a mail may carry."""
    if value in (None, ""):
        return
    if not isinstance(value, str) or not re.fullmatch(TRIGGER_PATH_PATTERN, value):
        raise ConfigError(f"DAG Param {name} is refused: a path from the trigger form holds only letters, digits and "
                          ". _ - + / ~ (no spaces, colons, commas, quotes or line breaks); its value is not shown "
                          f"(it is the trigger's text). Give the folder on the node, e.g. /models/Kimi-K2.5, or "
                          "leave the Param empty to use the config's, and trigger again")


_ADDRESS = re.compile(r"[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@([A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                      r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)+)")


def alert_domains(config_emails: list[str]) -> list[str]:
    """Mail domains the DAG Param alert_emails may name: $EAGLEFLOW_ALERT_DOMAINS (comma-separated), else those
    of the config's own watchdog.alert_emails."""
    listed = [d.strip().lower() for d in os.environ.get(ALERT_DOMAINS_ENV, "").split(",") if d.strip()]
    return listed or sorted({e.rsplit("@", 1)[-1].lower() for e in config_emails if "@" in e})


def checked_alert_emails(value: Any, config_emails: list[str]) -> list[str]:
    """The trigger form's recipients, each one plain address in an allowed domain.

    A run's mails carry its diagnosis (node names, paths, process evidence): a trigger must not route them to
    any address it likes, nor smuggle extra headers or recipients into one entry.
    """
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"DAG Param alert_emails = {value!r}: expected a list of mail addresses")
    domains = alert_domains(config_emails)
    out = []
    for addr in (v.strip() for v in value):
        m = _ADDRESS.fullmatch(addr)
        if not m:
            raise ConfigError(f"DAG Param alert_emails: {addr!r} is not one plain mail address (name@domain; no "
                              f"display names, commas or line breaks); give one address per entry")
        if addr not in config_emails and m.group(1).lower() not in domains:
            raise ConfigError(f"DAG Param alert_emails: {addr!r} is refused: a trigger may mail only addresses in "
                              f"this deployment's domains ({', '.join(domains) or 'none'}; ${ALERT_DOMAINS_ENV} in the "
                              f"deployment's settings, else the domains of the config's watchdog.alert_emails). "
                              f"Leave the Param empty to mail the config's recipients")
        out.append(addr)
    return out


def allowed_node_conn_ids() -> list[str]:
    """Node connections the DAG Param node_conn_id may name: $EAGLEFLOW_NODE_CONN_IDS (comma-separated).

    A config's own ``node.conn_id`` needs no listing: the config files are the deployment's (checked_config_path).
    """
    return [c.strip() for c in os.environ.get(NODE_CONN_IDS_ENV, "").split(",") if c.strip()]


def force_free_allowed() -> bool:
    """Whether the DAG Param force_free_gpus may switch force-freeing on ($EAGLEFLOW_ALLOW_FORCE_FREE)."""
    return os.environ.get(ALLOW_FORCE_FREE_ENV, "").strip().lower() in ("1", "true", "yes")


def resolved_config_dict(cfg: PipelineConfig) -> dict[str, Any]:
    """The config with every path made absolute, as JSON-safe data (the frozen form)."""
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
    data["server"]["dump_dir"] = str(cfg.resolve(cfg.server.dump_dir))
    for entry in data["fleet"]["nodes"]:
        for key in ("run_root", "dump_dir", "state_dir"):
            entry[key] = str(cfg.resolve(entry[key]))
    for ps in data["eval"]["prompt_sets"]:
        ps["path"] = str(cfg.resolve(ps["path"]))
    if cfg.eval.baseline_draft and cfg.eval.baseline_draft != "none":   # 'none': no comparison, not a path
        data["eval"]["baseline_draft"] = str(cfg.resolve(cfg.eval.baseline_draft))
    data["eval"]["promoted_draft_roots"] = [str(cfg.resolve(p)) for p in cfg.eval.promoted_draft_roots]
    return data


class _Payload(BaseModel):
    """Plain values inside a trigger payload, on the wire under the config fields' own names ("node.name");
    read and built by attribute. Keys this release does not know are ignored; only the values given are
    written back (``to_dict``), so a payload re-serialised by a trigger is the one it was given."""
    model_config = ConfigDict(frozen=True, extra="ignore", validate_by_name=True, validate_by_alias=True)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    @classmethod
    def wire_keys(cls) -> tuple[str, ...]:
        return tuple(str(f.serialization_alias) for f in cls.model_fields.values())


_P = TypeVar("_P", bound=_Payload)


def _wire(name: str, default: Any = None) -> Any:
    """A payload field carried under the config field ``name`` (its wire key)."""
    return Field(default, validation_alias=name, serialization_alias=name)


class ControlPlane(_Payload):
    """Settings the control plane acts on (what it executes, whom it mails, through which connection, which
    links): always the frozen config's (XCom, the trigger payload), never the copy on the node, which the node
    can edit. A trigger payload's ``control``."""
    python: str = _wire("node.python", "")
    alert_emails: list[str] = _wire("watchdog.alert_emails", [])
    smtp_conn_id: str = _wire("watchdog.smtp_conn_id", "smtp_default")
    airflow_base_url: str = _wire("watchdog.airflow_base_url", "")

    @classmethod
    def of(cls, cfg: PipelineConfig) -> "ControlPlane":
        wd = cfg.watchdog
        return cls(python=cfg.node.python, alert_emails=list(wd.alert_emails), smtp_conn_id=wd.smtp_conn_id,
                   airflow_base_url=wd.airflow_base_url)

    def apply(self, cfg: PipelineConfig) -> None:
        """Lay these settings over a config read from a node (only those the payload carries)."""
        given = self.model_fields_set
        if "python" in given:
            cfg.node.python = self.python
        if "alert_emails" in given:
            cfg.watchdog.alert_emails = list(self.alert_emails)
        if "smtp_conn_id" in given:
            cfg.watchdog.smtp_conn_id = self.smtp_conn_id
        if "airflow_base_url" in given:
            cfg.watchdog.airflow_base_url = self.airflow_base_url


class WatchHints(_Payload):
    """What a watch needs before it has read the run's config on the node (a triggerer can start a watch while
    the node is unreachable): the node's name, the job counts its mails name, the unreachable bound's settings.
    Only read while the config cannot be, never laid over it (a reconcile's watch of a run keeps the run's
    counts). None: a payload from before the hint was carried."""
    node_name: str | None = _wire("node.name")
    capture_shards: int | None = _wire("capture.shards")
    generate_shards: int | None = _wire("generate.shards")
    stall_after_s: float | None = _wire("watchdog.stall_after_s")
    poll_interval_s: float | None = _wire("watchdog.poll_interval_s")

    @classmethod
    def of(cls, cfg: PipelineConfig) -> "WatchHints":
        return cls(node_name=cfg.node.name, capture_shards=cfg.capture.shards, generate_shards=cfg.generate.shards,
                   stall_after_s=cfg.watchdog.stall_after_s, poll_interval_s=cfg.watchdog.poll_interval_s)

    def shards(self, kind: ShardKind) -> int | None:
        """The shard count of ``kind``'s phase: the hint carried under its descriptor's ``shards_field``."""
        value = self.to_dict().get(kind.shards_field)
        return None if value is None else int(value)


# the wire keys of each (a payload's ``control`` and ``watch``)
CONTROL_PLANE_FIELDS = ControlPlane.wire_keys()
WATCH_HINT_FIELDS = WatchHints.wire_keys()


def control_plane_settings(cfg: PipelineConfig) -> ControlPlane:
    """The control-plane settings of ``cfg`` (a trigger payload's ``control``)."""
    return ControlPlane.of(cfg)


def apply_control_plane(cfg: PipelineConfig, settings: ControlPlane) -> None:
    """Lay trusted control-plane settings over a config read from a node."""
    settings.apply(cfg)


class RunPayload(TypedDict, total=False):
    """A ``RunRef`` on the wire (what ``RunRef.to_dict`` writes and a trigger is given back)."""
    conn_id: str | None
    run_config: str
    run_id: str
    control: dict[str, object]
    watch: dict[str, object]


def _part(model: type[_P], data: object, key: str) -> _P | None:
    """A payload's ``control`` or ``watch``; None when absent (a payload from before it was carried); a value
    that does not fit is refused naming the key and what is wrong."""
    if not isinstance(data, dict):
        return None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"trigger payload's {key!r} does not fit this eagleflow build ({bad}); clear the task so "
                          "it defers anew") from None


@dataclass(frozen=True)
class RunRef:
    """What a trigger carries to find its run again: how to reach the node, where the frozen config lies there,
    which run, the frozen config's control-plane settings (``ControlPlane``; None in a payload
    from before they were carried) and the watch's hints for the time before it read the run's config
    (``WatchHints``). Nothing else, so a renamed config field never breaks a deferred task across an
    upgrade."""
    conn_id: str | None
    run_config: str
    run_id: str
    control: ControlPlane | None = None
    watch: WatchHints | None = None    # None in a payload from before they were carried

    def to_dict(self) -> RunPayload:
        d: RunPayload = {"conn_id": self.conn_id, "run_config": self.run_config, "run_id": self.run_id}
        if self.control is not None:
            d["control"] = self.control.to_dict()
        if self.watch is not None:
            d["watch"] = self.watch.to_dict()
        return d

    @property
    def hints(self) -> WatchHints:
        """The watch's hints; all None when the payload carries none."""
        return self.watch if self.watch is not None else WatchHints()

    @classmethod
    def from_dict(cls, data: RunPayload | RunRef) -> "RunRef":
        if isinstance(data, RunRef):
            return data
        if not isinstance(data, dict):
            raise ConfigError(f"trigger payload's run is a {type(data).__name__}, not a mapping; clear the task so "
                              "it defers anew")
        try:
            conn_id = data.get("conn_id")
            return cls(conn_id=None if conn_id is None else str(conn_id), run_config=str(data["run_config"]),
                       run_id=str(data["run_id"]), control=_part(ControlPlane, data.get("control"), "control"),
                       watch=_part(WatchHints, data.get("watch"), "watch"))
        except KeyError as e:
            raise ConfigError(f"trigger payload lacks {e.args[0]!r}: {sorted(data)}; expected conn_id, run_config, "
                              "run_id (a payload of another eagleflow build: clear the task so it defers anew)"
                              ) from None


def task_fleet_node(context, cfg: PipelineConfig | None = None) -> str | None:
    """The fleet node the context's task talks to (routing.task_node_name); None: the run's training node."""
    names = cfg.fleet_node_names() if cfg is not None and cfg.is_fleet else []
    return task_node_name(context.get("task"), names, getattr(context.get("ti"), "task_id", None))


def _node_for(conn_id: str | None) -> Node:
    """The node behind ``conn_id``, before its config is known (to read the frozen config there)."""
    from types import SimpleNamespace

    return node_from_config(SimpleNamespace(node=NodeConfig(name=conn_id or "local", conn_id=conn_id)))


def _freezing_task_ids(context) -> list[str]:
    """Task ids of the DAG that freeze the run's config (empty: the DAG has none, each task resolves)."""
    dag = context.get("dag")
    if dag is None:
        task = context.get("task")
        dag = getattr(task, "dag", None) if task is not None else None
    if dag is None:
        return []
    return [t.task_id for t in dag.tasks if getattr(t, "freezes_run_config", False)]


@dataclass
class RunContext:
    """Config, file layout and node of one DAG run."""
    cfg: PipelineConfig
    layout: RunLayout
    _node: Node | None = None
    _resolved_here: bool = False  # from the YAML + Params by this task, not read from a frozen copy

    # -- resolving (the run's first task) and the frozen copy (everything after) ------------------
    @classmethod
    def from_params(cls, params: RunParams, run_id: str) -> "RunContext":
        """Resolve the YAML + Params now (only the freezing task, or a DAG without one, does this)."""
        cfg = config_from_params(params)
        cfg = load_config(data=resolved_config_dict(cfg))  # absolute paths from here on
        return cls(cfg=cfg, layout=RunLayout.for_run(cfg, run_id), _resolved_here=True)

    @classmethod
    def resolve_for(cls, context) -> "RunContext":
        params = run_params(context["params"])
        # run_name names the run directory when set (the demo knows it before the run starts)
        return cls.from_params(params, params.get("run_name") or context["run_id"])

    @classmethod
    def from_frozen(cls, frozen: FrozenRun) -> "RunContext":
        cfg = load_config(data=frozen["config"])
        return cls(cfg=cfg, layout=RunLayout.for_run(cfg, frozen["run_id"]))

    def frozen(self) -> FrozenRun:
        """The XCom form of the frozen config: the run id and the config, paths absolute."""
        return {"run_id": self.layout.run_id, "config": self.cfg.model_dump(mode="json")}

    @classmethod
    def frozen_in(cls, context) -> "RunContext | None":
        """The run's frozen config from the XCom of the task that froze it; None when nothing is frozen."""
        ti = context.get("ti")
        for task_id in _freezing_task_ids(context) if ti is not None else []:
            frozen = ti.xcom_pull(task_ids=task_id, key=RUN_CONFIG_XCOM_KEY)
            if frozen:
                return cls.from_frozen(frozen)
        return None

    @classmethod
    def from_airflow(cls, context) -> "RunContext":
        """The run's frozen config (as the task's fleet node sees it); resolved from the Params only in a DAG
        that has no freezing task."""
        ctx = cls.frozen_in(context)
        if ctx is not None:
            return ctx.for_node(task_fleet_node(context, ctx.cfg))
        freezers = _freezing_task_ids(context)
        if freezers:
            raise ConfigError(f"run {context.get('run_id')}: the run's config was never frozen: task(s) "
                              f"{', '.join(freezers)} must succeed first (clear the run from there); a later "
                              "task never re-reads the YAML, which may have changed since the run started")
        ctx = cls.resolve_for(context)
        return ctx.for_node(task_fleet_node(context, ctx.cfg))

    def for_node(self, name: str | None) -> "RunContext":
        """This run as fleet node ``name`` sees it: its connection, run dir, pid records, GPUs (None: as is)."""
        if name is None or name == self.cfg.node.name:
            return self
        cfg = self.cfg.node_view(name)
        return RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, self.layout.run_id))

    # -- triggers ------------------------------------------------------------------------------
    def serialize(self) -> RunPayload:
        """The RunRef a trigger carries."""
        conn_id = getattr(self._node, "conn_id", self.cfg.node.conn_id) if self._node is not None \
            else self.cfg.node.conn_id
        return RunRef(conn_id=conn_id, run_config=self.run_config_path, run_id=self.layout.run_id,
                      control=ControlPlane.of(self.cfg), watch=WatchHints.of(self.cfg)).to_dict()

    def trigger_ref(self) -> RunPayload:
        """The RunRef for a trigger this task defers to. A config this task resolved itself (a DAG without a
        freezing task) is first written to run-config.json, where the trigger reads it."""
        if self._resolved_here:
            self.write_run_config()
        return self.serialize()

    @classmethod
    def from_serialized(cls, run: RunPayload) -> "RunContext":
        """Rebuild in a trigger (blocking: reads run-config.json on the node; call it via asyncio.to_thread)."""
        return cls.from_ref(RunRef.from_dict(run))

    @classmethod
    def from_ref(cls, ref: RunRef) -> "RunContext":
        probe = _node_for(ref.conn_id)
        try:
            text = probe.read_text(ref.run_config)
        finally:
            probe.close()
        return cls.from_frozen_text(ref, text, probe.name)

    @classmethod
    def from_frozen_text(cls, ref: RunRef, text: str | None, node_name: str) -> "RunContext":
        """From the text of run-config.json as read on the node (None: not there)."""
        if text is None:
            raise ConfigError(f"run {ref.run_id}: frozen config {ref.run_config} not found on node "
                              f"{node_name} (connection {ref.conn_id or 'local'}); the run's first task "
                              "(write_run_config) writes it: clear the run from there")
        try:
            data = bounded_json.loads(text, source=f"{ref.run_config} on node {node_name}")
        except ValueError as e:
            raise ConfigError(f"run {ref.run_id}: frozen config {ref.run_config} on node {node_name} is not "
                              f"JSON ({e}); clear the run from write_run_config to write it again") from None
        cfg = load_config(data=data)
        cfg.node.conn_id = ref.conn_id  # the node is reached the way the payload says (a reconcile may differ)
        if ref.control is not None:     # what runs here and whom to mail: the frozen config's, not the node's copy
            ref.control.apply(cfg)
        return cls(cfg=cfg, layout=RunLayout.for_run(cfg, ref.run_id))

    # -- the node ------------------------------------------------------------------------------
    @property
    def node(self) -> Node:
        if self._node is None:
            self._node = node_from_config(self.cfg)
        return self._node

    @property
    def run_config_path(self) -> str:
        return str(self.layout.run_config_file)

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
