"""GPU check (prepared, run on a GPU node with sglang or vLLM installed): an engine's capture path end to end.

What it proves, for ``--engine sglang`` (stage sglang_capture) or ``--engine vllm`` (stage vllm_capture), on a
tiny random Llama (hidden 512, 4 heads of 128, 2 KV
heads, 8 layers, bf16, the demo's local tokenizer; nothing is downloaded):

1. `eagleflow capture serve` with capture.backend sglang starts sglang.launch_server
   with the capture plugin; with capture.backend vllm, vLLM's own `vllm serve` with
   extract_hidden_states and our KV connector (engines/vllm/launcher.py); either
   way the self-check dump appears (else it exits 4);
2. `eagleflow capture run` extracts every sample of a small corpus (batched
   prefills: in_flight 4), `eagleflow capture verify` passes;
3. every stored sample equals a transformers forward of the same model on the
   GPU (aux = outputs of layers 1, 3, 4; last = final post-norm states), within
   bf16 tolerance (per-row cosine >= 0.995 and max |diff| reported).

Run it in the engine's node venv (sglang: requirements-node.txt, then `pip install -e . --no-deps`
so that sglang sees our plugin entry point; vLLM: requirements-node-vllm.txt, the same install):

    python bench/gpu_check_capture.py [--engine sglang|vllm] [--keep DIR]

Exit 0 = PASS. The hook's slicing and the connector are already proven on CPU against sglang
0.5.23's and vLLM 0.33's own classes (`make test-node`, `make test-node-vllm`); this proves the live
server path.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_check_common import write_verdict  # noqa: E402
from gpu_check_engines import ENGINES, EXPORT_RECORD, CheckEngine  # noqa: E402


def build_target(root: Path) -> Path:
    """Tiny Llama per notes/sglang-capture.md, with the demo's tokenizer (vocab ~512)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagleflow.demo_assets import ensure_demo_assets
    assets = ensure_demo_assets(root / "assets", n_per_source=24)
    tok_dir = Path(assets["target_model"])
    out = root / "tiny-llama-512"
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def write_config(root: Path, model: Path, engine: CheckEngine) -> Path:
    import yaml
    cfg = {"run_root": str(root / "runs"), "target_model": str(model),
           "node": {"name": "gpu-check", "has_gpu": True, "state_dir": str(root / "state")},
           "server": {"port": 0, "dump_dir": f"/dev/shm/eagleflow-gpu-check-{engine.name}-{os.getpid()}",
                      "dtype": "bfloat16", "tp": 1, "ready_timeout_s": 240,
                      "extra_server_args": engine.config_server_args()},
           "capture": {"backend": engine.name, "shards": 1, "in_flight": 4, "heartbeat_interval_s": 1,
                       "request_timeout_base_s": 60}}
    p = root / "config.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def compare(run_dir: Path, model: Path, corpus_rows: list[dict]) -> tuple[bool, list[str]]:
    import torch
    from transformers import AutoModelForCausalLM

    from eagleflow.capture.storage import read_sample
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).cuda().eval()
    ok, lines = True, []
    for row in corpus_rows:
        t, meta = read_sample(run_dir / "hidden_states" / "shard_00000" / f"{row['index']:08d}.safetensors")
        with torch.inference_mode():
            hs = hf(torch.tensor([row["input_ids"]], device="cuda"), output_hidden_states=True).hidden_states
        want_aux = torch.cat([hs[i + 1][0] for i in json.loads(meta["aux_layers"])], -1).float().cpu()
        want_last = hs[-1][0].float().cpu()
        got_aux, got_last = t["aux_hidden_states"].float(), t["hidden_states"].float()
        shapes = (got_aux.shape == want_aux.shape and got_last.shape == want_last.shape)
        if not shapes:
            ok = False
            lines.append(f"sample {row['index']}: shapes aux {tuple(got_aux.shape)} vs {tuple(want_aux.shape)}, "
                         f"last {tuple(got_last.shape)} vs {tuple(want_last.shape)}  FAIL")
            continue
        cos_aux = torch.nn.functional.cosine_similarity(got_aux, want_aux, dim=-1).min().item()
        cos_last = torch.nn.functional.cosine_similarity(got_last, want_last, dim=-1).min().item()
        d_aux = (got_aux - want_aux).abs().max().item()
        d_last = (got_last - want_last).abs().max().item()
        good = cos_aux >= 0.995 and cos_last >= 0.995 and t["input_ids"].tolist() == row["input_ids"]
        ok &= good
        lines.append(f"sample {row['index']} ({len(row['input_ids'])} tokens): aux min cos {cos_aux:.5f} max|d| "
                     f"{d_aux:.4f}; last min cos {cos_last:.5f} max|d| {d_last:.4f}  {'ok' if good else 'FAIL'}")
    return ok, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=sorted(ENGINES), default="sglang",
                    help="the capture.backend whose live server this checks (stage <engine>_capture)")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--keep", help="work in this folder and keep it (default: a temp dir, removed)")
    a = ap.parse_args()
    engine = ENGINES[a.engine]
    stage = f"{engine.name}_capture"
    import torch
    if not torch.cuda.is_available():
        print("gpu_check_capture: torch sees no CUDA GPU here; run this on a GPU node")
        return write_verdict(stage, "fail", "torch sees no CUDA GPU here")
    try:
        version = engine.check_version()
        print(f"{engine.name} {version}")
    except Exception as e:
        print(f"gpu_check_capture: {e}")
        return write_verdict(stage, "fail", str(e))
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="eagleflow-gpu-check-"))
    root.mkdir(parents=True, exist_ok=True)
    (root / EXPORT_RECORD).unlink(missing_ok=True)   # a draft trained on an earlier capture is not this one's
    from eagleflow.phases.extract.lifecycle import start_capture_server, stop_capture_server, wait_capture_server_ready
    from eagleflow.local_run import LocalRun
    from eagleflow.config import load_config
    from eagleflow.layout import RunLayout
    from tests.fixtures.capture_corpus import write_corpus

    t0 = time.time()
    model = build_target(root)
    cfgp = write_config(root, model, engine)
    cfg = load_config(cfgp)
    lay = RunLayout.for_run(cfg, "gpucheck")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rows = write_corpus(Path(lay.corpus_dir) / "corpus.parquet", a.samples, vocab, seed=3, min_len=8, max_len=300)
    ctx = LocalRun(cfg=cfg, layout=lay, config_path=str(cfgp))
    start_capture_server(ctx, log=print)
    try:
        try:
            info = wait_capture_server_ready(ctx, log=print)
        except Exception as e:
            print(f"server not ready: {e}")
            print(Path(lay.log_file("capture_server")).read_text()[-6000:])
            return write_verdict(stage, "fail", f"server not ready: {e}")
        print(f"server: {json.dumps(info)}")
        w = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "run", "--config", str(cfgp),
                            "--run-id", "gpucheck", "--shard", "0"], capture_output=True, text=True, timeout=180)
        print(w.stdout[-3000:], w.stderr[-3000:])
        v = subprocess.run([sys.executable, "-m", "eagleflow.cli", "capture", "verify", "--config", str(cfgp),
                            "--run-id", "gpucheck"], capture_output=True, text=True, timeout=60)
        print(v.stdout[-2000:], v.stderr[-2000:])
        if w.returncode != 0 or v.returncode != 0:
            print(Path(lay.log_file("capture_server")).read_text()[-6000:])
            return write_verdict(stage, "fail", f"worker exit {w.returncode}, verify exit {v.returncode}",
                                 worker_stderr=w.stderr[-2000:])
    finally:
        print(stop_capture_server(ctx, grace_s=30, log=print))
    ok, lines = compare(Path(lay.run_dir), model, rows)
    print("\n".join(lines))
    ids = f"{engine.name}_layer_ids"   # the launcher's info names the ids in its engine's numbering
    figures = {"samples": len(rows), "engine": engine.name, ids: info.get(ids), engine.name: info.get("version"),
               "aux_layers": info.get("aux_layers"), "seconds": round(time.time() - t0, 1)}
    (root / "compare.txt").write_text("\n".join(lines) + "\n")
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    return write_verdict(stage, "pass" if ok else "fail",
                         None if ok else "stored states differ from the transformers forward (see compare lines)",
                         **figures)


if __name__ == "__main__":
    sys.exit(main())
