"""`make demo`: the whole eagle3_pipeline on this machine through `airflow dags test`.

Builds the demo's local inputs (sources, tokenizer, tiny target) once, migrates
the checkout's Airflow DB once, runs the DAG with the demo config, then prints
where every output is.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from eagleflow.config import load_config
from eagleflow.demo_assets import ensure_demo_assets
from eagleflow.evaluate.run import table_lines

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagleflow.demo", description=__doc__)
    ap.add_argument("--config", default=str(REPO / "configs" / "local-demo.yaml"))
    ap.add_argument("--run-id", default=None, help="default: demo__<timestamp>")
    a = ap.parse_args(argv)

    # lazy: airflow: only `make demo` drives it (the core imports no Airflow: test_airflow_boundary)
    from eagleflow.airflow.deploy.home import airflow_bin, airflow_env, ensure_db

    t0 = time.time()
    print("[demo] building local inputs (sources, tokenizer, tiny Llama target) under .cache/demo ...", flush=True)
    ensure_demo_assets(REPO / ".cache" / "demo")
    cfg = load_config(a.config)  # fail early, with the field named, on a bad config
    # the config named here is the deployment's own (the DAG parses with it, the run's Param may name it)
    env = airflow_env(extra={"EAGLEFLOW_CONFIG": str(Path(a.config).absolute())})
    print(f"[demo] Airflow home {env['AIRFLOW_HOME']} (SQLite); migrating the DB if needed ...", flush=True)
    ensure_db(env)
    run_id = a.run_id or time.strftime("demo__%Y%m%dT%H%M%S")
    conf = {"config_path": str(Path(a.config).absolute()), "run_name": run_id}
    cmd = [airflow_bin(), "dags", "test", "eagle3_pipeline", "--conf", json.dumps(conf)]
    print(f"[demo] running: {' '.join(cmd)}", flush=True)
    res = subprocess.run(cmd, env=env)
    run_dir = cfg.run_dir(run_id)
    if res.returncode != 0:
        print(f"[demo] FAILED (exit {res.returncode}); run directory {run_dir}", file=sys.stderr)
        return res.returncode
    print(f"\n[demo] eagle3_pipeline finished in {time.time() - t0:.0f} s. Outputs:")
    for label, rel in [("run config", "run-config.json"), ("regenerated records", "generated"),
                       ("corpus", "corpus/corpus.parquet"),
                       ("corpus stats", "corpus/stats.json"), ("hidden states", "hidden_states"),
                       ("training metrics", "draft/metrics.jsonl"), ("training curves", "draft/curves.png"),
                       ("exported draft (SGLang EAGLE3)", "draft/export"),
                       ("exported draft (vLLM, speculators)", "draft/export/speculators"),
                       ("held-out corpus", "corpus/eval.parquet"),
                       ("held-out evaluation", "eval.json"), ("run report (HTML)", "report.html"),
                       ("logs", "logs")]:
        p = run_dir / rel
        print(f"  {label:32s} {p}{'' if p.exists() else '   (not produced)'}")
    print(f"  {'Airflow task logs':32s} {Path(env['AIRFLOW_HOME']) / 'logs'}")
    for line in summary_lines(run_dir) + next_steps(run_dir):
        print(line)
    return 0


def next_steps(run_dir: Path) -> list[str]:
    """What to do after the demo: the report it wrote, the same pipeline from Airflow's UI, a real GPU node."""
    report = run_dir / "report.html"
    return [
        "\n[demo] what next:",
        f"  1. open the run report in a browser: {report}" + ("" if report.exists() else "   (not produced)"),
        "     (corpus per source, samples per shard over time, training curves, the evaluation, both serve commands)",
        "  2. run it from Airflow's UI: `make airflow` prints the URL, user admin and the password; open the URL,",
        "     unpause eagle3_pipeline and press Trigger (the form starts from configs/local-demo.yaml; an empty field",
        "     takes the config's value); watch it under Browse -> GPU nodes; each run's run_report task has a 'Run",
        "     report' link to its own report; `make airflow-stop` stops it all",
        "  3. on a GPU node: README.md, 'Against a GPU node' (configs/gpu-node.example.yaml)",
        "  Why the figures above differ from the README's and from run to run: docs/demo.md, 'Which figures vary'",
    ]


