"""One typed pipeline config, loaded from YAML and overridable by DAG Params.

Every section is a pydantic model with ``extra="forbid"`` so a typo in a key is
an error, not a silently ignored setting. ``load_config`` turns pydantic's
errors into one message per bad field: where it is, the value, what is allowed.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from dataclasses import dataclass
from typing import Annotated, Any, Callable, ClassVar, Literal, overload

import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from eagleflow.engines import ROLES, UnknownEngine, engine, export_formats, generation_backend, names_for
from eagleflow.server_flags import check_extra_server_args
from eagleflow.stores import UnknownStore, store_for
from eagleflow.deletion_roots import deletion_root_problem as by_identity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choices:
    """``Annotated`` metadata of a string field whose values come from a registry: ``values()`` names them
    (docs/config-reference.md lists them, as it does a ``Literal``'s)."""
    values: Callable[[], list[str]]


class ConfigError(ValueError):
    """A config that cannot be used; the message names file, field, value and fix."""


def check_engine(name: str, role: str, field: str) -> str:
    """A config's engine name, checked against the registry (eagleflow.engines) for the server role it fills."""
    try:
        eng = engine(name, field)
    except UnknownEngine:
        # pydantic's own shape ("Input should be ..."): load_config then adds "(got a value of type str, not
        # shown)", because a config's errors never echo a value (docs/safety.md: it may be a pasted secret)
        raise PydanticCustomError("unknown_engine", "Input should be {choices}: the engines eagleflow.engines "
                                  "registers for the {what}", {"choices": " or ".join(map(repr, names_for(role))),
                                                               "what": ROLES[role]}) from None
    if getattr(eng, role) is None:   # a registered name is no secret: say what it lacks
        raise eng.unsupported(role)
    return name


def check_unique_names(what: str, names: list[str]) -> None:
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{what} names must be unique; repeated: {', '.join(dup)}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SourceConfig(_Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="short id used in sample ids (source:row)")
    path: str = Field(min_length=1, description="JSONL, JSON, Parquet file or a datasets save_to_disk directory")
    format: Literal["auto", "jsonl", "json", "parquet", "arrow"] = Field(
        default="auto", description="how to read path; auto = by its suffix (a directory: a datasets save_to_disk)")
    limit: int | None = Field(default=None, ge=1, description="keep at most this many records")


class CorpusConfig(_Section):
    sources: list[SourceConfig] = Field(default_factory=list)
    seed: int = Field(default=42, description="the merged corpus's shuffle seed")
    max_length: int = Field(default=8192, ge=16, le=1_048_576, description="tokens per record at most (see "
                            "over_max_length)")
    max_bad_records: int = Field(default=0, ge=0, description="malformed records allowed (each named in the "
                                 "corpus's bad-records file) before the phase fails")
    num_proc: int = Field(default=1, ge=1, le=256, description="processes that tokenise the corpus (datasets' "
                          "map); `eagleflow corpus prepare --num-proc` overrides it")
    over_max_length: Literal["cut_at_message", "drop", "truncate"] = Field(
        default="cut_at_message", description="a record over max_length: cut after the last assistant message "
        "that fits, drop it (counted), or truncate at the token")
    non_text_parts: Literal["error", "drop"] = Field(
        default="error", description="a non-text content part (image, audio): a bad record, or dropped (counted)")
    # Held-out split: a group is held out, all its records, when sha256("eval", its key) falls in the lowest
    # eval_fraction, so reruns, seeds and added sources never move a record between the splits. The key is the
    # record's eval_group_key field (what it is about), or its id "source:row" when that is unset.
    eval_fraction: float = Field(default=0.03, ge=0.0, lt=1.0, description="share of records (of groups, "
                                 "with eval_group_key) held out of training for `eagleflow evaluate` "
                                 "(corpus/eval.parquet); 0 = none")
    eval_min_records: int = Field(default=4, ge=0, description="hold out at least this many (a small corpus "
                                  "still gets prompts to evaluate on), when eval_fraction > 0")
    eval_max_records: int = Field(default=500, ge=0, description="hold out at most this many records")
    eval_group_key: str | None = Field(
        default=None, min_length=1, pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$",
        description="the field of each source record that says what it is about (a dotted path reaches into "
        "objects; a name absent at the top level is looked up in the record's `metadata` object): records "
        "with the same value form one group, held out or trained on whole, so no held-out record has its "
        "subject in training under another record; every record must have it; null = each record its own group")

    @field_validator("sources")
    @classmethod
    def _unique_names(cls, v: list[SourceConfig]) -> list[SourceConfig]:
        check_unique_names("source", [s.name for s in v])
        return v


class DiskConfig(_Section):
    cache_root: str | None = Field(default=None, description="only paths under this root may be deleted")
    old_caches: list[str] = Field(default_factory=list, description="old hidden-state caches that may be deleted")
    delete_old_caches: bool = Field(default=False, description="allow `eagleflow corpus delete-caches` (and the "
                                    "DAG's delete_old_caches) to delete old_caches; false = only report them")
    headroom_fraction: float = Field(default=0.05, ge=0.0, le=1.0,
                                     description="extra space kept free beyond the estimate")


class NodeConfig(_Section):
    name: str = Field(default="local", min_length=1, description="name shown in logs and alerts")
    conn_id: str | None = Field(default=None, description="Airflow SSH connection id; null = this machine")
    python: str = Field(default="", description="python on the node with eagleflow installed; empty = this interpreter (local) or python3 (ssh)")
    state_dir: str = Field(default="", description="where the node keeps pid records and locks; empty = <run_root>/.node-state")
    has_gpu: bool = Field(default=True, description="false on a CPU-only node: GPU gates log and pass")
    queue: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$",
                              description="Celery queue whose worker runs this node's tasks (CeleryExecutor); "
                                          "null = Airflow's default queue")
    pool: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$",
                             description="Airflow pool whose slots limit concurrent GPU work on this node; "
                                         "null = default_pool")

    @field_validator("name")
    @classmethod
    def _one_line_name(cls, v: str) -> str:
        # the name goes into mail subjects, incident ids and logs: a line break there would write headers
        if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u2028\u2029" for c in v):
            raise ValueError("node.name holds a line break or another control character (it goes into mail "
                             "subjects and logs); use a plain name such as gpu-node-1")
        return v


class FleetNodeConfig(NodeConfig):
    """One GPU node of a fleet: how to reach it (the NodeConfig fields) and what of it a run uses.

    ``run_root``, ``dump_dir`` and ``gpus`` left empty take the top-level run_root, server.dump_dir and
    gpu.select; ``state_dir`` empty is <run_root>/.node-state/<name> (one per node, so nodes that share a
    run root never share pid records or locks).
    """
    gpu_slots: int = Field(default=1, ge=1, le=1024, description="how many shards this node runs at once "
                           "(its pool's slots); a run's shards are shared out in proportion to them")
    gpus: list[str] | None = Field(default=None, description="GPU UUIDs or indices a run uses; null = gpu.select")
    run_root: str | None = Field(default=None, description="the node's run root; null = the top-level run_root")
    dump_dir: str | None = Field(default=None, description="the node's capture dump dir; null = server.dump_dir")


