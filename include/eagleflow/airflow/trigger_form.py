"""The trigger form's fields as a person reads them: what an empty field means, and the config file it starts from.

Airflow 3's trigger form draws a Param from its JSON schema: a schema with ``enum`` is a dropdown whose option for
``None`` reads ``null`` unless ``values_display`` names it; a ``boolean`` (also ``["null", "boolean"]``) is a
switch that shows *off* for ``None``; a text or number field has no placeholder of its own. So:

* every optional dropdown labels its ``None`` option ``FROM_CONFIG`` (``optional_choice``);
* a setting the config decides and the form may turn either way is a dropdown of three (``config_switch``):
  ``FROM_CONFIG`` / on / off, never a switch that reads *off* while the config says on; its ``"on"``/``"off"``
  reach the config as the booleans they name (the config's booleans take them);
* every optional field's help ends with what an empty field means (``from_config``), the config field named;
* the config path the form starts from is the deployment's default config as the docs name it, relative to the
  project root (``configs/local-demo.yaml``), not the absolute path ``make airflow`` puts in $EAGLEFLOW_CONFIG.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from airflow.sdk import Param

from eagleflow.airflow.project import project_root
from eagleflow.airflow.routing import default_config_path
from eagleflow.stores import STORES

FROM_CONFIG = "(from the config)"
SWITCH_CHOICES = ("on", "off")


def from_config(description: str, field: str) -> str:
    """``description`` and what an empty field means: the config's ``field``."""
    return f"{description.rstrip()} Empty: {FROM_CONFIG}, {field}."


def optional_choice(choices: Sequence[str], *, title: str, description: str, field: str,
                    labels: dict[str, str] | None = None) -> Param:
    """A dropdown of ``choices`` whose empty option reads ``FROM_CONFIG``, never ``null``."""
    display = {"null": FROM_CONFIG, **{c: c for c in choices}, **(labels or {})}
    return Param(None, type=["null", "string"], enum=[None, *choices], values_display=display, title=title,
                 description=from_config(description, field))


def config_switch(*, title: str, description: str, field: str) -> Param:
    """A setting the config decides, as three choices: ``FROM_CONFIG`` (the default), on, off."""
    return optional_choice(SWITCH_CHOICES, title=title, description=description, field=field)


def storage_choice() -> Param:
    """The ``storage`` Param: the hidden-state store of this run (``stream.storage``), one of the stores
    registry's (``eagleflow.stores.STORES``), each shown with its label; empty: the config's."""
    return optional_choice(list(STORES), title="Hidden-state storage",
                           description="Where the captured hidden states go between capture and training. "
                                       + "; ".join(f"{name}: {store.label}" + (" (streaming: training starts as "
                                                   "soon as capture is ready and draws samples as they arrive, "
                                                   "nothing on disk)" if store.streaming else " (offline: "
                                                   "training starts after every sample is verified)")
                                                   for name, store in STORES.items()) + ".",
                           field="stream.storage",
                           labels={name: f"{name} ({'streaming' if store.streaming else 'offline'})"
                                   for name, store in STORES.items()})


def form_config_path() -> str:
    """The config the form starts from: ``routing.default_config_path()`` (the deployment's $EAGLEFLOW_CONFIG, else
    the demo's), named relative to the project root when it lies under it, as the docs name it; a config
    elsewhere keeps its absolute path (the deployment named it so)."""
    path = default_config_path()
    p = Path(path).expanduser()
    if not p.is_absolute():
        return path
    try:
        return Path(os.path.normpath(p)).relative_to(project_root()).as_posix()
    except ValueError:   # outside the project: only the absolute path names it
        return path


def shown_choices(schema: dict[str, Any]) -> list[str]:
    """The labels the form shows for a dropdown's options (as Airflow's form picks them: ``values_display`` by the
    option's JSON text, else that text)."""
    display = schema.get("values_display") or {}
    out = []
    for value in schema.get("enum") or []:
        key = "null" if value is None else (str(value).lower() if isinstance(value, bool) else str(value))
        out.append(str(display.get(key, key)))
    return out
