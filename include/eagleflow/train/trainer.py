"""The draft training loop: one process on CPU, or one per GPU under torchrun (DDP).

Under torchrun (``WORLD_SIZE`` > 1 in the environment) the process group is
initialised from the environment: NCCL on GPUs, gloo on CPU. Rank 0 alone
writes the vocabulary, checkpoints, metrics, curves and the heartbeat.

Resume is the default: if ``<draft_dir>/checkpoints`` holds a checkpoint, the
weights, optimizer state, step, RNG and data position come back from it, and
the learning rate is a pure function of the step, so the run continues as if
it had never stopped.

Streaming (a store whose ``streaming`` is set, ``stream.storage: mooncake``): the samples are drawn from
the store while capture fills it (``data.StreamLoader``, shuffled within ``stream.shuffle_window``), each
epoch's ids written to the run's ledger (``stores.ledger``) as taken, and as trained once the checkpoint of
the steps that used them is durable (the checkpoint records those ids, so a kill between the two is
repaired at resume). The run trains whole epochs of the corpus prepared (``train.max_steps`` rounded to
whole epochs), resumes from its checkpoint plus the ledger (taken but not trained: served again), and
ends with the exactly-once check, written beside the offline verification record
(``RunLayout.stream_verified_file``): green only when every sample was trained exactly once per epoch.
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from eagleflow.capture.verify import require_verified
from eagleflow.config import PipelineConfig
from eagleflow.heartbeat import (BUSY_WITH, WAITING_FOR_SAMPLES, WAITING_FOR_STORE, Heartbeat, HeartbeatWriter,
                                 record_step_time, set_busy)
from eagleflow.layout import RunLayout
from eagleflow.stores import store_for

from .checkpoint import (load_newest_intact_checkpoint, remove_leftover_temp_dirs, restore_rng,
                         save_checkpoint)
from .curves import append_metrics, plot_curves, truncate_metrics
from .data import Batch, DataPosition, HiddenStateLoader, read_aux_layers, scan_samples
from .held_out import evaluate_held_out, held_out_refs
from .loss import TargetHead, TrainingTimeTest, load_target_head_and_embedding, summarize, target_batch
from .model import DraftConfig, Eagle3Draft
from .stream import StreamRun
from .vocab import DraftVocab, build_draft_vocab, count_loss_tokens


def lr_at(step_index: int, base_lr: float, warmup: int, max_steps: int) -> float:
    """Learning rate of the ``step_index``-th update (0-based): linear warmup, then cosine to zero.

    SpecForge's schedule (lr_scheduler.py CosineAnnealingWarmupLR: warm-up lr x (i + 1) / warmup, then
    torch's CosineAnnealingLR over the remaining steps down to eta_min 0)."""
    if step_index < warmup:
        return base_lr * (step_index + 1) / warmup
    span = max(1, max_steps - warmup)
    progress = min(1.0, (step_index - warmup) / span)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_pref: str) -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but torch sees no GPU on this node; set train.device: cpu "
                           "or install a CUDA build of torch")
    if use_cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="nccl" if use_cuda else "gloo", init_method="env://")
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=device)


def _barrier(d: DistInfo) -> None:
    if d.world_size > 1:
        torch.distributed.barrier()


def training_paths(layout: RunLayout) -> dict[str, Path]:
    draft = Path(layout.draft_dir)
    return {"draft": draft, "checkpoints": draft / "checkpoints", "vocab": draft / "vocab.safetensors",
            "metrics": draft / "metrics.jsonl", "curves": draft / "curves.png",
            "heartbeat": Path(layout.train_heartbeat_file), "export": draft / "export"}


def prepare_vocab(cfg: PipelineConfig, layout: RunLayout, refs, dcfg: DraftConfig, d: DistInfo,
                  resuming: bool, log: Callable[[str], None],
                  counts: Callable[[], torch.Tensor] | None = None) -> DraftVocab:
    """Rank 0 counts loss tokens and writes the vocabulary once; every rank then reads that file.

    ``counts``: the loss-token counts from elsewhere than ``refs`` (streaming: the corpus prepared, whose ids
    and loss masks are the stored samples' own, before they are all captured)."""
    path = training_paths(layout)["vocab"]
    if d.is_main:
        existing = DraftVocab.load(path) if path.is_file() else None
        fits = (existing is not None and existing.size == dcfg.draft_vocab_size
                and existing.target_vocab_size == dcfg.vocab_size)
        if not fits:
            if resuming:
                raise ValueError(f"{path} does not match the checkpoint's draft vocabulary "
                                 f"({dcfg.draft_vocab_size} of {dcfg.vocab_size}); delete {Path(path).parent} "
                                 "to train from scratch, or restore the vocabulary file")
            if counts is None:
                log(f"counting loss-position tokens over {len(refs)} stored samples")
            build_draft_vocab(count_loss_tokens(refs, dcfg.vocab_size) if counts is None else counts(),
                              dcfg.draft_vocab_size, log).save(path)
    _barrier(d)
    return DraftVocab.load(path)