class FleetConfig(_Section):
    """The GPU nodes one deployment drives. Empty: the single node of the ``node`` section."""
    nodes: list[FleetNodeConfig] = Field(default_factory=list, description="the fleet's nodes, names unique")
    training_node: str | None = Field(default=None, description="the node that prepares the corpus, trains "
                                      "and evaluates; null = the first of nodes")
    storage: Literal["auto", "shared", "copy"] = Field(
        default="auto", description="auto: a probe file written on each node and read on the training node "
        "decides; shared: the run roots must be one filesystem (the probe must pass); copy: each node's "
        "verified shards are copied to the training node over SSH")
    use: list[str] | None = Field(default=None, description="the nodes this run uses (the trigger form's "
                                  "fleet_nodes); null = all; the training node is always among them")
    take_over: bool = Field(default=True, description="after the nodes' groups: the training node takes "
                            "over the shards another node left incomplete, once that node is proven free of our "
                            "workers (reachable, the shard's worker lock free, no live worker); false: they wait "
                            "for their node and verification fails the run naming them")

    @field_validator("nodes")
    @classmethod
    def _unique_nodes(cls, v: list[FleetNodeConfig]) -> list[FleetNodeConfig]:
        names = [n.name for n in v]
        check_unique_names("node", names)
        bad = [n for n in names if not n.replace("-", "").replace("_", "").isalnum()]
        if bad:
            raise ValueError(f"fleet node names name task groups and files: letters, digits, '-' and '_' only; "
                             f"not {', '.join(map(repr, bad))}")
        return v


class GpuConfig(_Section):
    select: list[str] = Field(default_factory=list, description="GPU UUIDs or indices; empty = all")
    probe: Literal["auto", "nvml", "smi"] = Field(default="auto", description="how GPUs are read: NVML, "
                                                 "nvidia-smi, or auto = NVML when it loads, else nvidia-smi")
    idle_threshold_mib: int = Field(default=16, ge=0, description="idle when used <= baseline + this margin")
    baseline_file: str | None = Field(default=None, description="per-UUID idle baselines from `eagleflow gpu baseline`")
    poll_interval_s: float = Field(default=5.0, gt=0, description="the GPU gate's time between two readings")
    idle_timeout_s: float = Field(default=300.0, gt=0, description="the GPU gate fails when the GPUs are not idle "
                                  "within this long")
    force_free: bool = Field(default=False, description="also kill foreign processes, and other runs' live jobs, "
                             "holding the selected GPUs")
    kill_grace_s: float = Field(default=15.0, ge=0, description="after SIGTERM, how long a process we stop may "
                                "take before SIGKILL")


class ServerConfig(_Section):
    """The target server's settings, whatever its role (capture, generation, an sglang or vllm evaluation) and
    engine (eagleflow.serving). Until issue 48 they were capture's: ``capture.<field>`` is still read as
    ``server.<field>``, with a note (PipelineConfig._server_names_moved)."""
    host: str = Field(default="127.0.0.1", description="the servers' listening address on the node (loopback: "
                      "they take no credential)")
    port: int = Field(default=30000, ge=0, le=65535, description="the capture server's port; 0 = pick a free "
                      "port at start (generate.port is the generation server's)")
    dump_dir: str = Field(default="/dev/shm/eagleflow_hs-{uid}",
                          description="where servers leave dumps for the workers; {uid} = the node user's id "
                                      "(one 0700 folder per user, checked on the node)")
    tp: int = Field(default=1, ge=1, le=64, description="tensor-parallel GPUs of the server (sglang --tp-size)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(default="auto", description="the target's "
                                                                     "compute dtype; auto = its config's")
    device: Literal["auto", "cpu", "cuda"] = Field(default="cpu", description="where the hf backend runs the "
                                                   "model (auto = cuda when torch sees a GPU); sglang ignores it")
    ready_timeout_s: float = Field(default=900.0, gt=0, description="model loading grace")
    extra_server_args: list[str] = Field(default_factory=list, description="appended to the serving engine's "
                                         "command line (sglang: launch_server flags); a flag eagleflow sets "
                                         "itself (--host, --port, --middleware, ...: eagleflow.server_flags) is "
                                         "refused")

    @field_validator("extra_server_args")
    @classmethod
    def _no_owned_flags(cls, v: list[str]) -> list[str]:
        return check_extra_server_args(v, "server.extra_server_args")


class CaptureConfig(_Section):
    backend: str = Field(default="hf", description="the capture server's engine (eagleflow.engines): hf = our "
                         "transformers server (CPU or GPU), sglang = SGLang with our capture hook, vllm = vLLM "
                         "with our KV connector (a GPU node each)")
    aux_layers: list[int] | None = Field(default=None, description="EAGLE-3 auxiliary layers; null = 1, N/2-1, N-4")
    store_dtype: Literal["auto", "fp8_e4m3"] = Field(default="auto", description="how the hidden states are "
                                                     "stored: auto = the target's dtype; fp8_e4m3 = half the "
                                                     "disk (per-token scales; docs/benchmarks.md has its error)")
    shards: int = Field(default=1, ge=1, le=1024, description="extraction shards (one worker and one Airflow "
                        "task each; reruns and takeovers are per shard)")
    in_flight: int = Field(default=4, ge=1, le=256, description="requests in flight per worker, so the model never waits on the disk")
    request_timeout_base_s: float = Field(default=60.0, gt=0, description="one capture request may take this "
                                          "long plus request_timeout_per_token_s per prompt token")
    request_timeout_per_token_s: float = Field(default=0.05, ge=0, description="see request_timeout_base_s")
    heartbeat_interval_s: float = Field(default=2.0, gt=0, description="how often a worker rewrites its "
                                        "heartbeat (the watch reads it)")

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, v: str) -> str:
        return check_engine(v, "capture_server", "capture.backend")


class WatchdogConfig(_Section):
    # Defaults for real runs (seeds: ~1 sample/s, samples up to 8k tokens): a stall like the seeds' is
    # detected within detection_bound_s = 15 + 1 + 2 x 2 + 20 = 40 s, mailed and recovered in the watch.
    poll_interval_s: float = Field(default=20.0, gt=0, description="one node-side `eagleflow watch` per poll "
                                   "(sooner when progress is about to turn stale)")
    stall_after_s: float = Field(default=15.0, gt=0, description="no completed sample for this long (or "
                                 "slow_factor x this run's p95 gap, if longer) starts a stall check")
    health_timeout_s: float = Field(default=20.0, gt=0, description="/health_generate timeout (SGLang's own is 20 s)")
    gpu_window_s: float = Field(default=20.0, gt=0, description="GPUs held at 0 % for this long count as evidence")
    startup_grace_s: float = Field(default=120.0, ge=0, description="no verdict before a job's first unit this early")
    d_state_after_s: float = Field(default=20.0, gt=0, description="a job in D state this long counts as evidence")
    slow_factor: float = Field(default=3.0, ge=1.0, description="progress is stale only past this many times "
                               "the run's own recent p95 gap between samples (slow GPUs are not stalls)")
    recoveries_in_watch: int = Field(default=3, ge=0, description="stalls the shard's watch recovers by itself "
                                     "(restart server/worker, one mail per incident) before failing the task; "
                                     "0 = fail the task and let Airflow's retry recover")
    train_recoveries_in_watch: int = Field(default=2, ge=0, description="faults of the trainer (stopped, dead, "
                                           "stuck; its store lost) the training task's watch recovers by itself "
                                           "(mail, restart the store or the trainer from its last checkpoint) "
                                           "before failing the task; 0 = fail the task and let Airflow's retry "
                                           "recover")
    alert_emails: list[str] = Field(default_factory=list, description="who is mailed a stall, a failure, a "
                                    "recovery; empty = nobody (the task log only)")
    smtp_conn_id: str = Field(default="smtp_default", description="the Airflow SMTP connection the control plane "
                              "mails through")
    node_smtp: str = Field(default="", pattern=r"^([A-Za-z0-9_.\[\]:-]+:\d{1,5})?$",
                           description="host:port of a plain SMTP relay the node itself reaches (its local MTA): "
                           "the sentinel mails from there when the watch goes silent; empty = only "
                           "gpu_node_health mails it (from the sentinel's record)")
    node_mail_from: str = Field(default="eagleflow-sentinel@localhost", description="From: of the node's mails")
    airflow_base_url: str = Field(default="http://localhost:8080", description="links in mails when Airflow's "
                                  "[api] base_url is not set")

    # What one `eagleflow watch` costs besides the health check: interpreter start, /proc, GPU samples, SSH.
    WATCH_COMMAND_ALLOWANCE_S: ClassVar[float] = 2.0
    # The watch looks again when progress is about to turn stale, at most this late.
    RECHECK_SLACK_S: ClassVar[float] = 1.0

    @property
    def detection_bound_s(self) -> float:
        """Worst time from the last progress to the stall verdict, for a run at its usual pace.

        The watch looks again when progress is about to turn stale (not a whole poll_interval later):
        that look starts at most RECHECK_SLACK_S plus one command's cost after stall_after_s, and it
        lasts at most the health timeout plus the command's own cost. A run slower than usual is
        judged against slow_factor x its own p95 gap instead of stall_after_s.
        """
        return (self.stall_after_s + self.RECHECK_SLACK_S + 2 * self.WATCH_COMMAND_ALLOWANCE_S
                + self.health_timeout_s)


