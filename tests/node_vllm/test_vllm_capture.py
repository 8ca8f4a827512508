"""vLLM capture (`capture.backend: vllm`) through vLLM 0.33.0's own classes, on the CPU.

- the launcher's argv goes through vLLM's own ``serve`` parser and ``create_engine_config``: the VllmConfig
  has the extract_hidden_states SpeculativeConfig with our capture ids (as vLLM's GPU model runner reads
  them), the KVTransferConfig naming our connector by module path, prefix caching off, loopback, TP, dtype;
- vLLM's own connector factory imports our module from ``kv_connector_module_path`` and builds the
  connector for both roles (scheduler, worker) from that VllmConfig and a real KVCacheConfig whose second
  group is vLLM's HiddenStateCacheSpec;
- the save path runs the way vLLM runs it: the scheduler side gets real SchedulerOutput /
  NewRequestData / CachedRequestData built from real Requests and SamplingParams (our rid in
  ``kv_transfer_params``); the hidden states are put into the cache by vLLM's own ExtractHiddenStatesModel
  (its CacheOnlyAttentionLayer's cache update, in a vLLM forward context); the worker side's
  ``wait_for_save`` writes the dump; the project's worker-side reader (``read_dump`` + ``verify_dump`` with
  the MAC) accepts it, and it equals what the hf capture server writes for the same ids (aux layers and the
  final, post-norm hidden states the trainer puts the lm_head on);
- a request whose prompt starts cached (prefix cache) is refused: no dump, logged, the answer says why.

Not constructible on a CPU: vLLM's engine core and GPU model runner (CUDA), so the scheduler's and the
runner's loops are not run; the states a Llama forward hands the proposer come from transformers' forward of
the same checkpoint (the layer numbering is proven against vLLM's own Llama in test_export_speculators.py).
"""
from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

import pytest
import torch

from eagleflow.engines.vllm import connector as vc_mod
from eagleflow.serving.dump_protocol import (ENV_DUMP_KEY, DumpTrustError, dump_path, load_dump_key, read_dump,
                                        request_id, verify_dump)
from eagleflow.engines.sglang.plugin import ENV_AUX_LAYERS, ENV_DUMP_DIR, ENV_MODEL
from eagleflow.engines.vllm.launcher import SUPPORTED_VERSIONS, build_command, capture_env
from eagleflow.config import load_config
from tests.fixtures.train_hidden_states import NOT_DEFAULT_AUX_LAYERS

pytestmark = pytest.mark.timeout(600)

# layer outputs of the 8-layer demo Llama: vLLM ids 3, 6, 7, plus 8 (final norm); vLLM's default is (2, 4, 5)
AUX = NOT_DEFAULT_AUX_LAYERS
BLOCK = 16               # slots per block in the hidden-states cache
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory, demo_assets):
    """The launcher's argv, parsed and built by vLLM; the connector's environment set as the launcher sets it."""
    import vllm.entrypoints.cli.serve as serve
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    tmp = tmp_path_factory.mktemp("vllm-capture")
    target = demo_assets["target_model"]
    cfg = load_config(data={"run_root": str(tmp / "runs"), "target_model": target,
                            "server": {"tp": 1, "dtype": "float32"}, "capture": {"aux_layers": AUX}})
    from eagleflow.engines.vllm.layers import vllm_aux_layer_ids
    ids = vc_mod.vllm_capture_ids(vllm_aux_layer_ids(AUX, ["LlamaForCausalLM"], 8), 8)
    argv = build_command(cfg, model_path=target, host="127.0.0.1", port=18123, capture_ids=ids)
    assert argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="subparser")
    cmd = serve.ServeSubcommand()
    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(shlex.split(shlex.join(argv[3:])))   # through a shell's quoting, as it runs
    cmd.validate(args)
    args.model = args.model_tag
    dumps = tmp / "dumps"
    key = load_dump_key(tmp / "state" / "dump.key", create=True)
    mp = pytest.MonkeyPatch()
    for k, v in capture_env(dump_dir=str(dumps), aux_layers=AUX, model=target).items():
        mp.setenv(k, v)
    mp.setenv(ENV_DUMP_KEY, key.hex())
    vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    yield {"cfg": cfg, "target": target, "args": args, "vc": vllm_config, "ids": ids, "dumps": dumps, "key": key,
           "tmp": tmp}
    mp.undo()


