"""The launcher's command line, parsed and resolved by sglang 0.5.23's own server-argument code."""
from __future__ import annotations

import json

import pytest
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.server_args import prepare_server_args

from eagleflow.engines.sglang.layers import layer_outputs_from_sglang_ids, sglang_aux_layer_ids
from eagleflow.serving.aux_layers import default_aux_layers, target_architectures_and_layers
from eagleflow.engines.sglang.launcher import SglangLaunchError, build_command, check_model_supports_capture
from eagleflow.config import ConfigError, load_config
from tests.fixtures.train_hidden_states import NOT_DEFAULT_AUX_LAYERS

N_LAYERS = 8
# layer outputs that are not sglang's default for 8 layers ([1, 3, 4]): a launch that lost the ids would capture
# the default ones, and the checks below would see it
AUX = NOT_DEFAULT_AUX_LAYERS


def _llama(d):
    from transformers import LlamaConfig
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                architectures=["LlamaForCausalLM"]).save_pretrained(d)
    return d


def _deepseek_v3(d):
    """Kimi-K2/K2.5's text model is a DeepseekV3ForCausalLM (sglang deepseek_v2.py): MLA, MoE, dense first layer."""
    from transformers import DeepseekV3Config
    DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=N_LAYERS,
                     num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                     qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=256,
                     max_position_embeddings=512, n_group=1, topk_group=1,
                     architectures=["DeepseekV3ForCausalLM"]).save_pretrained(d)
    return d


def _argv(model_dir, extra=()):
    cfg = load_config(data={"target_model": str(model_dir),
                            "capture": {"backend": "sglang"},
                            "server": {"tp": 1, "dtype": "bfloat16", "extra_server_args": list(extra)}})
    archs, n = target_architectures_and_layers(json.loads((model_dir / "config.json").read_text()))
    ids = sglang_aux_layer_ids(AUX, archs, n)
    argv = build_command(cfg, model_path=str(model_dir), host="127.0.0.1", port=31000, sglang_layer_ids=ids,
                         python="python")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    # The one flag added here: this machine has no GPU, and resolution asks the platform for its device.
    return argv[3:] + ["--device", "cpu"], ids, archs


@pytest.mark.parametrize("make_target", [_llama, _deepseek_v3], ids=["llama", "deepseek-v3"])
def test_sglang_accepts_and_resolves_the_extraction_flags(tmp_path, make_target):
    model = make_target(tmp_path / "target")
    argv, ids, archs = _argv(model)
    server_args = prepare_server_args(argv)     # argparse: an unknown flag exits here
    server_args.resolve_once()                  # sglang's validation and resolution hooks
    cfg = resolving_view(server_args)
    assert cfg.aux_hidden_state_capture == "eagle3" and cfg.speculative_algorithm is None, \
        "capture without a draft: the algorithm only names the convention"
    assert list(cfg.return_aux_hidden_state_layer_ids) == ids
    assert layer_outputs_from_sglang_ids(ids, archs, N_LAYERS) == AUX != default_aux_layers(N_LAYERS)
    assert cfg.return_hidden_states_mode == "full"
    assert cfg.disable_radix_cache is True and cfg.chunked_prefill_size == -1
    graphs = cfg.cuda_graph_config
    assert graphs.decode.backend == "disabled" and graphs.prefill.backend == "disabled"
    assert cfg.pp_size == 1 and cfg.tp_size == 1


def test_an_unknown_flag_is_refused_by_sglang(tmp_path, capsys):
    argv, _, _ = _argv(_llama(tmp_path / "t"), extra=["--no-such-sglang-flag", "1"])
    with pytest.raises(SystemExit):
        prepare_server_args(argv)
    assert "unrecognized arguments: --no-such-sglang-flag" in capsys.readouterr().err


def test_a_conflicting_flag_is_refused_by_the_config_and_by_sglang(tmp_path):
    """A speculative flag is eagleflow's (eagleflow.server_flags): server.extra_server_args may not set it; one
    appended past the config anyway is refused by sglang's own resolution too."""
    model = _llama(tmp_path / "t")
    with pytest.raises(ConfigError, match="server.extra_server_args sets --speculative-draft-model-path"):
        _argv(model, extra=["--speculative-draft-model-path", str(model)])
    argv, _, _ = _argv(model)
    server_args = prepare_server_args(argv + ["--speculative-draft-model-path", str(model)])
    with pytest.raises(ValueError, match="captures without a draft"):
        server_args.resolve_once()


def test_model_classes_from_sglangs_registry(tmp_path):
    assert check_model_supports_capture(str(_llama(tmp_path / "l"))) == "LlamaForCausalLM"
    assert check_model_supports_capture(str(_deepseek_v3(tmp_path / "d"))) == "DeepseekV3ForCausalLM"
    bert = tmp_path / "b"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "num_hidden_layers": 4}))
    with pytest.raises(SglangLaunchError, match="BertModel .*has no set_eagle3_layers_to_capture"):
        check_model_supports_capture(str(bert))
