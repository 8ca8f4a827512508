"""`eval.backend: vllm` (issue 40, item 4) in the control plane's venv, which has no vLLM.

- the config takes it on a GPU node, and refuses a top-k > 1 configuration with it by name (vLLM's EAGLE-3
  drafts chains only: the registry's eval_trees flag);
- `eagleflow evaluate` with it and no vLLM installed fails fast (a real process, before any server), naming
  requirements-node-vllm.txt;
- the evaluation's control plane (the servers shared with the sglang backend in evaluate/served.py: started
  detached and recorded, polled, warmed up, stopped by their records; vLLM's counters read before and after
  each prompt set; the lossless rule on the reference's log-probabilities; the gate) against a stand-in
  vLLM server: this file run as a script (``_fake_vllm``) that takes the flags ``vllm_backend.build_command``
  passes and answers ``/health``, ``/v1/completions`` (token ids, ``logprobs`` keyed ``token_id:<id>``,
  refused above ``--max-logprobs`` as vLLM refuses it) and ``/metrics`` with vLLM 0.33's spec-decode counter
  names, counted as its scheduler counts them (tests/node_vllm/test_vllm_eval.py reads the same names from
  vLLM's own metric objects).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagleflow.config import ConfigError, load_config
from eagleflow.engines import eval_engine, names_for
from eagleflow.layout import RunLayout
from eagleflow.nodes.process_record import records_in

SELF = str(Path(__file__).resolve())


# --- the config ---------------------------------------------------------------------------------------------

def test_the_config_takes_eval_backend_vllm_on_a_gpu_node_and_refuses_trees_by_name(monkeypatch):
    cfg = load_config(data={"target_model": "/models/t", "node": {"has_gpu": True}, "eval": {"backend": "vllm"}})
    assert cfg.eval.backend == "vllm" and "vllm" in names_for("evaluator")
    from eagleflow.engines.vllm import evaluator as vllm_backend
    # the registered evaluator is vllm_backend.results (the engine's role imports it when called)
    monkeypatch.setattr(vllm_backend, "results", lambda c, lay, **kw: ([{"via": "vllm_backend.results"}], kw))
    rows, kw = eval_engine(cfg).evaluate(cfg, "layout", target_dir="/t", drafts={}, prompt_sets={}, log=print)
    assert rows == [{"via": "vllm_backend.results"}] and kw["target_dir"] == "/t"
    monkeypatch.undo()
    assert eval_engine(cfg).eval_server_per_config   # the operator gives each server's load its time
    with pytest.raises(ConfigError) as e:
        load_config(data={"target_model": "/models/t", "node": {"has_gpu": True},
                          "eval": {"backend": "vllm", "configs": [{"steps": 3, "draft_tokens": 4},
                                                                  {"steps": 3, "topk": 4, "draft_tokens": 8}]}})
    msg = str(e.value)
    assert ("eval.configs 3/4/8: the vllm evaluator drafts chains only (topk 1); use eval.backend sglang for "
            "top-k > 1") in msg, msg
    assert "3/1/4" not in msg


@pytest.mark.timeout(300)
def test_evaluate_with_vllm_and_no_vllm_installed_fails_fast_naming_what_to_install(tmp_path, demo_assets):
    import importlib.util

    from eagleflow.corpus.prepare import prepare_corpus
    from tests.fixtures.pipeline_config import write_short_config
    assert importlib.util.find_spec("vllm") is None, "this test proves the control plane's venv, without vLLM"
    cfgp = write_short_config(tmp_path, demo_assets, node={"name": "local", "has_gpu": True,
                                                           "state_dir": str(tmp_path / "node-state")},
                              corpus={"eval_fraction": 0.05, "eval_min_records": 2},
                              eval={"backend": "vllm", "baseline_draft": "none"}, generate={"backend": "hf"})
    cfg = load_config(cfgp)
    layout = RunLayout.for_run(cfg, "r1")
    prepare_corpus(cfg, layout, num_proc=1, log=lambda _m: None)
    draft = _export(tmp_path / "draft", accept=1)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "eagleflow.cli", "evaluate", "--config", str(cfgp), "--run-id", "r1",
                          "--draft", str(draft)], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "eagleflow evaluate: eval.backend vllm: vLLM is not installed in this interpreter" in out.stderr, out.stderr
    assert "eval.backend vllm runs `eagleflow evaluate` in the node's vLLM venv" in out.stderr, out.stderr
    assert "requirements-node-vllm.txt" in out.stderr, out.stderr
    assert time.monotonic() - t0 < 60
    # nothing was started: no server record, no server log
    assert records_in(str(layout.pids_dir), "r1") == []
    assert not list(Path(str(layout.run_dir)).rglob("eval_vllm_*"))


# --- the control plane against a stand-in vLLM --------------------------------------------------------------

def _export(d: Path, **quality) -> Path:
    """An export directory with its speculators folder (what the stand-in reads: how good the 'draft' is)."""
    (d / "speculators").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    # the ids are checked before any server starts (vLLM would take its default layers without them)
    (d / "speculators" / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [3, 6, 7]}))
    (d / "speculators" / "fake_draft.json").write_text(json.dumps(quality))
    return d


def _setup(tmp_path, **eval_cfg):
    cfg = load_config(data={"run_root": str(tmp_path / "runs"), "target_model": str(tmp_path / "target"),
                            "node": {"has_gpu": True, "state_dir": str(tmp_path / "node-state")},
                            "server": {"dtype": "bfloat16"},
                            "eval": {"backend": "vllm", "concurrency": 4, "max_new_tokens": 16,
                                     "ready_timeout_s": 30, "configs": [{"steps": 3, "draft_tokens": 4},
                                                                         {"steps": 7, "draft_tokens": 8}],
                                     **eval_cfg}})
    layout = RunLayout.for_run(cfg, "ev")
    Path(str(layout.run_dir)).mkdir(parents=True)
    return cfg, layout


def _fake_command(extra=()):
    from eagleflow.engines.vllm import evaluator as vb

    def command(cfg, *, model_path, host, port, draft_dir, sc, python=sys.executable):
        argv = vb.build_command(cfg, model_path=model_path, host=host, port=port, draft_dir=draft_dir, sc=sc)
        return [python, SELF, *argv[4:], *extra]   # vLLM's own flags (after `-m ... serve`), answered by the fake
    return command


def _prompts(n, base=0):
    return [{"id": f"p{i}", "prompt_ids": [base + i, 5, 9]} for i in range(n)]


@pytest.mark.timeout(120)
def test_acceptance_from_vllms_counters_per_configuration_and_prompt_set_and_every_server_stopped(tmp_path):
    from eagleflow.engines.vllm import evaluator as vb
    from eagleflow.evaluate.run import gate
    cfg, layout = _setup(tmp_path)
    drafts = {"draft": _export(tmp_path / "new", accept=2), "baseline": _export(tmp_path / "old", accept=0)}
    logs = []
    rows, about = vb.results(cfg, layout, target_dir=str(tmp_path / "target"), drafts=drafts,
                             prompt_sets={"held_out": _prompts(6), "mine": _prompts(3, 40)}, log=logs.append,
                             command=_fake_command())
    assert [(r["config"], r["prompt_set"], r["prompts"]) for r in rows] == [
        ("3/1/4", "held_out", 6), ("3/1/4", "mine", 3), ("7/1/8", "held_out", 6), ("7/1/8", "mine", 3)]
    for r in rows:
        new, old = r["draft"], r["baseline"]
        # 16 tokens a prompt: 1 from the prefill, then 5 verify steps of 2 accepted + bonus; the warm-up request
        # and the other prompt set also moved the counters, but before this set's first read
        assert new["accept_length"] == 1 + 10 / 5 == 3.0 and new["verify_passes"] == 5 * r["prompts"]
        steps = r["steps"]
        assert new["accepted_at_position"] == [1.0, 1.0] + [0.0] * (steps - 2)
        assert new["draft_tokens"] == 5 * steps * r["prompts"]
        assert new["lossless"] and not new["mismatches"]
        assert old["accept_length"] == 1.0 and old["accepted_at_position"] == [0.0] * steps
        assert new["tokens_per_s"] > 0 and new["target_tokens_per_s"] > 0
    assert gate(rows, cfg, baseline=True) == []
    assert about["device"] == "vllm" and about["target_dtype"] == "bfloat16"
    # one alone server + 2 configurations x 2 drafts, each started, ready, stopped by its record
    started = [m for m in logs if ", log " in m]
    assert len(started) == 5 and "--speculative-config" not in started[0] and "--max-logprobs 32" in started[0]
    assert sum(f'"model":"{tmp_path / "new" / "speculators"}","num_speculative_tokens":7' in m
               for m in started) == 1
    assert len([m for m in logs if m.endswith("terminated")]) == 5
    assert records_in(str(layout.pids_dir), "ev") == []


@pytest.mark.timeout(120)
def test_a_never_accepted_draft_and_a_lossy_server_are_refused_by_the_gate(tmp_path):
    from eagleflow.engines.vllm import evaluator as vb
    from eagleflow.evaluate.run import gate
    cfg, layout = _setup(tmp_path, configs=[{"steps": 3, "draft_tokens": 4}])
    rows, _ = vb.results(cfg, layout, target_dir=str(tmp_path / "target"),
                         drafts={"draft": _export(tmp_path / "bad", accept=0, corrupt_at=4)},
                         prompt_sets={"held_out": _prompts(2)}, log=lambda m: None, command=_fake_command())
    [row] = rows
    d = row["draft"]
    assert d["accept_length"] == 1.0 and not d["lossless"]
    # the emitted token is the target's second choice, 8.9 below its top: beyond bf16's tolerance (1.0)
    m = d["mismatches"][0]
    assert m["position"] == 4 and m["emitted_rank"] == 2 and m["emitted_logit_gap"] == 8.9 and not m["near_tie"]
    why = gate(rows, cfg, baseline=False)
    assert why[0] == ("configuration 3/1/4 on held_out (2 prompts): acceptance length 1.000 is below "
                      "eval.min_accept_length 1.500")
    assert "position 4 (emitted token " in why[1] and "ranked 2 in the target's distribution, 8.9 below" in why[1]


@pytest.mark.timeout(120)
def test_a_draft_without_its_speculators_folder_and_a_dying_server_are_named(tmp_path):
    from eagleflow.engines.vllm import evaluator as vb
    cfg, layout = _setup(tmp_path)
    sglang_only = tmp_path / "sglang-only"
    sglang_only.mkdir()
    (sglang_only / "config.json").write_text("{}")
    with pytest.raises(vb.VllmEvalError, match=r"draft draft .*sglang-only has no .*sglang-only/speculators/"
                                                r"config\.json .*train\.export_formats including speculators"):
        vb.results(cfg, layout, target_dir=str(tmp_path / "target"), drafts={"draft": sglang_only},
                   prompt_sets={"held_out": _prompts(1)}, log=lambda m: None, command=_fake_command())
    assert not Path(str(layout.log_file("eval_vllm_target"))).exists()   # refused before any server
    with pytest.raises(vb.VllmEvalError, match=r"vllm \(eval_vllm_target\) exited while loading; read "
                                                r".*eval_vllm_target\.log"):
        vb.results(cfg, layout, target_dir=str(tmp_path / "target"), drafts={"draft": _export(tmp_path / "d")},
                   prompt_sets={"held_out": _prompts(1)}, log=lambda m: None,
                   command=_fake_command(["--die-while-loading"]))
    assert records_in(str(layout.pids_dir), "ev") == []
    assert "dying while loading" in Path(str(layout.log_file("eval_vllm_target"))).read_text()


# --- the stand-in vLLM server (this file run as a script) ----------------------------------------------------

def _fake_vllm() -> int:
    import argparse
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CollectorRegistry, Counter, generate_latest

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--speculative-config")
    ap.add_argument("--max-logprobs", type=int, default=20)   # vLLM's ModelConfig default
    ap.add_argument("--die-while-loading", action="store_true")
    a, _rest = ap.parse_known_args()
    if a.die_while_loading:
        print("fake vllm: dying while loading", flush=True)
        return 3
    spec = json.loads(a.speculative_config) if a.speculative_config else None
    draft = json.loads((Path(spec["model"]) / "fake_draft.json").read_text()) if spec else None
    steps = spec["num_speculative_tokens"] if spec else 0
    # vLLM 0.33's SpecDecodingProm names and labels (present only with a speculative config)
    reg = CollectorRegistry()
    lv = [a.model, "0"]
    if spec:
        drafts_c = Counter("vllm:spec_decode_num_drafts", "d", ["model_name", "engine"], registry=reg).labels(*lv)
        tokens_c = Counter("vllm:spec_decode_num_draft_tokens", "t", ["model_name", "engine"], registry=reg).labels(*lv)
        acc_c = Counter("vllm:spec_decode_num_accepted_tokens", "a", ["model_name", "engine"], registry=reg).labels(*lv)
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "p", ["model_name", "engine", "position"],
                          registry=reg)
        pos_c = [per_pos.labels(*lv, str(i)) for i in range(steps)]
    lock = threading.Lock()
    time.sleep(0.5)   # loading: the evaluator polls /health until it answers

    def next_token(t: int) -> int:
        return (7 * t + 3) % 97

    class H(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, obj, status=200, ctype="application/json"):
            data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(b"", ctype="text/plain")
            if self.path == "/metrics":
                return self._send(generate_latest(reg), ctype="text/plain; version=0.0.4")
            self.send_error(404)

        def do_POST(self):
            if self.path != "/v1/completions":
                return self.send_error(404)
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            k = req.get("logprobs")
            if k is not None and k > a.max_logprobs:   # vLLM's own refusal
                return self._send({"error": {"message": f"Requested sample logprobs of {k}, which is greater "
                                                        f"than max allowed: {a.max_logprobs}"}}, status=400)
            prompt, n = req["prompt"], req["max_tokens"]
            out, t = [], prompt[-1]
            for _ in range(n):
                t = next_token(t)
                out.append(t)
            if draft and draft.get("corrupt_at") is not None and draft["corrupt_at"] < n:
                out[draft["corrupt_at"]] = (out[draft["corrupt_at"]] + 1) % 97
            choice = {"index": 0, "text": "", "finish_reason": "length",
                      "token_ids": out if req.get("return_token_ids") else None, "logprobs": None}
            if k:
                assert req.get("return_tokens_as_token_ids")
                choice["logprobs"] = {"tokens": [f"token_id:{x}" for x in out],
                                      "token_logprobs": [-0.1] * n, "text_offset": [0] * n,
                                      "top_logprobs": [{f"token_id:{x}": -0.1, f"token_id:{(x + 1) % 97}": -9.0}
                                                       for x in out]}
            if draft:   # the scheduler's observe_draft per verify step: the prefill made the first token
                per, left = min(draft["accept"], steps), n - 1
                with lock:
                    while left > 0:
                        got = min(per, left - 1)
                        drafts_c.inc()
                        tokens_c.inc(steps)
                        acc_c.inc(got)
                        for i in range(got):
                            pos_c[i].inc()
                        left -= got + 1
            self._send({"id": "cmpl-1", "object": "text_completion", "model": a.model, "choices": [choice],
                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                  "total_tokens": len(prompt) + n}})

    srv = ThreadingHTTPServer((a.host, a.port), H)
    print(f"fake vllm serving {a.model} at {a.host}:{a.port}", flush=True)
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(_fake_vllm())


def test_the_draft_check_looks_for_the_format_the_evaluation_engine_serves(tmp_path):
    """vLLM serves the speculators folder: a speculators-only export (train.export_formats [speculators]) is
    evaluated, an SGLang-only one is refused naming speculators/config.json; our hf decoder the reverse."""
    import pytest as _pytest

    from eagleflow.evaluate.run import evaluate_run
    from eagleflow.layout import RunLayout
    spec_only, sglang_only = tmp_path / "spec-only", tmp_path / "sglang-only"
    (spec_only / "speculators").mkdir(parents=True)
    (spec_only / "speculators" / "config.json").write_text("{}")
    sglang_only.mkdir()
    (sglang_only / "config.json").write_text("{}")
    base = {"run_root": str(tmp_path / "runs"), "target_model": str(tmp_path / "no-target"),
            "node": {"has_gpu": True, "state_dir": str(tmp_path / "node-state")}}
    vllm = load_config(data={**base, "eval": {"backend": "vllm", "baseline_draft": "none"}})
    hf = load_config(data={**base, "eval": {"backend": "hf", "baseline_draft": "none"}})
    with _pytest.raises(FileNotFoundError, match=r"has no speculators/config\.json .*eval\.backend vllm"):
        evaluate_run(vllm, RunLayout.for_run(vllm, "r"), draft_dir=sglang_only, log=lambda _: None)
    with _pytest.raises(FileNotFoundError, match=r"has no config\.json .*eval\.backend hf"):
        evaluate_run(hf, RunLayout.for_run(hf, "r"), draft_dir=spec_only, log=lambda _: None)
    # past the draft check: what stops the speculators-only export now is the run's missing held-out split
    with _pytest.raises(FileNotFoundError, match="no held-out split"):
        evaluate_run(vllm, RunLayout.for_run(vllm, "r"), draft_dir=spec_only, log=lambda _: None)
