"""Issue 53, more than one epoch when the corpus does not fit the store's buffer: the plan that says whether each
shard is captured again per epoch, and the loader and ledger over per-epoch captures (epoch e takes only pass e's
samples, each released after its use in that epoch, every sample exactly once per epoch, a resume mid-pass)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from eagleflow.config import load_config
from eagleflow.corpus.passes import capture_plan, corpus_stored_bytes
from eagleflow.layout import RunLayout
from eagleflow.stores import pass_manifest
from eagleflow.stores.contract import SampleRef
from eagleflow.stores.encoding import encode_sample
from eagleflow.stores.ledger import EpochLedger, check_exactly_once, read_ledger
from eagleflow.stores.mooncake.store import sample_key
from eagleflow.train.data import StreamLoader
from eagleflow.train.stream import release_trained
from tests.fixtures.capture_corpus import write_corpus
from tests.unit.test_stream_ledger import MemorySource


class PassSource(MemorySource):
    """MemorySource whose captures carry their pass, each pass under its own key (as the Mooncake sink puts)."""

    def add(self, i: int, capture_pass: int = 0) -> None:  # type: ignore[override]
        n = 3 + i % 4
        # another pass of a GPU capture is not bitwise the same: its own bytes, its own digest
        enc = encode_sample(index=i, sample_id=f"s{i}", input_ids=torch.arange(n), loss_mask=[1] * n,
                            aux_hidden_states=torch.full((n, 6), float(capture_pass)),
                            hidden_states=torch.zeros(n, 2), aux_layers=[1, 2, 3], model="m")
        key = sample_key("run", 0, i, capture_pass)
        self.data[key] = enc.to_bytes()
        self.refs.append(SampleRef(0, i, f"s{i}", key, enc.tokens, enc.size, enc.sha256(), capture_pass=capture_pass))


def _loader(src, led, **kw) -> StreamLoader:
    return StreamLoader(src, led, batch_size=2, corpus_size=6, epochs=2, recapture=True, poll_s=0.001,
                        starve_after_s=0.5, **kw)


def _drain_epoch(sl: StreamLoader, step: int) -> tuple[int, list[SampleRef]]:
    refs: list[SampleRef] = []
    epoch = sl.epoch
    while sl.epoch == epoch and not sl.finished:
        _, got = sl.next_batch()
        refs += got
        step += 1
        sl.commit(step)
    return step, refs


def _pass_zero_of_six(tmp_path):
    """A source holding capture pass 0 of six samples, and an empty ledger."""
    src = PassSource()
    for i in range(6):
        src.add(i, 0)
    return src, EpochLedger(tmp_path / "l.jsonl", fsync=False)


def test_each_epoch_takes_only_its_own_pass_and_each_key_leaves_after_that_epoch(tmp_path):
    src, led = _pass_zero_of_six(tmp_path)
    waits: list = []
    sl = _loader(src, led, on_wait=waits.append)
    step, first = _drain_epoch(sl, 0)
    assert {r.capture_pass for r in first} == {0} and len(first) == 6
    assert not any(k for k in src.data if "/pass1/" not in k)      # pass 0's keys gone once epoch 0 committed
    assert sl.epoch == 1 and not sl.ready(2)                       # epoch 1 waits for pass 1: starved, not stuck
    for i in range(6):
        src.add(i, 1)
    assert sl.ready(2)
    step, second = _drain_epoch(sl, step)
    assert {r.capture_pass for r in second} == {1} and sorted(r.id for r in second) == [f"s{i}" for i in range(6)]
    assert sl.finished and src.data == {}                         # every key out of the store at the end
    check = check_exactly_once(read_ledger(tmp_path / "l.jsonl"), {f"s{i}" for i in range(6)}, 2)
    assert check.ok, check.summary()


def test_an_epoch_waits_for_the_next_pass_as_for_any_sample(tmp_path):
    src, led = _pass_zero_of_six(tmp_path)
    waits: list = []
    sl = _loader(src, led, on_wait=waits.append)
    _drain_epoch(sl, 0)
    try:
        sl.next_batch()
    except Exception as e:       # noqa: BLE001 - the starved loader's own error is asserted below
        err = e
    assert type(err).__name__ == "StreamStarved" and "epoch 1 (0/6 served)" in str(err)
    assert waits and waits[0] is not None              # its heartbeat said it waits for the producer


def test_a_loader_killed_in_epoch_two_resumes_with_none_lost_and_none_twice(tmp_path):
    src, led = _pass_zero_of_six(tmp_path)
    sl = _loader(src, led)
    step, _ = _drain_epoch(sl, 0)
    for i in range(6):
        src.add(i, 1)
    sl.next_batch()
    step += 1
    sl.commit(step)                      # one batch of epoch 1 trained
    _, taken = sl.next_batch()           # one taken, never trained: the trainer is killed here
    led.close()

    led2 = EpochLedger(tmp_path / "l.jsonl", fsync=False)
    again = _loader(src, led2)
    assert again.epoch == 1 and again.served == 2
    _, first = again.next_batch()
    assert sorted(r.id for r in first) == sorted(r.id for r in taken) and {r.capture_pass for r in first} == {1}
    again.commit(step + 1)
    _drain_epoch(again, step + 1)
    assert again.finished and src.data == {}
    check = check_exactly_once(read_ledger(tmp_path / "l.jsonl"), {f"s{i}" for i in range(6)}, 2)
    assert check.ok, check.summary()


def test_without_recapture_every_epoch_trains_on_pass_zero_kept_to_the_last(tmp_path):
    src, led = _pass_zero_of_six(tmp_path)
    sl = StreamLoader(src, led, batch_size=2, corpus_size=6, epochs=2, poll_s=0.001, starve_after_s=0.5)
    step, _ = _drain_epoch(sl, 0)
    assert len(src.data) == 6                           # kept for the last epoch
    _drain_epoch(sl, step)
    assert sl.finished and src.data == {}


def test_release_trained_releases_a_pass_only_once_its_own_epoch_trained_it(tmp_path):
    src = PassSource()
    for p in (0, 1):
        for i in range(2):
            src.add(i, p)
    led = EpochLedger(tmp_path / "l.jsonl", fsync=False)
    led.trained(0, ["s0", "s1"], step=1)
    led.trained(1, ["s0"], step=2)
    led.close()
    assert release_trained(tmp_path / "l.jsonl", 2, src, recapture=True) == 3
    assert list(src.data) == [sample_key("run", 0, 1, 1)]
    keep = PassSource()
    for i in range(2):
        keep.add(i, 0)
    assert release_trained(tmp_path / "l.jsonl", 2, keep) == 1 and list(keep.data) == [sample_key("run", 0, 1)]


def test_pass_keys_and_manifests_are_their_own_and_pass_zero_is_unchanged():
    assert sample_key("r", 3, 7) == "r/shard_00003/00000007"
    assert sample_key("r", 3, 7, 2) == "r/shard_00003/pass2/00000007"
    assert pass_manifest(0) == "manifest.jsonl" and pass_manifest(1) == "manifest.pass1.jsonl"


def _run(tmp_path, buffer_gib: float, max_steps: int, storage: str = "mooncake", model_config: bool = True):
    model = tmp_path / "model"
    model.mkdir(parents=True, exist_ok=True)
    if model_config:
        (model / "config.json").write_text(json.dumps({"hidden_size": 16, "num_hidden_layers": 8,
                                                       "torch_dtype": "float32"}))
    cfg = load_config(data={"target_model": str(model), "run_root": str(tmp_path / "runs"),
                            "capture": {"shards": 2}, "node": {"name": "n", "state_dir": str(tmp_path / "state")},
                            "train": {"batch_size": 2, "grad_accum": 1, "max_steps": max_steps},
                            "stream": {"storage": storage, "buffer_gib": buffer_gib}})
    layout = RunLayout.for_run(cfg, "r")
    corpus = Path(str(layout.corpus_dir))
    rows = write_corpus(corpus / "corpus.parquet", 10, 50)
    (corpus / "stats.json").write_text(json.dumps({"records": len(rows),
                                                   "tokens": sum(len(r["input_ids"]) for r in rows)}))
    return cfg, layout


def test_the_plan_recaptures_only_when_several_epochs_do_not_fit_the_buffer(tmp_path):
    cfg, layout = _run(tmp_path, buffer_gib=1.0, max_steps=10)          # 10 samples, batch 2: 2 epochs
    need = corpus_stored_bytes(cfg, layout)
    assert 10 * 4 * 16 * 4 < need < 10 * 40 * (4 * 16 * 4 + 9) + 10 * 1024   # tensors of 4 x 16 float32 a token
    fits = capture_plan(cfg, layout)
    assert (fits.epochs, fits.passes, fits.recapture) == (2, 1, False) and fits.last_epoch(0) == 1
    small = need / 3 / (1 << 30)
    cfg, layout = _run(tmp_path, buffer_gib=small, max_steps=10)
    plan = capture_plan(cfg, layout)
    assert (plan.epochs, plan.passes) == (2, 2) and plan.capture_pass(1) == 1 and plan.last_epoch(0) == 0
    assert "does not fit" in plan.why
    cfg, layout = _run(tmp_path, buffer_gib=small, max_steps=5)          # one epoch: one capture, however big
    assert capture_plan(cfg, layout).passes == 1
    cfg, layout = _run(tmp_path, buffer_gib=small, max_steps=10, storage="disk")
    assert capture_plan(cfg, layout).passes == 1                         # a disk keeps every sample


def test_a_corpus_whose_bytes_cannot_be_estimated_is_recaptured(tmp_path):
    cfg, layout = _run(tmp_path / "x", buffer_gib=1.0, max_steps=10, model_config=False)
    plan = capture_plan(cfg, layout)
    assert plan.passes == 2 and plan.corpus_bytes is None and "config.json" in plan.why


def test_reconcile_counts_a_recapturing_shard_over_its_passes(tmp_path, monkeypatch):
    """A shard whose pass 0 is complete and pass 1 is not is incomplete (its claim reruns the worker, which resumes
    at pass 1); pass 1's lines kept by its own epoch's rule."""
    from eagleflow.capture.manifest import ManifestEntry, ManifestWriter
    from eagleflow.local_run import LocalRun
    from eagleflow.stores.mooncake import store as mstore
    from eagleflow.stores.mooncake.master import MooncakeEndpoint
    from eagleflow.watchdog.reconcile import shard_state
    cfg, layout = _run(tmp_path, buffer_gib=1e-6, max_steps=10)
    cfg = cfg.model_copy(update={"capture": cfg.capture.model_copy(update={"shards": 1})})
    layout = RunLayout.for_run(cfg, "r")
    shard = Path(str(layout.shard_dir(0)))
    ids = [f"src{i % 3}:{i * 7}" for i in range(10)]

    def write(cp: int, n: int) -> None:
        with ManifestWriter(shard / pass_manifest(cp), fsync=False) as w:
            for i in range(n):
                w.append(ManifestEntry(id=ids[i], index=i, file=sample_key("r", 0, i, cp), tokens=5, bytes=10,
                                       sha256="0" * 64, store_dtype="auto", store_id="s1"))
    write(0, 10)
    write(1, 3)
    monkeypatch.setattr(mstore, "running_store", lambda f: MooncakeEndpoint(
        host="127.0.0.1", rpc_port=1, metadata_port=2, metrics_port=3, segment_bytes=1, store_id="s1"))
    run = LocalRun(cfg=cfg, layout=layout, config_path=str(tmp_path / "c.yaml"))
    st = shard_state(run, 0)
    assert (st.stored, st.expected, st.incomplete) == (13, 20, True)
    write(1, 10)
    st = shard_state(run, 0)
    assert (st.stored, st.expected, st.incomplete) == (20, 20, False)


class _PassStore:
    """The worker's view of a streaming store without a server: every recorded line is kept at resume (as with no
    store id to prove one lost), a sink appends its pass's manifest line per sample."""
    streaming = True

    def __init__(self):
        self.put: list[tuple[int, int]] = []       # (pass, index) in put order
        self.fail_after: int | None = None         # the worker dies after this many puts (killed mid-pass)

    def resume_check(self, shard_dir, scan, last_epoch=None):
        from eagleflow.capture.manifest import ResumeCheck
        return ResumeCheck(done=set(scan.entries), broken=[], hashed=0, refreshed={})

    def open_sink(self, settings, shard):
        from eagleflow.capture.manifest import ManifestEntry, ManifestWriter
        store = self

        class Sink:
            on_wait = None
            manifest = ManifestWriter(Path(settings.root) / f"shard_{shard:05d}" / pass_manifest(settings.capture_pass),
                                      fsync=False)

            def put(self, smp):
                if store.fail_after is not None and len(store.put) >= store.fail_after:
                    raise RuntimeError("killed")
                store.put.append((settings.capture_pass, smp.index))
                self.manifest.append(ManifestEntry(id=smp.id, index=smp.index,
                                                   file=sample_key("r", shard, smp.index, settings.capture_pass),
                                                   tokens=smp.tokens, bytes=1, sha256="0" * 64, store_dtype="auto"))

            def close(self):
                self.manifest.close()
        return Sink()


