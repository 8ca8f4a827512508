"""The run report's serve command (target + our EAGLE-3 draft), parsed and resolved by sglang 0.5.23 itself."""
from __future__ import annotations

import ast
import inspect
import json
import shlex
import subprocess
import sys
import textwrap

from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.server_args import prepare_server_args

from eagleflow.config import load_config
from eagleflow.engines.sglang.serve import serve_command
from tests.node.test_export_loads_in_sglang import _export, _target
from tests.node.test_plugin_registration import plain_env


def test_sglang_resolves_the_serve_command_with_our_export(tmp_path):
    target = _target(tmp_path / "target")
    export = _export(tmp_path, target)
    cfg = load_config(data={"target_model": str(target), "capture": {"backend": "sglang"}, "server": {"tp": 1, "dtype": "bfloat16"}})
    argv = shlex.split(serve_command(cfg, str(export)))
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    server_args = prepare_server_args(argv[3:] + ["--device", "cpu"])   # argparse: an unknown flag exits here
    server_args.resolve_once()
    view = resolving_view(server_args)
    assert view.speculative_algorithm == "EAGLE3"
    assert view.speculative_draft_model_path == str(export)
    assert (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (3, 1, 4)
    assert view.tp_size == 1 and view.dtype == "bfloat16"


def test_the_serve_command_loads_every_plugin_and_serves_untouched(tmp_path):
    """`python -m sglang.launch_server` with the report's arguments, in the node's venv as a person runs it
    (no SGLANG_PLUGINS, so sglang loads every installed plugin, ours too): up to the point where the HTTP
    server would start, nothing exits and the target method is not wrapped."""
    import sglang.launch_server as ls
    main = next(n for n in ast.parse(inspect.getsource(ls)).body
                if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    calls = [c.func.id for c in ast.walk(main) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    assert calls.index("load_plugins") < calls.index("prepare_server_args") < calls.index("run_server")

    target = _target(tmp_path / "target")
    export = _export(tmp_path, target)
    cfg = load_config(data={"target_model": str(target),
                            "capture": {"backend": "sglang"}, "server": {"tp": 1, "dtype": "bfloat16"}})
    argv = shlex.split(serve_command(cfg, str(export)))[3:] + ["--device", "cpu"]
    code = textwrap.dedent("""
        import json, sys
        import sglang.srt.managers.tp_worker as tw
        original = tw.TpModelWorker.forward_batch_generation
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang.srt.server_args import prepare_server_args
        load_plugins()                                   # what launch_server's __main__ does, in its order
        server_args = prepare_server_args(sys.argv[1:])
        server_args.resolve_once()                       # run_server's first step
        ours = [t for t, hooks in HookRegistry._hooks.items()
                if any(src is not None and src.plugin_name == "eagleflow_capture" for _, _, src in hooks)]
        print(json.dumps({"untouched": tw.TpModelWorker.forward_batch_generation is original, "ours": ours,
                          "draft": resolving_view(server_args).speculative_draft_model_path}))
    """)
    res = subprocess.run([sys.executable, "-c", code, *argv], env=plain_env(), capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"untouched": True, "ours": [], "draft": str(export)}
    assert "eagleflow capture: not a capture launch" in res.stderr and "FATAL" not in res.stderr
