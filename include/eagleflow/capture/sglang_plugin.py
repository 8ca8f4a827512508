"""The capture hook inside sglang's scheduler processes, installed through sglang's plugin entry point.

sglang starts its schedulers with the spawn start method, so a patch made in
the launcher never reaches them. Instead our package declares the entry point
``sglang.srt.plugins: eagleflow_capture = eagleflow.capture.sglang_plugin:register``;
with ``SGLANG_PLUGINS=eagleflow_capture`` sglang's ``load_plugins()`` calls
``register()`` at the start of every scheduler process. Nothing of sglang is edited.

Two modes, chosen by the launcher from the sglang version (``EAGLEFLOW_CAPTURE_MODE``):

- ``native`` (0.5.23): the server runs with ``--enable-return-aux-hidden-states``;
  each prefill's ``logits_output.hidden_states`` holds the aux concat [T, k*H]
  and ``logits_output.last_hidden_states`` the final states [T, H]. An AFTER
  hook on ``TpModelWorker.forward_batch_generation`` slices them per request.
- ``logits`` (0.5.14): an AFTER hook on ``ModelRunner.load_model`` turns aux
  capture on (``set_eagle3_layers_to_capture``) and a BEFORE hook on
  ``LogitsProcessor.forward`` receives (final states, aux list, ForwardBatch).

Per request i of a batched prefill, rows ``[start[i], start[i] + len[i])``
belong to rid i. Only TP rank 0 writes. A hook that did not install is an
error that stops the scheduler with a message (sglang only logs failed hooks).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .protocol import SELFCHECK_PREFIX, check_rid, parse_request_id, write_dump

log = logging.getLogger("eagleflow.capture.sglang_plugin")

ENV_DUMP_DIR = "EAGLEFLOW_CAPTURE_DUMP_DIR"
ENV_AUX_LAYERS = "EAGLEFLOW_CAPTURE_AUX_LAYERS"
ENV_MODEL = "EAGLEFLOW_CAPTURE_MODEL"
ENV_MODE = "EAGLEFLOW_CAPTURE_MODE"

NATIVE_TARGET = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
LOAD_MODEL_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
LOGITS_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
TARGETS = {"native": [NATIVE_TARGET], "logits": [LOAD_MODEL_TARGET, LOGITS_TARGET]}


class CaptureHookError(RuntimeError):
    pass


@dataclass(frozen=True)
class CaptureSettings:
    dump_dir: str
    aux_layers: list[int]
    model: str
    mode: str

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "CaptureSettings":
        env = dict(os.environ if env is None else env)
        missing = [k for k in (ENV_DUMP_DIR, ENV_AUX_LAYERS, ENV_MODE) if not env.get(k)]
        if missing:
            raise CaptureHookError(f"eagleflow capture plugin loaded without {', '.join(missing)}; start sglang "
                                   "through `eagleflow capture serve --backend sglang`, which sets them")
        mode = env[ENV_MODE]
        if mode not in TARGETS:
            raise CaptureHookError(f"{ENV_MODE}={mode!r}: expected one of {sorted(TARGETS)}")
        return cls(dump_dir=env[ENV_DUMP_DIR], aux_layers=[int(x) for x in json.loads(env[ENV_AUX_LAYERS])],
                   model=env.get(ENV_MODEL, ""), mode=mode)


@dataclass(frozen=True)
class ExtendView:
    """Which rows of a batched prefill belong to which request."""
    rids: list[str]
    lens: list[int]
    starts: list[int]
    prefix_lens: list[int]


def _as_list(x) -> list[int] | None:
    if x is None:
        return None
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [int(v) for v in x]


def extend_view(batch: Any) -> ExtendView | None:
    """The per-request split of a prefill batch (ForwardBatch, ModelWorkerBatch or ScheduleBatch); None for decode."""
    mode = getattr(batch, "forward_mode", None)
    if mode is None or not mode.is_extend():
        return None
    rids = getattr(batch, "rids", None)
    reqs = getattr(batch, "reqs", None)
    if not rids and reqs:
        rids = [r.rid for r in reqs]
    lens = _as_list(getattr(batch, "extend_seq_lens_cpu", None)) or _as_list(getattr(batch, "extend_seq_lens", None))
    if not rids or lens is None:
        raise CaptureHookError(f"prefill batch {type(batch).__name__} carries no request ids or extend lengths; "
                               "this sglang version is not supported by the eagleflow capture hook")
    if len(rids) != len(lens):
        raise CaptureHookError(f"prefill batch has {len(rids)} request ids but {len(lens)} extend lengths")
    starts = _as_list(getattr(batch, "extend_start_loc", None))
    if starts is None:
        starts, acc = [], 0
        for n in lens:
            starts.append(acc)
            acc += n
    prefix = (_as_list(getattr(batch, "extend_prefix_lens_cpu", None))
              or _as_list(getattr(batch, "extend_prefix_lens", None)) or [0] * len(lens))
    return ExtendView(rids=[str(r) for r in rids], lens=lens, starts=starts, prefix_lens=prefix)


def concat_aux(aux: Any):
    """A list of [T, H] tensors (Llama) or one packed [T, k*H] tensor (DeepSeek 0.5.23) -> [T, k*H]."""
    import torch
    if isinstance(aux, (list, tuple)):
        return torch.cat(list(aux), dim=-1)
    return aux


def slice_requests(view: ExtendView, aux, last) -> list[tuple[str, int, Any, Any]]:
    """(rid, first row, aux rows, last rows) per request whose prefill is whole (no cached prefix)."""
    out = []
    for rid, n, s, p in zip(view.rids, view.lens, view.starts, view.prefix_lens):
        if p:
            # A cache hit computed only the suffix: a dump of it would be silently short.
            log.error("eagleflow capture: request %s reused %d cached tokens; no dump written "
                      "(start sglang with --disable-radix-cache)", rid, p)
            continue
        out.append((rid, s, aux[s:s + n], last[s:s + n]))
    return out


def is_capture_rid(rid: str) -> bool:
    """Only our requests get dumps: sglang's own (health checks, warmup) would pile up in the dump dir."""
    return parse_request_id(rid) is not None or rid.startswith(SELFCHECK_PREFIX)