def summary_lines(run_dir: Path) -> list[str]:
    """What each phase produced, in numbers, read back from its files."""
    lines = ["\n[demo] what each phase produced:"]
    gen_file = run_dir / "generated" / "stats.json"
    if gen_file.is_file():
        g = json.loads(gen_file.read_text())
        for name, ps in g.get("per_source", {}).items():
            lines.append(f"  generation ({name}, by the target): {ps['kept']}/{ps['records']} records kept, "
                         f"{ps['turns_regenerated']} turns, {ps['cut_at_diverging_call']} cut at a diverging call, "
                         f"{ps['truncated_turns']} hit max_new_tokens, {ps['tokens_generated']:,} tokens at "
                         f"{ps['tokens_per_s'] or 0:,.0f} tokens/s")
    stats_file = run_dir / "corpus" / "stats.json"
    if stats_file.is_file():
        st = json.loads(stats_file.read_text())
        lines.append(f"  corpus: {st['records']:,} records, {st['tokens']:,} tokens ({st['masked_tokens']:,} in the "
                     f"loss mask) from {len(st.get('per_source', {}))} sources; loss mask by {st.get('mask_method')}")
    manifests = sorted((run_dir / "hidden_states").glob("shard_*/manifest.jsonl"))
    if manifests:
        entries = [json.loads(l) for m in manifests for l in m.read_text().splitlines() if l.strip()]
        size = sum(e["bytes"] for e in entries)
        lines.append(f"  hidden states: {len(entries):,} samples in {len(manifests)} shards, {size / 2**20:,.1f} MiB "
                     f"({len({e['id'] for e in entries}):,} distinct ids)")
    streamed = run_dir / "hidden_states" / "stream_verified.json"
    if streamed.is_file():   # a streaming run (stream.storage: mooncake): the trainer's exactly-once record
        sv = json.loads(streamed.read_text())
        on_disk = len(list((run_dir / "hidden_states").rglob("*.safetensors")))
        once = "each trained exactly once per epoch" if sv["ok"] else f"NOT exactly once: {sv.get('summary')}"
        lines.append(f"  streamed, not stored: {sv['samples']:,} samples x {sv['epochs']} epoch(s) through the run's "
                     f"{sv.get('store', 'streaming')} store, {once} (the ledger, {streamed.name}); {on_disk} hidden-state files on disk, only the "
                     "manifests")
    metrics = run_dir / "draft" / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip() and '"loss"' in l]
        if rows:
            tail = rows[-10:]
            mean = lambda k: sum(r.get(k, 0.0) for r in tail) / len(tail)  # noqa: E731
            lines.append(f"  draft training: {rows[-1]['step']} steps; loss {rows[0]['loss']:.2f} -> {mean('loss'):.2f}, "
                         f"acc_0 {rows[0].get('acc_0', 0):.2f} -> {mean('acc_0'):.2f}, acceptance length "
                         f"{mean('accept_length'):.2f} simulated on training batches (means of the last "
                         f"{len(tail)} steps)")
            held = [r for r in rows if "eval_accept_length" in r]
            if held:
                h0, h1 = held[0], held[-1]
                lines.append(f"  held-out while training ({h1['eval_samples']} samples never trained on, steps "
                             f"{h0['step']} -> {h1['step']}): loss per scored position "
                             f"{h0.get('eval_loss_per_position', 0):.2f} -> {h1.get('eval_loss_per_position', 0):.2f}, "
                             f"acc_0 {h0['eval_acc_0']:.2f} -> {h1['eval_acc_0']:.2f}, acceptance length "
                             f"{h0['eval_accept_length']:.2f} -> {h1['eval_accept_length']:.2f} simulated")
    eval_file = run_dir / "eval.json"
    if eval_file.is_file():
        ev = json.loads(eval_file.read_text())
        lines.append(f"  held-out evaluation (real speculative decoding, greedy, target {ev['target_dtype']} on "
                     f"{ev['device']}): {'passed the gate' if ev['passed'] else 'REFUSED by the gate'}")
        lines += ["    " + line for line in table_lines(ev)]
    return lines


if __name__ == "__main__":
    sys.exit(main())
