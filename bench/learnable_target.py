"""Drafts for a target with something to learn: the figures the demo's toy target cannot resolve.

The target is ``eagleflow.learnable_target``'s: a 12-layer Llama trained on this CPU, once and cached under
``.cache/learnable-target``, on the Python standard library's own source and docstrings shaped as chat records
(tool calls included). On it, through the pipeline's own phases (``bench/pipeline_runs.py``: corpus, the hf
capture server and workers, verify, train, export, evaluate with the hf backend's speculative decoding),
every draft scored on the same held-out prompts (the full corpus's evaluation split, never trained on; split by
function, ``corpus.eval_group_key: function``, so no scored prompt is about a function the draft trained on under
another record: split by record, 79 % of them were):

1. **the draft**: held-out acceptance length at 3/1/4 and 7/1/8 and the wall-clock speed-up, target alone and
   with the draft timed in pairs on the same prompts after a warm-up (``evaluate.speed``), medians and spread;
2. **the data-size trend** (the EAGLE-3 paper's): the same training steps on 25 %, 50 % and 100 % of the
   corpus (each source's first records: ``corpus.sources[].limit``), each its own capture;
3. **the misnumbered-layer control**: the full draft served with every aux layer numbered one lower than it was
   trained on (what an off-by-one between capture and serving numbering does; ``serving/aux_layers.py``);
4. **fp8 vs full width**: drafts from the target-dtype store and from an ``fp8_e4m3`` store of the same corpus,
   per seed, the difference of means and its paired spread.

    .venv/bin/python bench/learnable_target.py [--steps 1200] [--seeds 1 2 3] [--json bench/results/learnable_target.json]

The target's training (about 10-15 minutes on 2 cores) is paid once; the whole benchmark takes about an hour.
With ``--dir``, captures and drafts already evaluated there are kept: a later run with more ``--fractions`` or
``--seeds`` (or without ``--no-fp8``) adds only the rows it lacks (``--reevaluate`` scores the kept drafts again).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_runs import (REPO, capture_store, cli, evaluate, evaluated_again, finish,  # noqa: E402
                           train_export_evaluate, write_config)

from eagleflow.config import load_config  # noqa: E402

from eagleflow.learnable_target import ensure_learnable_target  # noqa: E402

CONFIGS = ("3/1/4", "7/1/8")
FIXED = "held_out_fixed"


def base_config(root: Path, info: dict, a: argparse.Namespace) -> dict:
    return {
        "run_root": str(root / "runs"),
        "target_model": info["target_model"],
        "node": {"name": "local", "has_gpu": False, "state_dir": str(root / "state")},
        "corpus": {"sources": [dict(s) for s in info["sources"]], "seed": 42, "max_length": a.max_length,
                   "eval_fraction": a.eval_fraction, "eval_group_key": a.group_key or None},
        "generate": {"enabled": False},
        "capture": {"backend": "hf", "shards": 2},
        "server": {"port": 0, "dump_dir": str(root / "dumps"), "ready_timeout_s": 300},
        "watchdog": {"poll_interval_s": 2, "stall_after_s": 60, "startup_grace_s": 60},
        "train": {"device": "cpu", "max_steps": a.steps, "batch_size": a.batch, "lr": a.lr, "warmup_steps": 20,
                  "draft_vocab_size": a.draft_vocab, "checkpoint_every": a.steps, "log_every": 50,
                  "eval_every": 0},
        # held_out (this run's own split) is read at one prompt only: every draft is judged on the fixed set
        "eval": {"max_prompts": 1, "max_new_tokens": a.max_new, "min_accept_length": 1.0, "baseline_draft": "none",
                 "prompt_sets": [{"name": FIXED, "path": str(root / "held_out_fixed.jsonl"),
                                  "max_prompts": a.prompts}]},
    }


def write_fixed_prompts(store_run_dir: str, out: Path) -> int:
    """The full corpus's evaluation split as a JSONL prompt set (each record prompted before its last answer)."""
    import pyarrow.parquet as pq
    rows = pq.read_table(Path(store_run_dir) / "corpus" / "eval.parquet", columns=["id", "conversation"]).to_pylist()
    out.write_text("".join(json.dumps({"id": r["id"], **json.loads(r["conversation"])}) + "\n" for r in rows))
    return len(rows)


def _fixed(rows: dict) -> dict:
    return {c: rows[f"{FIXED}:{c}"] for c in CONFIGS}