def build_draft(dcfg: DraftConfig, vocab: DraftVocab, head: torch.Tensor, embed: torch.Tensor,
                seed: int) -> Eagle3Draft:
    torch.manual_seed(seed)
    model = Eagle3Draft(dcfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed.float())
        model.d2t.copy_(vocab.d2t)
        model.t2d.copy_(vocab.t2d)
        # Start lm_head at the target's rows for the draft vocab: the output norm mimics the
        # target's, so the first steps already point the right way.
        model.lm_head.weight.copy_(head.float()[vocab.draft_ids])
    return model


@dataclass
class TrainResult:
    step: int
    completed: bool
    metrics: dict[str, Any]
    checkpoint: Path | None
    stream_check: dict[str, Any] | None = None    # streaming: the exactly-once record (StreamRun.verify)


# A fault for the tests (tests/integration/test_stream_faults.py): the first trainer to find this file takes it and
# hangs inside its step, its heartbeat thread running on, as a collective or a transfer that never returns does
HANG_FILE_ENV = "EAGLEFLOW_TRAIN_HANG_FILE"


def _hang_if_asked(path: str) -> None:
    try:
        os.rename(path, path + ".taken")     # taken once: the trainer started after it does not hang
    except OSError:
        return
    while True:
        time.sleep(3600)


def _say_wait(hb: HeartbeatWriter, key: str) -> Callable[[float | None], None]:
    """The heartbeat's word on a wait inside a step (since when, or None once it ended): the step's own clock
    starts again at the wait's end, so its watch judges the step's compute, not the producer's pace."""
    def said(since: float | None) -> None:
        def mark(h: Heartbeat) -> None:
            h.extra[key] = since
            if since is None and h.extra.get(BUSY_WITH) == "step":
                set_busy(h, "step")
        hb.update(mark)
    return said


