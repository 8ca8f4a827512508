"""The run report's serve command (target + our EAGLE-3 draft), parsed and resolved by sglang 0.5.23 itself."""
from __future__ import annotations

import shlex

from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.server_args import prepare_server_args

from eagleflow.config import load_config
from eagleflow.console.run_report import serve_command
from tests.node.test_export_loads_in_sglang import _export, _target


def test_sglang_resolves_the_serve_command_with_our_export(tmp_path):
    target = _target(tmp_path / "target")
    export = _export(tmp_path, target)
    cfg = load_config(data={"target_model": str(target), "capture": {"backend": "sglang", "tp": 1, "dtype": "bfloat16"}})
    argv = shlex.split(serve_command(cfg, str(export)))
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    server_args = prepare_server_args(argv[3:] + ["--device", "cpu"])   # argparse: an unknown flag exits here
    server_args.resolve_once()
    view = resolving_view(server_args)
    assert view.speculative_algorithm == "EAGLE3"
    assert view.speculative_draft_model_path == str(export)
    assert (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (3, 1, 4)
    assert view.tp_size == 1 and view.dtype == "bfloat16"
