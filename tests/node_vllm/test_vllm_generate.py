"""vLLM generation (`generate.backend: vllm`, issue 40 item 3) through vLLM 0.33.0's own classes, on the CPU.

- the generation launcher's argv goes through vLLM's own ``serve`` parser and ``create_engine_config``: the
  VllmConfig serves the target (no speculative method, no KV connector, prefix caching on), with the TP,
  dtype and seed of the config, loopback, our ``--middleware``; server.extra_server_args reach vLLM only
  when they are vLLM's (capture.backend vllm), never sglang's flags;
- the generation worker's own client (``client.generate_tokens``, the call ``phases/generate/worker.py`` makes) talks
  over HTTP to a FastAPI app with that ``--middleware`` applied by vLLM's own ``init_entrypoints_middleware``.
  Behind it ``/v1/completions`` is a stand-in for vLLM's engine (not constructible on a CPU) that validates
  our body with vLLM's own ``CompletionRequest``, builds the ``SamplingParams`` vLLM's serving builds
  (``to_sampling_params`` with server defaults as a model's generation_config.json would set them), and
  answers with vLLM's own ``CompletionResponse``: the client returns exactly the answer's token ids (never
  its text) and its finish reason, refuses an abort, and refuses an answer without token ids.

Not constructible on a CPU: vLLM's engine core and GPU model runner (CUDA), so no token is sampled here; that
the sampled ids and the finish reason are what vLLM's serving puts into ``token_ids`` / ``finish_reason``
is read from its source (``completion/serving.py``: ``as_list(output.token_ids)``; ``check_stop`` keeps the
stop token in the output).
"""
from __future__ import annotations

import shlex
import socket
import threading
import time

import pytest
import torch

from eagleflow.serving.client import CaptureServerError, generate_tokens, health_generate, server_info
from eagleflow.engines.sglang.plugin import ENV_MODEL
from eagleflow.engines.vllm.api import GENERATE_MIDDLEWARE
from eagleflow.config import load_config
from eagleflow.engines import generation_engine
from eagleflow.engines.vllm.generate_server import build_command

pytestmark = pytest.mark.timeout(600)

# what a model's generation_config.json makes vLLM's server defaults (vllm serve --generation-config auto)
MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.3,
                  "presence_penalty": 0.5, "frequency_penalty": 0.5}


def _parse(argv: list[str]):
    """``argv`` as ``vllm serve`` parses it, and the VllmConfig vLLM's engine is built from."""
    import vllm.entrypoints.cli.serve as serve
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    assert argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="subparser")
    cmd = serve.ServeSubcommand()
    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(shlex.split(shlex.join(argv[3:])))   # through a shell's quoting, as it runs
    cmd.validate(args)
    args.model = args.model_tag
    return args, AsyncEngineArgs.from_cli_args(args).create_engine_config()


def _cfg(tmp_path, target: str, backend: str = "hf", **server):
    return load_config(data={"run_root": str(tmp_path / "runs"), "target_model": target, "node": {"has_gpu": True},
                             "server": {"tp": 1, "dtype": "float32", **server}, "capture": {"backend": backend},
                             "generate": {"backend": "vllm", "seed": 7}})


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_assets):
    tmp = tmp_path_factory.mktemp("vllm-generate")
    target = demo_assets["target_model"]
    cfg = _cfg(tmp, target)
    assert generation_engine(cfg).name == "vllm"
    args, vc = _parse(build_command(cfg, model_path=target, host="127.0.0.1", port=18124))
    return {"cfg": cfg, "target": target, "args": args, "vc": vc, "tmp": tmp}


def test_vllm_parses_the_generate_argv_into_a_serving_config(served):
    args, vc = served["args"], served["vc"]
    assert (args.host, args.port) == ("127.0.0.1", 18124)
    assert vc.model_config.model == served["target"] and vc.model_config.dtype == torch.float32
    assert vc.model_config.seed == 7 and vc.parallel_config.tensor_parallel_size == 1
    assert vc.speculative_config is None and vc.kv_transfer_config is None     # the target serving, no capture
    assert vc.cache_config.enable_prefix_caching is True                        # a shared prefix computed once
    assert args.middleware == [GENERATE_MIDDLEWARE]
    assert not vc.model_config.skip_tokenizer_init      # vLLM knows the target's eos, as sglang does


def test_extra_server_args_reach_vllm_only_when_they_are_vllm_s(served, tmp_path):
    target = served["target"]
    cfg = _cfg(tmp_path, target, backend="vllm", extra_server_args=["--max-model-len", "96"])
    _, vc = _parse(build_command(cfg, model_path=target, host="127.0.0.1", port=18125))
    assert vc.model_config.max_model_len == 96
    # capture on sglang: its flags are sglang's, vLLM's parser would refuse them; the serving config is unchanged
    cfg = _cfg(tmp_path, target, backend="sglang", extra_server_args=["--mem-fraction-static", "0.8"])
    argv = build_command(cfg, model_path=target, host="127.0.0.1", port=18125)
    assert "--mem-fraction-static" not in argv
    _, vc = _parse(argv)
    assert vc.model_config.max_model_len == served["vc"].model_config.max_model_len


