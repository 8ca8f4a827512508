"""A generation shard resumes only what it made: same split, same inputs, same id at each index."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagleflow.capture.manifest import ManifestEntry, ManifestWriter, completed_indexes, read_manifest
from eagleflow.capture.storage import file_sha256
from eagleflow.phases.generate.phase import GenerationIncomplete, generated_source_rows
from eagleflow.phases.generate.regenerate import REGENERATED, RecordResult
from eagleflow.phases.generate.worker import (IDENTITY, MANIFEST, GenerationError, InputRecord, check_identity, plan_resume,
                                       read_results, result_file_name)


def _inputs(ids, shard=0, n=1):
    return [InputRecord(i, rid, "s", "s.jsonl", f"line {i + 1}", '{"messages": []}', None)
            for i, rid in ids if i % n == shard]


def _store(shard_dir: Path, entries):
    shard_dir.mkdir(parents=True, exist_ok=True)
    with ManifestWriter(shard_dir / MANIFEST, fsync=False) as m:
        for index, rid in entries:
            path = shard_dir / result_file_name(index)
            path.write_text(RecordResult(id=rid, source="s", where="w", status=REGENERATED, input_ids=[1],
                                         loss_mask=[1], spans=[[0, 1]]).to_json() + "\n")
            st = os.stat(path)
            m.append(ManifestEntry(id=rid, index=index, file=path.name, tokens=1, bytes=st.st_size,
                                   sha256=file_sha256(path), mtime_ns=st.st_mtime_ns))


def test_a_resume_under_another_shard_count_or_other_inputs_is_refused_naming_the_file(tmp_path):
    ins = _inputs([(0, "s:0"), (2, "s:2")], 0, 2)
    check_identity(tmp_path, 0, 2, ins)
    assert (tmp_path / IDENTITY).exists()
    check_identity(tmp_path, 0, 2, ins)   # the same split and inputs resume
    with pytest.raises(GenerationError, match=r"shard\.json: num_shards 2 there, 3 now.*delete"):
        check_identity(tmp_path, 0, 3, ins)
    with pytest.raises(GenerationError, match=r"inputs_sha256 '[0-9a-f]{64}' there"):
        check_identity(tmp_path, 0, 2, _inputs([(0, "s:0"), (2, "s:7")], 0, 2))


def test_a_reworded_bad_record_message_still_resumes_but_another_error_or_conversation_does_not(tmp_path):
    from eagleflow.corpus.normalise import BadRecord

    def bad(problem, kind="wrong_type", field="messages"):
        return BadRecord(source="s", file="s.jsonl", where="line 2", field=field, value="1", kind=kind,
                         problem=problem).to_json()
    good = InputRecord(0, "s:0", "s", "s.jsonl", "line 1", '{"messages": []}', None)
    check_identity(tmp_path, 0, 1, [good, InputRecord(1, "s:1", "s", "s.jsonl", "line 2", None, bad("is not a list"))])
    # an upgrade words the same error differently: the same inputs, resumed
    check_identity(tmp_path, 0, 1, [good, InputRecord(1, "s:1", "s", "s.jsonl", "line 2", None,
                                                      bad("must be a list of messages; fix the record"))])
    for other in ([good, InputRecord(1, "s:1", "s", "s.jsonl", "line 2", None, bad("x", field="tools"))],
                  [InputRecord(0, "s:0", "s", "s.jsonl", "line 1", '{"messages": [1]}', None),
                   InputRecord(1, "s:1", "s", "s.jsonl", "line 2", None, bad("x"))]):
        with pytest.raises(GenerationError, match="inputs_sha256"):
            check_identity(tmp_path, 0, 1, other)


def test_an_identity_written_with_the_older_digest_resumes_and_is_rewritten(tmp_path):
    import hashlib
    import json
    ins = _inputs([(0, "s:0"), (1, "s:1")])
    h = hashlib.sha256()   # the digest before (the whole conversation and error text)
    for r in ins:
        h.update(json.dumps([r.index, r.id, r.conversation, r.error], ensure_ascii=False).encode() + b"\n")
    (tmp_path / IDENTITY).write_text(json.dumps({"num_shards": 1, "shard": 0, "inputs_sha256": h.hexdigest()}))
    check_identity(tmp_path, 0, 1, ins)
    assert json.loads((tmp_path / IDENTITY).read_text())["inputs_sha256"] != h.hexdigest()
    check_identity(tmp_path, 0, 1, ins)


def test_an_index_is_skipped_only_when_its_stored_id_is_the_inputs(tmp_path):
    _store(tmp_path, [(0, "s:0"), (1, "other:1")])
    scan = read_manifest(tmp_path / MANIFEST)
    done = completed_indexes(tmp_path, scan).done
    assert done == {0, 1}
    todo, redo = plan_resume(_inputs([(0, "s:0"), (1, "s:1"), (2, "s:2")]), scan, done)
    assert [r.index for r in todo] == [1, 2]
    assert redo == ["index 1: stored 'other:1', input 's:1'"]


def test_read_results_returns_only_this_shards_indexes(tmp_path):
    _store(tmp_path, [(0, "s:0"), (1, "s:1"), (2, "s:2"), (3, "s:3")])
    assert [r.id for r in read_results(tmp_path, 1, 2)] == ["s:1", "s:3"]
    (tmp_path / IDENTITY).write_text('{"num_shards": 2, "shard": 0, "inputs_sha256": "x"}')
    assert [r.id for r in read_results(tmp_path)] == ["s:0", "s:2"]


def test_generated_source_rows_refuses_an_id_stored_twice(tmp_path):
    layout = SimpleNamespace(generated_dir=tmp_path, generate_shard_dir=lambda s: tmp_path / f"shard_{s:05d}")
    cfg = SimpleNamespace(generate=SimpleNamespace(shards=2))
    _store(layout.generate_shard_dir(0), [(0, "s:0"), (2, "s:2")])
    _store(layout.generate_shard_dir(1), [(1, "s:1")])
    assert [r["__row"] for r in generated_source_rows(cfg, layout, "s")] == [0, 1, 2]
    _store(layout.generate_shard_dir(1), [(3, "s:2")])
    with pytest.raises(GenerationIncomplete, match=r"s:2 \(shards 0, 1\)"):
        generated_source_rows(cfg, layout, "s")


def test_tokens_per_s_after_a_resume_divides_by_every_runs_wall_time(tmp_path):
    from eagleflow.config import load_config
    from eagleflow.phases.generate.phase import collect
    from eagleflow.phases.generate.worker import HEARTBEAT, earlier_wall_s
    from eagleflow.heartbeat import Heartbeat
    cfg = load_config(data={"target_model": "/models/t", "corpus": {"sources": [{"name": "s", "path": "/x.jsonl"}]},
                            "generate": {"enabled": True, "shards": 1}})
    layout = SimpleNamespace(generated_dir=tmp_path, generate_shard_dir=lambda s: tmp_path / f"shard_{s:05d}")
    d = layout.generate_shard_dir(0)
    d.mkdir()
    with ManifestWriter(d / MANIFEST, fsync=False) as m:
        for i in range(2):   # record 0 from the first run, record 1 from the resume: 100 tokens each
            p = d / result_file_name(i)
            p.write_text(RecordResult(id=f"s:{i}", source="s", where="w", status=REGENERATED, input_ids=[1],
                                      loss_mask=[1], spans=[[0, 1]], tokens_generated=100,
                                      generation_s=1.0).to_json() + "\n")
            st = os.stat(p)
            m.append(ManifestEntry(id=f"s:{i}", index=i, file=p.name, tokens=1, bytes=st.st_size,
                                   sha256=file_sha256(p), mtime_ns=st.st_mtime_ns))
    # the first run took 30 s, the resume 10 s
    first = Heartbeat(job="generate shard 0/1", pid=1, unit="records", started_at=1000.0, time=1030.0,
                      extra={"wall_s_before": 0.0})
    (d / HEARTBEAT).write_text(first.to_json())
    assert earlier_wall_s(d / HEARTBEAT) == 30.0
    resumed = Heartbeat(job="generate shard 0/1", pid=2, unit="records", started_at=2000.0, time=2010.0,
                        state="complete", total=2, done=2, extra={"wall_s_before": earlier_wall_s(d / HEARTBEAT)})
    (d / HEARTBEAT).write_text(resumed.to_json())
    stats = collect(cfg, layout)
    assert stats["wall_s"] == 40.0 and stats["tokens_per_s"] == 5.0
    assert stats["per_source"]["s"]["tokens_per_s"] == 5.0


def test_an_incomplete_fleet_generation_names_each_shards_node(tmp_path):
    """The corpus refuses a fleet's generation while a node's shard is missing, naming the node to bring back."""
    from eagleflow.config import load_config
    from eagleflow.phases.generate.phase import collect
    from eagleflow.phases.generate.worker import HEARTBEAT
    from eagleflow.heartbeat import Heartbeat
    cfg = load_config(data={"target_model": "/models/t", "corpus": {"sources": [{"name": "s", "path": "/x.jsonl"}]},
                            "generate": {"enabled": True, "shards": 2},
                            "fleet": {"nodes": [{"name": "n1"}, {"name": "n2"}], "training_node": "n1"}}
                      ).node_view("n1")
    layout = SimpleNamespace(generated_dir=tmp_path, generate_shard_dir=lambda s: tmp_path / f"shard_{s:05d}",
                             run_dir=tmp_path)
    _store(layout.generate_shard_dir(0), [(0, "s:0")])   # n1's shard, complete
    (layout.generate_shard_dir(0) / HEARTBEAT).write_text(
        Heartbeat(job="generate shard 0/2", pid=1, unit="records", state="complete", total=1, done=1).to_json())
    with pytest.raises(GenerationIncomplete) as e:    # n2's shard never came back
        collect(cfg, layout)
    assert "shard 1 (node n2): 0/? records, state never started" in str(e.value)
    assert "shard 0" not in str(e.value) and "clear that node's generate_responses" in str(e.value)
    # once the training node took it over (reconcile claim --taken-from), the shard is named as its
    from eagleflow.fleet.takeover import TAKEOVER_FILE
    (tmp_path / TAKEOVER_FILE).write_text(json.dumps({"generate_shards": {"1": "n2"}}))
    with pytest.raises(GenerationIncomplete, match=r"shard 1 \(node n1, taken over from n2\): 0/\? records"):
        collect(cfg, layout)
