"""Our KV connector for vLLM's ``extract_hidden_states`` speculative method: one project dump per request.

vLLM 0.33.0 (requirements-node-vllm.txt), nothing of it patched. ``vllm serve`` started by
``engines.vllm.launcher`` with

- ``--speculative-config {"method": "extract_hidden_states", "num_speculative_tokens": 1,
  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": IDS}}}``: after every forward
  the proposer (``vllm/v1/spec_decode/extract_hidden_states.py``) stacks the target's captured layers
  [T, len(IDS), H] and ``ExtractHiddenStatesModel``'s one ``CacheOnlyAttentionLayer`` writes them into its
  own KV cache group (``HiddenStateCacheSpec``: per token ``num_heads = len(IDS)`` rows of ``head_size = H``),
  at the slots of the request's blocks in that group. IDS are vLLM's numbering (id ``c`` = the residual
  stream entering layer ``c``, see ``aux_layers``): our aux layers plus ``N`` (the last layer's output
  before the final norm), in ascending order, as vLLM appends them;
- ``--kv-transfer-config {"kv_connector": "EagleflowCaptureConnector",
  "kv_connector_module_path": "eagleflow.engines.vllm.connector", "kv_role": "kv_producer"}``: vLLM's
  connector factory imports this module and takes the class by name, once in the scheduler process
  (role SCHEDULER) and once per worker (role WORKER).

Scheduler side (``build_connector_meta``, every step): a request is ours when its ``kv_transfer_params``
carry ``eagleflow_rid`` (a capture request id, ``protocol.parse_request_id``, or the launcher's self-check).
Its blocks in the hidden-states group are followed across chunks and preemptions; in the step that
computes its last prompt token the metadata asks the workers for its dump. A request that starts with
prompt tokens already computed (a prefix-cache hit: this pass would not compute their states) is refused:
logged, no dump, never a short one. The launcher turns prefix caching off, so this is a guard.

Worker side (``wait_for_save``, called once per step after the target's and the proposer's forwards, before
the step's output reaches the scheduler, so before vLLM answers the request): TP rank 0 reads the request's
rows with vLLM's own ``extract_from_kv_cache``, splits them into the aux concat [T, k*H] and the last
layer's pre-norm output, applies the target's final RMSNorm (its ``model.norm.weight`` from the checkpoint,
vLLM's own ``ir.ops.rms_norm``; the trainer puts the target's lm_head on exactly these states) and writes
``protocol.write_dump``: the project's dump, 0600 in the private folder, with its MAC. The settings come
from the environment, as for the sglang plugin (``EAGLEFLOW_CAPTURE_DUMP_DIR``, ``_AUX_LAYERS``, ``_MODEL``,
``_DUMP_KEY``): a connector named on the command line without them stops vLLM at start, naming them.

Shape of this module: it imports in the plain control-plane venv (no vLLM there) because the launcher and
the engine registry name it; the connector and its metadata subclass vLLM's base classes, so they are
built on first access (PEP 562 ``__getattr__``: vLLM's factory does ``getattr(module, name)``) and bound
as module globals, so pickle (the scheduler sends the metadata to the workers) finds them by name.
Everything that does not need vLLM (settings, request ids, block tracking, slicing, the norm) is plain code.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagleflow.serving.dump_protocol import DumpTrustError, check_rid, dump_key_from_env, write_dump
from eagleflow.serving.capture_hook import CaptureHookError, CaptureSettings, is_capture_rid

log = logging.getLogger("eagleflow.engines.vllm.connector")

MODULE_PATH = __name__                       # what --kv-transfer-config's kv_connector_module_path names
CONNECTOR_CLASS = "EagleflowCaptureConnector"
METADATA_CLASS = "EagleflowCaptureMetadata"
KV_PARAM_RID = "eagleflow_rid"               # in a request's kv_transfer_params: the capture request id
KV_PARAM_DUMP = "eagleflow_dump"             # in the answer's kv_transfer_params: the dump written
KV_PARAM_REFUSED = "eagleflow_refused"       # in the answer's kv_transfer_params: why none was written
INSTALL_HINT = ("install requirements-node-vllm.txt in the node's vLLM venv (and eagleflow with "
                "`pip install --no-deps -e .`), or use capture.backend hf")


class VllmCaptureError(RuntimeError):
    """The connector cannot capture as configured; the message names the setting and what to do."""


def capture_settings(env: dict[str, str] | None = None) -> CaptureSettings:
    """The sglang plugin's settings (same variables, same checks), with a vLLM launch's remedy."""
    try:
        return CaptureSettings.from_env(env)
    except CaptureHookError as e:
        raise VllmCaptureError(f"eagleflow's vLLM capture connector: {e}. With vLLM, start the server through "
                               "`eagleflow capture serve` with capture.backend: vllm, which sets them") from None


def vllm_capture_ids(aux_vllm_ids: list[int], num_layers: int) -> list[int]:
    """``eagle_aux_hidden_state_layer_ids`` for capture: the aux ids plus ``num_layers`` (the last layer's
    pre-norm output, from which the connector computes the final hidden states), ascending and unique:
    the order vLLM's decoder loop appends them in."""
    return sorted(set(aux_vllm_ids) | {num_layers})