def test_the_pinned_vllm_is_the_one_the_launcher_supports():
    from importlib.metadata import version
    pin = [ln.split("==")[1].strip() for ln in (REPO / "requirements-node-vllm.txt").read_text().splitlines()
           if ln.startswith("vllm==")]
    assert pin == [version("vllm")] and SUPPORTED_VERSIONS == (pin[0],)


def test_vllm_parses_the_launch_argv_into_the_capture_config(world):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    vc, args = world["vc"], world["args"]
    assert (args.host, args.port) == ("127.0.0.1", 18123)
    assert vc.model_config.model == world["target"] and vc.model_config.dtype == torch.float32
    assert vc.parallel_config.tensor_parallel_size == 1
    assert vc.cache_config.enable_prefix_caching is False
    spec = vc.speculative_config
    assert spec.method == "extract_hidden_states" and spec.num_speculative_tokens == 1
    assert type(spec.draft_model_config.hf_config).__name__ == "ExtractHiddenStatesConfig"
    assert world["ids"] == [3, 6, 7, 8]   # AUX + 1, then N: none is vLLM's default (2, 4, 5)
    assert list(spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids) == world["ids"]
    runner = GPUModelRunner.__new__(GPUModelRunner)          # what the runner hands set_aux_hidden_state_layers
    runner.speculative_config = spec
    assert runner._get_eagle3_aux_layers_from_config() == tuple(world["ids"])
    kv = vc.kv_transfer_config
    assert (kv.kv_connector, kv.kv_connector_module_path, kv.kv_role) == (
        "EagleflowCaptureConnector", "eagleflow.engines.vllm.connector", "kv_producer")


def test_vllm_s_factory_loads_our_connector_from_the_module_path(world):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
    cls = KVConnectorFactory.get_connector_class(world["vc"].kv_transfer_config)
    assert cls is vc_mod.EagleflowCaptureConnector
    assert issubclass(cls, KVConnectorBase_V1) and issubclass(cls, SupportsHMA)
    assert KVConnectorFactory.supports_hma_config(world["vc"].kv_transfer_config)
    # pickled by name: the scheduler sends the metadata to the workers
    import pickle
    meta = vc_mod.EagleflowCaptureMetadata(dumps=[vc_mod.PendingDump("r-1", "x.s00000.00000000", [1, 2], [3])])
    assert pickle.loads(pickle.dumps(meta)) == meta