def _every_export_format() -> list[str]:
    return export_formats()


def check_export_format(name: str) -> str:
    """An export format, checked against the registry: the formats its serving engines serve."""
    if name not in export_formats():
        raise PydanticCustomError("unknown_export_format", "Input should be {choices}: the formats the engines "
                                  "eagleflow.engines registers serve",
                                  {"choices": " or ".join(map(repr, export_formats()))})
    return name


# a format name, its choices the registry's (docs/config-reference.md lists them through Choices)
ExportFormat = Annotated[str, AfterValidator(check_export_format), Choices(export_formats)]


def server_flag_int(args: list[str], flag: str) -> int | None:
    """The integer an engine flag (``--flag N``, ``--flag=N``, ``_`` for ``-``) gets from extra server args; the
    last one wins, as argparse reads it; None when unset or not an integer."""
    found: int | None = None
    toks = [t for a in args for t in str(a).split(None, 1)]
    for i, tok in enumerate(toks):
        name, eq, val = tok.partition("=")
        if name.lstrip("-").replace("_", "-") != flag or not name.startswith("--"):
            continue
        val = val if eq else (toks[i + 1] if i + 1 < len(toks) else "")
        found = int(val) if val.strip().lstrip("-").isdigit() else found
    return found


def stream_host_reachable(host: str) -> bool:
    """An address other machines can connect to: not loopback (127/8, ::1, localhost) nor a wildcard."""
    h = host.strip("[]").lower()
    return not (h in ("localhost", "::1", "::", "0.0.0.0", "") or h.startswith("127."))


class StreamConfig(_Section):
    """Where the hidden states go between capture and training (eagleflow.stores, docs/streaming.md)."""
    storage: str = Field(default="disk", description="the hidden-state store (eagleflow.stores): disk = one "
                         "safetensors file per sample, verified, then trained on (offline); mooncake = a Mooncake "
                         "store in memory the trainer draws from as capture fills it (streaming)")
    buffer_gib: float = Field(default=4.0, gt=0, le=65536, description="mooncake: the most hidden-state bytes "
                              "the store holds at once; a capture worker waits (backpressure) while it is full")
    host: str = Field(default="127.0.0.1", pattern=r"^[A-Za-z0-9_.:-]+$", description="mooncake: the address "
                      "the run's master and segment holder bind on the training node (loopback on one machine)")
    shuffle_window: int = Field(default=64, ge=1, le=1_000_000, description="mooncake: the trainer shuffles "
                                "within this many arrived samples (1 = in arrival order)")
    put_timeout_s: float = Field(default=600.0, gt=0, description="mooncake: a put waits this long for room "
                                 "under buffer_gib before it fails naming the store (nobody consuming)")
    store_down_timeout_s: float = Field(default=120.0, gt=0, le=86400, description="mooncake: a trainer whose "
                                        "store went away (its master killed) waits this long for it to run again "
                                        "(the training task's watch, or its retry, restarts it) before it fails with "
                                        "StoreUnavailable")
    starve_after_s: float = Field(default=300.0, gt=0, le=86400, description="mooncake: a trainer that got no "
                                  "new sample from the producer for this long fails with StreamStarved (the "
                                  "producer's own watch judges the producer meanwhile)")
    max_sample_mib: float | None = Field(default=None, gt=0, description="mooncake in a fleet: the largest sample "
                                         "one capture node puts; each node keeps (nodes - 1) x this free for the "
                                         "other nodes' puts in flight (their room checks are not serialised with "
                                         "its own); null = buffer_gib / (4 x nodes); a larger sample is refused")
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="mooncake: the transfer engine's transport "
                                             "(Mooncake's -protocol): tcp (any network; what this project tests) "
                                             "or rdma (GPU clusters: InfiniBand or RoCE NICs, the CUDA build "
                                             "mooncake-transfer-engine on every node)")
    device_names: str = Field(default="", pattern=r"^([A-Za-z0-9_.:-]{1,64}(,[A-Za-z0-9_.:-]{1,64}){0,63})?$",
                              description="mooncake with rdma: the RDMA NICs to use, comma-separated (Mooncake's "
                              "-device_names, e.g. \"mlx5_0,mlx5_1\"); \"\" = the transfer engine finds them")
    master: str = Field(default="", description="mooncake: an existing Mooncake master to use, \"host:rpc_port\" "
                        "(started by someone else, with its HTTP metadata server and a short -default_kv_lease_ttl); "
                        "the run then starts no master, only its segment holder against it, and never signals it; "
                        "\"\" = the run starts and stops its own master")
    master_metadata_port: int = Field(default=8080, ge=1, le=65535, description="mooncake with master: the "
                                      "existing master's HTTP metadata server port on its host (mooncake_master "
                                      "-http_metadata_server_port; its default 8080)")
    master_metrics_port: int = Field(default=9003, ge=1, le=65535, description="mooncake with master: the "
                                     "existing master's metrics port on its host (mooncake_master -metrics_port; its "
                                     "default 9003): the buffer's backpressure reads it")

    @field_validator("storage")
    @classmethod
    def _registered(cls, v: str) -> str:
        try:
            store_for(v)
        except UnknownStore as e:
            raise ValueError(str(e)) from None
        return v

    @field_validator("master")
    @classmethod
    def _master_address(cls, v: str) -> str:
        if v == "":
            return v
        host, sep, port = v.rpartition(":")
        # what is wrong is said, the value itself only once it is an address (docs/safety.md: a config's errors
        # never echo a value that may be a secret pasted in the wrong place)
        wrong = ("has no ':rpc_port'" if not sep else
                 "has a host with characters other than letters, digits and '_.-'" if not re.fullmatch(
                     r"[A-Za-z0-9_.-]{1,253}", host) else
                 "has a port that is not a number" if not port.isdigit() or len(port) > 5 else
                 f"has port {int(port)}, not a TCP port (1-65535)" if not 1 <= int(port) <= 65535 else "")
        if wrong:
            raise ValueError(f"stream.master {wrong} (value not shown): it is \"host:rpc_port\" of an existing "
                             "Mooncake master, e.g. \"10.0.0.5:50051\"; \"\" = the run starts its own master")
        return v

    @model_validator(mode="after")
    def _master_fits(self) -> "StreamConfig":
        hp = self.master_host_port
        if hp is None:
            return self
        if not store_for(self.storage).start:      # a store with no server has no master to name
            raise ValueError(f"stream.master {self.master!r} names a Mooncake master, but stream.storage "
                             f"{self.storage!r} has no server: set storage: mooncake, or master: \"\"")
        ports = {"rpc port (stream.master)": hp[1], "stream.master_metadata_port": self.master_metadata_port,
                 "stream.master_metrics_port": self.master_metrics_port}
        if len(set(ports.values())) != len(ports):
            raise ValueError("the existing master's ports must differ: " + ", ".join(f"{k} {v}" for k, v in
                                                                                    ports.items()))
        return self

    @property
    def master_host_port(self) -> tuple[str, int] | None:
        """The existing master ``master`` names, or None when the run starts its own."""
        if not self.master:
            return None
        host, _, port = self.master.rpartition(":")
        return host, int(port)


class TrainConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="where the draft trains; auto = "
                                                   "cuda when torch sees a GPU")
    nproc_per_node: int = Field(default=1, ge=1, le=64, description="training processes (torchrun, one per GPU)")
    max_steps: int = Field(default=200, ge=1, description="optimizer steps")
    batch_size: int = Field(default=4, ge=1, description="samples per process and micro-step")
    grad_accum: int = Field(default=1, ge=1, description="micro-steps per optimizer step")
    # Optimisation defaults follow SpecForge, the reference EAGLE-3 trainer (specforge 0.2.0:
    # config/schema.py TrainingConfig learning_rate 1e-4, warmup_ratio 0.015, max_grad_norm 0.5,
    # ttt_length 7; optimizer.py BF16Optimizer: AdamW with torch's default betas, weight decay 0,
    # warm-up int(warmup_ratio x total steps) then cosine to 0, as train/trainer.py lr_at).
    lr: float = Field(default=1e-4, gt=0, description="peak learning rate (SpecForge: 1e-4)")
    warmup_steps: int | None = Field(default=None, ge=0,
                                     description="linear warm-up steps; null = int(warmup_ratio x max_steps)")
    warmup_ratio: float = Field(default=0.015, ge=0, le=1, description="warm-up share of max_steps when "
                                "warmup_steps is null (SpecForge: 0.015)")
    adam_betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas (SpecForge: torch's "
                                            "defaults, 0.9 and 0.999)")
    loss_normalization: Literal["all_positions", "loss_positions"] = Field(
        default="all_positions", description="each TTT step's loss sum divided by B x T of the padded batch "
        "(SpecForge's core/loss.py _compute_loss) or by the positions that count")
    loss_mask_alignment: Literal["specforge", "predicted_token"] = Field(
        default="specforge", description="which loss-mask entry lets target_j count: j-1 as SpecForge's "
        "_compute_target_p, or j+1 (the token target_j predicts); see eagleflow.train.loss")
    ttt_length: int = Field(default=7, ge=1, le=32, description="training-time test steps the draft unrolls "
                            "(SpecForge: 7)")
    draft_vocab_size: int = Field(default=32000, ge=2, description="the draft's own vocabulary (the most "
                                  "frequent target tokens; d2t/t2d map it)")
    checkpoint_every: int = Field(default=50, ge=1, description="steps between checkpoints (a retry resumes "
                                  "from the newest)")
    seed: int = Field(default=0, description="the draft's initialisation and the data order")
    log_every: int = Field(default=10, ge=1, description="steps between loss lines in the log")
    max_grad_norm: float = Field(default=0.5, gt=0, description="gradient clipping norm")
    keep_checkpoints: int = Field(default=2, ge=1, description="newest checkpoints kept on disk")
    on_bad_sample: Literal["raise", "skip"] = Field(
        default="raise", description="a stored sample that does not match its manifest: stop, or train without it")
    verify_sha256: bool = Field(default=False, description="hash every stored sample against its manifest at start")
    export_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="dtype of the exported weights; auto = the target's")
    export_formats: list[ExportFormat] = Field(
        default_factory=_every_export_format, min_length=1,
        description="draft formats `eagleflow export` writes: sglang (the export folder SGLang serves) and "
                    "speculators (its speculators/ subfolder, which vLLM serves with --speculative-config)")
    eval_every: int = Field(default=50, ge=0, description="evaluate the draft on the held-out hidden states every "
                            "this many steps and at the last (loss, top-1 agreement, simulated acceptance in "
                            "metrics.jsonl and curves.png, so overfitting shows); 0 = never")
    held_out_samples: int = Field(default=64, ge=0, description="held-out records (corpus eval split, in its "
                                  "order) whose hidden states the capture phase also stores, apart, for eval_every; "
                                  "0 = none captured")
    fast_step: bool = Field(default=False, description="the training step's fast path: the draft's attention in "
                            "fewer kernels and the head's loss over all TTT steps chunked (no step's logits kept for "
                            "the backward); the same loss and gradients to float32 rounding (issue 49)")
    compile: bool = Field(default=False, description="run the draft's decoder layer through torch.compile (implies "
                          "fast_step); if compiling fails the layer runs eagerly and the log says why")

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"train.adam_betas {list(v)}: each must be in [0, 1), e.g. [0.9, 0.999]")
        return v

    @property
    def warmup(self) -> int:
        """Warm-up steps in effect: ``warmup_steps``, or SpecForge's int(warmup_ratio x max_steps)."""
        return self.warmup_steps if self.warmup_steps is not None else int(self.warmup_ratio * self.max_steps)


class SpecConfig(_Section):
    """One speculative configuration, as SGLang's flags name it."""
    steps: int = Field(ge=1, le=32, description="--speculative-num-steps: draft steps per round")
    topk: int = Field(default=1, ge=1, le=16, description="--speculative-eagle-topk; the hf evaluator drafts "
                      "chains only (1), eval.backend sglang drafts trees too")
    draft_tokens: int = Field(ge=2, le=64, description="--speculative-num-draft-tokens; steps + 1 for a chain")
    min_accept_length: float | None = Field(default=None, ge=1.0, description="gate for this configuration; "
                                            "null = eval.min_accept_length")

    @model_validator(mode="after")
    def _chain(self) -> "SpecConfig":
        if self.topk == 1 and self.draft_tokens != self.steps + 1:
            raise ValueError(f"steps {self.steps}, topk 1, draft_tokens {self.draft_tokens}: a chain verifies "
                             f"steps + 1 tokens; set draft_tokens to {self.steps + 1}")
        return self

    @property
    def label(self) -> str:
        return f"{self.steps}/{self.topk}/{self.draft_tokens}"