def source_groups(sources: list[dict], key: str) -> dict[str, str | None]:
    """Each record id (``source:row``, as the corpus numbers JSONL records) -> the function it is about."""
    from eagleflow.corpus.normalise import record_group
    out: dict[str, str | None] = {}
    for s in sources:
        lines = [x for x in Path(s["path"]).read_text().splitlines() if x.strip()]
        out |= {f"{s['name']}:{row}": record_group(json.loads(x), key) for row, x in enumerate(lines)}
    return out


def split_figures(corpus_dir: Path, groups: dict[str, str | None], prompts: int) -> dict:
    """How far a run's held-out split is from its training split: held-out records, and the first ``prompts``
    of them (the scored prompts), whose function has a training record."""
    import pyarrow.parquet as pq
    held = pq.read_table(corpus_dir / "eval.parquet", columns=["id"])["id"].to_pylist()
    trained = {groups[i] for i in pq.read_table(corpus_dir / "corpus.parquet", columns=["id"])["id"].to_pylist()}
    scored = held[:prompts]
    stats = json.loads((corpus_dir / "stats.json").read_text())
    return {"group_key": stats["eval_split"].get("group_key"), "held_out_records": len(held),
            "held_out_functions": len({groups[i] for i in held}), "training_functions": len(trained),
            "held_out_with_function_in_training": sum(groups[i] in trained for i in held),
            "scored_prompts": len(scored), "scored_functions": len({groups[i] for i in scored}),
            "scored_with_function_in_training": sum(groups[i] in trained for i in scored)}


