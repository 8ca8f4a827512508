"""Which target layers sglang 0.5.23 feeds our exported draft, through its own code from the evaluation's launch
command: its ServerArgs, its ``resolve_spec_aux_hidden_state_config`` (which reads the draft's
``eagle_config.eagle_aux_hidden_state_layer_ids`` the way its model runner does) and its
``configure_aux_hidden_state_capture`` on its own Llama target. The draft is trained on layers that are not
sglang's default for the target's depth, so an export whose ids were removed (sglang then takes its default
without a word) fails the check, and eagleflow's own check refuses it before any server starts.
"""
from __future__ import annotations

import json
import shutil

import pytest

from eagleflow.config import SpecConfig, load_config
from eagleflow.engines.sglang.evaluator import SglangEvalError, build_command, check_drafts
from tests.node.test_export_loads_in_sglang import AUX, _export, _target

N = 8


@pytest.fixture(scope="module")
def target_and_export(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layer_ids_sglang")
    target = _target(tmp / "target")
    return target, _export(tmp, target)


def _layers_sglang_captures(target, export) -> list[int]:
    """The layer outputs (layers_to_capture - 1) sglang's Llama captures for the draft served from ``export``."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture)
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config)
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from transformers import LlamaConfig

    cfg = load_config(data={"target_model": str(target), "server": {"tp": 1, "dtype": "bfloat16"},
                            "eval": {"backend": "sglang"}})
    argv = build_command(cfg, model_path=str(target), host="127.0.0.1", port=31236, draft_dir=str(export),
                         sc=SpecConfig(steps=3, draft_tokens=4))
    server_args = prepare_server_args(argv[3:] + ["--device", "cpu"])
    server_args.resolve_once()
    get_context().set_server_args(server_args)   # what the scheduler process publishes before its model runner
    aux = resolve_spec_aux_hidden_state_config(
        server_args=server_args, model_config=ModelConfig.from_server_args(server_args),
        spec_algorithm=SpeculativeAlgorithm.from_string(server_args.speculative_algorithm), is_draft_worker=False)
    assert aux.eagle_use_aux_hidden_state
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(str(target)))
    configure_aux_hidden_state_capture(
        model=model, eagle_use_aux_hidden_state=aux.eagle_use_aux_hidden_state,
        eagle_aux_hidden_state_layer_ids=aux.eagle_aux_hidden_state_layer_ids,
        dflash_use_aux_hidden_state=aux.dflash_use_aux_hidden_state,
        dflash_target_layer_ids=aux.dflash_target_layer_ids, is_dspark=aux.is_dspark)
    return sorted(c - 1 for c in model.model.layers_to_capture)


def _sglang_default(sglang_world) -> list[int]:
    from sglang.srt.models.llama import LlamaForCausalLM
    from transformers import LlamaConfig
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=N,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    model.set_eagle3_layers_to_capture(None)
    return sorted(c - 1 for c in model.model.layers_to_capture)


def test_sglang_feeds_the_draft_the_layers_it_was_trained_on_not_its_default(target_and_export, sglang_world):
    target, export = target_and_export
    trained_on = json.loads((export / "eagleflow_export.json").read_text())["aux_layer_outputs"]
    assert trained_on == AUX != _sglang_default(sglang_world) == [1, 3, 4]
    assert _layers_sglang_captures(target, export) == AUX
    check_drafts({"draft": export}, target)


def test_an_export_with_its_layer_ids_removed_fails_the_check_and_is_refused(target_and_export, tmp_path,
                                                                            sglang_world):
    target, export = target_and_export
    dropped = tmp_path / "export"
    shutil.copytree(export, dropped)
    conf = json.loads((dropped / "config.json").read_text())
    del conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (dropped / "config.json").write_text(json.dumps(conf))
    captured = _layers_sglang_captures(target, dropped)
    assert captured == _sglang_default(sglang_world), "sglang fed other layers than its default: read its code again"
    assert captured != AUX, "sglang fed the trained layers without the ids: the check could not tell"
    with pytest.raises(SglangEvalError, match=r"names no eagle_aux_hidden_state_layer_ids \(None\): SGLang would "
                                              r"feed the draft its own default layers"):
        check_drafts({"draft": dropped}, target)
