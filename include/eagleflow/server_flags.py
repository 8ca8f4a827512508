"""The server flags eagleflow sets itself, and the check that extra server args leave them alone.

Every engine server eagleflow starts (sglang's ``launch_server``, ``vllm serve``: capture, generation and
evaluation) gets its flags from a launcher of ours, then ``server.extra_server_args`` (or
``eval.extra_server_args``). Both engines parse with argparse, where the last value of a flag wins (and
vLLM's ``--middleware`` appends), so an extra ``--host 0.0.0.0`` would silently undo the loopback-only
listen, another ``--middleware`` would add code to the server, ``--trust-remote-code`` would run the
model folder's own Python. ``OWNED_FLAGS`` is the one list of what the launchers own; the config refuses
an extra arg that names one of them, however it is spelled (``check_extra_server_args``, at config load):

- ``--flag value``, ``--flag=value``, ``--flag value`` as one list item (the name ends at ``=`` or a space);
- a prefix argparse would accept as an abbreviation (``--ho``, ``--tp``, ``--spec``);
- vLLM's spellings: ``--flag_name`` (underscores for dashes), ``--flag.key value`` (one key of a JSON
  flag), ``--no-flag`` (a boolean's negation), and a short alias (``-tp``);
- upper case (argparse would not match it, but nothing legitimate needs it).

Standard library only: eagleflow.config imports it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OwnedFlag:
    """Flags (canonical names: no dashes in front, ``-`` between words) one launcher setting stands for."""
    names: tuple[str, ...]
    why: str                      # what it would undo, in words
    instead: str = ""             # where the setting is made instead
    family: bool = False          # every flag whose name starts with a name (all of sglang's speculative-*)
    short: tuple[str, ...] = ()   # single-dash aliases (vLLM's -tp)


OWNED_FLAGS: tuple[OwnedFlag, ...] = (
    OwnedFlag(("host", "port", "uds"), "the servers listen on a loopback address only (they take no credential)",
              "set server.host (a loopback address) and server.port / generate.port"),
    OwnedFlag(("middleware",), "vLLM's only middleware is eagleflow's capture API (engines.vllm.api): no other "
              "code is loaded into the server"),
    OwnedFlag(("kv-transfer-config",), "vLLM captures through eagleflow's KV connector and nothing else"),
    OwnedFlag(("speculative",), "the evaluated draft configurations and the capture's switch are eagleflow's",
              "set the draft configurations in eval.configs", family=True),
    OwnedFlag(("enable-return-aux-hidden-states", "return-aux-hidden-state-layer-ids"),
              "the capture layers are the config's", "set capture.aux_layers"),
    OwnedFlag(("trust-remote-code",), "eagleflow never runs Python code from a model's folder",
              "use a target the engine supports natively"),
    OwnedFlag(("config",), "a file of flags could set any of these flags unseen", "list the flags themselves"),
    OwnedFlag(("model", "model-path", "skip-tokenizer-init"), "the model served is target_model, sent token ids",
              "set target_model"),
    OwnedFlag(("tensor-parallel-size", "tp-size"), "the GPUs are planned from server.tp", "set server.tp",
              short=("tp",)),
    OwnedFlag(("dtype",), "the servers compute in the dtype the config names", "set server.dtype"),
    OwnedFlag(("seed", "random-seed"), "generation's seeds derive from generate.seed", "set generate.seed"),
    OwnedFlag(("enable-prefix-caching", "disable-radix-cache", "chunked-prefill-size", "cuda-graph-backend-decode",
               "cuda-graph-backend-prefill"),
              "one capture request must be one whole prefill (a cache hit or a chunk would dump a part of it)"),
    OwnedFlag(("max-logprobs",), "the lossless check needs the reference's candidates it asks for"),
)


class OwnedFlagError(ValueError):
    """An extra server arg that sets a flag eagleflow owns; the message names the field, the flag and the fix."""


def _option_name(token: str) -> str | None:
    """The canonical name an option token sets (dashes, a value after ``=`` or a space, a JSON key after ``.``,
    a ``no-`` in front and case taken off; ``_`` read as ``-``); None for a value (``x``, ``-``, ``--``, ``-1``)."""
    body = token.lstrip("-")
    if body == token or not body:
        return None
    head = body.split("=", 1)[0].split(None, 1)
    name = head[0].split(".", 1)[0].replace("_", "-").lower() if head else ""
    if not name or name[0].isdigit():
        return None
    return name[3:] if name.startswith("no-") and len(name) > 3 else name


def owned_flag_of(token: str) -> tuple[str, OwnedFlag] | None:
    """(the owned flag it sets, as written on a command line, and its entry), when ``token`` is an option that
    argparse (or vLLM's parser) would read as one of ``OWNED_FLAGS``: the flag itself or an abbreviation."""
    name = _option_name(token)
    if name is None:
        return None
    for entry in OWNED_FLAGS:
        for dashes, names in (("--", entry.names), ("-", entry.short)):
            for owned in names:
                if owned.startswith(name):
                    return dashes + owned, entry
                if entry.family and name.startswith(owned):
                    return dashes + name, entry
    return None


def check_extra_server_args(args: list[str], field: str) -> list[str]:
    """``args`` unchanged, or OwnedFlagError naming ``field``, the first owned flag it sets and what to do.

    Only the option's name is shown, never its value (a config's values are not echoed: docs/safety.md)."""
    for token in args:
        hit = owned_flag_of(token)
        if hit is None:
            continue
        flag, entry = hit
        shown = (token.split("=", 1)[0].split(None, 1) or [""])[0][:64]
        how = "" if shown == flag else f" (written {shown!r})"
        raise OwnedFlagError(
            f"{field} sets {flag}{how}, a flag eagleflow sets itself on the servers it starts: {entry.why}. "
            f"Remove it from {field}" + (f"; {entry.instead}" if entry.instead else "")
            + " (eagleflow.server_flags.OWNED_FLAGS lists the flags it owns)")
    return args


def owned_option_names() -> set[str]:
    """Every owned flag as it is written on a command line (``--host``, ``-tp``): what a launcher may set."""
    out = set()
    for entry in OWNED_FLAGS:
        out |= {f"--{n}" for n in entry.names} | {f"-{n}" for n in entry.short}
    return out
