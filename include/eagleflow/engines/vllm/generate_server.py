"""`eagleflow generate serve` with generate.backend vllm: vLLM's own `vllm serve` in serving mode.

The generation worker is the one every engine uses (``phases/generate/worker.py``, through ``client.generate_tokens``):
``POST /generate`` with token ids, sampling (temperature, top_p, a seed per turn, the stop ids), answered with
the token ids the target sampled and its finish reason (stop or length: keep_truncated reads it). vLLM speaks
OpenAI's completions; ``--middleware eagleflow.engines.vllm.api.GenerateApi`` (the capture server's API,
without its connector) answers ``/generate``, ``/health_generate`` and ``/get_server_info`` through vLLM's
own ``/v1/completions`` in-process (vLLM's API process imports it from this interpreter, the one exec'd
here): a token-id prompt, ``return_token_ids`` (exactly the sampled ids, no detokenise/retokenise round
trip), temperature 0 greedy, otherwise vLLM's per-request seeded sampler.

No capture connector and no speculative method: this is the target serving, so vLLM's prefix caching stays
on (a shared system prompt is computed once) and its CUDA graphs too. Checks first, each naming what to do:
a loopback host, vLLM installed here at the version requirements-node-vllm.txt pins. Then the server's info
file is written and this process becomes ``vllm serve`` (exec): the recorded pid is the server's, as for
sglang.
"""
from __future__ import annotations

import json
import os
import sys

from eagleflow.serving.dump_protocol import loopback_host
from eagleflow.ports import free_port
from eagleflow.serving.capture_hook import ENV_MODEL
from eagleflow.engines.vllm.api import GENERATE_MIDDLEWARE
from eagleflow.engines.vllm.launcher import REQUIREMENTS_FILE, SUPPORTED_VERSIONS
from eagleflow.config import PipelineConfig
from eagleflow.engines import generation_backend
from eagleflow.layout import RunLayout
from eagleflow.phases import GENERATE, KINDS
from eagleflow.durable import atomic_write

INSTALL_HINT = (f"install {REQUIREMENTS_FILE} in the node's vLLM venv (and eagleflow with `pip install --no-deps "
                "-e .`) and run `eagleflow generate serve` from that venv, or use generate.backend hf or sglang")


class VllmGenerateError(RuntimeError):
    pass


def check_vllm() -> str:
    """The installed vLLM's version, when it is the one the generation client is proven against."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        have = version("vllm")
    except PackageNotFoundError:
        raise VllmGenerateError(f"vLLM is not installed in this interpreter ({sys.executable}): generate.backend "
                                f"vllm serves the target with `vllm serve`; {INSTALL_HINT}") from None
    if have not in SUPPORTED_VERSIONS:
        raise VllmGenerateError(f"vLLM {have} is not a version eagleflow's generation supports "
                                f"({', '.join(SUPPORTED_VERSIONS)}); install {REQUIREMENTS_FILE} (it pins "
                                f"{SUPPORTED_VERSIONS[-1]}) or use generate.backend hf or sglang")
    return have


def server_args(cfg: PipelineConfig) -> list[str]:
    """``server.extra_server_args`` are flags for capture.backend's server: passed only when that engine is
    this one (vllm), never sglang's flags to vLLM's parser."""
    return list(cfg.server.extra_server_args) if cfg.capture.backend == generation_backend(cfg)[0] else []


def build_command(cfg: PipelineConfig, *, model_path: str, host: str, port: int,
                  python: str = sys.executable) -> list[str]:
    """vLLM 0.33's argv for serving the target (proven against vLLM's own ``serve`` parser and config builder in
    tests/node_vllm/test_vllm_generate.py)."""
    srv = cfg.server
    return [python, "-m", "vllm.entrypoints.cli.main", "serve", model_path, "--host", host, "--port", str(port),
            "--tensor-parallel-size", str(srv.tp), "--dtype", srv.dtype, "--seed", str(cfg.generate.seed),
            # the project's API (/generate, /health_generate, /get_server_info) on vLLM's server
            "--middleware", GENERATE_MIDDLEWARE, *server_args(cfg)]


def launch_generate(cfg: PipelineConfig, layout: RunLayout) -> int:
    loopback_host(cfg.server.host)   # it takes no credential: loopback only
    try:
        version = check_vllm()
    except VllmGenerateError as e:
        print(f"eagleflow generate serve (vllm): {e}", file=sys.stderr, flush=True)
        return 2
    model = str(cfg.resolve(cfg.target_model))
    port = cfg.generate.port or free_port(cfg.server.host)
    url = f"http://{cfg.server.host}:{port}"
    argv = build_command(cfg, model_path=model, host=cfg.server.host, port=port)
    dropped = len(cfg.server.extra_server_args) - len(server_args(cfg))
    print(f"eagleflow generate serve: vLLM {version} serving {model} at {url}"
          + (f" (server.extra_server_args not passed: they are {cfg.capture.backend}'s flags)" if dropped else "")
          + f": {' '.join(argv)}", file=sys.stderr, flush=True)
    atomic_write(str(layout.generate_server_info_file),
                 json.dumps({"backend": "vllm", "mode": KINDS[GENERATE].server_mode, "model": model, "url": url, "pid": os.getpid(),
                             "version": version}), mode=0o644)   # read as ours: never group-writable
    # the middleware's served-model name: the model path, as vLLM names it
    os.environ[ENV_MODEL] = model
    os.execv(sys.executable, argv)
    return 0
