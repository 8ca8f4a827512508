"""`eagleflow capture serve` with capture.backend vllm: vLLM's own `vllm serve`, capturing through our connector.

Checks first (each failure names what to do): the installed vLLM is the version requirements-node-vllm.txt
pins; the target is a family whose vLLM numbering of the capture layers we know
(``layers.vllm_aux_layer_ids``); the dump folder is this user's and the dump key exists. Then it starts
``python -m vllm.entrypoints.cli.main serve`` (the ``vllm serve`` command) in this process group with

- ``--speculative-config`` method ``extract_hidden_states`` (one speculative token, the only count it takes),
  the aux layers in vLLM's numbering plus the last layer (``connector.vllm_capture_ids``);
- ``--kv-transfer-config`` naming ``EagleflowCaptureConnector`` through ``kv_connector_module_path``;
- ``--no-enable-prefix-caching``: a prefix-cache hit would compute only the suffix (the connector refuses
  such a request rather than write a short dump); chunked prefill may stay on: the connector follows a
  request's blocks until its whole prompt is in the cache;
- host (loopback only), port, TP and dtype from the config, then ``server.extra_server_args``;

- ``--middleware eagleflow.engines.vllm.api.CaptureApi``: the project's capture API (``POST /generate``,
  ``GET /health_generate``, ``GET /get_server_info``) answered through vLLM's own ``/v1/completions``, so
  the extraction worker, the readiness check and the watchdog are unchanged;

and the connector's settings in its environment (the sglang plugin's variables and the dump key).

Once ``/health_generate`` answers, a self-check request sent as the worker sends it must leave a dump that verifies under the key with
the prompt's ids: only then is ``<run_dir>/capture_server.json`` written (``"ready"`` means "captures"), its
``pid`` the server's own (a child of this process, in its process group: SIGTERM to the group stops both).
"""
from __future__ import annotations

import json
import os
import sys

from eagleflow.config import PipelineConfig
from eagleflow.layout import RunLayout

from .layers import vllm_aux_layer_ids
from eagleflow.serving.launch import LaunchError, plan_capture, run_capture_server
from eagleflow.serving.capture_hook import ENV_AUX_LAYERS, ENV_DUMP_DIR, ENV_MODEL
from eagleflow.engines.vllm.api import MIDDLEWARE
from eagleflow.engines.vllm.connector import (CONNECTOR_CLASS, INSTALL_HINT, MODULE_PATH, VllmCaptureError, capture_settings,
                             vllm_capture_ids)
from eagleflow.serving.dump_protocol import DumpTrustError, loopback_host

# The vLLM versions whose classes the connector and the flags are proven against (tests/node_vllm); the
# pin of requirements-node-vllm.txt (a unit test holds them equal).
SUPPORTED_VERSIONS = ("0.33.0",)
REQUIREMENTS_FILE = "requirements-node-vllm.txt"


class VllmLaunchError(LaunchError):
    pass


def installed_vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("vllm")
    except PackageNotFoundError:
        raise VllmLaunchError(f"vLLM is not installed in this interpreter ({sys.executable}): capture.backend "
                              f"vllm runs `eagleflow capture serve` in the node's vLLM venv; {INSTALL_HINT}") from None


def check_supported_version(version: str) -> str:
    if version not in SUPPORTED_VERSIONS:
        raise VllmLaunchError(f"vLLM {version} is not a version eagleflow's capture supports "
                              f"({', '.join(SUPPORTED_VERSIONS)}); install {REQUIREMENTS_FILE} (it pins "
                              f"{SUPPORTED_VERSIONS[-1]}) or use capture.backend hf")
    return version


def speculative_config(capture_ids: list[int]) -> dict:
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(capture_ids)}}}


def kv_transfer_config() -> dict:
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": MODULE_PATH, "kv_role": "kv_producer"}


def build_command(cfg: PipelineConfig, *, model_path: str, host: str, port: int, capture_ids: list[int],
                  python: str = sys.executable) -> list[str]:
    """vLLM 0.33's argv for extraction; ``capture_ids`` in vLLM's numbering (aux ids and the last layer).
    Proven against vLLM's own ``serve`` parser and config builders in tests/node_vllm/test_vllm_capture.py."""
    srv = cfg.server
    argv = [python, "-m", "vllm.entrypoints.cli.main", "serve", model_path, "--host", host, "--port", str(port),
            "--tensor-parallel-size", str(srv.tp), "--dtype", srv.dtype,
            # a prefix-cache hit computes only the suffix: its dump would be short (the connector refuses it)
            "--no-enable-prefix-caching",
            "--speculative-config", json.dumps(speculative_config(capture_ids), separators=(",", ":")),
            "--kv-transfer-config", json.dumps(kv_transfer_config(), separators=(",", ":")),
            # the project's capture API (/generate, /health_generate, /get_server_info) on vLLM's server
            "--middleware", MIDDLEWARE]
    return argv + list(srv.extra_server_args)


def capture_env(*, dump_dir: str, aux_layers: list[int], model: str) -> dict[str, str]:
    """The connector's settings: the sglang plugin's variables (engine-neutral names)."""
    return {ENV_DUMP_DIR: dump_dir, ENV_AUX_LAYERS: json.dumps(aux_layers), ENV_MODEL: model}


def check_connector(env: dict[str, str]) -> None:
    """What the connector checks when vLLM builds it, proven here first (before the model loads): the module
    vLLM's factory will import is this interpreter's, and the settings parse."""
    import importlib.util
    if importlib.util.find_spec(MODULE_PATH) is None:
        raise VllmLaunchError(f"{MODULE_PATH} cannot be imported by {sys.executable}: vLLM would fail to load the "
                              "capture connector; install eagleflow into this venv (`pip install --no-deps -e .`)")
    try:
        capture_settings(env)
    except VllmCaptureError as e:
        raise VllmLaunchError(str(e)) from None


def launch(cfg: PipelineConfig, layout: RunLayout) -> int:
    loopback_host(cfg.server.host)   # first: vLLM's server takes no credential here, loopback only
    try:
        version = check_supported_version(installed_vllm_version())
        plan = plan_capture(cfg, layout)
        capture_ids = vllm_capture_ids(vllm_aux_layer_ids(plan.aux_layers, plan.architectures, plan.num_layers),
                                       plan.num_layers)
        env = plan.env(capture_env(dump_dir=plan.dump_dir, aux_layers=plan.aux_layers, model=plan.model_path))
        check_connector(env)
    except (LaunchError, ValueError, DumpTrustError) as e:
        print(f"eagleflow capture serve (vllm): {e}", file=sys.stderr, flush=True)
        return 2
    argv = build_command(cfg, model_path=plan.model_path, host=cfg.server.host, port=plan.port,
                         capture_ids=capture_ids)
    print(f"eagleflow capture serve: vLLM {version}, outputs of layers {plan.aux_layers} (vLLM ids {capture_ids}, the "
          f"last for the final norm): {' '.join(argv)}", file=sys.stderr, flush=True)
    return run_capture_server(
        argv, env, engine="vLLM", url=plan.url, ready_timeout_s=cfg.server.ready_timeout_s,
        dump_dir=plan.dump_dir, dump_key=plan.dump_key, appear_within_s=0.0,   # written before vLLM answers: no wait
        missing_dump_hint="the capture connector did not write it; read its lines above in this log",
        info_file=str(layout.server_info_file), info=plan.info(cfg, "vllm", version, vllm_layer_ids=capture_ids))
