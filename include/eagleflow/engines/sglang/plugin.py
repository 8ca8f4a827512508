"""The capture hook inside sglang's scheduler processes, installed through sglang's plugin entry point.

sglang starts its schedulers with the spawn start method, so a patch made in
the launcher never reaches them. Instead our package declares the entry point
``sglang.srt.plugins: eagleflow_capture = eagleflow.engines.sglang.plugin:register``;
with ``SGLANG_PLUGINS=eagleflow_capture`` sglang's ``load_plugins()`` calls
``register()`` at the start of every scheduler process. Nothing of sglang is edited.

sglang 0.5.23 (the version requirements-node.txt pins; proven by ``make test-node``
against its real classes): the server runs with ``--enable-return-aux-hidden-states
--speculative-algorithm EAGLE3``, which makes every prefill's
``logits_output.hidden_states`` the packed aux concat [T, k*H] and
``logits_output.last_hidden_states`` the final post-norm states [T, H]
(``srt/layers/logits_processor.py``). An AFTER hook on
``TpModelWorker.forward_batch_generation(self, batch: ScheduleBatch | None,
forward_batch: ForwardBatch | None = None, ...)`` slices them per request:

- scheduler path: ``batch`` is a ``ScheduleBatch``; request i is ``batch.reqs[i].rid``
  and owns rows ``[sum(extend_lens[:i]), sum(extend_lens[:i+1]))``; ``prefix_lens[i]``
  cached tokens were not recomputed (no dump: it would be short);
- ``forward_batch``-only path (``batch`` None): ``ForwardBatch.rids``,
  ``extend_seq_lens_cpu``, ``extend_prefix_lens_cpu``, ``extend_start_loc``.

Only attention-TP rank 0 writes (``sglang.srt.runtime_context.get_parallel().attn_tp_rank``).
Before anything is hooked, ``check_sglang_contract`` proves every attribute the hook
reads exists in the installed sglang; a missing one stops the scheduler with the
version and the attribute named (sglang itself only logs a failed plugin).

Inert unless asked: with ``SGLANG_PLUGINS`` unset sglang 0.5.23 loads every installed
plugin, so a plain ``sglang.launch_server`` on the node (serving the exported draft,
any other model) calls ``register()`` too. Without any ``EAGLEFLOW_CAPTURE_*`` variable
it prints one line and wraps nothing. Once any of them is set the launch is a capture
launch, and settings that are incomplete or malformed stop the scheduler, naming them.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from eagleflow.serving.capture_hook import (CAPTURE_ENV_PREFIX, ENV_AUX_LAYERS, ENV_DUMP_DIR, ENV_MODEL,  # noqa: F401
                                           CaptureHookError, CaptureSettings, capture_requested, is_capture_rid)
from eagleflow.serving.dump_protocol import check_rid, dump_key_from_env, write_dump

log = logging.getLogger("eagleflow.engines.sglang.plugin")

TARGET = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"

# What the hook reads, per sglang class: the contract checked at start-up.
SCHEDULE_BATCH_FIELDS = ("reqs", "extend_lens", "prefix_lens", "input_ids", "forward_mode")
FORWARD_BATCH_FIELDS = ("rids", "extend_seq_lens_cpu", "extend_prefix_lens_cpu", "extend_start_loc", "input_ids",
                        "forward_mode")
LOGITS_OUTPUT_FIELDS = ("hidden_states", "last_hidden_states")
FORWARD_PARAMS = ("self", "batch", "forward_batch")


# --- the contract with the installed sglang ------------------------------------------------

def _sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sglang")
    except PackageNotFoundError:
        return "(not installed)"


def _field_names(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__annotations__", {}))


def check_sglang_contract() -> None:
    """Every class attribute and API the hook reads, proven present in this sglang; else CaptureHookError."""
    version = _sglang_version()

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise CaptureHookError(f"sglang {version}: {what}; the eagleflow capture hook supports sglang 0.5.23 "
                                   "(requirements-node.txt). Install that version or use capture.backend hf")
    try:
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.managers.utils import GenerationBatchResult
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    except ImportError as e:
        raise CaptureHookError(f"sglang {version}: cannot import {e.name or e} that the capture hook reads; the "
                               "eagleflow capture hook supports sglang 0.5.23 (requirements-node.txt)") from None
    for cls, fields in ((ScheduleBatch, SCHEDULE_BATCH_FIELDS), (ForwardBatch, FORWARD_BATCH_FIELDS),
                        (LogitsProcessorOutput, LOGITS_OUTPUT_FIELDS), (GenerationBatchResult, ("logits_output",))):
        have = _field_names(cls)
        for f in fields:
            need(f in have, f"{cls.__module__}.{cls.__name__} has no attribute {f!r}")
    need("rid" in inspect.signature(Req.__init__).parameters, "Req has no 'rid'")
    params = list(inspect.signature(inspect.unwrap(TpModelWorker.forward_batch_generation)).parameters)
    need(params[:3] == list(FORWARD_PARAMS),
         f"TpModelWorker.forward_batch_generation takes {params[:3]}, not {list(FORWARD_PARAMS)}")
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        need(False, "sglang.srt.runtime_context.get_parallel (the attention-TP rank API) is missing")
    need(callable(get_parallel), "sglang.srt.runtime_context.get_parallel is not callable")


def attention_tp_rank() -> int:
    """This scheduler's attention-TP rank, from sglang 0.5.23's runtime context (published before serving)."""
    from sglang.srt.runtime_context import get_parallel
    return int(get_parallel().attn_tp_rank)


# --- slicing a prefill per request ----------------------------------------------------------

@dataclass(frozen=True)
class ExtendView:
    """Which rows of a batched prefill belong to which request."""
    rids: list[str]
    lens: list[int]
    starts: list[int]
    prefix_lens: list[int]


def _ints(x) -> list[int]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [int(v) for v in x]


def _cumulative_starts(lens: list[int]) -> list[int]:
    starts, acc = [], 0
    for n in lens:
        starts.append(acc)
        acc += n
    return starts


def _is_prefill(mode: Any) -> bool:
    # EXTEND and MIXED carry whole prefills here; a verify or decode pass carries no sample.
    return mode is not None and mode.is_extend() and not mode.is_target_verify()


def extend_view(batch: Any = None, forward_batch: Any = None) -> ExtendView | None:
    """The per-request split of a prefill (from the ScheduleBatch, or the ForwardBatch alone); None for decode."""
    if batch is not None:
        if not _is_prefill(batch.forward_mode):
            return None
        lens = _ints(batch.extend_lens)
        rids = [str(r.rid) for r in batch.reqs]
        prefix = _ints(batch.prefix_lens)
        starts = _cumulative_starts(lens)
    elif forward_batch is not None:
        if not _is_prefill(forward_batch.forward_mode):
            return None
        lens = _ints(forward_batch.extend_seq_lens_cpu)
        rids = [str(r) for r in forward_batch.rids]
        prefix = _ints(forward_batch.extend_prefix_lens_cpu)
        starts = _ints(forward_batch.extend_start_loc)
    else:
        return None
    if not (len(rids) == len(lens) == len(prefix) == len(starts)):
        raise CaptureHookError(f"prefill batch has {len(rids)} requests but {len(lens)} extend lengths, "
                               f"{len(prefix)} prefix lengths and {len(starts)} starts")
    return ExtendView(rids=rids, lens=lens, starts=starts, prefix_lens=prefix)


def slice_requests(view: ExtendView, aux, last) -> list[tuple[str, int, Any, Any]]:
    """(rid, first row, aux rows, last rows) per request whose prefill is whole (no cached prefix)."""
    rows = aux.shape[0]
    if view.lens and view.starts[-1] + view.lens[-1] > rows:
        raise CaptureHookError(f"prefill of {len(view.rids)} requests spans {view.starts[-1] + view.lens[-1]} rows "
                               f"but the hidden states have {rows}")
    out = []
    for rid, n, s, p in zip(view.rids, view.lens, view.starts, view.prefix_lens):
        if p:
            if is_capture_rid(rid):
                # A cache hit computed only the suffix: a dump of it would be silently short.
                log.error("eagleflow capture: request %s reused %d cached tokens; no dump written "
                          "(start sglang with --disable-radix-cache)", rid, p)
            continue
        out.append((rid, s, aux[s:s + n], last[s:s + n]))
    return out


def write_request_dumps(settings: CaptureSettings, view: ExtendView, aux, last, input_ids) -> list[str]:
    """Write one dump per capture request of the prefill; returns the rids written."""
    import torch
    if isinstance(aux, (list, tuple)):      # a model that hands back one [T, H] tensor per layer
        aux = torch.cat(list(aux), dim=-1)
    written = []
    for rid, s, a, h in slice_requests(view, aux, last):
        if not is_capture_rid(rid):
            continue
        check_rid(rid)
        ids = input_ids[s:s + a.shape[0]].to(dtype=torch.int64)
        write_dump(settings.dump_dir, rid, input_ids=ids, aux_hidden_states=a, hidden_states=h,
                   aux_layers=settings.aux_layers, model=settings.model, key=dump_key_from_env())
        written.append(rid)
    return written


# --- the hook --------------------------------------------------------------------------------

_settings: CaptureSettings | None = None


def _s() -> CaptureSettings:
    global _settings
    if _settings is None:
        _settings = CaptureSettings.from_env()
    return _settings


def after_forward_batch_generation(result, worker, batch=None, forward_batch=None, *args, **kwargs):
    """AFTER TpModelWorker.forward_batch_generation(self, batch, forward_batch=None, ...): dump each prefill."""
    view = extend_view(batch, forward_batch)
    if view is None or attention_tp_rank() != 0:
        return None
    out = result.logits_output
    aux = getattr(out, "hidden_states", None)
    last = getattr(out, "last_hidden_states", None)
    if aux is None or last is None:
        raise CaptureHookError("prefill result has no hidden_states/last_hidden_states: the server was not "
                               "started with --enable-return-aux-hidden-states (use `eagleflow capture serve`)")
    ids = batch.input_ids if batch is not None else forward_batch.input_ids
    write_request_dumps(_s(), view, aux, last, ids)
    return None


def install(registry, hook_type_enum, hooks: dict[str, tuple[str, Callable]] | None = None) -> list[str]:
    """Register the hooks, apply them now and check each target really is wrapped by ours.

    Applying early is safe: sglang's ``apply_hooks`` skips targets already patched.
    Identity is checked by ``id()`` taken before: ``apply_hooks`` rebinds every stale
    reference to the original it finds in ``sys.modules``, ours included.
    """
    import pkgutil
    hooks = hooks or {TARGET: ("AFTER", after_forward_batch_generation)}
    original_ids = {}
    for t, (kind, fn) in hooks.items():
        obj_path, attr = t.rsplit(".", 1)
        try:
            original_ids[t] = id(getattr(pkgutil.resolve_name(obj_path), attr))
        except (ImportError, AttributeError, ValueError) as e:
            raise CaptureHookError(f"cannot find {t} in this sglang ({e}); install sglang 0.5.23") from None
        registry.register(t, fn, getattr(hook_type_enum, kind))
    registry.apply_hooks()
    missing = []
    for t in hooks:
        obj_path, attr = t.rsplit(".", 1)
        now = getattr(pkgutil.resolve_name(obj_path), attr)
        if id(now) == original_ids[t] or t not in registry._patched:
            missing.append(t)
    if missing:
        raise CaptureHookError(f"sglang did not apply the eagleflow capture hook(s) to {', '.join(missing)}; "
                               "see the 'Failed to apply hooks' line above in this log")
    return list(hooks)


def register() -> None:
    """sglang's plugin entry point (runs in every sglang process that loads plugins)."""
    if not capture_requested():
        # A plain sglang launch on the node: serve it untouched.
        print(f"eagleflow capture: not a capture launch (no {ENV_DUMP_DIR}) in pid {os.getpid()}; plugin inert, "
              "nothing hooked", file=sys.stderr, flush=True)
        return
    try:
        settings = _s()
        check_sglang_contract()
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        targets = install(HookRegistry, HookType)
        print(f"eagleflow capture: hook installed in pid {os.getpid()} ({', '.join(targets)}); dumps to "
              f"{settings.dump_dir}", file=sys.stderr, flush=True)
    except CaptureHookError as e:
        # sglang catches Exception from plugins and only logs it: stop this process so the launch fails loudly.
        print(f"eagleflow capture: FATAL: {e}", file=sys.stderr, flush=True)
        raise SystemExit(f"eagleflow capture plugin: {e}") from None
