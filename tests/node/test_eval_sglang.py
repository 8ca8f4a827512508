"""eval.backend sglang against sglang 0.5.23's own code: the evaluation's launch command, parsed and resolved by
its ServerArgs with our export, and the /generate answer's meta_info built by its own tokenizer manager from
counters as its scheduler fills them, read by our evaluator."""
from __future__ import annotations

import inspect

import pytest

from eagleflow.config import SpecConfig, load_config
from eagleflow.engines.sglang.evaluator import build_command, measure, read_answer
from tests.node.test_export_loads_in_sglang import _export, _target


@pytest.fixture(scope="module")
def target_and_export(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval_sglang")
    target = _target(tmp / "target")
    return target, _export(tmp, target)


def _cfg(target):
    return load_config(data={"target_model": str(target), "server": {"tp": 1, "dtype": "bfloat16"},
                             "eval": {"backend": "sglang",
                                      "extra_server_args": ["--mem-fraction-static", "0.7"]}})


def _resolved(argv):
    from sglang.srt.server_args import prepare_server_args
    server_args = prepare_server_args(argv[3:] + ["--device", "cpu"])   # argparse: an unknown flag exits here
    server_args.resolve_once()
    return server_args


@pytest.mark.parametrize("sc", [SpecConfig(steps=3, draft_tokens=4), SpecConfig(steps=7, draft_tokens=8),
                                SpecConfig(steps=3, topk=4, draft_tokens=8)], ids=lambda s: s.label)
def test_the_evaluation_command_resolves_in_sglang_with_our_export(target_and_export, sc):
    from sglang.srt.arg_groups.overrides import resolving_view
    target, export = target_and_export
    argv = build_command(_cfg(target), model_path=str(target), host="127.0.0.1", port=31234,
                         draft_dir=str(export), sc=sc)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    view = resolving_view(_resolved(argv))
    assert view.speculative_algorithm == "EAGLE3" and view.speculative_draft_model_path == str(export)
    assert (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens) == \
        (sc.steps, sc.topk, sc.draft_tokens)
    assert (view.host, view.port, view.tp_size, view.dtype, view.mem_fraction_static) == \
        ("127.0.0.1", 31234, 1, "bfloat16", 0.7)


def test_the_target_alone_command_has_no_draft(target_and_export):
    from sglang.srt.arg_groups.overrides import resolving_view
    target, _ = target_and_export
    argv = build_command(_cfg(target), model_path=str(target), host="127.0.0.1", port=31235, draft_dir=None,
                         sc=None)
    view = resolving_view(_resolved(argv))
    assert view.speculative_algorithm is None and view.speculative_draft_model_path is None


@pytest.fixture
def published_spec(target_and_export):
    """sglang's runtime context holding the server args of a 3/1/4 evaluation server (what get_spec() reads in
    the tokenizer manager), restored after the test."""
    from sglang.srt.runtime_context import get_context
    target, export = target_and_export
    ctx = get_context()
    saved = (ctx._server_args, ctx._config_bags, ctx.parallel._config, ctx._overrides_log, ctx._publish_role)
    argv = build_command(_cfg(target), model_path=str(target), host="127.0.0.1", port=31236,
                         draft_dir=str(export), sc=SpecConfig(steps=3, draft_tokens=4))
    ctx.set_server_args(_resolved(argv))
    yield
    ctx._server_args, ctx._config_bags, ctx.parallel._config, ctx._overrides_log, ctx._publish_role = saved


def _answer_as_sglang_writes_it(rid: str, prompt: list[int], passes: list[int], output_ids: list[int]) -> dict:
    """One finished request through sglang's own objects: a Req whose counters move per verify pass as
    ``batch_result_processor`` moves them, the BatchStrOutput the output streamer fills from it, the meta_info
    ``TokenizerManager`` builds (completion_tokens, then ``_calculate_spec_decoding_metrics``), and the
    non-streaming answer dict of ``_handle_batch_output``."""
    from sglang.srt.managers.io_struct import BatchStrOutput
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.sampling.sampling_params import SamplingParams
    req = Req(rid, "", prompt, SamplingParams(max_new_tokens=len(output_ids), temperature=0))
    for correct in passes:                      # batch_result_processor, per verify pass
        req.spec_verify_ct += 1
        req.spec_num_correct_drafts += correct
        req.update_spec_correct_drafts_histogram(correct)
    n = len(output_ids)
    none = [None]
    out = BatchStrOutput(
        rids=[rid], finished_reasons=[{"type": "length", "length": n}], output_strs=[""], output_ids=[output_ids],
        prompt_tokens=[len(prompt)], completion_tokens=[n], reasoning_tokens=[0], cached_tokens=[0],
        input_token_logprobs_val=none, input_token_logprobs_idx=none, output_token_logprobs_val=none,
        output_token_logprobs_idx=none, input_top_logprobs_val=none, input_top_logprobs_idx=none,
        output_top_logprobs_val=none, output_top_logprobs_idx=none, input_token_ids_logprobs_val=none,
        input_token_ids_logprobs_idx=none, output_token_ids_logprobs_val=none, output_token_ids_logprobs_idx=none,
        output_token_entropy_val=None, output_token_sampling_mask=None, output_hidden_states=None,
        routed_experts=None, indexer_topk=None, placeholder_tokens_idx=None, placeholder_tokens_val=None,
        # output_streamer: appended from the Req when the server speculates
        spec_verify_ct=[req.spec_verify_ct], spec_num_correct_drafts=[req.spec_num_correct_drafts],
        spec_correct_drafts_histogram=[req.spec_correct_drafts_histogram])
    meta_info = {"id": rid, "finish_reason": out.finished_reasons[0], "prompt_tokens": out.prompt_tokens[0],
                 "completion_tokens": out.completion_tokens[0]}
    TokenizerManager._calculate_spec_decoding_metrics(None, meta_info, out, 0)   # self is not read
    return {"text": "", "output_ids": list(out.output_ids[0]), "meta_info": meta_info}


def test_sglangs_own_counters_read_as_the_hf_backend_reports_them(published_spec):
    # the scheduler counts what we read: one verify pass = one increment, correct drafts without the bonus
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp
    src = inspect.getsource(brp)
    for line in ("req.spec_verify_ct += 1", "req.spec_num_correct_drafts += num_correct_drafts",
                 "req.update_spec_correct_drafts_histogram(num_correct_drafts)"):
        assert line in src, line

    # a draft that is never right: 1 prefill token + 8 passes of one token each
    never = _answer_as_sglang_writes_it("never", [1, 2, 3], [0] * 8, list(range(10, 19)))
    assert never["meta_info"]["spec_accept_length"] == 9 / 8          # sglang's figure: above 1.0
    # a good draft: accepted 3, 0, 2, 3 of 3 drafts; 1 + 4 + 1 + 3 + 4 = 13 tokens
    good = _answer_as_sglang_writes_it("good", [4, 5], [3, 0, 2, 3], list(range(20, 33)))
    assert good["meta_info"]["spec_verify_ct"] == 4 and good["meta_info"]["spec_num_correct_drafts"] == 8
    assert good["meta_info"]["spec_correct_drafts_histogram"] == [1, 0, 1, 2]

    read = {"never": read_answer(never, "never", True), "good": read_answer(good, "good", True)}
    alone = {k: {"tokens": v["tokens"]} for k, v in read.items()}
    m = measure({"never": read["never"]}, alone, 1.0, 1.0, 3, 0.1)
    assert m["accept_length"] == 1.0 and m["sglang_accept_length"] == 1.125 and m["accepted_at_position"] == [0, 0, 0]
    m = measure({"good": read["good"]}, alone, 1.0, 2.0, 3, 0.1)
    assert m["accept_length"] == (8 + 4) / 4 and m["sglang_accept_length"] == 13 / 4
    assert m["accepted_at_position"] == [0.75, 0.75, 0.5] and m["lossless"] and m["speedup"] == 2.0
    both = measure(read, alone, 1.0, 1.0, 3, 0.1)
    assert both["accept_length"] == round((8 + 12) / 12, 4) and both["verify_passes"] == 12


def test_an_answer_without_counters_from_a_speculating_run_is_refused(published_spec):
    ans = _answer_as_sglang_writes_it("none", [1], [], list(range(5)))
    assert "spec_verify_ct" not in ans["meta_info"]      # sglang writes the spec_* fields only after a pass
    from eagleflow.engines.sglang.evaluator import SglangEvalError
    with pytest.raises(SglangEvalError, match="not decoding speculatively"):
        read_answer(ans, "none", True)