def _worker(tmp_path, monkeypatch, store: _PassStore, shard: int = 0, num_shards: int = 1):
    from eagleflow.phases.extract import worker as w

    def one(self, smp, sink, hbw):       # the capture itself is the server's (other tests): here only the put
        sink.put(smp)

        def progressed(hb):
            hb.done += 1
        hbw.update(progressed)
    monkeypatch.setattr(w, "store_for", lambda name: store)
    monkeypatch.setattr(w.ShardWorker, "_one", one)
    s = w.WorkerSettings(run_id="r", shard=shard, num_shards=num_shards, corpus_file=str(tmp_path / "corpus.parquet"),
                         shard_dir=str(tmp_path / "hs" / f"shard_{shard:05d}"), dump_dir=str(tmp_path / "dumps"),
                         server_url="http://127.0.0.1:9", in_flight=1, heartbeat_interval_s=0.05, storage="mooncake",
                         passes=2)
    (tmp_path / "dumps").mkdir(exist_ok=True)
    return w.ShardWorker(s, log=lambda m: None)


def test_a_worker_captures_its_shard_once_per_pass_and_resumes_at_the_pass_and_sample(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus.parquet", 5, 50)
    store = _PassStore()
    store.fail_after = 7                           # pass 0's five, then two of pass 1: killed there
    try:
        _worker(tmp_path, monkeypatch, store).run()
    except RuntimeError:
        pass
    assert store.put == [(0, i) for i in range(5)] + [(1, 0), (1, 1)]
    store.fail_after = None
    hb = _worker(tmp_path, monkeypatch, store).run()
    assert store.put[7:] == [(1, 2), (1, 3), (1, 4)]          # resumed at pass 1, sample 2: none redone, none lost
    assert (hb.state, hb.done, hb.total, hb.resumed) == ("complete", 10, 10, 7)
    d = tmp_path / "hs" / "shard_00000"
    assert sorted(p.name for p in d.glob("manifest*")) == ["manifest.jsonl", "manifest.pass1.jsonl"]
    assert all("/pass1/" in json.loads(x)["file"] for x in (d / "manifest.pass1.jsonl").read_text().splitlines())


def test_a_pass_starts_only_once_every_shards_previous_pass_is_put(tmp_path, monkeypatch):
    """Shard 0's pass 1 would take room the trainer's epoch 0 still needs from shard 1: it waits, held back."""
    import threading
    import time

    from eagleflow.capture.manifest import ManifestEntry, ManifestWriter
    from eagleflow.heartbeat import WAITING_FOR_PASS, WAITING_FOR_ROOM, Heartbeat
    rows = write_corpus(tmp_path / "corpus.parquet", 4, 50)
    store = _PassStore()
    worker = _worker(tmp_path, monkeypatch, store, shard=0, num_shards=2)
    other = tmp_path / "hs" / "shard_00001"
    seen: dict = {}

    def shard_one_puts_late():
        try:
            _puts_late()
        except BaseException as e:   # noqa: BLE001 - handed to the test; the worker must not wait for ever
            seen["error"] = e
            with ManifestWriter(other / "manifest.jsonl", fsync=False) as m:
                for i in (1, 3):
                    m.append(ManifestEntry(id=rows[i]["id"], index=i, file=sample_key("r", 1, i), tokens=4, bytes=1,
                                           sha256="0" * 64, store_dtype="auto"))

    def _puts_late():
        hb_file = tmp_path / "hs" / "shard_00000" / "heartbeat.json"
        end = time.monotonic() + 20
        while time.monotonic() < end and WAITING_FOR_ROOM not in seen:
            try:
                hb = Heartbeat.read(str(hb_file))
                seen.update(hb.extra if hb is not None else {})
            except (OSError, ValueError, TypeError, KeyError):
                pass
            time.sleep(0.02)
        seen["puts_while_waiting"] = list(store.put)
        with ManifestWriter(other / "manifest.jsonl", fsync=False) as m:
            for i in (1, 3):
                m.append(ManifestEntry(id=rows[i]["id"], index=i, file=sample_key("r", 1, i), tokens=4, bytes=1,
                                       sha256="0" * 64, store_dtype="auto"))
    t = threading.Thread(target=shard_one_puts_late, daemon=True)
    t.start()
    hb = worker.run()
    t.join(5)
    assert "error" not in seen, seen["error"]
    assert WAITING_FOR_ROOM in seen                              # its heartbeat said held back while it waited
    assert seen.get(WAITING_FOR_PASS) == 1 and WAITING_FOR_PASS not in hb.extra   # ... at pass 1's gate, then not
    assert seen["puts_while_waiting"] == [(0, 0), (0, 2)]        # no pass 1 put before shard 1's pass 0
    assert store.put == [(0, 0), (0, 2), (1, 0), (1, 2)] and hb.done == hb.total == 4
