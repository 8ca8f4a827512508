"""What the GPU check's engine stages (bench/gpu_check_capture.py, gpu_check_eagle3.py) need to know per serving
engine, in one place: the flags that make a server start fast on a shared GPU, and the installed-version check
the engine's capture launcher itself runs. ``--engine`` of both scripts picks a row.

Nothing here imports an engine: each script is run in that engine's own venv (sglang and vLLM pin different
torch), by bench/gpu_check.sh, which learns with ``importlib.util.find_spec`` whether the engine is there.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


# In a kept capture folder: the draft an eagle3 stage trained and exported there, so that the other engine's
# eagle3 stage serves that same draft (one draft proven on both engines); a new capture removes it.
EXPORT_RECORD = "eagle3_export.json"


@dataclass(frozen=True)
class CheckEngine:
    name: str
    launcher: str            # the capture launcher module: installed_<name>_version, check_supported_version
    server_args: tuple[str, ...]   # appended to every server the stages start: memory share and a fast start
    ready_path: str          # answers once the server generates (the eagle3 stage's readiness poll)

    def config_server_args(self) -> list[str]:
        """``server_args`` for a config's ``server.extra_server_args``: without the flags eagleflow's launchers set
        themselves (each with its value), which the config refuses (eagleflow.server_flags); the capture launcher
        already sets those (sglang's CUDA graphs off)."""
        from eagleflow.server_flags import owned_flag_of
        out: list[str] = []
        owned_value = False
        for arg in self.server_args:
            if owned_value and not arg.startswith("-"):
                owned_value = False
                continue
            owned_value = owned_flag_of(arg) is not None and "=" not in arg
            if owned_flag_of(arg) is None:
                out.append(arg)
        return out

    def check_version(self) -> str:
        """The installed version if the launcher supports it; its error (naming what to install) otherwise."""
        mod = importlib.import_module(self.launcher)
        return mod.check_supported_version(getattr(mod, f"installed_{self.name}_version")())


ENGINES = {e.name: e for e in (
    # sglang 0.5.23's spelling (its --disable-cuda-graph is deprecated): no CUDA graph capture, which only costs
    # start-up time for a prefill-only capture and a few prompts
    CheckEngine("sglang", "eagleflow.engines.sglang.launcher",
                ("--mem-fraction-static", "0.3", "--cuda-graph-backend-decode", "disabled",
                 "--cuda-graph-backend-prefill", "disabled"), "/health_generate"),
    # vLLM 0.33: --enforce-eager skips CUDA graph capture and torch.compile (minutes of start-up otherwise)
    CheckEngine("vllm", "eagleflow.engines.vllm.launcher",
                ("--gpu-memory-utilization", "0.3", "--enforce-eager"), "/health"),
)}
