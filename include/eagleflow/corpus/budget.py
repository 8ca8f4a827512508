"""Will the hidden states fit? A go/no-go before any GPU is touched.

Per token the capture stores ``aux_hidden_states`` [3H] and ``hidden_states``
[H] in the target's dtype, ``input_ids`` as int64 and ``loss_mask`` as uint8.
Per sample file: the safetensors header (8-byte length + JSON, padded to 8)
and, on disk, half a filesystem block on average lost to rounding up; plus one
manifest line. With ``capture.store_dtype: fp8_e4m3`` the two hidden-state
tensors take one byte an element plus a float32 scale per token and captured
layer (4 x H + 16 + 9 bytes a token); the verdict also says what ``auto``
would need. All inputs are read through the Node (corpus stats, the
target's config.json, free space), so the check is the same locally and over SSH.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from eagleflow import bounded_json
from eagleflow.serving.dump_protocol import expand_dump_dir
from eagleflow.config import PipelineConfig
from eagleflow.layout import RunLayout
from eagleflow.nodes import Node
from eagleflow.capture.storage import FP8_SCALING
from eagleflow.serving.aux_layers import default_aux_layers

from .prepare import STATS_FILE

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1}
CAPTURED_LAYERS = 4  # 3 auxiliary layers + the last
MANIFEST_LINE_BYTES = 160  # {"id","index","file","tokens","bytes","sha256"}: ~150 bytes a line
DEFAULT_BLOCK_BYTES = 4096


class BudgetError(ValueError):
    """Missing or unusable inputs for the estimate; the message says which and what to do."""


@dataclass(frozen=True)
class TargetShape:
    hidden_size: int
    dtype: str
    num_layers: int

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def default_aux_layers(self) -> list[int]:
        return default_aux_layers(self.num_layers)   # the layers capture takes when none are configured


def target_shape(config_json: str, where: str, dtype_override: str = "auto") -> TargetShape:
    """hidden size, dtype and depth from a Hugging Face config.json (text_config for multimodal targets)."""
    try:
        data = json.loads(config_json)
    except json.JSONDecodeError as e:
        raise BudgetError(f"{where} is not valid JSON ({e}); the target model directory needs a config.json") from None
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    def pick(key):
        return text.get(key, data.get(key))
    hidden = pick("hidden_size")
    if not isinstance(hidden, int) or hidden <= 0:
        raise BudgetError(f"{where}: hidden_size = {hidden!r}; expected a positive integer")
    dtype = dtype_override if dtype_override != "auto" else (pick("torch_dtype") or pick("dtype") or "float32")
    if dtype not in DTYPE_BYTES:
        raise BudgetError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}; "
                          "set server.dtype in the config")
    layers = pick("num_hidden_layers") or 0
    return TargetShape(hidden_size=hidden, dtype=dtype, num_layers=int(layers))


def bytes_per_token(shape: TargetShape, store_dtype: str = "auto") -> int:
    if store_dtype == "fp8_e4m3":   # 1 byte an element + float32 scales (aux: one per layer, hidden: one)
        return CAPTURED_LAYERS * shape.hidden_size + CAPTURED_LAYERS * 4 + 8 + 1
    return CAPTURED_LAYERS * shape.hidden_size * shape.dtype_bytes + 8 + 1


def safetensors_header_bytes(sample_tokens: int, shape: TargetShape, aux_layers: list[int], model: str,
                             sample_id: str, index: int, store_dtype: str = "auto") -> int:
    """The exact header a capture writes for one sample (length prefix + padded JSON)."""
    h, l = shape.hidden_size, sample_tokens
    st_dtype = {2: "BF16" if shape.dtype == "bfloat16" else "F16", 4: "F32", 1: "F8_E4M3"}[shape.dtype_bytes]
    meta = {"id": sample_id, "index": str(index), "aux_layers": json.dumps(aux_layers), "model": model,
            "store_dtype": store_dtype}
    # tensors in the order capture.storage writes them
    if store_dtype == "fp8_e4m3":
        k = len(aux_layers)
        tensors = [("input_ids", "I64", [l], 8 * l), ("loss_mask", "U8", [l], l),
                   ("aux_hidden_states", "F8_E4M3", [l, 3 * h], l * 3 * h), ("hidden_states", "F8_E4M3", [l, h], l * h),
                   ("aux_hidden_states_scale", "F32", [l, k], 4 * l * k), ("hidden_states_scale", "F32", [l, 1], 4 * l)]
        err = {"max_rel": "0.000e+00", "mean_rel": "0.000e+00"}   # the writer's figures have this fixed width
        meta.update(orig_dtype=shape.dtype, scaling=FP8_SCALING,
                    quant_error=json.dumps({"aux_hidden_states": err, "hidden_states": err}, separators=(",", ":")))
    else:
        tensors = [("input_ids", "I64", [l], 8 * l), ("loss_mask", "U8", [l], l),
                   ("aux_hidden_states", st_dtype, [l, 3 * h], l * 3 * h * shape.dtype_bytes),
                   ("hidden_states", st_dtype, [l, h], l * h * shape.dtype_bytes)]
    header: dict = {"__metadata__": meta}
    offset = 0
    for name, dt, shp, size in tensors:
        header[name] = {"dtype": dt, "shape": shp, "data_offsets": [offset, offset + size]}
        offset += size
    n = len(json.dumps(header, separators=(",", ":")).encode())
    return 8 + n + (-n) % 8


@dataclass(frozen=True)
class DiskEstimate:
    records: int
    tokens: int
    bytes_per_token: int
    tensor_bytes: int
    header_bytes: int
    block_overhead_bytes: int
    manifest_bytes: int
    total_bytes: int
    headroom_fraction: float
    needed_bytes: int
    hidden_size: int
    dtype: str
    store_dtype: str = "auto"
    auto_needed_bytes: int = 0      # what capture.store_dtype auto (the target's dtype) would need


def estimate(records: int, tokens: int, shape: TargetShape, *, aux_layers: list[int], model: str,
             longest_id: str, headroom_fraction: float, block_bytes: int = DEFAULT_BLOCK_BYTES,
             store_dtype: str = "auto") -> DiskEstimate:
    def total_for(sd: str) -> tuple[int, int, int, int, int, int]:
        bpt = bytes_per_token(shape, sd)
        mean_len = max(1, round(tokens / records)) if records else 0
        per_header = safetensors_header_bytes(mean_len, shape, aux_layers, model, longest_id, max(records - 1, 0), sd)
        tensor = tokens * bpt
        header = records * per_header
        blocks = records * (block_bytes // 2)  # expected rounding loss of a file's last block
        manifest = records * MANIFEST_LINE_BYTES
        return bpt, tensor, header, blocks, manifest, tensor + header + blocks + manifest
    bpt, tensor, header, blocks, manifest, total = total_for(store_dtype)
    auto_total = total if store_dtype == "auto" else total_for("auto")[-1]
    return DiskEstimate(records=records, tokens=tokens, bytes_per_token=bpt, tensor_bytes=tensor, header_bytes=header,
                        block_overhead_bytes=blocks, manifest_bytes=manifest, total_bytes=total,
                        headroom_fraction=headroom_fraction, needed_bytes=int(total * (1 + headroom_fraction)),
                        hidden_size=shape.hidden_size, dtype=shape.dtype, store_dtype=store_dtype,
                        auto_needed_bytes=int(auto_total * (1 + headroom_fraction)))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def cache_sizes(node: Node, paths: list[str]) -> dict[str, int | None]:
    """Bytes on disk of each configured old cache (None when it does not exist)."""
    sizes: dict[str, int | None] = {}
    for p in paths:
        res = node.run(["du", "-s", "-B1", "--", p], timeout=600)
        sizes[p] = int(res.stdout.split()[0]) if res.ok and res.stdout.strip() else None
    return sizes


@dataclass
class DiskVerdict:
    ok: bool
    where: str
    free_bytes: int
    estimate: DiskEstimate
    old_caches: dict[str, int | None] = field(default_factory=dict)
    message: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["estimate"] = asdict(self.estimate)
        return d


def check_budget(cfg: PipelineConfig, layout: RunLayout, node: Node) -> DiskVerdict:
    """Estimate from the corpus stats and the target's config; compare with free space at the output dir."""
    stats_path = str(layout.corpus_dir / STATS_FILE)
    stats_text = node.read_text(stats_path)
    if stats_text is None:
        raise BudgetError(f"no corpus statistics at {stats_path} on node {node.name}; "
                          "run `eagleflow corpus prepare` (task prepare_corpus) for this run first")
    stats = bounded_json.loads(stats_text, source=f"{stats_path} on node {node.name}")
    model = str(cfg.resolve(cfg.target_model))
    config_path = f"{model}/config.json"
    config_text = node.read_text(config_path)
    if config_text is None:
        raise BudgetError(f"target config {config_path} not found on node {node.name}; fix target_model")
    shape = target_shape(config_text, config_path, cfg.server.dtype)
    aux = cfg.capture.aux_layers or shape.default_aux_layers()
    longest_source = max((len(s) for s in stats.get("per_source", {})), default=8)
    # the held-out records the trainer scores itself on are stored too (train.held_out_samples; mean length)
    eval_records = int(stats.get("eval_records") or 0)
    held_n = min(cfg.train.held_out_samples, eval_records) if cfg.train.eval_every else 0
    held_tokens = round(int(stats.get("eval_tokens") or 0) * held_n / eval_records) if held_n else 0
    est = estimate(stats["records"] + held_n, stats["tokens"] + held_tokens, shape, aux_layers=aux, model=model,
                   longest_id="s" * longest_source + ":" + "9" * len(str(max(stats["records"], 1))),
                   headroom_fraction=cfg.disk.headroom_fraction, store_dtype=cfg.capture.store_dtype)
    where = str(layout.hidden_states_dir)
    free = node.free_bytes(where)
    caches = cache_sizes(node, [str(cfg.resolve(p)) for p in cfg.disk.old_caches])
    ok = free >= est.needed_bytes
    # the dumps in flight live in server.dump_dir (often /dev/shm): a full one fails every request
    longest = int((stats.get("length") or {}).get("max") or cfg.corpus.max_length)
    dump_dir = str(expand_dump_dir(cfg.resolve(cfg.server.dump_dir)))   # this node user's folder
    # dumps stay in the target's dtype whatever the store keeps
    dump_need = min(stats["records"], cfg.capture.shards * cfg.capture.in_flight) * longest * bytes_per_token(shape)
    dump_free = node.free_bytes(dump_dir)
    dump_line = (f"dump_dir {dump_dir}: {min(stats['records'], cfg.capture.shards * cfg.capture.in_flight)} dump(s) "
                 f"in flight of up to {longest} tokens need {human_bytes(dump_need)}; free there: "
                 f"{human_bytes(dump_free)}")
    head = (f"hidden states for {est.records} samples" + (f" ({held_n} of them held out)" if held_n else "")
            + f" / {est.tokens} tokens need {human_bytes(est.needed_bytes)} "
            f"({est.needed_bytes} bytes: {human_bytes(est.total_bytes)} estimated + "
            f"{est.headroom_fraction:.0%} headroom; {est.bytes_per_token} bytes/token = 4 x {est.hidden_size} x "
            + (f"fp8_e4m3 + scales + ids + mask; capture.store_dtype auto ({est.dtype}) would need "
               f"{human_bytes(est.auto_needed_bytes)}" if est.store_dtype == "fp8_e4m3" else f"{est.dtype} + ids + mask")
            + f") at {where} on node {node.name}; free there: {human_bytes(free)} ({free} bytes)")
    if ok and dump_free < dump_need:
        ok = False
        msg = (f"NOT ENOUGH SPACE IN server.dump_dir: {dump_line}; short by {human_bytes(dump_need - dump_free)}. "
               "Free space there, point server.dump_dir at a bigger filesystem, or lower capture.in_flight / "
               f"capture.shards. ({head})")
    elif ok:
        msg = f"disk OK: {head}; {dump_line}"
    else:
        lines = [f"NOT ENOUGH DISK: {head}; short by {human_bytes(est.needed_bytes - free)}."]
        present = {p: s for p, s in caches.items() if s is not None}
        if present:
            total = sum(present.values())
            lines.append(f"What could be freed (disk.old_caches, {human_bytes(total)} in all):")
            lines += [f"  - {p}: {human_bytes(s)}" for p, s in present.items()]
            if total + free >= est.needed_bytes:
                lines.append("Deleting them would be enough.")
            lines.append("To delete them: trigger the DAG with the Param delete_old_caches = true (or set "
                         "disk.delete_old_caches: true and run `eagleflow corpus delete-caches`); only paths "
                         f"under disk.cache_root ({cfg.resolve(cfg.disk.cache_root)}) are ever deleted.")
        else:
            lines.append("No old caches are configured (disk.old_caches) or they are already gone: free space at "
                         f"{where}, point run_root at a bigger disk, or shorten the corpus (limits, max_length).")
        msg = "\n".join(lines)
    return DiskVerdict(ok=ok, where=where, free_bytes=free, estimate=est, old_caches=caches, message=msg)
