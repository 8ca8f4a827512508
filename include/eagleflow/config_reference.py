"""The configuration reference (docs/config-reference.md), generated from ``PipelineConfig`` itself.

Every key a config file may hold, with its type, default, bounds and the ``description=`` the code
carries, so the document cannot drift from the validator: ``tests/unit/test_config_reference.py`` fails
when the checked-in file differs from what this module prints, and when a key has no description.

    python -m eagleflow.config_reference > docs/config-reference.md
"""
from __future__ import annotations

import json
import typing
from enum import Enum
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from eagleflow.config import Choices, PipelineConfig

HEADER = """# Configuration reference

Generated from `eagleflow.config.PipelineConfig` by `python -m eagleflow.config_reference >
docs/config-reference.md`; a test fails when this file is out of date. What the settings do together is in
[configuration.md](configuration.md). Unknown keys are errors; a list of sections (`corpus.sources`,
`fleet.nodes`, `eval.configs`, `eval.prompt_sets`) is written `key[]`. The `server` keys were `capture.<key>`
before the target server had its own section: those names are still read as `server.<key>`, with a note in the
log (the same key under both names with different values is an error).
"""


def _section_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the section model a field holds, whether as a list), or (None, False) for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], True
    return None, False


def _type_text(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is typing.Annotated:
        choices = [m for m in annotation.__metadata__ if isinstance(m, Choices)]
        return " | ".join(json.dumps(v) for v in choices[0].values()) if choices else _type_text(args[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_text(a) for a in args)
    if origin is list:
        return f"list of {_type_text(args[0])}" if args else "list"
    if origin is dict:
        return f"map {_type_text(args[0])} to {_type_text(args[1])}" if args else "map"
    if isinstance(annotation, type):
        if issubclass(annotation, Enum):
            return " | ".join(json.dumps(m.value) for m in annotation)
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__)
    return str(annotation).replace("typing.", "")


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()   # type: ignore[call-arg]  # pydantic's factories here take no argument
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, Enum):
        value = value.value
    return "`" + json.dumps(value) + "`"


def _bounds_text(info: FieldInfo) -> str:
    words = []
    for m in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "length >="),
                           ("max_length", "length <="), ("pattern", "matches")):
            v = getattr(m, attr, None)
            if v is not None:
                words.append(f"{sign} `{v}`")
    return ", ".join(words)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def rows(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> list[tuple[str, FieldInfo, str]]:
    """(dotted key, its field, its type text) for every plain value under ``model``, sections flattened."""
    out = []
    for name, info in model.model_fields.items():
        if info.exclude:   # set by the loader (where the file was), never written in one
            continue
        key = prefix + (info.alias or name)
        section, many = _section_model(info.annotation)
        if section is not None:
            out += rows(section, key + ("[]." if many else "."))
        else:
            out.append((key, info, _type_text(info.annotation)))
    return out


def undescribed() -> list[str]:
    """The keys whose field carries no ``description=`` (the test requires none)."""
    return [key for key, info, _ in rows() if not (info.description or "").strip()]


def render() -> str:
    lines = [HEADER]
    section = None
    for key, info, type_text in rows():
        top = key.split(".", 1)[0].removesuffix("[]") if "." in key else ""
        if top != section:
            section = top
            lines += ["", f"## `{top}`" if top else "## Top level", "",
                      "| key | type | default | bounds | what it does |", "|---|---|---|---|---|"]
        lines.append(f"| `{key}` | {_cell(type_text)} | {_cell(_default_text(info))} | {_cell(_bounds_text(info))} "
                     f"| {_cell(info.description or '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