class PromptSet(_Section):
    """Extra held-out prompts (eagleflow.evaluate.prompt_sets): a JSONL file or a datasets save_to_disk folder of
    MT-Bench questions (both turns, the second after the target's own first answer), GSM8K or HumanEval records,
    chat records (the corpus schema: 'messages' or 'conversations'; one ending in an assistant turn is prompted
    with what precedes it) or {"prompt": "text"} lines."""
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="the set's name in the tables")
    path: str = Field(min_length=1, description="the JSONL file or datasets save_to_disk folder (relative to the "
                      "config's folder)")
    format: Literal["auto", "mt_bench", "gsm8k", "humaneval", "chat", "prompt"] = Field(
        default="auto", description="the records' format; auto = recognised per record by its fields")
    split: str | None = Field(default=None, min_length=1, description="a datasets folder holding several splits "
                              "(a DatasetDict): the one to read; null = its only split, or test")
    max_prompts: int | None = Field(default=None, ge=1, description="records read at most (an MT-Bench record "
                                    "gives a prompt per turn); null = eval.max_prompts")


class EvalConfig(_Section):
    backend: str = Field(default="hf", description="the evaluation's engine (eagleflow.engines): hf = our "
                         "speculative decoder over transformers (CPU or GPU); sglang = the target served by "
                         "SGLang with the draft (GPU node), its own acceptance counters; vllm = the same on vLLM "
                         "(chains only), acceptance from its spec-decode metrics")
    device: Literal["auto", "cpu", "cuda"] = Field(default="cpu", description="where the hf backend decodes; "
                                                   "auto = cuda when torch sees a GPU")
    configs: list[SpecConfig] = Field(default_factory=lambda: [SpecConfig(steps=3, draft_tokens=4),
                                                               SpecConfig(steps=7, draft_tokens=8)])
    min_accept_length: float = Field(default=1.5, ge=1.0, description="the new draft must reach this mean "
                                     "acceptance length (tokens per verify pass) on the held-out prompts")
    baseline_draft: str | None = Field(default=None, description="the draft the new one must not be worse than "
                                       "beyond tolerance, on the same prompts: null = the draft in service "
                                       "(<run_root>/promoted.json, when a draft was promoted), an export directory "
                                       "= that draft, 'none' = no comparison")
    promoted_draft_roots: list[str] = Field(default_factory=list, description="directories besides run_root "
                                            "where the draft promoted.json names may live (it is refused "
                                            "elsewhere)")
    tolerance: float = Field(default=0.05, ge=0.0, description="acceptance length the new draft may lose "
                             "against baseline_draft")
    approval: Literal["none", "on_improvement", "always"] = Field(
        default="none", description="a person's approval before a draft the gate passed is promoted (an Airflow "
        "human-in-the-loop task, under Required Actions, showing the evaluation table against the draft in "
        "service): none = the gate alone promotes; on_improvement = asked when the draft would replace a draft "
        "in service (the first draft is promoted by the gate); always = asked for every draft the gate passes. "
        "A rejected draft is not promoted, the draft in service stays, and eval.json and the run report say who "
        "rejected it and why")
    approval_timeout_h: float = Field(default=72.0, gt=0, le=24 * 365, description="how long the approval waits "
                                      "for a person, in hours; then approval_on_timeout decides")
    approval_on_timeout: Literal["keep", "promote"] = Field(default="keep", description="what an unanswered "
                                                            "approval does once approval_timeout_h has passed: "
                                                            "keep = the draft in service stays (not promoted), "
                                                            "promote = the draft is promoted as the gate decided")
    max_new_tokens: int = Field(default=64, ge=1, le=8192, description="tokens decoded per held-out prompt")
    max_prompts: int = Field(default=32, ge=1, description="held-out prompts evaluated at most (per prompt set)")
    near_tie_logit_gap: float | None = Field(default=None, ge=0.0, description="a lossless mismatch whose "
                                             "top-2 logit gap is below this is a near-tie; null = by dtype")
    prompt_sets: list[PromptSet] = Field(default_factory=list, description="evaluated besides the corpus's "
                                         "held-out split ('held_out'), each reported on its own")
    gate_sets: list[str] | None = Field(default=None, description="the prompt sets whose acceptance decides the "
                                        "gate (min_accept_length, the baseline comparison): 'held_out' and "
                                        "names from prompt_sets; null = every set. Every set must be lossless")
    concurrency: int = Field(default=8, ge=1, le=1024, description="server backends (sglang, vllm): "
                             "requests in flight at once")
    ready_timeout_s: float = Field(default=1800.0, gt=0, description="server backends: how long a server "
                                   "may take to load before it answers")
    request_timeout_s: float = Field(default=600.0, gt=0, description="server backends: one request")
    extra_server_args: list[str] = Field(default_factory=list, description="server backends: appended to each "
                                         "server command (e.g. sglang's --mem-fraction-static 0.8); a flag "
                                         "eagleflow sets itself (eagleflow.server_flags) is refused")

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, v: str) -> str:
        return check_engine(v, "evaluator", "eval.backend")

    @field_validator("extra_server_args")
    @classmethod
    def _no_owned_flags(cls, v: list[str]) -> list[str]:
        return check_extra_server_args(v, "eval.extra_server_args")

    @model_validator(mode="after")
    def _backend_fits(self) -> "EvalConfig":
        trees = [c.label for c in self.configs if c.topk > 1]
        if trees and not engine(self.backend, "eval.backend").eval_trees:
            tree_engines = [n for n in names_for("evaluator") if engine(n).eval_trees]
            raise ValueError(f"eval.configs {', '.join(trees)}: the {self.backend} evaluator drafts chains only "
                             f"(topk 1); use eval.backend {' or '.join(tree_engines)} for top-k > 1")
        names = [p.name for p in self.prompt_sets]
        if "held_out" in names or len(set(names)) != len(names):
            raise ValueError(f"eval.prompt_sets names {names}: each must be unique and not 'held_out' (the "
                             "corpus's own split)")
        if self.gate_sets is not None:
            unknown = [g for g in self.gate_sets if g not in ["held_out", *names]]
            if unknown or not self.gate_sets:
                raise ValueError(f"eval.gate_sets {self.gate_sets}: name one or more of held_out"
                                 + "".join(f", {n}" for n in names) + " (eval.prompt_sets' names), or null for "
                                 "every set" + (f"; unknown: {unknown}" if unknown else ""))
        return self


class GenerateConfig(_Section):
    """The generation phase: the target rewrites the assistant turns of chosen sources (eagleflow.phases.generate)."""
    enabled: bool = Field(default=False, description="regenerate assistant turns with the target before tokenising")
    sources: list[str] | None = Field(default=None, description="corpus source names to regenerate; null = all "
                                      "(e.g. keep a source that is already the target's own output as it is)")
    temperature: float = Field(default=0.7, ge=0.0, le=10.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling; 1 = off")
    max_new_tokens: int = Field(default=2048, ge=1, le=131072, description="per assistant turn")
    seed: int = Field(default=0, ge=0, description="each turn's seed is derived from it, the record id and the turn")
    reasoning: bool = Field(default=True, description="thinking on or off (chat_template_kwargs enable_thinking)")
    concurrency: int = Field(default=8, ge=1, le=1024, description="records in flight per shard worker")
    shards: int = Field(default=1, ge=1, le=1024, description="generation shards (one worker and one Airflow "
                        "task each)")
    keep_truncated: bool = Field(default=True, description="a turn that hits max_new_tokens: keep it as the "
                                 "record's last turn (true) or drop the record (false)")
    max_bad_records: int = Field(default=0, ge=0, description="records that cannot be regenerated (named in "
                                 "generated/bad_records.jsonl) allowed before the phase fails")
    tool_call_format: Literal["hermes"] = Field(default="hermes", description="how the target writes a tool "
                                                "call: hermes = <tool_call>{\"name\", \"arguments\"}</tool_call>")
    request_timeout_base_s: float = Field(default=120.0, gt=0, description="one generation request may take "
                                          "this long plus request_timeout_per_token_s per new token")
    request_timeout_per_token_s: float = Field(default=0.1, ge=0, description="per new token allowed")
    port: int = Field(default=0, ge=0, le=65535, description="the generation server's port; 0 = a free one")
    backend: str | None = Field(default=None, description="the generation server's engine (eagleflow.engines: "
                                "hf, sglang or vllm); default: capture.backend")

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, v: str | None) -> str | None:
        return v if v is None else check_engine(v, "generate_server", "generate.backend")


