"""The old path of the sglang capture hook, kept for node venvs installed before it moved: their installed
``sglang.srt.plugins`` entry point still names ``eagleflow.capture.sglang_plugin:register`` until the next
``pip install -e .`` (pyproject.toml now names ``eagleflow.engines.sglang.plugin:register``)."""
from eagleflow.engines.sglang.plugin import register

__all__ = ["register"]
