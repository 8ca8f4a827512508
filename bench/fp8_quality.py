"""Held-out acceptance of drafts trained from a bf16 store and from an fp8 store of the same corpus.

The demo's pipeline, phase by phase through the node CLI (what `make demo` runs through Airflow):
`corpus prepare` -> the hf capture server and `capture run` per shard -> `capture verify --stats`, once per
capture.store_dtype (auto: the tiny demo target's float32; fp8_e4m3), on the same corpus (same sources and
seed: the two corpus.parquet files are checked to be byte-identical); then per seed `train` -> `export` ->
`evaluate --json` (the hf backend's real speculative decoding, greedy, of the held-out split). Every seed
trains in its own run directory whose corpus/ and hidden_states/ link to its store's capture.

Prints, per store and eval configuration, the acceptance length of each seed, the mean and the spread
(sample standard deviation; min..max), and fp8 - bf16 as a difference of means with the seeds' spread.

    .venv/bin/python bench/fp8_quality.py [--seeds 1 2 3] [--steps 150] [--json bench/results/fp8_quality.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_runs import REPO, capture_store, finish, train_export_evaluate, write_config  # noqa: E402

import yaml  # noqa: E402

from eagleflow.demo_assets import ensure_demo_assets  # noqa: E402

STORES = {"auto": "bf16 store (auto: the target's dtype)", "fp8_e4m3": "fp8 store"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=150, help="train.max_steps (the demo's 150)")
    ap.add_argument("--eval-fraction", type=float, default=0.15,
                    help="corpus.eval_fraction: more held-out prompts than the demo's 3 %% (4), so a 1 %% "
                         "difference is not lost in 4 prompts")
    ap.add_argument("--max-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--dir", default=None, help="work dir (default: a temp dir, removed at the end)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--stores", nargs="+", choices=list(STORES), default=list(STORES))
    ap.add_argument("--parallel", type=int, default=1, help="seeds trained and evaluated at once")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="print the table of earlier --json results (e.g. one run per store) and exit")
    a = ap.parse_args()
    if a.merge:
        merged: dict = {"stores": {}}
        for m in a.merge:
            d = json.loads(Path(m).read_text())
            merged["stores"].update(d["stores"])
            merged.update({k: d[k] for k in ("seeds", "steps") if k in d})
        table(merged)
        return 0
    t_all = time.time()
    ensure_demo_assets(REPO / ".cache" / "demo")
    root = Path(a.dir or tempfile.mkdtemp(prefix="eagleflow-fp8-quality-"))
    demo = yaml.safe_load((REPO / "configs" / "local-demo.yaml").read_text())
    base = REPO / "configs"
    demo["run_root"] = str(root / "runs")
    demo["target_model"] = str((base / demo["target_model"]).resolve())
    for s in demo["corpus"]["sources"]:
        s["path"] = str((base / s["path"]).resolve())
    demo["corpus"]["eval_fraction"] = a.eval_fraction
    demo["server"]["dump_dir"] = str(root / "dumps")
    demo["node"]["state_dir"] = str(root / "state")
    demo["train"]["max_steps"] = a.steps
    demo["eval"].update(max_prompts=a.max_prompts, max_new_tokens=a.max_new_tokens)
    if "generate" in demo:   # the demo's regeneration phase is not what is compared: the sources as they are
        demo["generate"]["enabled"] = False

    results: dict = {"seeds": a.seeds, "steps": a.steps, "stores": {}}
    corpus_digest = {}
    for store in a.stores:
        data = json.loads(json.dumps(demo))
        data["capture"]["store_dtype"] = store
        cfgp = write_config(root / f"config-{store}.yaml", data)
        entry = capture_store(cfgp, f"cap-{store}")
        entry["runs"] = {}
        corpus_digest[store] = entry["corpus_sha256"]
        print(f"[{store}] captured {entry['samples']} samples, {entry['tokens']:,} tokens, "
              f"{entry['stored_bytes'] / 2**20:.1f} MiB ({entry['bytes_per_token']:,.1f} bytes/token) in "
              f"{entry['capture_s']:.0f} s", flush=True)

        def one_seed(seed: int, store=store, cfgp=cfgp, entry=entry) -> None:
            run = train_export_evaluate(cfgp, entry["run_dir"], f"{store}-seed{seed}", "--set", f"train.seed={seed}")
            rows = run["rows"]
            entry["runs"][str(seed)] = {"accept_length": {k: r["accept_length"] for k, r in rows.items()},
                                        "final_loss": run["final_loss"], "final_acc_0": run["final_acc_0"],
                                        "seconds": run["seconds"]}
            print(f"[{store}] seed {seed}: " + ", ".join(f"{k} {v['accept_length']:.3f}" for k, v in rows.items())
                  + f"; final loss {run['final_loss']:.3f} ({run['seconds']:.0f} s)"
                  + (" (train printed a traceback)" if run["train_traceback"] else ""), flush=True)
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max(1, a.parallel)) as pool:
            list(pool.map(one_seed, a.seeds))
        results["stores"][store] = entry
    if len(set(corpus_digest.values())) != 1:
        raise SystemExit(f"the two captures did not get the same corpus ({corpus_digest}); the comparison is void")
    results["corpus_sha256"] = next(iter(corpus_digest.values()))
    if len(results["stores"]) == len(STORES):
        table(results)
    return finish(results, t_all, root, a.json, keep=bool(a.dir))


def table(results: dict) -> None:
    """The side-by-side table: per eval configuration, each store's seeds, mean, spread, and the difference."""
    seeds, steps = results["seeds"], results["steps"]
    a16, a8 = results["stores"]["auto"], results["stores"]["fp8_e4m3"]
    print(f"\nfp8 / auto stored bytes per token on the demo: {a8['bytes_per_token'] / a16['bytes_per_token']:.4f} "
          f"({a8['bytes_per_token']:.1f} / {a16['bytes_per_token']:.1f}; the demo target is float32, so auto stores "
          "4 bytes an element here)")
    q = (a8.get("quantisation") or {}).get("tensors", {})
    if q:
        print("fp8 quantisation error (capture verify --stats): " + "; ".join(
            f"{k} max {t['max_rel']:.2e} mean {t['mean_rel']:.2e}" for k, t in q.items()))
    if a16.get("corpus_sha256") and a8.get("corpus_sha256") and a16["corpus_sha256"] != a8["corpus_sha256"]:
        raise SystemExit("the two stores were captured from different corpora; the comparison is void")
    keys = sorted(next(iter(a16["runs"].values()))["accept_length"])
    print(f"\nheld-out acceptance length, {len(seeds)} seeds ({', '.join(map(str, seeds))}), {steps} steps "
          "each (mean +- sample std [min..max]):")
    print(f"{'set:config':16s} {'auto store':>28s} {'fp8 store':>28s} {'fp8 - auto':>10s} {'relative':>9s} "
          f"{'paired (same seed) fp8 - auto':>30s}")
    rows = {}
    for k in keys:
        v16 = [a16["runs"][str(s)]["accept_length"][k] for s in seeds]
        v8 = [a8["runs"][str(s)]["accept_length"][k] for s in seeds]
        m16, m8 = statistics.mean(v16), statistics.mean(v8)
        sd16 = statistics.stdev(v16) if len(v16) > 1 else 0.0
        sd8 = statistics.stdev(v8) if len(v8) > 1 else 0.0
        paired = [y - x for x, y in zip(v16, v8)]   # same seed, same corpus: only the store differs
        sdp = statistics.stdev(paired) if len(paired) > 1 else 0.0
        rows[k] = {"bf16": v16, "fp8": v8, "bf16_mean": m16, "fp8_mean": m8, "bf16_std": sd16, "fp8_std": sd8,
                   "diff": m8 - m16, "relative": (m8 - m16) / m16, "paired": paired, "paired_std": sdp}
        cell = lambda m, sd, v: f"{m:.3f} +- {sd:.3f} [{min(v):.2f}..{max(v):.2f}]"  # noqa: E731
        print(f"{k:16s} {cell(m16, sd16, v16):>28s} {cell(m8, sd8, v8):>28s} {m8 - m16:>+10.3f} "
              f"{(m8 - m16) / m16:>+9.1%} {', '.join(f'{x:+.3f}' for x in paired) + f' (std {sdp:.3f})':>30s}")
    results["table"] = rows


if __name__ == "__main__":
    sys.exit(main())