@pytest.fixture(scope="module")
def engine(world):
    """Our connector built by vLLM's factory for both roles, vLLM's ExtractHiddenStatesModel with its cache."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.model_executor.models.extract_hidden_states import ExtractHiddenStatesModel
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    vc = world["vc"]
    with set_current_vllm_config(vc):
        model = ExtractHiddenStatesModel(vllm_config=vc, prefix="drafter")
    (layer_name, layer), = [(n, m) for n, m in vc.compilation_config.static_forward_context.items()
                            if n.startswith("drafter.")]
    hs_spec = layer.get_kv_cache_spec(vc)
    assert type(hs_spec).__name__ == "HiddenStateCacheSpec"
    target_spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    # the hidden states in the SECOND group: the connector must find it (block ids differ per group)
    kv_cfg = KVCacheConfig(num_blocks=12, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], target_spec),
                                            KVCacheGroupSpec([layer_name], hs_spec)])
    cache = torch.full((12, len(world["ids"]), BLOCK, 64), float("nan"))   # [blocks, layers, block size, H]
    layer.kv_cache = cache
    sched = KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kv_cfg)
    worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kv_cfg)
    assert type(sched) is vc_mod.EagleflowCaptureConnector and sched.group == 1
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # noqa: F401
    return {"model": model, "layer": layer, "layer_name": layer_name, "cache": cache, "sched": sched,
            "worker": worker, "kv_cfg": kv_cfg}


@pytest.fixture(scope="module")
def registered(engine, vllm_world):
    engine["worker"].register_kv_caches({engine["layer_name"]: engine["cache"]})
    return engine


def _hf_reference(target: str, ids: list[int]):
    """The hf capture server's own forward (its dump's tensors), and the last layer's output before the final
    norm (what vLLM captures as id N), from transformers on the same checkpoint."""
    from eagleflow.engines.hf.server import CaptureModel
    m = CaptureModel(target, dtype="float32", aux_layers=AUX)
    pre = {}
    h = m.model.model.norm.register_forward_pre_hook(lambda _mod, a: pre.__setitem__("x", a[0][0].clone()))
    try:
        _ids, aux, last, _next = m.forward(ids)
        out = m.model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        h.remove()
    # vLLM id c < N: the residual stream entering layer c (transformers' hidden_states[c]); id N: pre-norm
    by_id = {c: out.hidden_states[c][0] for c in range(8)} | {8: pre["x"]}
    return aux, last, by_id


def _cache_prompt(engine, world, by_id, slots: list[int], rows: slice) -> None:
    """Run vLLM's ExtractHiddenStatesModel as its proposer does: the stacked layers of the scheduled tokens,
    written at their slots by its CacheOnlyAttentionLayer, in a vLLM forward context."""
    from vllm.forward_context import set_forward_context
    stacked = torch.stack([by_id[c][rows] for c in world["ids"]], dim=1)   # [T, k+1, H]
    with set_forward_context(None, world["vc"], slot_mapping={engine["layer_name"]: torch.tensor(slots)}):
        engine["model"](hidden_states=stacked)


def _request(req_id: str, ids: list[int], rid: str | None, max_tokens: int = 1):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    extra = {"kv_transfer_params": {vc_mod.KV_PARAM_RID: rid}} if rid else None
    return Request(req_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra), None)


def _sched_out(new=(), cached=None, scheduled=None):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    scheduled = scheduled or {}
    return SchedulerOutput(scheduled_new_reqs=list(new),
                           scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
                           num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           num_common_prefix_blocks=[0, 0], finished_req_ids=set(), free_encoder_mm_hashes=[])


def _step(engine, out):
    """One engine step as vLLM runs it: the scheduler builds the metadata, the worker binds it and, after the
    forwards, runs wait_for_save; then clears it."""
    meta = engine["sched"].build_connector_meta(out)
    w = engine["worker"]
    w.bind_connector_metadata(meta)
    try:
        w.wait_for_save()
    finally:
        w.clear_connector_metadata()
    return meta


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 825, (n,), generator=g).tolist()


def test_a_capture_request_leaves_a_dump_the_worker_accepts_equal_to_the_hf_server_s(world, registered):
    from vllm.v1.core.sched.output import NewRequestData
    e = registered
    ids = _ids(21, 1)
    rid = request_id("runA", 3, 7)
    req = _request("cmpl-abc-0-1234abcd", ids, rid)
    blocks = ([0, 1], [5, 2])                    # group 0: the target's blocks; group 1: the hidden states
    slots = [blocks[1][i // BLOCK] * BLOCK + i % BLOCK for i in range(len(ids))]
    aux_ref, last_ref, by_id = _hf_reference(world["target"], ids)
    _cache_prompt(e, world, by_id, slots, slice(None))
    meta = _step(e, _sched_out([NewRequestData.from_request(req, blocks)], scheduled={req.request_id: len(ids)}))
    assert [d.rid for d in meta.dumps] == [rid]
    p = dump_path(world["dumps"], rid)
    dump = read_dump(p)
    verify_dump(dump, world["key"], p, rid)      # the worker's own check: MAC under the key, the rid
    assert dump.input_ids.tolist() == ids and dump.aux_layers == AUX and dump.model == world["target"]
    aux, hidden = dump.aux_hidden_states.to_torch(), dump.hidden_states.to_torch()
    assert aux.shape == (21, 3 * 64) and hidden.shape == (21, 64) and aux.dtype == hidden.dtype == torch.float32
    assert (aux - aux_ref).abs().max() < 1e-5
    assert (hidden - last_ref).abs().max() < 1e-5, "the final hidden states are not the target's post-norm ones"
    assert (hidden - by_id[8]).abs().max() > 1e-2     # and the norm was really applied
    assert (p.stat().st_mode & 0o777) == 0o600
    answer = e["sched"].request_finished_all_groups(req, ([0, 1], [5, 2]))
    assert answer == (False, {vc_mod.KV_PARAM_DUMP: rid})
    with pytest.raises(DumpTrustError):          # a wrong key: the worker refuses it
        verify_dump(dump, bytes(32), p, rid)
    p.unlink()


def test_a_prompt_chunked_over_two_steps_is_dumped_whole_once_its_last_token_is_cached(world, registered):
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
    e = registered
    ids = _ids(40, 2)
    rid = request_id("runA", 3, 8)
    req = _request("cmpl-chunk-0-00000001", ids, rid)
    first = ([3], [7])                           # first chunk: 16 tokens, one block per group
    _aux_ref, last_ref, by_id = _hf_reference(world["target"], ids)
    _cache_prompt(e, world, by_id, [7 * BLOCK + i for i in range(16)], slice(0, 16))
    meta = _step(e, _sched_out([NewRequestData.from_request(req, first)], scheduled={req.request_id: 16}))
    assert meta.dumps == [] and not dump_path(world["dumps"], rid).exists()
    # second chunk: 24 tokens in two more blocks of the hidden-states group
    later = [9, 4]
    _cache_prompt(e, world, by_id, [later[(i - 16) // BLOCK] * BLOCK + (i - 16) % BLOCK for i in range(16, 40)],
                  slice(16, 40))
    cached = CachedRequestData(req_ids=[req.request_id], resumed_req_ids=set(), new_token_ids=[[]],
                               all_token_ids={}, new_block_ids=[([10, 11], later)], num_computed_tokens=[16],
                               num_output_tokens=[0])
    meta = _step(e, _sched_out(cached=cached, scheduled={req.request_id: 24}))
    assert [d.block_ids for d in meta.dumps] == [[7, 9, 4]]
    p = dump_path(world["dumps"], rid)
    dump = read_dump(p)
    verify_dump(dump, world["key"], p, rid)
    assert dump.input_ids.tolist() == ids
    assert (dump.hidden_states.to_torch() - last_ref).abs().max() < 1e-5
    p.unlink()


def test_a_request_with_a_cached_prefix_is_refused_never_dumped_short(world, registered, caplog):
    from vllm.v1.core.sched.output import NewRequestData
    e = registered
    ids = _ids(24, 3)
    rid = request_id("runA", 3, 9)
    req = _request("cmpl-cached-0-00000002", ids, rid)
    new = NewRequestData.from_request(req, ([6, 8], [10, 11]))
    new.num_computed_tokens = 16                 # the prefix cache served the first block
    with caplog.at_level(logging.ERROR, logger="eagleflow.engines.vllm.connector"):
        meta = _step(e, _sched_out([new], scheduled={req.request_id: 8}))
    assert meta.dumps == [] and not dump_path(world["dumps"], rid).exists()
    assert any(rid in r.getMessage() and "16 prompt tokens" in r.getMessage() for r in caplog.records)
    keep, params = e["sched"].request_finished_all_groups(req, ([6, 8], [10, 11]))
    assert keep is False and vc_mod.KV_PARAM_REFUSED in params


def test_requests_that_are_not_capture_requests_leave_no_dump(world, registered):
    from vllm.v1.core.sched.output import NewRequestData
    e = registered
    before = set(Path(world["dumps"]).iterdir())
    plain = _request("cmpl-plain-0-1", _ids(10, 4), None)
    foreign = _request("cmpl-foreign-0-2", _ids(10, 5), "not-a-capture-rid")
    meta = _step(e, _sched_out([NewRequestData.from_request(plain, ([0], [1])),
                                NewRequestData.from_request(foreign, ([2], [3]))],
                               scheduled={plain.request_id: 10, foreign.request_id: 10}))
    assert meta.dumps == [] and set(Path(world["dumps"]).iterdir()) == before
    assert e["sched"].request_finished(plain, [1]) == (False, None)
    # a rid that could escape the dump folder is no capture request (and never stops the server)
    evil = _request("cmpl-evil-0-3", _ids(10, 7), "../evil")
    meta = _step(e, _sched_out([NewRequestData.from_request(evil, ([4], [5]))], scheduled={evil.request_id: 10}))
    assert meta.dumps == [] and set(Path(world["dumps"]).iterdir()) == before
    assert not (Path(world["dumps"]).parent / "evil.safetensors").exists()


def test_the_connector_refuses_to_start_without_its_settings(world, engine, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    monkeypatch.delenv(ENV_AUX_LAYERS)
    with pytest.raises(vc_mod.VllmCaptureError, match=ENV_AUX_LAYERS):
        KVConnectorFactory.create_connector(world["vc"], KVConnectorRole.SCHEDULER, engine["kv_cfg"])
    monkeypatch.setenv(ENV_AUX_LAYERS, json.dumps([0, 3, 5]))   # not the layers vLLM was told to capture
    with pytest.raises(vc_mod.VllmCaptureError, match=r"\[1, 4, 6, 8\]"):
        KVConnectorFactory.create_connector(world["vc"], KVConnectorRole.WORKER, engine["kv_cfg"])
    monkeypatch.setenv(ENV_AUX_LAYERS, json.dumps(AUX))
    monkeypatch.delenv(ENV_DUMP_KEY)
    with pytest.raises(vc_mod.VllmCaptureError, match=ENV_DUMP_KEY):
        KVConnectorFactory.create_connector(world["vc"], KVConnectorRole.WORKER, engine["kv_cfg"])
    assert {ENV_DUMP_DIR, ENV_MODEL} <= set(capture_env(dump_dir="d", aux_layers=AUX, model="m"))


def test_the_capture_api_reaches_vllm_s_completions_with_the_rid_our_connector_reads(world):
    """The worker's own client (``client.generate`` / ``health_generate`` / ``server_info``) over HTTP against
    a FastAPI app with the launcher's ``--middleware`` applied by vLLM's own ``init_entrypoints_middleware``.
    Behind it, ``/v1/completions`` is a stand-in for vLLM's engine (not constructible on a CPU) that parses
    the body with vLLM's own ``CompletionRequest`` and answers a vLLM ``CompletionResponse``; the sampling
    params it builds are what vLLM hands the scheduler, and our connector reads the rid from them."""
    import socket
    import threading
    import time

    import uvicorn
    from fastapi import Body, FastAPI
    from vllm.entrypoints.openai.completion.protocol import (CompletionRequest, CompletionResponse,
                                                             CompletionResponseChoice)
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    from eagleflow.serving.client import generate, health_generate, server_info
    seen: list[tuple[CompletionRequest, str | None]] = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict = Body(...)):   # noqa: B008  (FastAPI's way to take the raw JSON)
        req = CompletionRequest.model_validate(body)
        sp = req.to_sampling_params(max_tokens=req.max_tokens)
        seen.append((req, vc_mod.request_rid(sp)))
        return CompletionResponse(model=req.model or "m", usage=UsageInfo(prompt_tokens=len(req.prompt)),
                                  choices=[CompletionResponseChoice(index=0, text="x", finish_reason="length",
                                                                    token_ids=[42])]).model_dump()

    init_entrypoints_middleware(world["args"], app, ("generate",))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        rid = request_id("runB", 0, 1)
        ids = _ids(12, 6)
        out = generate(url, ids, rid, 30)
        assert out["output_ids"] == [42] and out["meta_info"]["finish_reason"] == {"type": "length"}
        req, got_rid = seen[-1]
        assert got_rid == rid and req.prompt == ids and req.max_tokens == 1 and req.temperature == 0.0
        assert req.model == world["target"]          # vLLM's served name: the model path the launcher gives
        health_generate(url, 30)
        req, got_rid = seen[-1]
        assert got_rid is None and req.max_tokens == 1   # a real generation, but no dump
        info = server_info(url)
        assert info["backend"] == "vllm" and info["aux_layers"] == AUX and info["model"] == world["target"]
        assert len(seen) == 2                         # /get_server_info never reached the engine
    finally:
        server.should_exit = True
        t.join(timeout=30)


def test_a_dump_that_cannot_be_written_is_logged_and_the_server_goes_on(world, registered, caplog, tmp_path):
    import dataclasses

    from vllm.v1.core.sched.output import NewRequestData
    e = registered
    w = e["worker"]
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    keep = w.settings
    w.settings = dataclasses.replace(keep, dump_dir=str(blocker / "dumps"))   # its parent is a file
    try:
        rid = request_id("runA", 3, 10)
        req = _request("cmpl-full-0-00000004", _ids(10, 8), rid)
        with caplog.at_level(logging.ERROR, logger="eagleflow.engines.vllm.connector"):
            meta = _step(e, _sched_out([NewRequestData.from_request(req, ([0], [1]))],
                                       scheduled={req.request_id: 10}))
        assert [d.rid for d in meta.dumps] == [rid]
        assert any(rid in r.getMessage() and "no dump written" in r.getMessage() for r in caplog.records)
    finally:
        w.settings = keep
    e["sched"].request_finished(req, [1])