class PipelineConfig(_Section):
    run_root: str = Field(default="runs", description="each run gets <run_root>/<run_id>")
    target_model: str = Field(min_length=1, description="local path of the target model (config, weights, tokenizer)")
    node: NodeConfig = Field(default_factory=NodeConfig)
    gpu: GpuConfig = Field(default_factory=GpuConfig)
    corpus: CorpusConfig = Field(default_factory=CorpusConfig)
    disk: DiskConfig = Field(default_factory=DiskConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)

    # Where the config was read from; relative paths resolve against its folder.
    source_path: str | None = Field(default=None, exclude=True)

    def _gpu_engines(self) -> list[tuple[str, str]]:
        """(field, engine) of each server this config runs on its nodes whose engine needs a GPU node."""
        picks = {self.capture.backend: "capture.backend"}
        name, field = generation_backend(self)
        picks.setdefault(name, field)   # the same engine as capture's: one complaint, about capture.backend
        return [(f, n) for n, f in picks.items() if engine(n, f).needs_gpu]

    @model_validator(mode="after")
    def _capture_matches_node(self) -> "PipelineConfig":
        cpu_ok = " or ".join(repr(n) for n in names_for("capture_server") if not engine(n).needs_gpu)
        for field, name in self._gpu_engines():
            if not self.node.has_gpu:
                raise ValueError(f"{field} {name!r} needs a GPU node, but node.has_gpu is false; "
                                 f"use backend {cpu_ok} on a CPU node")
        return self

    @model_validator(mode="before")
    @classmethod
    def _fleet_resolved(cls, data: Any) -> Any:
        """The fleet as data, before validation: each node's empty fields from the top level, and the top level
        the view of one node (the one the node section names, else the training node): its connection as the
        node section, its run_root, server.dump_dir and gpu.select. Nothing is changed after validation, so
        a validated config is what was read (a node's frozen view, run-config.<node>.json, reads back as itself)."""
        if not isinstance(data, dict) or not isinstance(data.get("fleet"), dict) or not data["fleet"].get("nodes"):
            return data
        data = dict(data)
        fleet = data["fleet"] = dict(data["fleet"])
        nodes = [n.model_dump(exclude_unset=True) if isinstance(n, BaseModel) else n for n in fleet["nodes"]]
        if not all(isinstance(n, dict) for n in nodes):
            return data                       # field validation names what is not a node
        server = _section_data(data, "server")
        gpu = _section_data(data, "gpu")
        run_root = data.get("run_root", cls.model_fields["run_root"].default)
        dump_dir = server.get("dump_dir", ServerConfig.model_fields["dump_dir"].default)
        select = list(gpu.get("select") or [])
        filled = []
        for n in nodes:
            n = dict(n)
            n["run_root"] = n.get("run_root") or run_root
            n["dump_dir"] = n.get("dump_dir") or dump_dir
            n["gpus"] = select if n.get("gpus") is None else n["gpus"]
            if isinstance(n.get("name"), str) and isinstance(n["run_root"], str):
                n["state_dir"] = n.get("state_dir") or f"{n['run_root'].rstrip('/')}/.node-state/{n['name']}"
            filled.append(n)
        fleet["nodes"] = filled
        names = [n.get("name") for n in filled]
        if fleet.get("training_node") is None and names and isinstance(names[0], str):
            fleet["training_node"] = names[0]
        node = data.get("node")
        name = (node.get("name", "local") if isinstance(node, dict) else getattr(node, "name", None)) \
            if "node" in data else fleet.get("training_node")
        entry = next((n for n in filled if n.get("name") == name), None)
        if entry is None:
            return data                       # the after-validator names the node that is not in the fleet
        data["node"] = {k: entry[k] for k in NodeConfig.model_fields if k in entry}
        data["run_root"] = entry["run_root"]
        data["server"] = server | {"dump_dir": entry["dump_dir"]}
        data["gpu"] = gpu | {"select": entry["gpus"]}
        return data

    # Defined after _fleet_resolved on purpose: pydantic runs "before" model validators last-defined first, and
    # the fleet reads server.dump_dir, which an old config gives as capture.dump_dir.
    @model_validator(mode="before")
    @classmethod
    def _server_names_moved(cls, data: Any, info: ValidationInfo) -> Any:
        """The target server's settings under their old names (``capture.<field>``, before issue 48) moved to
        ``server.<field>``. Each moved name is noted: into the validation context's ``moved_names`` list when
        there is one (load_config logs it once, naming the file), else logged here. A field given under both
        names with different values is refused, naming both."""
        if not isinstance(data, dict) or not isinstance(data.get("capture"), dict):
            return data
        moved = [f for f in ServerConfig.model_fields if f in data["capture"]]
        if not moved or not isinstance(data.get("server") or {}, (dict, ServerConfig)):
            return data                       # field validation names a server section that is not a mapping
        data = dict(data)
        capture = data["capture"] = dict(data["capture"])
        server = data["server"] = _section_data(data, "server")
        for f in moved:
            old = capture.pop(f)
            if f in server and server[f] != old:
                shown = f" (capture.{f} = {_valid_shown(f, old)}, server.{f} = {_valid_shown(f, server[f])})"
                raise ValueError(f"capture.{f} and server.{f} are both set, to different values"
                                 f"{'' if f == 'extra_server_args' else shown}: capture.{f} is the old name of "
                                 f"server.{f}; keep server.{f} only")
            server[f] = old
        notes = (info.context or {}).get("moved_names") if isinstance(info.context, dict) else None
        if isinstance(notes, list):
            notes.extend(f"capture.{f}" for f in moved)
        else:
            note_moved_names([f"capture.{f}" for f in moved], "(a config validated in code)")
        return data

    @model_validator(mode="after")
    def _fleet_is_complete(self) -> "PipelineConfig":
        """The fleet checked: its training node and the nodes a run uses among its nodes, the node section one
        of them, a GPU engine only on GPU nodes (the fleet was resolved by _fleet_resolved)."""
        fleet = self.fleet
        if not fleet.nodes:
            if fleet.use not in (None, [self.node.name]):
                raise ValueError(f"fleet.use {fleet.use} names nodes, but there is no fleet: this config's one "
                                 f"node is {self.node.name!r}; leave fleet_nodes empty")
            if fleet.training_node not in (None, self.node.name):
                raise ValueError(f"fleet.training_node {fleet.training_node!r} names no node of fleet.nodes "
                                 "(there are none); list the nodes under fleet.nodes or remove training_node")
            return self
        names = [n.name for n in fleet.nodes]
        if fleet.training_node not in names:
            raise ValueError(f"fleet.training_node {fleet.training_node!r} is not one of fleet.nodes "
                             f"({', '.join(names)}); name one of them")
        if self.node.name not in names:
            raise ValueError(f"with fleet.nodes, the node section is set from fleet.nodes (the training node's, "
                             f"or a node's own view); node.name {self.node.name!r} is none of them: remove it")
        for n in fleet.nodes:
            for field, name in self._gpu_engines():
                if not n.has_gpu:
                    raise ValueError(f"fleet node {n.name!r} has has_gpu false, but {field} is {name!r}, "
                                     "which needs a GPU node")
        if fleet.use is not None:
            unknown = [u for u in fleet.use if u not in names]
            if unknown:
                raise ValueError(f"fleet.use names {', '.join(map(repr, unknown))}, not in fleet.nodes "
                                 f"({', '.join(names)}); pick among those")
            if fleet.training_node not in fleet.use:
                raise ValueError(f"fleet.use {fleet.use} leaves out the training node {fleet.training_node!r}, "
                                 "which prepares the corpus and trains; keep it in")
        return self

    @model_validator(mode="after")
    def _stream_reaches_fleet(self) -> "PipelineConfig":
        """A streaming store's capture nodes reach the training node's store at stream.host: a loopback (or
        wildcard) address there is unreachable from a node behind another connection."""
        if not (self.fleet.nodes and store_for(self.stream.storage).streaming):
            return self
        home = next(n for n in self.fleet.nodes if n.name == self.fleet.training_node)
        remote = [f"{n.name} (connection {n.conn_id or 'this machine'})" for n in self.nodes_in_use()
                  if n.name != home.name and n.conn_id != home.conn_id]
        if remote and not stream_host_reachable(self.stream.host):
            raise ValueError(f"stream.host {self.stream.host!r} is loopback or a wildcard, but fleet node(s) "
                             f"{', '.join(remote)} put their samples into the training node {home.name}'s store "
                             f"over the network: set stream.host to {home.name}'s address reachable from them (the "
                             "store's master and segment holder bind it), or use stream.storage disk")
        return self

    def server_gpu_slots(self) -> list[int]:
        """The capture server's GPUs on this node, as positions in the run's GPU list (``gpu_at``): none on a CPU
        node or for an engine on the CPU (hf with server.device cpu); else server.tp of them (one for hf) from
        sglang's ``--base-gpu-id`` (0 unless server.extra_server_args sets it), ``--gpu-id-step`` apart. The
        engines take CUDA's devices from 0, as the node's environment shows them."""
        needs_gpu = engine(self.capture.backend, "capture.backend").needs_gpu
        if not self.node.has_gpu or not (needs_gpu or self.server.device != "cpu"):
            return []
        base = server_flag_int(self.server.extra_server_args, "base-gpu-id") or 0
        step = server_flag_int(self.server.extra_server_args, "gpu-id-step") or 1
        return [base + i * step for i in range(self.server.tp if needs_gpu else 1)]

    def train_gpu_slots(self) -> list[int]:
        """The trainer's GPUs on this node, as positions in the run's GPU list: none on a CPU node or with
        train.device cpu; else the first train.nproc_per_node (each process takes CUDA device LOCAL_RANK)."""
        if not self.node.has_gpu or self.train.device == "cpu":
            return []
        return list(range(self.train.nproc_per_node))

    def gpu_at(self, slots: list[int]) -> list[str]:
        """The GPUs (as gpu.select names them: UUID or index) at these positions of the run's GPU list: gpu.select
        in its order (the node's CUDA_VISIBLE_DEVICES is expected to list the same GPUs), or every GPU by index
        when it is empty."""
        select = [str(g) for g in self.gpu.select]
        return [select[i] if select else str(i) for i in slots if not select or i < len(select)]

    @model_validator(mode="after")
    def _stream_trainer_beside_server(self) -> "PipelineConfig":
        """A streaming run trains while the capture server still holds its GPUs (gpus_idle_after_capture is
        skipped): on a GPU node the trainer's GPUs must not be the server's."""
        if not (store_for(self.stream.storage).streaming and self.node.has_gpu):
            return self
        if self.fleet.nodes and self.node.name != self.fleet.training_node:
            return self                       # a capture node's view: the trainer runs on the training node
        server, train = self.server_gpu_slots(), self.train_gpu_slots()
        both = sorted(set(server) & set(train))
        select = list(self.gpu.select)
        past = [i for i in server + train if select and i >= len(select)]
        if not both and not past:
            return self
        base = server_flag_int(self.server.extra_server_args, "base-gpu-id")
        placed = (f"server.tp = {self.server.tp}, --base-gpu-id in server.extra_server_args: "
                  f"{'unset, 0' if base is None else base}"
                  if engine(self.capture.backend, "capture.backend").needs_gpu
                  else f"server.device {self.server.device!r}")
        where = (f"the capture server's GPU(s) {server} (capture.backend {self.capture.backend!r}, {placed}) and "
                 f"the trainer's {train} (train.device {self.train.device!r}, "
                 f"train.nproc_per_node = {self.train.nproc_per_node}), positions in gpu.select "
                 f"({', '.join(map(str, select)) or 'empty: every GPU by index'})")
        if past:
            raise ValueError(f"stream.storage {self.stream.storage!r} trains beside capture on "
                             f"{where}: position(s) {sorted(set(past))} are past the end of gpu.select; list "
                             "enough GPUs in gpu.select for both")
        raise ValueError(f"stream.storage {self.stream.storage!r} trains while the capture server still holds its "
                         f"GPUs, but {where} share position(s) {both} (GPU(s) {', '.join(self.gpu_at(both))}): "
                         f"give the server other GPUs (server.extra_server_args ['--base-gpu-id', "
                         f"'{self.train.nproc_per_node}'] with sglang), set train.device cpu, or use "
                         "stream.storage disk (offline: training starts once capture freed its GPUs)")

    def nodes_in_use(self) -> list[FleetNodeConfig]:
        """The fleet nodes this run uses, in the fleet's order (one implicit node without a fleet)."""
        if not self.fleet.nodes:
            return [FleetNodeConfig(**self.node.model_dump(), gpus=list(self.gpu.select), run_root=self.run_root,
                                    dump_dir=self.server.dump_dir)]
        use = self.fleet.use
        return [n for n in self.fleet.nodes if use is None or n.name in use]

    @property
    def is_fleet(self) -> bool:
        """More than one node: each node's files get its name (the nodes may share a run root)."""
        return len(self.fleet.nodes) > 1

    def fleet_node_names(self) -> list[str]:
        return [n.name for n in self.fleet.nodes] or [self.node.name]

    def node_view(self, name: str) -> "PipelineConfig":
        """This config as the fleet node ``name`` sees it: its connection, run root, dump dir and GPUs."""
        if not self.fleet.nodes and name == self.node.name:
            return self.model_copy(deep=True)
        if name not in [n.name for n in self.fleet.nodes]:
            raise ConfigError(f"node {name!r} is not in this run's fleet ({', '.join(self.fleet_node_names())})")
        view = PipelineConfig.model_validate(self.model_dump() | {"node": {"name": name}})
        view.source_path = self.source_path
        return view

    @overload
    def resolve(self, path: str) -> Path: ...
    @overload
    def resolve(self, path: None) -> None: ...
    @overload
    def resolve(self, path: str | None) -> Path | None: ...

    def resolve(self, path: str | None) -> Path | None:
        """A path from the config, made absolute against the config file's folder."""
        if path is None:
            return None
        p = Path(path).expanduser()
        if not p.is_absolute() and self.source_path:
            p = Path(self.source_path).parent / p
        return Path(os.path.normpath(p.absolute()))

    def run_dir(self, run_id: str) -> Path:
        root = self.resolve(self.run_root)
        d = root / safe_run_id(check_run_name(run_id, "run id"))
        if Path(os.path.normpath(d)).parent != root:   # belt and braces: one component, directly under run_root
            raise ConfigError(f"run id {run_id!r}: its directory {d} is not directly under run_root {root}; "
                              "use a plain name such as exp-01")
        return d

    def node_state_dir(self) -> Path:
        if self.node.state_dir:
            return self.resolve(self.node.state_dir)
        return self.resolve(self.run_root) / ".node-state"