@pytest.fixture()
def api(served, monkeypatch):
    """The middleware on an app as vLLM builds it; behind it a stand-in engine answering with vLLM's classes.
    ``answer`` sets what the next completion answers: (token_ids, finish_reason, text)."""
    import uvicorn
    from fastapi import Body, FastAPI
    from vllm.entrypoints.openai.completion.protocol import (CompletionRequest, CompletionResponse,
                                                             CompletionResponseChoice)
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    monkeypatch.setenv(ENV_MODEL, served["target"])   # what the launcher sets before it execs vllm serve
    state = {"seen": [], "answer": ([5], "length", "x"), "omit": False}
    app = FastAPI()
    defaults = {**served["vc"].model_config.get_diff_sampling_param(), **MODEL_DEFAULTS}

    @app.post("/v1/completions")
    async def completions(body: dict = Body(...)):   # noqa: B008  (FastAPI's way to take the raw JSON)
        req = CompletionRequest.model_validate(body)
        sp = req.to_sampling_params(max_tokens=req.max_tokens, default_sampling_params=defaults)
        state["seen"].append((body, req, sp))
        ids, finish, text = state["answer"]
        choice = CompletionResponseChoice(index=0, text=text, finish_reason=finish,
                                          token_ids=ids if req.return_token_ids and not state["omit"] else None)
        return CompletionResponse(model=req.model or "m", usage=UsageInfo(prompt_tokens=len(req.prompt)),
                                  choices=[choice]).model_dump()

    init_entrypoints_middleware(served["args"], app, ("generate",))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    state["url"] = f"http://127.0.0.1:{port}"
    yield state
    server.should_exit = True
    t.join(timeout=30)


def _ask(api, ids, **kw):
    sampling = {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop_token_ids": [2], **kw}
    return generate_tokens(api["url"], ids, "gen-r1-0-0-t0", timeout_s=30, **sampling)


def test_the_worker_s_request_is_a_vllm_completion_with_its_sampling_and_nothing_else(api):
    from vllm.sampling_params import SamplingType
    prompt = [1, 17, 42, 99, 3]
    # seeded sampling: temperature, top_p and seed as asked; the model's defaults change none of them
    api["answer"] = ([7, 8, 2], "stop", "ignored")
    _ask(api, prompt, max_new_tokens=12, temperature=0.7, top_p=0.9, seed=1234, stop_token_ids=[2, 128009])
    body, req, sp = api["seen"][-1]
    assert req.prompt == prompt and req.model == api_model(api) and req.return_token_ids is True
    assert sp.sampling_type == SamplingType.RANDOM_SEED and sp.seed == 1234
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.7, 0.9, 12)
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (
        0, 0.0, 1.0, 0.0, 0.0)
    assert sp.stop_token_ids == [2, 128009] and sp.ignore_eos is False and sp.n == 1
    assert sp.extra_args is None and "kv_transfer_params" not in body   # no rid for a connector: none is loaded
    # greedy: temperature 0 is vLLM's greedy sampler, whatever seed the turn carries
    _ask(api, prompt, temperature=0.0, seed=99)
    _, _, sp = api["seen"][-1]
    assert sp.sampling_type == SamplingType.GREEDY and sp.repetition_penalty == 1.0 and sp.top_k == 0


def api_model(api) -> str:
    import os
    return os.environ[ENV_MODEL]


def test_the_answer_is_exactly_vllm_s_token_ids_and_finish_reason(api):
    prompt = [1, 17, 42]
    # a stop: the stop token is the last id (vLLM's check_stop keeps it), as the worker's RecordBuilder expects;
    # the text is not what the ids decode to: the ids are taken as sampled, the text never re-tokenised
    api["answer"] = ([9, 11, 13, 2], "stop", "<not the decoded ids>")
    assert _ask(api, prompt, temperature=0.7, seed=3) == ([9, 11, 13, 2], "stop")
    api["answer"] = ([4] * 16, "length", "")
    assert _ask(api, prompt) == ([4] * 16, "length")                  # keep_truncated reads "length"
    api["answer"] = ([4], "abort", "")
    with pytest.raises(CaptureServerError, match="finish_reason .*'abort'.*not stop or length"):
        _ask(api, prompt)
    api["answer"] = ([4], "repetition", "")
    with pytest.raises(CaptureServerError, match="not stop or length"):
        _ask(api, prompt)


def test_an_answer_without_token_ids_is_refused_never_an_empty_turn(api):
    api["answer"], api["omit"] = ([9, 2], "stop", "hi"), True    # a vLLM that ignored return_token_ids
    with pytest.raises(CaptureServerError, match=r"502.*no token_ids list"):
        _ask(api, [1, 2, 3])


def test_health_and_server_info_say_generation(api):
    health_generate(api["url"], 30)
    _, req, sp = api["seen"][-1]
    assert req.max_tokens == 1 and sp.extra_args is None
    info = server_info(api["url"], 30)
    assert info["backend"] == "vllm" and info["mode"] == "generate" and info["model"] == api_model(api)
    assert len(api["seen"]) == 1                     # /get_server_info never reached the engine
