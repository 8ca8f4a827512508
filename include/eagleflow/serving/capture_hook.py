"""What every in-server capture hook reads, whatever the engine (sglang's plugin, vLLM's connector and API): the
settings the launcher hands it in its environment, and which requests are ours to dump."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from eagleflow.serving.dump_protocol import SELFCHECK_PREFIX, parse_request_id

ENV_DUMP_DIR = "EAGLEFLOW_CAPTURE_DUMP_DIR"
ENV_AUX_LAYERS = "EAGLEFLOW_CAPTURE_AUX_LAYERS"
ENV_MODEL = "EAGLEFLOW_CAPTURE_MODEL"
CAPTURE_ENV_PREFIX = "EAGLEFLOW_CAPTURE_"


class CaptureHookError(RuntimeError):
    pass


@dataclass(frozen=True)
class CaptureSettings:
    dump_dir: str
    aux_layers: list[int]
    model: str

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "CaptureSettings":
        env = dict(os.environ if env is None else env)
        missing = [k for k in (ENV_DUMP_DIR, ENV_AUX_LAYERS) if not env.get(k)]
        if missing:
            raise CaptureHookError(f"eagleflow capture plugin loaded without {', '.join(missing)}; start sglang "
                                   "through `eagleflow capture serve --backend sglang`, which sets them")
        raw = env[ENV_AUX_LAYERS]
        try:
            layers = json.loads(raw)
        except ValueError:
            layers = None
        # bool is an int subclass: [true] is not a layer list
        if not (isinstance(layers, list) and layers
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)):
            raise CaptureHookError(f"{ENV_AUX_LAYERS}={raw!r} is not a JSON list of layer indices (e.g. [1, 15, 28]); "
                                   "start sglang through `eagleflow capture serve --backend sglang`, which sets it")
        return cls(dump_dir=env[ENV_DUMP_DIR], aux_layers=layers, model=env.get(ENV_MODEL, ""))


def capture_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started for capture: any EAGLEFLOW_CAPTURE_* setting present (the dump
    key, protocol.ENV_DUMP_KEY, counts too)."""
    return any(k.startswith(CAPTURE_ENV_PREFIX) for k in (os.environ if env is None else env))


def is_capture_rid(rid: str) -> bool:
    """Only our requests get dumps: sglang's own (health checks, warmup) would pile up in the dump dir."""
    return parse_request_id(rid) is not None or rid.startswith(SELFCHECK_PREFIX)