def _valid_shown(field: str, value: Any) -> str:
    """A server field's value for an error: shown when it is a valid value of the field, else only its type (a
    misplaced value may be a pasted secret, docs/safety.md). Lists of server flags are never shown (a flag may
    carry a key): the caller leaves them out."""
    try:
        ServerConfig.model_validate({field: value})
    except ValidationError:
        return f"a value of type {type(value).__name__}, not shown"
    return repr(value)


def _section_data(data: dict[str, Any], key: str) -> dict[str, Any]:
    """A section of raw config data as a plain dict (it may be absent, or a validated section)."""
    section = data.get(key) or {}
    return section.model_dump(exclude_unset=True) if isinstance(section, BaseModel) else dict(section)


def check_run_name(value: str, field: str) -> str:
    """A run directory name (DAG Param run_name, --run-id, an Airflow run id): one plain path component.

    ``.``, ``..``, an absolute path or anything with a path separator would put the run's files
    outside run_root (``..`` makes the run dir run_root's parent), so they are refused by name.
    """
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{field} = {value!r}: a run needs a non-empty name, e.g. exp-01")
    if value in (".", "..") or value.startswith(("/", "~")) or any(c in value for c in "/\\\0"):
        raise ConfigError(f"{field} = {value!r}: not allowed; the run directory must stay inside run_root, so "
                          "the name cannot be '.', '..', an absolute path or contain '/' or '\\'; use a plain "
                          "name such as exp-01 (letters, digits, '_', '-', '.')")
    if value.startswith("-"):
        # the name is an argument of node commands (--run-id NAME): a leading '-' reads as an option there
        raise ConfigError(f"{field} = {value!r}: a run name may not start with '-' (node commands would read it "
                          "as an option); use a plain name such as exp-01 (letters, digits, '_', '-', '.')")
    return value