def train(cfg: PipelineConfig, layout: RunLayout, *, stop_after_step: int | None = None,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train (or resume) the draft of this run; returns where it stopped."""
    tc = cfg.train
    d = init_distributed(tc.device)
    paths = training_paths(layout)
    if d.is_main:
        paths["draft"].mkdir(parents=True, exist_ok=True)
    hb: HeartbeatWriter | None = None
    if d.is_main:
        hb = HeartbeatWriter(paths["heartbeat"], Heartbeat(job="train", pid=os.getpid(), unit="steps",
                                                           total=tc.max_steps),
                             interval_s=cfg.capture.heartbeat_interval_s).start()
    try:
        result = _train(cfg, layout, d, paths, hb, stop_after_step, log)
    except BaseException as e:
        if hb is not None:
            hb.stop("failed", error=f"{type(e).__name__}: {e}"[:2000])
        raise
    if hb is not None:
        hb.stop("complete" if result.completed else None)
    return result


def _train(cfg: PipelineConfig, layout: RunLayout, d: DistInfo, paths: dict[str, Path],
           hb: HeartbeatWriter | None, stop_after_step: int | None, log: Callable[[str], None]) -> TrainResult:
    tc = cfg.train
    say = log if d.is_main else (lambda _msg: None)
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    store = store_for(cfg.stream.storage)
    stream: StreamRun | None = None
    ck = None
    if store.streaming:
        # the samples arrive while capture runs: no verified store to scan, the ledger proves what was trained
        if d.world_size > 1:
            raise ValueError(f"stream.storage {cfg.stream.storage} trains on one process: set "
                             "train.nproc_per_node: 1 (several streaming trainers are not built)")
        stream = StreamRun(cfg, layout, store, say)
        if hb is not None:   # the heartbeat says when the trainer waits for the producer (its watch reads it)
            stream.on_wait = _say_wait(hb, WAITING_FOR_SAMPLES)
            stream.on_store_wait = _say_wait(hb, WAITING_FOR_STORE)    # a store lost mid-run, waited for
        remove_leftover_temp_dirs(paths["checkpoints"], log=say)
        ck = load_newest_intact_checkpoint(paths["checkpoints"], log=say)
        refs = []
        # on resume the first samples may be out of the store already: the checkpoint has their layers
        aux_layers = (ck.state.get("aux_layers") if ck is not None else None) or stream.aux_layers()
        trained_ids = stream.corpus_ids
    else:
        verified = require_verified(layout.hidden_states_dir,
                                    f"`eagleflow capture verify --config <run config> --run-id {layout.run_id}`")
        refs = scan_samples(layout.hidden_states_dir, on_bad=tc.on_bad_sample, verify_sha256=tc.verify_sha256,
                            log=say, verified=verified)
        aux_layers = read_aux_layers(refs[0])
        trained_ids = {r.id for r in refs}
    try:
        return _train_on(cfg, layout, d, paths, hb, stop_after_step, say, refs, aux_layers, trained_ids, stream, ck)
    finally:
        if stream is not None:
            stream.close()


def _train_on(cfg: PipelineConfig, layout: RunLayout, d: DistInfo, paths: dict[str, Path], hb: HeartbeatWriter | None,
              stop_after_step: int | None, say: Callable[[str], None], refs, aux_layers: list[int],
              trained_ids: set[str], stream: StreamRun | None, ck) -> TrainResult:
    tc = cfg.train
    # rank 0 scores the held-out records; the others need not read them
    held = held_out_refs(layout.held_out_hidden_states_dir, eval_every=tc.eval_every, log=say) if d.is_main else []
    leaked = sorted(r.id for r in held if r.id in trained_ids)
    if leaked:
        raise ValueError(f"held-out records {leaked[:5]} are also in the training store "
                         f"{layout.hidden_states_dir}: the split is broken; rerun `eagleflow corpus prepare` and "
                         "the capture for this run")
    target_dir = cfg.resolve(cfg.target_model)
    dcfg = DraftConfig.from_target(target_dir, tc.draft_vocab_size)
    if stream is None:
        if d.is_main:
            remove_leftover_temp_dirs(paths["checkpoints"], log=say)
        ck = load_newest_intact_checkpoint(paths["checkpoints"], log=say)
    ckpt_path = ck.path if ck is not None else None
    vocab = prepare_vocab(cfg, layout, refs, dcfg, d, ckpt_path is not None, say,
                          counts=(lambda: stream.loss_token_counts(dcfg.vocab_size)) if stream is not None else None)
    head, embed = load_target_head_and_embedding(target_dir)
    model = build_draft(dcfg, vocab, head, embed, tc.seed)
    ttt = TrainingTimeTest(model, tc.ttt_length, tc.loss_normalization, fast=tc.fast_step or tc.compile,
                           compile=tc.compile).to(d.device)
    params = [p for p in ttt.parameters() if p.requires_grad]
    # SpecForge (optimizer.py BF16Optimizer): AdamW, weight decay 0, betas from the config (torch's defaults)
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=tc.adam_betas, weight_decay=0.0)

    start_step, position = 0, DataPosition()
    if ck is not None:
        if ck.state.get("draft_config") != dcfg.to_json():
            raise ValueError(f"checkpoint {ckpt_path} was trained with another draft config (target or "
                             f"train.draft_vocab_size changed); delete {paths['checkpoints']} to start over")
        missing = set(model.trainable_state_dict()) - set(ck.model_state)
        if missing:
            raise ValueError(f"checkpoint {ckpt_path} lacks {sorted(missing)}")
        model.load_state_dict(ck.model_state, strict=False)
        opt.load_state_dict(ck.optimizer_state)
        restore_rng(ck.rng, ck.state.get("python_rng"))
        start_step = ck.step
        position = DataPosition(**ck.state["data_position"])
        say(f"resuming from {ckpt_path} at step {start_step} (epoch {position.epoch}, batch {position.cursor})")
    if d.is_main:
        truncate_metrics(paths["metrics"], start_step)
    module: torch.nn.Module = ttt
    ddp = None
    if d.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        module = ddp = DDP(ttt, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    on_gpu = d.device.type == "cuda"
    data_dtype = torch.bfloat16 if on_gpu else torch.float32
    head_t = TargetHead(head, vocab.draft_ids, vocab.t2d).to(d.device, data_dtype)
    del head
    max_steps = tc.max_steps if stream is None else stream.total_steps
    loader: HiddenStateLoader | None = None
    if stream is None:
        loader = offline = HiddenStateLoader(refs, batch_size=tc.batch_size, seed=tc.seed, rank=d.rank,
                                             world_size=d.world_size, position=position)
        next_batch: Callable[[], Batch] = offline.next_batch
        epoch_now: Callable[[], int] = lambda: offline.position.epoch  # noqa: E731
        data_done: Callable[[], bool] = lambda: False  # noqa: E731
        waited_s: Callable[[], float] | None = None
        window_low: Callable[[], int | None] | None = None
        n_samples, store_dtype = len(refs), refs[0].store_dtype
    else:
        say(stream.describe())
        sl = stream.open_loader(ck.state if ck is not None else None)
        next_batch = lambda: sl.next_batch()[0]  # noqa: E731  (its refs stay in the loader until the commit)
        epoch_now, data_done = (lambda: sl.epoch), (lambda: sl.finished)
        waited_s = lambda: sl.waited_s  # noqa: E731  (a step's wait for the producer, in its metrics row)
        window_low = sl.window_low      # the fewest samples a batch of the step was drawn from, in its row
        n_samples, store_dtype = stream.corpus_size, cfg.capture.store_dtype
    micro = tc.grad_accum
    say(f"training draft: hidden {dcfg.hidden_size}, draft vocab {dcfg.draft_vocab_size}, ttt {tc.ttt_length}, "
        f"{n_samples} samples (store {store_dtype}"
        f"{', de-quantised on ' + str(d.device) if store_dtype == 'fp8_e4m3' else ''}), batch {tc.batch_size} x accum {micro} x {d.world_size} process(es) on {d.device}, "
        f"steps {start_step}->{max_steps}, lr {tc.lr:g} (warm-up {tc.warmup}), loss over "
        f"{tc.loss_normalization}, mask {tc.loss_mask_alignment}"
        f"{', fast step' if tc.fast_step or tc.compile else ''}{', compiled layer' if tc.compile else ''}")
    if hb is not None:
        def running(h: Heartbeat) -> None:
            h.state, h.done, h.resumed, h.total = "running", start_step, start_step, max_steps
            h.extra.update(aux_layers=aux_layers)
        hb.update(running)

    last_metrics: dict[str, Any] = {}
    last_ckpt: Path | None = ckpt_path
    step = start_step
    tokens_this_run = 0
    t_start = time.time()
    hang_file = os.environ.get(HANG_FILE_ENV)      # read once, not on every micro-batch
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_gpu else contextlib.nullcontext
    try:
        while step < max_steps and not data_done() and (stop_after_step is None or step < stop_after_step):
            t0 = time.time()
            w0 = waited_s() if waited_s is not None else 0.0
            if hb is not None:
                hb.update(lambda h: set_busy(h, "step"))
            lr = lr_at(step, tc.lr, tc.warmup, max_steps)
            for g in opt.param_groups:
                g["lr"] = lr
            stats_sum = None
            tokens = 0
            used = 0
            for m in range(micro):
                if m and data_done():
                    break        # streaming: the last epoch ended inside this step
                used += 1
                batch = next_batch().to(d.device, data_dtype)
                tb = target_batch(head_t, batch, tc.loss_mask_alignment)
                # DDP's all-reduce only on the last micro-batch
                sync = ddp.no_sync() if ddp is not None and m != micro - 1 else contextlib.nullcontext()
                with sync:
                    with autocast():
                        loss, stats = module(batch.input_ids, batch.aux_hidden_states, tb.probs, tb.top, tb.valid)
                    (loss / micro).backward()
                if hang_file:
                    _hang_if_asked(hang_file)
                stats_sum = stats if stats_sum is None else stats_sum + stats
                tokens += batch.num_tokens
            if stats_sum is None:
                raise ValueError(f"train.grad_accum is {micro}: a step needs at least one micro-batch")
            grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if tc.compile and step == start_step + 1:
                say("train.compile: " + (f"compiling failed, the decoder layer runs eagerly ({ttt.compile_error})"
                                         if ttt.compile_error else "the decoder layer runs compiled"))
            packed = torch.cat([stats_sum, torch.tensor([float(tokens)], device=stats_sum.device)])
            if d.world_size > 1:
                torch.distributed.all_reduce(packed)
            tokens_all = int(packed[-1].item())
            sm = summarize(packed[:-1], tc.ttt_length, used * d.world_size)
            tokens_this_run += tokens_all
            dt = time.time() - t0
            row: dict[str, Any] = {"step": step, "time": time.time(), "lr": lr, "grad_norm": float(grad_norm),
                   "tokens": tokens_all, "tokens_per_s": tokens_all / max(dt, 1e-9),
                   "epoch": epoch_now(), **sm.as_dict()}
            if waited_s is not None:     # streaming: seconds of this step spent waiting for the producer's samples
                row["producer_wait_s"] = round(waited_s() - w0, 4)
                # and the fewest samples its batches were drawn from (under stream.shuffle_window: the producer
                # was not ahead; the batches came from what had just arrived)
                row["stream_window"] = window_low() if window_low is not None else None
            end_now = (step == max_steps or data_done()
                       or (stop_after_step is not None and step >= stop_after_step))
            if held and (step % tc.eval_every == 0 or end_now):
                if hb is not None:
                    hb.update(lambda h: set_busy(h, "eval"))
                row.update(evaluate_held_out(ttt, head_t, held, batch_size=tc.batch_size, device=d.device,
                                             dtype=data_dtype, mask_alignment=tc.loss_mask_alignment,
                                             autocast=autocast))
                say(f"held-out at step {step}: loss per position {row.get('eval_loss_per_position', float('nan')):.4f} "
                    f"acc_0 {row['eval_acc_0']:.3f} accept_len {row['eval_accept_length']:.2f} "
                    f"({len(held)} samples)")
            last_metrics = row
            if d.is_main:
                append_metrics(paths["metrics"], row)
                if hb is not None:
                    def bump(h: Heartbeat, row=row) -> None:
                        h.done = step
                        h.tokens += tokens_all
                        record_step_time(h, dt - row.get("producer_wait_s", 0.0))
                        h.extra.update(tokens_this_run=tokens_this_run, loss=row["loss"], acc_0=row["acc_0"],
                                       accept_length=row["accept_length"])
                    hb.update(bump)
                    hb.mark_progress()
                if step % tc.log_every == 0 or step == start_step + 1:
                    say(f"step {step}/{max_steps} loss {sm.loss:.4f} acc_0 {sm.acc[0]:.3f} "
                        f"accept_len {sm.accept_length:.2f} lr {lr:.2e} {row['tokens_per_s']:,.0f} tok/s")
            commit_now = stream is not None and stream.must_commit(tc.batch_size * micro)
            if step % tc.checkpoint_every == 0 or end_now or commit_now:
                if hb is not None:
                    hb.update(lambda h: set_busy(h, "checkpoint"))
                if d.is_main:
                    data_position = (stream.position() if stream is not None
                                     else loader.position if loader is not None else DataPosition()).to_json()
                    state = {"data_position": data_position, "draft_config": dcfg.to_json(),
                             "aux_layers": aux_layers, "target_model": str(target_dir),
                             "max_steps": max_steps, "lr": tc.lr, "warmup_steps": tc.warmup,
                             "world_size": d.world_size, "metrics": row}
                    if stream is not None:      # the ids these steps trained on: committed once this is durable
                        state["stream"] = stream.checkpoint_state()
                    last_ckpt = save_checkpoint(paths["checkpoints"], step, model.trainable_state_dict(), opt,
                                                state, keep=tc.keep_checkpoints)
                    if stream is not None:
                        stream.commit(step)
                    # the curves at the regular checkpoints and the end only: a streaming commit can come every
                    # few steps (stream.must_commit), and drawing the PNG cost ~2 s a time here (issue 53 bench)
                    if step % tc.checkpoint_every == 0 or end_now:
                        plot_curves(paths["metrics"], paths["curves"])
                    say(f"checkpoint {last_ckpt}")
                _barrier(d)
    finally:
        if loader is not None:
            loader.close()
    elapsed = time.time() - t_start
    say(f"stopped at step {step}/{max_steps} after {elapsed:.1f} s "
        f"({tokens_this_run / max(elapsed, 1e-9):,.0f} tokens/s)")
    completed = step >= max_steps or data_done()
    check = stream.verify() if stream is not None and completed and d.is_main else None
    return TrainResult(step=step, completed=completed, metrics=last_metrics, checkpoint=last_ckpt,
                       stream_check=check)
