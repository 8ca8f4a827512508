"""`eagleflow capture serve --backend sglang`: sglang's own server, with our capture installed at runtime.

Checks first (each failure names what to do): the installed sglang is a
version we support; the target's sglang model class can capture EAGLE-3
auxiliary states (``set_eagle3_layers_to_capture``). Then it starts
``python -m sglang.launch_server`` in this process group with the extraction
flags (one prefill = one whole sample: no CUDA graphs, no radix cache, no
chunked prefill), TP from the config, and the env that makes sglang load our
plugin (``SGLANG_PLUGINS`` naming ``eagleflow_capture``) in every scheduler process
with the capture settings that turn it on (without them the plugin is inert, so a
plain sglang launch on the node is untouched). Before sglang starts, the launcher
proves what the schedulers will check: the entry point is installed in this
interpreter, the settings it passes parse, and this sglang has every attribute the
hook reads; each failure stops the launch naming what to do.

Once ``/health_generate`` answers, a self-check request must leave a dump:
only then is ``<run_dir>/capture_server.json`` written (so "ready" means
"captures"). SIGTERM to this process group stops sglang with it.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Callable

from eagleflow.config import PipelineConfig
from eagleflow.layout import RunLayout
from eagleflow.phases import GENERATE, KINDS

from .layers import sglang_aux_layer_ids
from eagleflow.ports import free_port
from eagleflow.serving.launch import LaunchError, model_config, plan_capture, run_capture_server
from eagleflow.engines.sglang.plugin import (ENV_AUX_LAYERS, ENV_DUMP_DIR, ENV_MODEL, CaptureHookError, CaptureSettings,
                            check_sglang_contract)
from eagleflow.durable import atomic_write
from eagleflow.serving.dump_protocol import DumpTrustError, loopback_host

PLUGIN_NAME = "eagleflow_capture"
# The sglang versions whose classes the capture hook is proven against (`make test-node`).
SUPPORTED_VERSIONS = ("0.5.23",)


class SglangLaunchError(LaunchError):
    pass


def installed_sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sglang")
    except PackageNotFoundError:
        raise SglangLaunchError("sglang is not installed in this interpreter "
                                f"({sys.executable}); install requirements-node.txt on the GPU node, or use "
                                "capture.backend hf") from None


def check_supported_version(version: str) -> str:
    if version not in SUPPORTED_VERSIONS:
        raise SglangLaunchError(f"sglang {version} is not a version eagleflow's capture supports "
                                f"({', '.join(SUPPORTED_VERSIONS)}); install requirements-node.txt (it pins "
                                f"{SUPPORTED_VERSIONS[-1]}) or use capture.backend hf")
    return version


def sglang_model_class(architectures: list[str]):
    from sglang.srt.models.registry import ModelRegistry
    cls, _arch = ModelRegistry.resolve_model_cls(architectures)
    return cls


def check_model_supports_capture(model_path: str,
                                 resolve_class: Callable[[list[str]], type] = sglang_model_class) -> str:
    """The sglang class name of the target; refuses one without EAGLE-3 aux capture."""
    archs = model_config(model_path).get("architectures") or []
    if not archs:
        raise SglangLaunchError(f"{model_path}/config.json lists no architectures; sglang cannot pick a model class")
    try:
        cls = resolve_class(archs)
    except Exception as e:
        raise SglangLaunchError(f"sglang has no model class for {archs} ({e}); use capture.backend hf") from None
    if not hasattr(cls, "set_eagle3_layers_to_capture"):
        raise SglangLaunchError(
            f"sglang's {cls.__name__} (for {', '.join(archs)}) has no set_eagle3_layers_to_capture: it cannot "
            "capture EAGLE-3 auxiliary hidden states. Use a model sglang supports for EAGLE-3 (llama, qwen2/3, "
            "deepseek_v2/v3, kimi, gpt_oss, glm4_moe, ...) or capture.backend hf")
    return cls.__name__


def build_command(cfg: PipelineConfig, *, model_path: str, host: str, port: int, sglang_layer_ids: list[int],
                  python: str = sys.executable) -> list[str]:
    """sglang 0.5.23's argv for extraction; ``sglang_layer_ids`` are already in sglang's convention for the
    target's family (see ``capture.aux_layers``). Proven against sglang's own parser and resolution in
    tests/node/test_sglang_launch_args.py."""
    srv = cfg.server
    argv = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port),
            "--tp-size", str(srv.tp), "--dtype", srv.dtype,
            # one request = one whole prefill = one whole sample: no radix cache (a hit computes only the
            # suffix), no chunked prefill, no CUDA graphs (0.5.23 turns breakable prefill graphs on by default)
            "--disable-radix-cache", "--chunked-prefill-size", "-1",
            "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
            # the draft-free capture switch: the algorithm only names the capture convention
            "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
            "--return-aux-hidden-state-layer-ids", *[str(x) for x in sglang_layer_ids]]
    return argv + list(srv.extra_server_args)


def capture_env(*, dump_dir: str, aux_layers: list[int], model: str,
                environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The env sglang gets: our plugin named in SGLANG_PLUGINS (sglang 0.5.23 reads it as comma-separated
    entry-point names and loads only those), plugins the caller already named kept, and the settings."""
    env = os.environ if environ is None else environ
    named = [n.strip() for n in env.get("SGLANG_PLUGINS", "").split(",") if n.strip()]
    plugins = ",".join(named + [PLUGIN_NAME] if PLUGIN_NAME not in named else named)
    return {"SGLANG_PLUGINS": plugins, ENV_DUMP_DIR: dump_dir, ENV_AUX_LAYERS: json.dumps(aux_layers),
            ENV_MODEL: model}