def write_request_dumps(settings: CaptureSettings, view: ExtendView, aux, last, input_ids=None) -> list[str]:
    """Write one dump per capture request of the prefill; returns the rids written."""
    aux = concat_aux(aux)
    written = []
    for rid, s, a, h in slice_requests(view, aux, last):
        if not is_capture_rid(rid):
            continue
        check_rid(rid)
        ids = input_ids[s:s + a.shape[0]] if input_ids is not None else _arange_like(a)
        write_dump(settings.dump_dir, rid, input_ids=ids.to(dtype=_int64()), aux_hidden_states=a,
                   hidden_states=h, aux_layers=settings.aux_layers, model=settings.model)
        written.append(rid)
    return written


def _int64():
    import torch
    return torch.int64


def _arange_like(a):
    import torch
    return torch.arange(a.shape[0])


def tp_rank(obj: Any = None) -> int:
    """The attention-TP rank of this scheduler (0 when not distributed)."""
    for attr in ("attn_tp_rank", "tp_rank"):
        v = getattr(obj, attr, None)
        if isinstance(v, int):
            return v
    try:
        from sglang.srt.layers.dp_attention import get_attention_tp_rank
        return int(get_attention_tp_rank())
    except Exception:
        pass
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    return 0


# --- hooks --------------------------------------------------------------------------------

_settings: CaptureSettings | None = None


def _s() -> CaptureSettings:
    global _settings
    if _settings is None:
        _settings = CaptureSettings.from_env()
    return _settings


