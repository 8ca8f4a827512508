"""eval.backend vllm through vLLM 0.33.0's own classes, on the CPU.

- the evaluation's serve argv (``vllm_backend.build_command``) goes through vLLM's own ``serve`` parser and
  ``create_engine_config``: with a configuration, a real SpeculativeConfig (method eagle3, our export's
  speculators folder, num_speculative_tokens = steps) built from our trained draft; alone, no speculative
  config and ``max_logprobs`` = the lossless rule's candidates;
- the acceptance figures are read from text that vLLM's own ``PrometheusStatLogger`` (its
  ``SpecDecodingProm``) renders after recording ``SpecDecodingStats`` the way its scheduler fills them
  (``observe_draft`` per request per step), rendered by prometheus_client's ``generate_latest``: before and
  after, the differences give exactly vLLM's own mean acceptance length (its ``SpecDecodingLogging``) and
  per-position rates;
- our completion request is validated by vLLM's ``CompletionRequest`` (greedy sampling params, logprobs),
  and an answer whose logprobs vLLM's own serving code builds is read into ids and candidates.

Not constructible on a CPU: vLLM's engine core and GPU model runner (CUDA), so no server runs here; the
order of the servers, their records and the gate are the sglang backend's (.served), tested in tests/unit.
"""
from __future__ import annotations

import json
import shlex

import pytest

from eagleflow.config import SpecConfig, load_config
from eagleflow.engines.vllm import SPECULATORS_DIR
from eagleflow.engines.vllm import evaluator as vb
from eagleflow.evaluate.lossless import TOP_CANDIDATES
from tests.node_vllm.test_export_speculators import trained  # noqa: F401  (the module's trained export)

pytestmark = pytest.mark.timeout(600)


def _cfg(target):
    return load_config(data={"target_model": str(target), "server": {"tp": 1, "dtype": "float32"},
                             "eval": {"backend": "vllm", "configs": [{"steps": 3, "draft_tokens": 4}],
                                      "extra_server_args": ["--max-model-len", "512"]}})


def _vllm_config(argv):
    """The argv through vLLM's own `serve` parser (through a shell's quoting) and engine-config builder."""
    import vllm.entrypoints.cli.serve as serve
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    assert argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="subparser")
    cmd = serve.ServeSubcommand()
    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(shlex.split(shlex.join(argv[3:])))   # an unknown flag or bad JSON exits here
    cmd.validate(args)
    args.model = args.model_tag            # what ServeSubcommand.cmd does first
    return args, AsyncEngineArgs.from_cli_args(args).create_engine_config()


@pytest.mark.parametrize("sc", [SpecConfig(steps=3, draft_tokens=4), SpecConfig(steps=7, draft_tokens=8)],
                         ids=lambda s: s.label)
def test_the_evaluation_command_builds_vllms_eagle3_speculative_config_with_our_draft(trained, sc):  # noqa: F811
    cfg = _cfg(trained["target"])
    argv = vb.build_command(cfg, model_path=str(trained["target"]), host="127.0.0.1", port=31240,
                            draft_dir=str(trained["export"]), sc=sc)
    args, vc = _vllm_config(argv)
    spec = vc.speculative_config
    assert spec.method == "eagle3" and spec.model == str(trained["export"] / SPECULATORS_DIR)
    assert spec.num_speculative_tokens == sc.steps
    assert spec.draft_model_config.architectures == ["Eagle3LlamaForCausalLM"]
    assert (args.host, args.port, vc.parallel_config.tensor_parallel_size, vc.model_config.max_model_len) == \
        ("127.0.0.1", 31240, 1, 512)
    assert vc.model_config.model == str(trained["target"])


def test_the_target_alone_command_has_no_draft_and_answers_the_lossless_candidates(trained):  # noqa: F811
    cfg = _cfg(trained["target"])
    argv = vb.build_command(cfg, model_path=str(trained["target"]), host="127.0.0.1", port=31241, draft_dir=None,
                            sc=None)
    _, vc = _vllm_config(argv)
    assert vc.speculative_config is None
    # vLLM refuses a request for more log-probs than max_logprobs (default 20): the rule reads 32
    assert vc.model_config.max_logprobs == TOP_CANDIDATES == 32