@dataclass(frozen=True)
class RowLayout:
    """Where, in the [k+1] captured rows of a token, each aux layer and the last layer's output are."""
    aux_rows: list[int]
    last_row: int
    width: int          # rows per token in the cache (len of vLLM's ids)

    @classmethod
    def of(cls, aux_layers: list[int], vllm_ids: list[int], num_layers: int) -> "RowLayout":
        ids = list(vllm_ids)
        want = vllm_capture_ids([j + 1 for j in aux_layers], num_layers)
        if ids != want:
            raise VllmCaptureError(
                f"vLLM captures layers {ids} (the speculative config's eagle_aux_hidden_state_layer_ids) but "
                f"EAGLEFLOW_CAPTURE_AUX_LAYERS={json.dumps(aux_layers)} of a {num_layers}-layer target needs "
                f"{want}; start vLLM through `eagleflow capture serve`, which sets both from one list")
        return cls(aux_rows=[ids.index(j + 1) for j in aux_layers], last_row=ids.index(num_layers), width=len(ids))


def request_rid(sampling_params: Any) -> str | None:
    """Our capture request id from a request's ``kv_transfer_params``; None for any other request (vLLM's
    own warm-up, health checks, a client's plain completion)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    params = extra.get("kv_transfer_params") or {}
    rid = params.get(KV_PARAM_RID) if isinstance(params, dict) else None
    if rid is None:
        return None
    try:
        check_rid(rid)   # it becomes a file name
    except ValueError as e:
        # any local user can send a request: a bad one is no capture request, and never stops the server
        log.warning("eagleflow capture: ignoring a request's %s: %s", KV_PARAM_RID, e)
        return None
    return rid if is_capture_rid(rid) else None


def slot_mapping(block_ids: list[int], block_size: int, num_tokens: int) -> list[int]:
    """The cache slots of a request's first ``num_tokens`` tokens (token i: block i // size, offset i % size)."""
    need = -(-num_tokens // block_size)
    if len(block_ids) < need:
        raise VllmCaptureError(f"{num_tokens} tokens need {need} blocks of {block_size} slots, the request has "
                               f"{len(block_ids)}")
    return [block_ids[i // block_size] * block_size + i % block_size for i in range(num_tokens)]


def split_rows(rows, layout: RowLayout):
    """[T, k+1, H] captured rows -> (aux concat [T, k*H] in the configured order, last layer pre-norm [T, H])."""
    t, width, h = rows.shape
    if width != layout.width:
        raise VllmCaptureError(f"captured rows have {width} layers per token, the layout {layout.width}")
    aux = rows[:, layout.aux_rows, :].reshape(t, len(layout.aux_rows) * h)
    return aux.contiguous(), rows[:, layout.last_row, :].contiguous()


_NORM_NAMES = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")


def final_norm_weight(model_path: str | os.PathLike[str]):
    """The target's final RMSNorm weight, read from its safetensors checkpoint (one tensor)."""
    from safetensors import safe_open
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {n: root / f for n, f in weight_map.items()}
    else:
        files = {}
        for f in sorted(root.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                files.update({n: f for n in sf.keys()})
    names = [n for n in _NORM_NAMES if n in files]
    if len(names) != 1:
        raise VllmCaptureError(f"target {root}: found {names or 'none'} of the final-norm weights "
                               f"{', '.join(_NORM_NAMES)} in its safetensors files; the vLLM capture needs exactly "
                               "one to compute the final hidden states. Use capture.backend sglang or hf for it")
    with safe_open(str(files[names[0]]), framework="pt") as sf:
        return sf.get_tensor(names[0])


@dataclass
class PendingDump:
    """Scheduler -> worker: write this request's dump after this step (its last prompt token is in it)."""
    req_id: str
    rid: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class _Tracked:
    rid: str
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)


class CaptureScheduler:
    """The scheduler side's bookkeeping, free of vLLM: which requests are ours, their blocks in the
    hidden-states group, and when each prompt is whole in the cache."""

    def __init__(self, group: int):
        self.group = group
        self.tracked: dict[str, _Tracked] = {}
        self.answers: dict[str, dict[str, str]] = {}   # req_id -> the answer's kv_transfer_params

    def _refuse(self, req_id: str, rid: str, cached: int) -> None:
        # This pass computes only the uncached suffix: a dump of it would be silently short.
        log.error("eagleflow capture: request %s (vLLM %s) starts with %d prompt tokens already computed (prefix "
                  "cache); no dump written. Start vLLM with --no-enable-prefix-caching (`eagleflow capture "
                  "serve` does)", rid, req_id, cached)
        self.tracked.pop(req_id, None)
        self.answers[req_id] = {KV_PARAM_REFUSED: f"{cached} cached prompt tokens: a dump would be short"}

    def _maybe_done(self, out: list[PendingDump], req_id: str, computed_after: int) -> None:
        t = self.tracked[req_id]
        if computed_after >= len(t.token_ids):
            out.append(PendingDump(req_id=req_id, rid=t.rid, token_ids=t.token_ids, block_ids=list(t.block_ids)))
            del self.tracked[req_id]
            self.answers[req_id] = {KV_PARAM_DUMP: t.rid}

    def step(self, scheduler_output: Any) -> list[PendingDump]:
        out: list[PendingDump] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            rid = request_rid(new.sampling_params)
            if rid is None:
                continue
            if new.prompt_token_ids is None:
                log.error("eagleflow capture: request %s came without prompt token ids; no dump written", rid)
                self.answers[new.req_id] = {KV_PARAM_REFUSED: "no prompt token ids"}
                continue
            self.tracked[new.req_id] = _Tracked(rid, list(new.prompt_token_ids), list(new.block_ids[self.group]))
            if new.num_computed_tokens:
                self._refuse(new.req_id, rid, new.num_computed_tokens)
                continue
            self._maybe_done(out, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self.tracked.get(req_id)
            if t is None:
                continue
            blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:    # preempted: its blocks are replaced, not extended
                if cached.num_computed_tokens[i]:
                    self._refuse(req_id, t.rid, cached.num_computed_tokens[i])
                    continue
                t.block_ids = list(blocks[self.group]) if blocks is not None else []
            elif blocks is not None:
                t.block_ids.extend(blocks[self.group])
            self._maybe_done(out, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return out

    def finished(self, req_id: str) -> dict[str, str] | None:
        self.tracked.pop(req_id, None)
        return self.answers.pop(req_id, None)


def hidden_state_group(kv_cache_config: Any) -> int:
    """The KV cache group holding the captured states (vLLM's reference connector's own lookup)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector)
    return ExampleHiddenStatesConnector._find_cache_kv_group_id(kv_cache_config)


def _build() -> dict[str, type]:
    """The vLLM classes (only where vLLM is installed)."""
    try:
        import torch
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA)
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            extract_from_kv_cache)
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    except ImportError as e:
        raise ImportError(f"eagleflow.engines.vllm.connector.{CONNECTOR_CLASS} needs vLLM ({e}); "
                          f"{INSTALL_HINT}") from None

    @dataclass
    class EagleflowCaptureMetadata(KVConnectorMetadata):
        dumps: list[PendingDump] = field(default_factory=list)

    class EagleflowCaptureConnector(KVConnectorBase_V1, SupportsHMA):
        """Writes one project dump per capture request (see the module's docstring)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            spec = vllm_config.speculative_config
            if spec is None or spec.method != "extract_hidden_states":
                raise VllmCaptureError(f"{CONNECTOR_CLASS} captures what vLLM's extract_hidden_states speculative "
                                       f"method caches; this server's method is "
                                       f"{getattr(spec, 'method', None)!r}. Start it through `eagleflow capture "
                                       "serve` (capture.backend: vllm)")
            self.settings = capture_settings()
            self.key = dump_key_from_env()
            if self.key is None:
                raise VllmCaptureError("eagleflow's vLLM capture connector: EAGLEFLOW_CAPTURE_DUMP_KEY is not set, "
                                       "so no dump would carry a MAC and the worker would refuse them all; start "
                                       "the server through `eagleflow capture serve`, which sets it")
            mc = vllm_config.model_config
            self.layout = RowLayout.of(self.settings.aux_layers,
                                       list(spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids),
                                       mc.get_total_num_hidden_layers())
            eps = getattr(mc.hf_text_config, "rms_norm_eps", None)
            if eps is None:
                raise VllmCaptureError(f"target {mc.model}: its config has no rms_norm_eps, so the connector cannot "
                                       "apply its final RMSNorm; use capture.backend sglang or hf for it")
            self.eps = float(eps)
            self.model_path = str(mc.model)
            self.group = hidden_state_group(kv_cache_config)
            self.sched = CaptureScheduler(self.group)
            self.kv_cache: torch.Tensor | None = None
            self.norm_weight: torch.Tensor | None = None
            self.rank0 = True

        # --- scheduler side ---
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False          # store-only: nothing is ever loaded from outside

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            return EagleflowCaptureMetadata(dumps=self.sched.step(scheduler_output))

        def request_finished(self, request, block_ids):
            # the dump was written in the step that computed the prompt: nothing to wait for, free the blocks
            return False, self.sched.finished(request.request_id)

        def request_finished_all_groups(self, request, block_ids):
            return self.request_finished(request, block_ids[self.group] if self.group < len(block_ids) else [])

        # --- worker side ---
        def register_kv_caches(self, kv_caches):
            from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
            self.rank0 = get_tensor_model_parallel_rank() == 0
            layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer,
                                                      list(kv_caches)))
            if len(layers) != 1:
                raise VllmCaptureError(f"expected one CacheOnlyAttentionLayer (extract_hidden_states), found "
                                       f"{layers}")
            self.kv_cache = kv_caches[layers[0]]   # [blocks, k+1 layers, block size, H]
            if self.kv_cache.dim() != 4 or self.kv_cache.shape[1] != self.layout.width:
                raise VllmCaptureError(f"the hidden-states cache {layers[0]} has shape {tuple(self.kv_cache.shape)}, "
                                       f"not [blocks, {self.layout.width} layers, block size, hidden size]")
            if self.rank0:
                self.norm_weight = final_norm_weight(self.model_path).to(self.kv_cache.device)

        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass                     # the proposer has cached the states; they are read in wait_for_save

        def wait_for_save(self):
            if not self.rank0 or not self.has_connector_metadata():
                return
            meta = self._get_connector_metadata()
            for d in getattr(meta, "dumps", ()):
                try:
                    self.write(d)
                except (OSError, DumpTrustError) as e:
                    # no dump: the worker fails this sample by name; the server goes on serving the others
                    log.error("eagleflow capture: request %s: no dump written: %s", d.rid, e)

        def write(self, d: PendingDump) -> Path:
            """One request's dump from the hidden-states cache (called after the step's forwards)."""
            from vllm import ir
            assert self.kv_cache is not None and self.norm_weight is not None
            n = len(d.token_ids)
            slots = torch.tensor(slot_mapping(d.block_ids, self.kv_cache.shape[2], n), dtype=torch.long,
                                 device=self.kv_cache.device)
            rows = extract_from_kv_cache(self.kv_cache, slots, n)
            aux, last = split_rows(rows, self.layout)
            hidden = ir.ops.rms_norm(last, self.norm_weight.to(last.dtype), self.eps, None)
            path = write_dump(self.settings.dump_dir, d.rid, input_ids=torch.tensor(d.token_ids, dtype=torch.int64),
                              aux_hidden_states=aux, hidden_states=hidden, aux_layers=self.settings.aux_layers,
                              model=self.settings.model, key=self.key)
            log.info("eagleflow capture: request %s: %d tokens dumped to %s", d.rid, n, path)
            return path

        def get_finished_count(self):
            return 1                 # only TP rank 0 writes

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config):
            # as vLLM's reference hidden-states connector: a token's captured layers stay together, so the
            # cache views are [blocks, layers, block size, H], what extract_from_kv_cache indexes
            return "LBNHC"

    out: dict[str, type] = {}
    for cls in (EagleflowCaptureMetadata, EagleflowCaptureConnector):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__   # pickled by name: module.Class
        out[cls.__name__] = cls
    return out


def __getattr__(name: str) -> Any:
    if name in (CONNECTOR_CLASS, METADATA_CLASS):
        classes = _build()
        globals().update(classes)
        return classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

