"""``stream.starve_after_s`` (issue 53): how long a streaming trainer waits for the producer's next sample before
it fails with StreamStarved, a validated config field (was 300 s in the code) used by both of its waits: the
first sample (the capture layers) and the loader's next one."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from eagleflow.config import ConfigError, load_config
from eagleflow.train import stream
from eagleflow.train.data import StreamStarved

BASE = {"target_model": "/models/t", "run_root": "/data/runs"}


def _cfg(**fields):
    return load_config(data={**BASE, "stream": {"storage": "mooncake", **fields}})


def test_the_field_defaults_to_300_s_and_refuses_a_wait_that_is_no_wait_naming_it():
    assert load_config(data=BASE).stream.starve_after_s == 300.0
    assert _cfg(starve_after_s=42).stream.starve_after_s == 42.0
    for bad in (0, -5, 10 ** 6):
        with pytest.raises(ConfigError, match=r"stream\.starve_after_s"):
            _cfg(starve_after_s=bad)


def _stream_run(cfg) -> stream.StreamRun:
    sr = stream.StreamRun.__new__(stream.StreamRun)   # no corpus, no store: only what the waits read
    sr.cfg, sr.store, sr.log = cfg, SimpleNamespace(name="mooncake store"), lambda _: None
    sr.source = SimpleNamespace(scan=lambda: [], store="mooncake store")
    return sr


def test_the_wait_for_the_first_sample_ends_after_the_configured_time():
    sr = _stream_run(_cfg(starve_after_s=0.3))
    t0 = time.monotonic()
    with pytest.raises(StreamStarved, match=r"no sample at all for 0\.3 s"):
        sr.aux_layers()
    assert 0.3 <= time.monotonic() - t0 < 5


def test_the_loader_gets_the_configured_time(monkeypatch, tmp_path):
    seen: dict = {}
    monkeypatch.setattr(stream, "StreamLoader", lambda *a, **kw: seen.update(kw) or SimpleNamespace())
    monkeypatch.setattr(stream, "EpochLedger", lambda *a, **kw: SimpleNamespace(plan=lambda epochs: None))
    sr = _stream_run(_cfg(starve_after_s=17))
    sr.reconcile = lambda checkpoint: 0
    sr.ledger_file, sr.settings, sr.corpus_ids, sr.epochs = tmp_path / "ledger", SimpleNamespace(fsync=False), {"a"}, 1
    sr.on_wait = sr.on_store_wait = None
    sr.plan = SimpleNamespace(recapture=False)
    sr.open_loader(None)
    assert seen["starve_after_s"] == 17.0