def safe_run_id(run_id: str) -> str:
    """Airflow run ids hold ':' and '+'; keep a path-safe form."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)


_NOTED: set[tuple[str, str]] = set()   # (where, old name) already logged: one note per file and name


def note_moved_names(old_names: list[str], where: str) -> None:
    """Log, once per config and name, that ``capture.<field>`` is read as ``server.<field>`` (issue 48)."""
    for old in old_names:
        if (where, old) in _NOTED:
            continue
        _NOTED.add((where, old))
        new = "server." + old.split(".", 1)[1]
        log.warning("eagleflow config %s: %s is deprecated, read as %s (the target server's settings have their "
                    "own section, server:, docs/configuration.md); move it under server:", where, old, new)


def _as_written(text: str, moved: list[str]) -> str:
    """``text`` with each moved field under the name the config used (``capture.port``, not ``server.port``)."""
    for old in moved:
        new = "server." + old.split(".", 1)[1]
        text = re.sub(rf"\b{re.escape(new)}\b", old, text)
    return text


def _format_errors(err: ValidationError, where: str, moved: list[str] | None = None) -> str:
    lines = [f"invalid eagleflow config {where}:"]
    for e in err.errors():
        # a moved field is named as the config wrote it (capture.port), so the user finds it in the file
        field = _as_written(".".join(str(p) for p in e["loc"]), moved or []) or "(top level)"
        if e["type"] == "extra_forbidden":
            # the key only: an unknown key's value may be anything the file holds (a password, a token)
            lines.append(f"  - {field}: unknown field; remove it or check its spelling")
        elif e["type"] == "missing":
            lines.append(f"  - {field} = (absent): required field is missing; add it")
        elif e["type"].startswith(("value_error", "assertion_error")):
            # our own validators' words: each says itself what it may show
            lines.append(f"  - {field}: {_as_written(e['msg'], moved or [])}")
        else:
            # key and what it expects only (pydantic's msg never holds the input): a wrongly typed or
            # misplaced value may be a secret (docs/safety.md: values are never echoed)
            lines.append(f"  - {field}: {e['msg']} (got a value of type {type(e.get('input')).__name__}, not shown)")
    return "\n".join(lines)


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts, creating sections as needed."""
    parts = dotted.split(".")
    cur = data
    for p in parts[:-1]:
        nxt = cur.get(p)
        if nxt is None:
            nxt = cur[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is a value, not a section")
        cur = nxt
    cur[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                data: dict[str, Any] | None = None) -> PipelineConfig:
    """Read YAML (or take ``data``), apply dotted overrides, validate."""
    where = "(inline)"
    raw: dict[str, Any] = dict(data or {})
    if path is not None:
        p = Path(path)
        where = f"in {p}"
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass the path of a YAML file (see configs/)")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            # where and what only: PyYAML's own message quotes the offending line of the file
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"config file {p} is not valid YAML{at}: "
                              f"{getattr(e, 'problem', None) or type(e).__name__}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top, not {type(loaded).__name__}")
        raw = loaded
    for key, value in (overrides or {}).items():
        set_dotted(raw, key, value)
    moved: list[str] = []   # old names of server fields the config used (PipelineConfig._server_names_moved)
    try:
        cfg = PipelineConfig.model_validate(raw, context={"moved_names": moved})
    except ValidationError as e:
        raise ConfigError(_format_errors(e, where, moved)) from None
    note_moved_names(moved, where)
    if path is not None:
        cfg.source_path = str(Path(path).absolute())
    problem = deletion_root_problem(cfg)   # relative paths resolve against the file's folder: after source_path
    if problem:
        raise ConfigError(f"invalid eagleflow config {where}:\n  - disk.cache_root = {cfg.disk.cache_root!r}: "
                          f"{problem}; everything under cache_root may be deleted (disk.old_caches), so it must "
                          "be a folder that holds only hidden-state caches, e.g. /data/eagleflow/caches")
    return cfg


def deletion_root_problem(cfg: "PipelineConfig") -> str | None:
    """Why ``disk.cache_root`` must not be the root deletions are confined to: ``/``, a home folder or a
    folder holding one, or a folder above ``run_root``, compared by real path and identity (so ``//``,
    ``/proc/self/root`` or a link to ``/`` are ``/``; see eagleflow.deletion_roots). None: acceptable, or no
    cache_root. Checked again before every deletion: the folder may be created or swapped later."""
    if not cfg.disk.cache_root:
        return None
    return by_identity(str(cfg.resolve(cfg.disk.cache_root)), str(cfg.resolve(cfg.run_root)))
