"""What a node answers, typed: the field types that hold a node's answer to the untrusted-input rule, and the
answer models of the fleet and reconcile commands the control plane reads.

A node is another machine: everything it prints is untrusted input (docs/safety.md). A model here refuses an
answer that does not fit it (``Node.run_json`` turns that into a ``NodeAnswerError`` naming the node, the
field and the value) before the control plane acts on any of it:

- names (a file, a run) are one plain path component (``PathComponent``): joined onto a folder they stay
  in it, so they are checked before any file is opened;
- sizes and counts are non-negative integers, digests the hex of their length, timestamps finite;
- free text (a reason) is one bounded line with control characters escaped: it goes to logs and mails;
- numbers that answer a question (which shards were handed over) are checked against what was asked by the
  caller, who knows what it asked (``TakeOverShardsOperator``).

No Airflow and no other eagleflow import: the node side and every adapter can use these.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from eagleflow.phases import EXTRACT, KINDS

MAX_NAME_BYTES = 255          # NAME_MAX of Linux filesystems
MAX_TEXT_CHARS = 2000


def _control(ch: str) -> bool:
    """C0/C1 controls, DEL, the Unicode line separators and unpaired surrogates (no file name, no line)."""
    return ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 or ch in "\u2028\u2029" or 0xD800 <= ord(ch) <= 0xDFFF


def path_component(value: str) -> str:
    """``value`` when it is one plain path component; else ValueError saying why (pydantic adds field and value)."""
    why = ("is empty" if value == ""
           else "is '.' or '..' (a folder, not a name)" if value in (".", "..")
           else "is absolute" if value.startswith("/")
           else "holds '/' (a path)" if "/" in value
           else "holds '\\'" if "\\" in value
           else "holds a NUL or control character" if any(_control(c) for c in value)
           else f"is longer than {MAX_NAME_BYTES} bytes" if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
           else None)
    if why:
        raise ValueError(f"a name from a node must be one plain path component; {value[:200]!r} {why}; refused "
                         "before any file is opened")
    return value


def node_path(value: str) -> str:
    """An absolute POSIX path without control characters: a file on the node that answered, read there only."""
    if not value.startswith("/") or any(_control(c) for c in value):
        raise ValueError("a path from a node must be absolute, without NUL or control characters")
    return value


def known_phase(value: str) -> str:
    """The name of a sharded phase, as its descriptor has it (``phases.KINDS``): the wire carries the name."""
    if value not in KINDS:
        raise ValueError(f"not a sharded phase: {value!r} (known: {', '.join(sorted(KINDS))})")
    return value


def one_line(value: str) -> str:
    """Free text from a node, made safe for a log line or a mail: control characters escaped, length bounded."""
    text = "".join(c if not _control(c) else ascii(c)[1:-1] for c in value)
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS - 3] + "..."


PathComponent = Annotated[str, Field(strict=True), AfterValidator(path_component)]
NodePath = Annotated[str, Field(strict=True), AfterValidator(node_path)]
NodeText = Annotated[str, Field(strict=True), AfterValidator(one_line)]
Sha256Hex = Annotated[str, Field(strict=True), StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(strict=True, ge=0)]            # sizes, shard numbers, stored/expected units
Timestamp = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]   # epoch seconds; 1e999 refused
Phase = Annotated[str, Field(strict=True), AfterValidator(known_phase)]   # a sharded phase's name (phases.KINDS)


class _Answer(BaseModel):
    model_config = ConfigDict(frozen=True)


class FileDigest(_Answer):
    """One file of ``python -m eagleflow.fleet.digest``."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    size: Count
    sha256: Sha256Hex


class DigestAnswer(_Answer):
    """What ``python -m eagleflow.fleet.digest DIR [NAME ...]`` prints: name -> size and SHA-256."""
    files: dict[PathComponent, FileDigest]


class ShardStateAnswer(_Answer):
    """One shard of ``eagleflow reconcile states`` / ``scan`` (``eagleflow.watchdog.reconcile.ShardState``)."""
    run_id: PathComponent
    shard: Count
    num_shards: Count
    expected: Count
    stored: Count
    worker_alive: bool
    run_config: NodePath
    phase: Phase = EXTRACT
    finished: bool = True
    needs_rerun: bool = False
    line: NodeText = ""


class ShardStates(_Answer):
    """What ``eagleflow reconcile states`` and ``eagleflow reconcile scan`` print."""
    shards: list[ShardStateAnswer]


class HandOverAnswer(_Answer):
    """What ``eagleflow reconcile hand-over`` prints (``eagleflow.watchdog.reconcile.hand_over``); which of
    ``handed_over`` were asked about is the caller's check."""
    handed_over: list[Count]
    kept: dict[Annotated[str, Field(strict=True), StringConstraints(pattern=r"^[0-9]{1,9}$")], NodeText]
    node: PathComponent


class ClaimAnswer(BaseModel):
    """What ``eagleflow reconcile claim`` and ``release`` print (``eagleflow.watchdog.reconcile.claim``); a
    claim's shard, when it says one, is the caller's check."""
    model_config = ConfigDict(extra="allow", frozen=True)
    action: Literal["started", "attached", "skipped", "none", "kept", "stopped"]
    reason: NodeText
    shard: Count | None = None
    run_id: PathComponent | None = None
    worker_pid: Annotated[int, Field(strict=True, gt=0)] | None = None


class OtherRunJob(_Answer):
    """A live job of another run that ``eagleflow gpu free`` left running: a run never stops another run's job
    unless forced (``eagleflow.gpu.cleanup``); the GPU gate names it when it waits and when it refuses."""
    run_id: PathComponent | None          # None: the record's file name does not end with its role (no run to name)
    role: NodeText
    pid: Annotated[int, Field(strict=True, gt=1)]
    user: NodeText | None = None
    command: NodeText = ""
    record: NodeText                      # shown to a person (the file to stop it by), never opened here
    on_selected_gpus: bool | None = None  # holds one of the run's selected GPUs; None: the GPUs were not read
    gpu_mib: Count | None = None

    def describe(self) -> str:
        where = ("on the selected GPUs" + (f", {self.gpu_mib} MiB" if self.gpu_mib is not None else "")
                 if self.on_selected_gpus else "not on the selected GPUs" if self.on_selected_gpus is False
                 else "GPUs not read")
        run = f"run {self.run_id}" if self.run_id else "an unnamed run"
        return (f"{run}: {self.role} pid {self.pid} ({self.user or 'user ?'}, `{self.command}`, {where}; "
                f"record {self.record})")


def answer_line(model: type[BaseModel], data: Any) -> str:
    """The one JSON line a node command prints as its answer: ``data`` validated into ``model``, the class the
    control plane reads it with (``Node.run_json``), so a node never prints what its reader would refuse."""
    return model.model_validate(data).model_dump_json()


__all__ = ["PathComponent", "NodePath", "NodeText", "Sha256Hex", "Count", "Timestamp", "FileDigest", "DigestAnswer",
           "ShardStateAnswer", "ShardStates", "HandOverAnswer", "ClaimAnswer", "OtherRunJob", "path_component", "one_line",
           "answer_line"]