def check_capture_plugin(env: dict[str, str]) -> CaptureSettings:
    """What each scheduler's register() will check, proven here first so a bad launch fails before sglang
    loads the model: the entry point is installed in this interpreter, the settings parse, the hook's
    sglang contract holds."""
    from importlib.metadata import entry_points
    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    if PLUGIN_NAME not in eps:
        raise SglangLaunchError(f"the sglang plugin entry point {PLUGIN_NAME!r} is not installed for {sys.executable}: "
                                "sglang would start without the capture hook; install eagleflow into this venv "
                                "(`pip install --no-deps -e .`)")
    try:
        settings = CaptureSettings.from_env(env)
        check_sglang_contract()
    except CaptureHookError as e:
        raise SglangLaunchError(str(e)) from None
    return settings


def launch_generate(cfg: PipelineConfig, layout: RunLayout) -> int:
    """`eagleflow generate serve` with sglang: its own launch_server in serving mode (radix cache and CUDA
    graphs on, no capture hook), exec'd so that the recorded pid stays the server's."""

    loopback_host(cfg.server.host)   # it takes no credential: loopback only
    model = str(cfg.resolve(cfg.target_model))
    port = cfg.generate.port or free_port(cfg.server.host)
    atomic_write(str(layout.generate_server_info_file),
                 json.dumps({"backend": "sglang", "mode": KINDS[GENERATE].server_mode, "model": model,
                             "url": f"http://{cfg.server.host}:{port}", "pid": os.getpid()}),
                 mode=0o644)   # read as ours (phase_jobs.server_url_in): never group-writable
    os.execv(sys.executable, build_generate_command(cfg, model_path=model, host=cfg.server.host, port=port))
    return 0


def build_generate_command(cfg: PipelineConfig, *, model_path: str, host: str, port: int,
                           python: str = sys.executable) -> list[str]:
    """sglang's argv for serving the target (generation): its own flags, then ``server.extra_server_args``."""
    return [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port),
            "--tp-size", str(cfg.server.tp), "--random-seed", str(cfg.generate.seed), "--skip-tokenizer-init",
            *cfg.server.extra_server_args]


def launch(cfg: PipelineConfig, layout: RunLayout) -> int:
    loopback_host(cfg.server.host)   # first: sglang takes no credential, so it never listens beyond loopback
    try:
        version = check_supported_version(installed_sglang_version())
        cls_name = check_model_supports_capture(str(cfg.resolve(cfg.target_model)))
        plan = plan_capture(cfg, layout)
        sglang_ids = sglang_aux_layer_ids(plan.aux_layers, plan.architectures, plan.num_layers)
        env = plan.env(capture_env(dump_dir=plan.dump_dir, aux_layers=plan.aux_layers, model=plan.model_path))
        check_capture_plugin(env)
    except (LaunchError, ValueError, DumpTrustError) as e:
        print(f"eagleflow capture serve (sglang): {e}", file=sys.stderr, flush=True)
        return 2
    argv = build_command(cfg, model_path=plan.model_path, host=cfg.server.host, port=plan.port,
                         sglang_layer_ids=sglang_ids)
    print(f"eagleflow capture serve: sglang {version}, {cls_name}, outputs of layers {plan.aux_layers} (sglang ids "
          f"{sglang_ids}): {' '.join(argv)}", file=sys.stderr, flush=True)
    return run_capture_server(
        argv, env, engine="sglang", url=plan.url, ready_timeout_s=cfg.server.ready_timeout_s,
        dump_dir=plan.dump_dir, dump_key=plan.dump_key, appear_within_s=10.0,   # the plugin writes beside the answer
        missing_dump_hint="the capture plugin is not active in the scheduler (is eagleflow installed in sglang's "
                          "venv with its entry point, `pip install -e .`?)",
        info_file=str(layout.server_info_file), info=plan.info(cfg, "sglang", version, sglang_layer_ids=sglang_ids))