def _stat_logger(trained, steps):  # noqa: F811
    """vLLM's own Prometheus stat logger for an evaluation server's VllmConfig (its SpecDecodingProm inside)."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    argv = vb.build_command(_cfg(trained["target"]), model_path=str(trained["target"]), host="127.0.0.1",
                            port=31242, draft_dir=str(trained["export"]), sc=SpecConfig(steps=steps,
                                                                                        draft_tokens=steps + 1))
    _, vc = _vllm_config(argv)
    return PrometheusStatLogger(vc, engine_indexes=[0, 1])   # two engines (data parallel): summed


def _step(steps, drafts):
    """One scheduler step's stats as vLLM's scheduler fills them: one observe_draft per request that verified
    drafts, (draft tokens proposed, accepted)."""
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats
    stats = SpecDecodingStats.new(steps)
    for proposed, accepted in drafts:
        stats.observe_draft(num_draft_tokens=proposed, num_accepted_tokens=accepted)
    return SchedulerStats(spec_decoding_stats=stats)


def _metrics_text():
    import prometheus_client
    return prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()


def test_the_acceptance_read_from_vllms_own_metrics_is_vllms_mean_acceptance_length(trained):  # noqa: F811
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging
    logger = _stat_logger(trained, 3)
    # warm-up and an earlier prompt set: counted before, so not in the difference
    logger.record(scheduler_stats=_step(3, [(3, 3), (3, 3)]), iteration_stats=None, engine_idx=0)
    before = vb.parse_spec_counters(_metrics_text())
    assert (before.drafts, before.accepted, before.accepted_per_pos) == (2, 6, (2, 2, 2))

    steps_of_the_set = [(0, [(3, 2), (3, 0)]), (1, [(3, 3)]), (0, [(3, 1), (2, 2)])]
    vllm_log = SpecDecodingLogging()
    for engine_idx, drafts in steps_of_the_set:
        stats = _step(3, drafts)
        logger.record(scheduler_stats=stats, iteration_stats=None, engine_idx=engine_idx)
        vllm_log.observe(stats.spec_decoding_stats)
    delta = vb.parse_spec_counters(_metrics_text()) - before
    # 5 drafts, 14 tokens proposed, 8 accepted: at position 0 four drafts, at 1 three, at 2 one
    assert (delta.drafts, delta.draft_tokens, delta.accepted) == (5, 14, 8)
    assert delta.accepted_per_pos == (4, 3, 1)

    said = []
    vllm_log.log(log_fn=lambda fmt, *a: said.append(a))
    # v1/spec_decode/metrics.py:114 (vLLM 0.33.0): mean_acceptance_length = 1 + (num_accepted_tokens / num_drafts)
    vllm_mean, vllm_rates = said[0][0], said[0][5]
    alone = {"p": {"tokens": [5, 6, 7]}}
    m = vb.measure(delta, {"p": {"tokens": [5, 6, 7]}}, alone, 1.0, 2.0, 3, 0.1)
    assert m["accept_length"] == vllm_mean == 1 + 8 / 5
    assert m["accepted_at_position"] == [0.8, 0.6, 0.2] and vllm_rates == "0.800, 0.600, 0.200"
    assert m["verify_passes"] == 5 and m["correct_drafts"] == 8 and m["draft_acceptance_rate"] == round(8 / 14, 4)
    assert m["lossless"] and m["speedup"] == 2.0


def test_a_server_whose_counters_do_not_move_is_not_decoding_speculatively(trained):  # noqa: F811
    _stat_logger(trained, 3)   # the counters exist, at zero
    delta = vb.parse_spec_counters(_metrics_text()) - vb.parse_spec_counters(_metrics_text())
    with pytest.raises(vb.VllmEvalError, match="spec_decode_num_drafts did not move: the server is not decoding "
                                               "speculatively"):
        vb.measure(delta, {"p": {"tokens": [1, 2, 3]}}, {"p": {"tokens": [1, 2, 3]}}, 1.0, 1.0, 3, 0.1)
    # a server without a speculative config has no spec-decode counters at all
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    cfg = _cfg(trained["target"])
    _, vc = _vllm_config(vb.build_command(cfg, model_path=str(trained["target"]), host="127.0.0.1", port=31243,
                                          draft_dir=None, sc=None))
    PrometheusStatLogger(vc)
    with pytest.raises(vb.VllmEvalError, match=r"has no vllm:spec_decode_num_drafts_total"):
        vb.parse_spec_counters(_metrics_text())


def test_our_completion_request_is_vllms_greedy_request_and_its_answer_reads_as_ids_and_candidates():
    from types import SimpleNamespace

    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.completion.protocol import (CompletionRequest, CompletionResponse,
                                                             CompletionResponseChoice)
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.logprobs import Logprob
    from vllm.sampling_params import SamplingType

    body = vb.completion_request([1, 2, 3], 16, candidates=True)
    req = CompletionRequest(**json.loads(json.dumps(body)))
    sp = req.to_sampling_params(16, {})
    assert sp.sampling_type == SamplingType.GREEDY and sp.max_tokens == 16 and sp.logprobs == TOP_CANDIDATES
    assert req.prompt == [1, 2, 3] and req.return_token_ids and req.return_tokens_as_token_ids

    # the answer's logprobs as vLLM's serving code builds them (the sampled token first, as vLLM orders them)
    ids = [7, 9]
    top = [{7: Logprob(-0.1, 1), 8: Logprob(-0.6, 2), 3: Logprob(-9.0, 3)},
           {8: Logprob(-0.2, 1), 9: Logprob(-0.4, 2)}]
    serving = SimpleNamespace(return_tokens_as_token_ids=False,
                              _get_decoded_token=GenerateBaseServing._get_decoded_token)
    lp = OpenAIServingCompletion._create_completion_logprobs(serving, ids, top, TOP_CANDIDATES, None,
                                                              return_as_token_id=req.return_tokens_as_token_ids)
    answer = CompletionResponse(model="t", choices=[CompletionResponseChoice(
        index=0, text="", logprobs=lp, finish_reason="length", token_ids=ids)],
        usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}).model_dump(mode="json")
    got = vb.read_completion(answer, "p", candidates=True)
    assert got["tokens"] == [7, 9] and got["finish_reason"] == "length"
    assert got["candidates"] == [[(7, -0.1), (8, -0.6), (3, -9.0)], [(8, -0.2), (9, -0.4)]]
    # the second token is the target's second choice, 0.2 below its top: a mismatch the rule judges on it
    from eagleflow.evaluate.lossless import first_difference
    mm = first_difference([7, 8], got["tokens"], lambda i: got["candidates"][i], lambda top: 0.1)
    assert mm["emitted_rank"] == 2 and mm["emitted_logit_gap"] == pytest.approx(0.2) and not mm["near_tie"]
