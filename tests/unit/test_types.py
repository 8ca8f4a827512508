"""mypy over the package, with pyproject.toml's [tool.mypy] settings, so `make test-fast` type-checks
include/eagleflow (issue 39: the node protocol modules strict, the rest as annotated).

A cold run takes about a minute; the cache (.cache/mypy) makes the next ones take seconds.
"""
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTOCOL_MODULES = {"eagleflow.protocol", "eagleflow.watchdog.protocol", "eagleflow.serving.dump_protocol"}
# mypy's --strict, flag by flag (`strict = true` in an override would turn them on for every module)
STRICT_FLAGS = ("disallow_any_generics", "disallow_subclassing_any", "disallow_untyped_calls",
                "disallow_untyped_defs", "disallow_incomplete_defs", "check_untyped_defs",
                "disallow_untyped_decorators", "warn_return_any", "no_implicit_reexport", "strict_equality",
                "extra_checks")


def test_mypy_passes_on_the_package():
    res = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml")],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (f"mypy found type errors in include/eagleflow (fix the types; `.venv/bin/mypy` "
                                 f"repeats this):\n{res.stdout}{res.stderr}")


def test_the_protocol_modules_are_checked_strictly():
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert conf["files"] == ["include/eagleflow"]
    strict = [o for o in conf.get("overrides", []) if PROTOCOL_MODULES <= set(o["module"])]
    assert strict, f"no [[tool.mypy.overrides]] lists all of {sorted(PROTOCOL_MODULES)}"
    missing = [f for f in STRICT_FLAGS if strict[0].get(f) is not True]
    assert not missing, f"the protocol modules' override lacks {missing}"
    assert "strict" not in strict[0], "`strict` in an override applies to every module; list the flags"