def after_forward_batch_generation(result, worker, batch, *args, **kwargs):
    """native mode: AFTER TpModelWorker.forward_batch_generation."""
    if tp_rank(worker) != 0:
        return None
    view = extend_view(batch)
    if view is None:
        return None
    out = getattr(result, "logits_output", None)
    aux = getattr(out, "hidden_states", None)
    last = getattr(out, "last_hidden_states", None)
    if aux is None or last is None:
        raise CaptureHookError("prefill result has no hidden_states/last_hidden_states: the server was not "
                               "started with --enable-return-aux-hidden-states (use `eagleflow capture serve`)")
    write_request_dumps(_s(), view, aux, last, getattr(batch, "input_ids", None))
    return None


def after_load_model(result, runner, *args, **kwargs):
    """logits mode: turn on aux capture of the target model (not a draft runner)."""
    if getattr(runner, "is_draft_worker", False):
        return None
    model = getattr(runner, "model", None)
    fn = getattr(model, "set_eagle3_layers_to_capture", None)
    if fn is None:
        raise CaptureHookError(f"{type(model).__name__} has no set_eagle3_layers_to_capture: sglang cannot "
                               "capture its auxiliary hidden states; use backend hf or an EAGLE-3-capable model")
    fn(_s().aux_layers)
    return None


def before_logits_forward(processor, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                          *args, **kwargs):
    """logits mode: BEFORE LogitsProcessor.forward(input_ids, final states, lm_head, ForwardBatch, aux list)."""
    if aux_hidden_states is None or tp_rank() != 0:
        return None
    view = extend_view(logits_metadata)
    if view is not None:
        write_request_dumps(_s(), view, aux_hidden_states, hidden_states, input_ids)
    return None


HOOKS: dict[str, tuple[str, Callable]] = {
    NATIVE_TARGET: ("AFTER", after_forward_batch_generation),
    LOAD_MODEL_TARGET: ("AFTER", after_load_model),
    LOGITS_TARGET: ("BEFORE", before_logits_forward),
}


def install(registry, hook_type_enum, mode: str, hooks: dict[str, tuple[str, Callable]] | None = None) -> list[str]:
    """Register this mode's hooks, apply them now and check each target really is wrapped.

    Applying early is safe: sglang's ``apply_hooks`` skips targets already patched.
    """
    import pkgutil
    hooks = hooks or {t: HOOKS[t] for t in TARGETS[mode]}
    targets = list(hooks)
    originals = {}
    for t in targets:
        obj_path, attr = t.rsplit(".", 1)
        try:
            originals[t] = getattr(pkgutil.resolve_name(obj_path), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise CaptureHookError(f"cannot find {t} in this sglang ({e}); capture mode {mode!r} does not fit "
                                   "this version") from None
        kind, fn = hooks[t]
        registry.register(t, fn, getattr(hook_type_enum, kind))
    registry.apply_hooks()
    missing = []
    for t in targets:
        obj_path, attr = t.rsplit(".", 1)
        now = getattr(pkgutil.resolve_name(obj_path), attr)
        if now is originals[t] or t not in getattr(registry, "_patched", {t}):
            missing.append(t)
    if missing:
        raise CaptureHookError(f"sglang did not apply the eagleflow capture hook(s) to {', '.join(missing)}; "
                               "see the 'Failed to apply hooks' line above in this log")
    return targets


def register() -> None:
    """sglang's plugin entry point (runs in every scheduler process)."""
    try:
        settings = _s()
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        targets = install(HookRegistry, HookType, settings.mode)
        print(f"eagleflow capture: hooks installed in pid {os.getpid()} ({settings.mode} mode: "
              f"{', '.join(targets)}); dumps to {settings.dump_dir}", file=sys.stderr, flush=True)
    except CaptureHookError as e:
        # sglang catches Exception from plugins and only logs it: stop this process so the launch fails loudly.
        print(f"eagleflow capture: FATAL: {e}", file=sys.stderr, flush=True)
        raise SystemExit(f"eagleflow capture plugin: {e}") from None