def _split_line(name: str, f: dict) -> str:
    pct = lambda n, d: f"{n / d:.0%}" if d else "n/a"  # noqa: E731
    return (f"{name}: {f['held_out_records']} records held out ({f['held_out_functions']} functions; "
            f"{f['training_functions']} in training); {f['held_out_with_function_in_training']} of them "
            f"({pct(f['held_out_with_function_in_training'], f['held_out_records'])}) about a function trained on "
            f"under another record; scored prompts {f['scored_prompts']} ({f['scored_functions']} functions): "
            f"{f['scored_with_function_in_training']} "
            f"({pct(f['scored_with_function_in_training'], f['scored_prompts'])}) about one")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1200, help="train.max_steps of every draft")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds of the full-data drafts "
                    "per store (the fp8 comparison); the first is the one reported above it")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--eval-fraction", type=float, default=0.02)
    ap.add_argument("--group-key", default="function", help="corpus.eval_group_key: every record of a function "
                    "on one side of the split; '' = split by record (as before issue 51)")
    ap.add_argument("--no-split-compare", action="store_true", help="skip preparing the corpus split by record "
                    "too, to count how many of its held-out prompts are about functions in training")
    ap.add_argument("--reevaluate", action="store_true", help="with --dir: score the drafts already evaluated "
                    "there again (by default their figures are reused)")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--stream", action="store_true", help="issue 53: for the largest --fractions and every --seeds, "
                    "the offline draft beside a streamed one (stream.storage: mooncake: the run's store started, "
                    "the trainer drawing from it while the capture workers put into it, shuffled within "
                    "stream.shuffle_window), same corpus, steps and seed; the misnumbered control and fp8 skipped")
    ap.add_argument("--stream-seeds", type=int, nargs="+", default=None, help="--stream: the seeds that get a "
                    "streamed draft (default every --seeds); every seed gets its offline draft (the seed spread)")
    ap.add_argument("--buffer-gib", type=float, default=None, help="--stream: stream.buffer_gib (default the "
                    "config's)")
    ap.add_argument("--dir", default=None, help="work dir (default: a temp dir, removed at the end)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t_all = time.time()
    info = ensure_learnable_target(REPO / ".cache" / "learnable-target")
    tr = info["training"]
    print(f"target: {info['target_model']}: {tr['params'] / 1e6:.1f} M parameters, {info['records']} records "
          f"({tr['corpus_tokens']:,} tokens) from {info['functions']} standard-library functions; "
          f"LM loss {tr['first_loss']:.2f} -> {tr['final_loss']:.2f} over {tr['tokens_trained']:,} tokens in "
          f"{tr['seconds'] / 60:.1f} min", flush=True)
    root = Path(a.dir or tempfile.mkdtemp(prefix="eagleflow-learnable-"))
    base = base_config(root, info, a)
    out: dict = {"target": info, "args": vars(a), "sizes": {}, "stores": {}}

    def config(name: str, fraction: float = 1.0, store: str = "auto") -> Path:
        data = json.loads(json.dumps(base))
        if fraction < 1.0:
            for s in data["corpus"]["sources"]:   # JSONL: a record a line
                s["limit"] = max(1, round(fraction * len(Path(s["path"]).read_text().splitlines())))
        data["capture"]["store_dtype"] = store
        return write_config(root / f"config-{name}.yaml", data)

    # captures are kept in the work dir: a rerun with the same --dir (other steps, seeds) reuses them
    stores_file = root / "stores.json"
    stores: dict[str, dict] = json.loads(stores_file.read_text()) if stores_file.is_file() else {}

    def store_of(fraction: float, store: str = "auto") -> tuple[Path, dict]:
        name = f"{store}-{fraction:g}"
        cfgp = config(name, fraction, store)
        if name not in stores:
            entry = capture_store(cfgp, f"cap-{name}")
            print(f"[{name}] captured {entry['samples']} samples, {entry['tokens']:,} tokens, "
                  f"{entry['stored_bytes'] / 2**20:,.0f} MiB in {entry['capture_s']:.0f} s", flush=True)
            stores[name] = entry
            stores_file.write_text(json.dumps(stores, indent=2))
        return cfgp, stores[name]

    full_cfg, full = store_of(1.0)
    n_fixed = write_fixed_prompts(full["run_dir"], root / "held_out_fixed.jsonl")
    groups = source_groups(info["sources"], a.group_key or "function")
    out["split"] = split_figures(Path(full["run_dir"]) / "corpus", groups, a.prompts)
    print(_split_line(f"split by {a.group_key or 'record'}", out["split"]), flush=True)
    if not a.no_split_compare and a.group_key:   # the same corpus split by record, for comparison
        by_record = json.loads(json.dumps(base))
        by_record["corpus"]["eval_group_key"] = None
        cfgp = write_config(root / "config-by-record.yaml", by_record)
        cli("corpus", "prepare", "--config", str(cfgp), "--run-id", "split-by-record")
        out["split_by_record"] = split_figures(Path(str(load_config(cfgp).run_dir("split-by-record"))) / "corpus",
                                               groups, a.prompts)
        print(_split_line("split by record (before issue 51)", out["split_by_record"]), flush=True)
    print(f"held-out prompts: {min(n_fixed, a.prompts)} of the full corpus's {n_fixed} (never trained on)")
    scored = [json.loads(x)["id"] for x in (root / "held_out_fixed.jsonl").read_text().splitlines()][:a.prompts]

    def scored_seen(store_run_dir: str) -> int:
        """Scored prompts whose function the store's corpus trains on (under any record): 0 on a split by function."""
        import pyarrow.parquet as pq
        ids = pq.read_table(Path(store_run_dir) / "corpus" / "corpus.parquet", columns=["id"])["id"].to_pylist()
        trained = {groups[i] for i in ids}
        return sum(groups[i] in trained for i in scored)

    # drafts evaluated are kept in the work dir too: a rerun with the same --dir adds only the rows it lacks
    runs_file = root / "runs.json"
    evaluated: dict[str, dict] = json.loads(runs_file.read_text()) if runs_file.is_file() else {}

    def draft(fraction: float, seed: int, store: str = "auto") -> dict:
        cfgp, entry = store_of(fraction, store)
        run_id = f"{store}-{fraction:g}-{a.steps}-seed{seed}"
        if run_id in evaluated and not a.reevaluate:
            print(f"[{store} {fraction:g} seed {seed}] evaluated before in {root}: reused", flush=True)
            return evaluated[run_id]
        done = Path(str(load_config(cfgp).run_dir(run_id))) / "draft" / "export" / "config.json"
        if done.is_file():   # a rerun with the same --dir: the draft is kept, only its evaluation is redone
            run = evaluated_again(cfgp, run_id)
        else:
            run = train_export_evaluate(cfgp, entry["run_dir"], run_id, "--set", f"train.seed={seed}")
        rows = _fixed(run["rows"])
        print(f"[{store} {fraction:g} seed {seed}] " + ", ".join(
            f"{c}: accept {r['accept_length']:.3f}, speed-up {r.get('speedup')}" for c, r in rows.items())
            + f"; loss {run['final_loss']:.3f}, acc_0 {run['final_acc_0']:.3f} ({run['seconds']:.0f} s)", flush=True)
        evaluated[run_id] = {"samples": entry["samples"], "rows": rows, "final_loss": run["final_loss"],
                             "final_acc_0": run["final_acc_0"], "run_dir": run["run_dir"],
                             "scored_prompts_about_functions_trained_on": scored_seen(entry["run_dir"]),
                             "load_average": os.getloadavg()}
        runs_file.write_text(json.dumps(evaluated, indent=2))
        return evaluated[run_id]

    seed0 = a.seeds[0]
    for fraction in sorted(a.fractions) if not a.stream else ():
        out["sizes"][f"{fraction:g}"] = draft(fraction, seed0)
    main_draft = out["sizes"][f"{max(a.fractions):g}"] if not a.stream else {}

    if a.stream:      # issue 53: offline against streamed, paired by seed, same corpus and steps
        from stream_runs import stream_run
        fraction = max(a.fractions)
        _, off_store = store_of(fraction)    # the offline store of the same corpus (its digest: the streamed run's check)
        # a streaming run trains whole epochs (train.max_steps rounded): the offline drafts train the same steps
        per_epoch = -(-off_store["samples"] // a.batch)
        whole = max(1, round(a.steps / per_epoch)) * per_epoch
        if whole != a.steps:
            print(f"--stream: {a.steps} steps rounded to {whole} ({whole // per_epoch} epoch(s) of "
                  f"{off_store['samples']} samples at batch {a.batch}), offline and streamed alike", flush=True)
            a.steps = base["train"]["max_steps"] = base["train"]["checkpoint_every"] = whole

        def streamed(seed: int) -> dict:
            run_id = f"stream-{fraction:g}-{a.steps}-seed{seed}"
            if run_id in evaluated and not a.reevaluate:
                print(f"[stream {fraction:g} seed {seed}] evaluated before in {root}: reused", flush=True)
                return evaluated[run_id]
            data = yaml_of(config(f"auto-{fraction:g}", fraction))
            data["stream"] = {"storage": "mooncake", "put_timeout_s": 1800,
                              **({"buffer_gib": a.buffer_gib} if a.buffer_gib else {})}
            cfgp = write_config(root / f"config-stream-{fraction:g}.yaml", data)
            rdir = Path(str(load_config(cfgp).run_dir(run_id)))
            if (rdir / "draft" / "export" / "config.json").is_file():
                run = evaluated_again(cfgp, run_id)
                fig = evaluated.get(run_id, {}).get("stream", {})
            else:
                shutil.rmtree(rdir, ignore_errors=True)    # a streaming run cut short starts again whole
                t0 = time.time()
                cli("corpus", "prepare", "--config", str(cfgp), "--run-id", run_id)
                import hashlib
                sha = hashlib.sha256((rdir / "corpus" / "corpus.parquet").read_bytes()).hexdigest()
                offline_sha = stores[f"auto-{fraction:g}"]["corpus_sha256"]
                if sha != offline_sha:
                    raise SystemExit(f"the streamed run's corpus {sha[:12]} is not the offline store's "
                                     f"{offline_sha[:12]}: not the same corpus")
                fig = stream_run(cfgp, run_id, int(data["capture"]["shards"]), logs=root / "logs",
                                 train_args=("--set", f"train.seed={seed}"), t0=t0)
                cli("export", "--config", str(cfgp), "--run-id", run_id, "--set", f"train.seed={seed}")
                run = _figures_of(rdir, evaluate(cfgp, run_id, "--set", f"train.seed={seed}"), t0)
                fig |= {"verified": json.loads((rdir / "hidden_states" / "stream_verified.json").read_text()),
                        "hidden_state_files_on_disk": sum(1 for _ in (rdir / "hidden_states").rglob("*.safetensors")),
                        "steps_trained": len((rdir / "draft" / "metrics.jsonl").read_text().splitlines())}
            rows = _fixed(run["rows"])
            print(f"[stream {fraction:g} seed {seed}] " + ", ".join(
                f"{c}: accept {r['accept_length']:.3f}" for c, r in rows.items())
                + f"; loss {run['final_loss']:.3f}, acc_0 {run['final_acc_0']:.3f} ({run['seconds']:.0f} s; "
                f"{fig.get('steps_trained')} steps, store peak {fig.get('store_peak_bytes', 0) / 2**20:.0f} MiB)",
                flush=True)
            evaluated[run_id] = {"samples": stores[f"auto-{fraction:g}"]["samples"], "rows": rows,
                                 "final_loss": run["final_loss"], "final_acc_0": run["final_acc_0"],
                                 "run_dir": run["run_dir"], "stream": fig, "seconds": run["seconds"],
                                 "load_average": os.getloadavg()}
            runs_file.write_text(json.dumps(evaluated, indent=2))
            return evaluated[run_id]

        pairs = {}
        stream_seeds = a.stream_seeds if a.stream_seeds is not None else a.seeds
        for seed in a.seeds:     # the streamed draft first: a failing streaming run shows before the offline work
            st = streamed(seed) if seed in stream_seeds else None
            pairs[str(seed)] = {"offline": draft(fraction, seed), "streamed": st}
        out["stream_compare"] = stream_table(pairs, fraction, a)
        return finish(out, t_all, root, a.json, keep=bool(a.dir))

    # the control: the full draft's export with every aux layer renamed one lower than what it was trained on
    export = Path(main_draft["run_dir"]) / "draft" / "export"
    wrong = root / "misnumbered-export"
    shutil.copytree(export, wrong, dirs_exist_ok=True)
    meta = json.loads((wrong / "eagleflow_export.json").read_text())
    trained_on = list(meta["aux_layer_outputs"])
    meta["aux_layer_outputs"] = [x - 1 for x in trained_on]
    (wrong / "eagleflow_export.json").write_text(json.dumps(meta, indent=2))
    key = f"misnumbered-{Path(main_draft['run_dir']).name}"
    if key not in evaluated or a.reevaluate:
        evaluated[key] = {"trained_on": trained_on, "served_with": meta["aux_layer_outputs"],
                          "rows": _fixed(evaluate(full_cfg, Path(main_draft["run_dir"]).name, draft=wrong)),
                          "load_average": os.getloadavg()}
        runs_file.write_text(json.dumps(evaluated, indent=2))
    out["misnumbered"] = evaluated[key]

    for store in ("auto",) + (() if a.no_fp8 else ("fp8_e4m3",)):
        runs = {str(seed0): main_draft} if store == "auto" else {}
        for seed in a.seeds:
            if str(seed) not in runs:
                runs[str(seed)] = draft(1.0, seed, store)
        out["stores"][store] = {"bytes_per_token": stores[f"{store}-1"]["bytes_per_token"], "runs": runs}
    report(out)
    return finish(out, t_all, root, a.json, keep=bool(a.dir))


def yaml_of(path: Path) -> dict:
    import yaml
    return yaml.safe_load(path.read_text())


def _figures_of(rdir: Path, rows: dict, t0: float) -> dict:
    metrics = [json.loads(x) for x in (rdir / "draft" / "metrics.jsonl").read_text().splitlines() if x]
    return {"rows": rows, "final_loss": metrics[-1]["loss"], "final_acc_0": metrics[-1]["acc_0"],
            "seconds": time.time() - t0, "run_dir": str(rdir)}


def stream_table(pairs: dict, fraction: float, a: argparse.Namespace) -> dict:
    """Offline against streamed acceptance per seed: the paired differences beside the offline seed spread."""
    seeds = sorted(pairs, key=int)
    streamed = [s for s in seeds if pairs[s]["streamed"] is not None]     # --stream-seeds: a subset may stream
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0  # noqa: E731
    print(f"\noffline vs streamed drafts ({fraction:g} of the corpus, {a.steps} steps asked, offline seeds "
          f"{', '.join(seeds)}, streamed seeds {', '.join(streamed)}; held-out acceptance):")
    table: dict = {"fraction": fraction, "steps": a.steps, "seeds": seeds, "streamed_seeds": streamed,
                   "steps_trained": {s: pairs[s]["streamed"]["stream"].get("steps_trained") for s in streamed}}
    for c in CONFIGS:
        off = [pairs[s]["offline"]["rows"][c]["accept_length"] for s in seeds]
        st = [pairs[s]["streamed"]["rows"][c]["accept_length"] for s in streamed]
        paired = [pairs[s]["streamed"]["rows"][c]["accept_length"] - pairs[s]["offline"]["rows"][c]["accept_length"]
                  for s in streamed]
        spread = max(off) - min(off)
        mo, ms = statistics.mean(off), statistics.mean(st)
        table[c] = {"offline": off, "streamed": st, "paired": paired, "offline_mean": mo, "streamed_mean": ms,
                    "relative": (ms - mo) / mo, "offline_seed_range": spread, "offline_std": sd(off),
                    "streamed_std": sd(st), "within_offline_seed_range": abs(ms - mo) <= spread}
        print(f"  {c}: offline {', '.join(f'{x:.3f}' for x in off)} (mean {mo:.3f}, seed range {spread:.3f}); "
              f"streamed {', '.join(f'{x:.3f}' for x in st)} (mean {ms:.3f}): {(ms - mo) / mo:+.2%}, paired "
              f"{', '.join(f'{x:+.3f}' for x in paired)}")
    return table


def _spread(r: dict) -> str:
    s = r.get("speedup_spread")
    return f"{r['speedup']:.2f}x [{s[0]:.2f}..{s[1]:.2f}]" if r.get("speedup") and s else "n/a"


def report(out: dict) -> None:
    main_rows = out["sizes"][max(out["sizes"], key=float)]["rows"]
    print(f"\nscored prompts: {_split_line('split by ' + (out['split']['group_key'] or 'record'), out['split'])}")
    if "split_by_record" in out:
        print(f"  (the same corpus {_split_line('split by record', out['split_by_record'])})")
    print("\nthe draft, full data, held-out prompts (acceptance = tokens per verify pass; speed-up = median of "
          "per-prompt pairs, target alone / with the draft [min..max]):")
    for c in CONFIGS:
        r = main_rows[c]
        print(f"  {c}: acceptance {r['accept_length']:.3f}, speed-up {_spread(r)} over {r.get('speedup_pairs')} "
              f"pairs ({r['tokens_per_s']:.0f} vs {r['target_tokens_per_s']:.0f} tokens/s), lossless "
              f"{'yes' if r['lossless'] else 'NO'}" + (f"; {r['speedup_note']}" if r.get("speedup_note") else ""))
    print("\ndata-size trend (same steps; acceptance at " + " / ".join(CONFIGS) + "):")
    for f, run in sorted(out["sizes"].items(), key=lambda kv: float(kv[0])):
        print(f"  {float(f):>5.0%} of the corpus ({run['samples']:>5} samples): "
              + " / ".join(f"{run['rows'][c]['accept_length']:.3f}" for c in CONFIGS)
              + f"  (final loss {run['final_loss']:.3f}, acc_0 {run['final_acc_0']:.3f}; scored prompts about a "
              f"function it trained on: {run.get('scored_prompts_about_functions_trained_on', 'n/a')})")
    m = out["misnumbered"]
    print(f"\nmisnumbered control: trained on layers {m['trained_on']}, served with {m['served_with']}: "
          + " / ".join(f"{m['rows'][c]['accept_length']:.3f}" for c in CONFIGS)
          + " vs " + " / ".join(f"{main_rows[c]['accept_length']:.3f}" for c in CONFIGS))
    if "fp8_e4m3" in out["stores"]:
        a16, a8 = out["stores"]["auto"], out["stores"]["fp8_e4m3"]
        seeds = sorted(set(a16["runs"]) & set(a8["runs"]), key=int)
        print(f"\nfp8 store vs the target-dtype store ({a8['bytes_per_token'] / a16['bytes_per_token']:.3f} of its "
              f"bytes a token), seeds {', '.join(seeds)}:")
        table = {}
        for c in CONFIGS:
            v16 = [a16["runs"][s]["rows"][c]["accept_length"] for s in seeds]
            v8 = [a8["runs"][s]["rows"][c]["accept_length"] for s in seeds]
            paired = [y - x for x, y in zip(v16, v8)]
            m16, m8 = statistics.mean(v16), statistics.mean(v8)
            sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0  # noqa: E731
            table[c] = {"auto": v16, "fp8": v8, "relative": (m8 - m16) / m16, "paired": paired,
                        "paired_std": sd(paired), "auto_std": sd(v16), "fp8_std": sd(v8)}
            print(f"  {c}: auto {m16:.3f} +- {sd(v16):.3f}, fp8 {m8:.3f} +- {sd(v8):.3f}: {(m8 - m16) / m16:+.2%} "
                  f"(paired {', '.join(f'{x:+.3f}' for x in paired)}; std {sd(paired):.3f} = "
                  f"{sd(paired) / m16:.2%} of auto)")
        out["fp8_table"] = table


if __name__ == "__main__":
    sys.exit(main())
