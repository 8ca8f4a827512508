"""Issue 38, breaks 1 and 7: everything a node answers is untrusted input.

1. A fleet node's digest answer names the files ``copy_dir`` writes under the destination's ``.partial/``:
   a name that is not one plain path component (``../../home/x/.ssh/authorized_keys``, an absolute path)
   is refused, naming the node, the field and the value, before any file is opened at the destination.
   Driven through the real path: a node whose eagleflow answers the digest with such names (its python is
   a script that prints them), copied to the training node over a real sshd (SFTP) and to a LocalNode.
7. A node's hand-over answer is checked against what was asked: shards not asked about are ignored with a
   warning naming the node and the values; an unknown number fails nothing, and the other nodes' shards
   are still taken over. Driven through ``TakeOverShardsOperator`` with real ``eagleflow reconcile`` commands
   on the training node and on an honest node, and a hostile node's hand-over answer.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from eagleflow.fleet.transfer import PARTIAL, copy_dir
from eagleflow.nodes.base import NodeAnswerError
from eagleflow.nodes.local import LocalNode
from tests.fixtures.sshd import sshd  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(180)]

KEY = b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOwnerkeyOwnerkeyOwnerkeyOwnerkey train@host\n"


def hostile_python(tmp_path: Path, answers: dict[str, dict | str]) -> str:
    """A node's python whose eagleflow answers the commands named in ``answers`` (a word of the argv ->
    the JSON it prints; a str is printed as it is) and runs everything else as the real one does."""
    path = tmp_path / "hostile-python"
    path.write_text(f"""#!{sys.executable}
import json, os, sys
answers = {json.dumps(answers)!r}
for word, answer in json.loads(answers).items():
    if word in sys.argv[1:]:
        print(answer if isinstance(answer, str) else json.dumps(answer))
        sys.exit(0)
os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])
""")
    path.chmod(0o755)
    return str(path)


def _digest(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _layout(tmp_path: Path):
    """The training user's key, the source's shard (one level deeper than the destination's .partial/, so a
    relative name read on the source reaches the attacker's own file), the destination shard."""
    sentinel = tmp_path / "home" / "train" / ".ssh" / "authorized_keys"
    sentinel.parent.mkdir(parents=True)
    sentinel.write_bytes(KEY)
    os.utime(sentinel, ns=(1_000_000_000, 1_000_000_000))
    src = tmp_path / "node" / "evil" / "runs" / "r" / "hidden_states" / "shard_00001"
    src.mkdir(parents=True)
    (src / "s0.safetensors").write_bytes(b"x" * 100)
    dst = tmp_path / "home" / "train" / "runs" / "r" / "hidden_states" / "shard_00001"
    return sentinel, src, dst


def _hostile_names(tmp_path: Path, sentinel: Path, src: Path, dst: Path) -> dict[str, dict]:
    part = dst / PARTIAL
    rel = os.path.relpath(sentinel, part)                     # ../../../../../.ssh/authorized_keys
    attacker = Path(os.path.normpath(src / rel))              # what the source serves under that name
    attacker.parent.mkdir(parents=True, exist_ok=True)
    attacker.write_bytes(b"ssh-ed25519 AAAAattacker evil@node\n")
    return {
        "relative": {rel: _digest(attacker.read_bytes())},
        "relative-new": {os.path.relpath(sentinel.parent / "authorized_keys2", part): _digest(b"k\n")},
        # read on the source, the absolute name is the training user's key itself; a larger size makes the old
        # copy truncate it (opened 'wb' for the redo before the source is read)
        "absolute": {str(sentinel): {"size": len(KEY) + 50, "sha256": "0" * 64}},
        "dotdot": {"..": _digest(b"")},
        "backslash": {"..\\..\\x": _digest(b"")},
        "newline": {"a\nb": _digest(b"")},
    }


def _assert_untouched(sentinel: Path, dst: Path):
    assert sentinel.read_bytes() == KEY, "the training user's authorized_keys was written"
    assert sentinel.stat().st_mtime_ns == 1_000_000_000
    assert not (sentinel.parent / "authorized_keys2").exists()
    assert sorted(p.name for p in sentinel.parent.iterdir()) == ["authorized_keys"]
    # nothing opened under the destination either: the answer is refused before .partial/ is made
    assert not (dst / PARTIAL).exists() or not any((dst / PARTIAL).iterdir())


CASES = ["relative", "relative-new", "absolute", "dotdot", "backslash", "newline"]


def _copy_refused(tmp_path: Path, case: str, dst_node):
    sentinel, src, dst = _layout(tmp_path)
    bad = _hostile_names(tmp_path, sentinel, src, dst)[case]
    files = {"s0.safetensors": _digest((src / "s0.safetensors").read_bytes()), **bad}
    evil = LocalNode("gpu-node-7", python=hostile_python(tmp_path, {"eagleflow.fleet.digest": {"files": files}}))
    with pytest.raises(NodeAnswerError) as e:
        copy_dir(evil, str(src), dst_node, str(dst), chunk_bytes=16)
    msg = str(e.value)
    name = next(iter(bad))
    assert "on node gpu-node-7" in msg and "DigestAnswer" in msg and "files." in msg, msg
    assert "one plain path component" in msg, msg
    assert repr(name) in msg, msg
    _assert_untouched(sentinel, dst)


@pytest.mark.parametrize("case", CASES)
def test_a_digest_naming_a_path_outside_partial_is_refused_locally(tmp_path, case):
    _copy_refused(tmp_path, case, LocalNode("training"))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["relative", "relative-new", "absolute"])
def test_a_digest_naming_a_path_outside_partial_is_refused_over_sftp(tmp_path, case, sshd, monkeypatch):  # noqa: F811
    from eagleflow.nodes.ssh import SSHNode
    monkeypatch.setenv("AIRFLOW_CONN_TRAINING_NODE_TEST", sshd.airflow_conn())
    with SSHNode("training_node_test", name="training", python=sys.executable) as training:
        _copy_refused(tmp_path, case, training)


@pytest.mark.parametrize("entry, field", [
    ({"size": -1, "sha256": "0" * 64}, "size"),
    ({"size": 1.5, "sha256": "0" * 64}, "size"),
    ({"size": "1e999", "sha256": "0" * 64}, "size"),
    ({"size": 3, "sha256": "0" * 63}, "sha256"),
    ({"size": 3, "sha256": "../../x" + "0" * 57}, "sha256"),
])
def test_a_digest_with_sizes_or_digests_of_the_wrong_shape_is_refused(tmp_path, entry, field):
    sentinel, src, dst = _layout(tmp_path)
    evil = LocalNode("gpu-node-7", python=hostile_python(
        tmp_path, {"eagleflow.fleet.digest": {"files": {"s0.safetensors": entry}}}))
    with pytest.raises(NodeAnswerError, match=rf"on node gpu-node-7: .*files\.`s0\.safetensors`\.{field}"):
        copy_dir(evil, str(src), LocalNode("training"), str(dst))
    assert not dst.exists()



def test_a_digest_with_an_infinite_size_is_refused(tmp_path):
    _, src, dst = _layout(tmp_path)
    # 1e999 is a JSON number the parser reads as inf: no size
    evil = LocalNode("gpu-node-8", python=hostile_python(
        tmp_path, {"eagleflow.fleet.digest": '{"files": {"a": {"size": 1e999, "sha256": "%s"}}}' % ("0" * 64)}))
    with pytest.raises(NodeAnswerError, match=r"on node gpu-node-8: .*files\.a\.size"):
        copy_dir(evil, str(src), LocalNode("training"), str(dst))
    assert not dst.exists()


def test_an_honest_copy_still_works_and_extra_names_from_the_node_are_not_copied(tmp_path):
    """A name the node adds to a digest it was asked for by name is ignored, not compared or copied."""
    from eagleflow.fleet import transfer
    _, src, dst = _layout(tmp_path)
    rep = copy_dir(LocalNode("gpu-node-7"), str(src), LocalNode("training"), str(dst))
    assert rep.files_copied == 1 and (dst / "s0.safetensors").read_bytes() == b"x" * 100
    evil = LocalNode("gpu-node-7", python=hostile_python(tmp_path, {"eagleflow.fleet.digest": {"files": {
        "s0.safetensors": _digest(b"x" * 100), "other.bin": _digest(b"")}}}))
    assert list(transfer.digest(evil, str(src), ["s0.safetensors"])) == ["s0.safetensors"]


# -- break 7: the takeover trusts only what it asked ---------------------------------------------------------

SOURCE = REPO / "tests" / "fixtures" / "corpus" / "good_sharegpt.jsonl"


def _fleet(tmp_path: Path, hostile: str):
    """A three-node fleet (a: training, generation shards 0-1; b: 2-3; c: 4-5), every node's view of the run
    frozen on disk as the pipeline writes it; node b's eagleflow answers the hand-over with ``hostile``."""
    from eagleflow.airflow.runtime import RunContext
    from eagleflow.config import load_config
    from eagleflow.layout import RunLayout

    nodes = [{"name": n, "run_root": str(tmp_path / f"runs-{n}"), "state_dir": str(tmp_path / f"state-{n}")}
             for n in "abc"]
    nodes[1]["python"] = hostile
    whole = load_config(data={
        "target_model": "/m", "run_root": str(tmp_path / "runs-a"), "capture": {"shards": 3},
        "server": {"dump_dir": "/d"},
        "corpus": {"sources": [{"name": "chat", "path": str(SOURCE)}]},
        "generate": {"enabled": True, "shards": 6},
        "fleet": {"training_node": "a", "take_over": True, "storage": "copy", "nodes": nodes}})
    for n in "abc":
        cfg = whole.node_view(n)
        path = Path(str(RunLayout.for_run(cfg, "r").run_config_file))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg.model_dump(mode="json")))
    cfg = whole.node_view("a")
    return RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, "r"))


@pytest.mark.slow
@pytest.mark.parametrize("answer, ignored", [
    ({"handed_over": [2, 4, 99], "kept": {}, "node": "b"}, [4, 99]),              # c's shard, and an unknown one
    ({"handed_over": [2, 2], "kept": {"3": "held\r\nSubject: x", "77": "no"}, "node": "b"}, [77]),
])
def test_a_hand_over_answer_counts_only_what_was_asked(tmp_path, capsys, answer, ignored):
    from eagleflow.airflow.fleet_operators import TakeOverShardsOperator
    from eagleflow.fleet import takeover

    ctx = _fleet(tmp_path, hostile_python(tmp_path, {"hand-over": answer}))
    todo = TakeOverShardsOperator(task_id="take_over_generated", phase="generate").run(ctx, {})
    log = capsys.readouterr().out   # the operator's log (Airflow's structlog writes to stdout here)
    got = sorted((t["taken_from"], t["shard"]) for t in todo)
    # b: only shard 2 (asked, and said handed over); c (honest, after b): both its shards, proven free there
    assert got == [("b", 2), ("c", 4), ("c", 5)], (got, log)
    c_layout = ctx.for_node("c").layout
    assert all(takeover.handed_over_to(c_layout, s, "generate")["to"] == "a" for s in (4, 5))
    warned = [line for line in log.splitlines() if "not asked" in line]
    assert len(warned) == 1 and "node b" in warned[0] and str(ignored) in warned[0], log
    assert not any(line.startswith("Subject") for line in log.splitlines()), log   # a node's text: one line


@pytest.mark.slow
def test_a_hand_over_answer_of_another_node_or_of_the_wrong_shape_refuses_that_node_only(tmp_path, capsys):
    from eagleflow.airflow.fleet_operators import TakeOverShardsOperator

    for i, answer in enumerate(({"handed_over": [2, 3], "kept": {}, "node": "c"},
                                {"handed_over": [-1, 2], "kept": {}, "node": "b"},
                                {"handed_over": [2], "kept": {"3": "x"}, "node": "../b"})):
        base = tmp_path / str(i)
        base.mkdir()
        ctx = _fleet(base, hostile_python(base, {"hand-over": answer}))
        todo = TakeOverShardsOperator(task_id="take_over_generated", phase="generate").run(ctx, {})
        log = capsys.readouterr().out
        assert sorted((t["taken_from"], t["shard"]) for t in todo) == [("c", 4), ("c", 5)], log
        refused = [line for line in log.splitlines() if "node b" in line and ("refused" in line or "could not prove"
                                                                              in line)]
        assert len(refused) == 1, log


@pytest.mark.slow
@pytest.mark.parametrize("depth", [3000, 100_000])
def test_a_hand_over_answer_nested_thousands_deep_refuses_that_node_only(tmp_path, capsys, depth):
    """Issue 52, item 1: json.loads of an answer ~3,000 deep raised RecursionError, which escaped parse_answer
    and failed the takeover whole; now node b's answer is refused (naming it) and honest node c's shards are
    still taken over, through real `eagleflow reconcile` commands on a and c."""
    from eagleflow.airflow.fleet_operators import TakeOverShardsOperator

    ctx = _fleet(tmp_path, hostile_python(tmp_path, {"hand-over": "[" * depth + "]" * depth}))
    todo = TakeOverShardsOperator(task_id="take_over_generated", phase="generate").run(ctx, {})
    log = capsys.readouterr().out
    assert sorted((t["taken_from"], t["shard"]) for t in todo) == [("c", 4), ("c", 5)], log
    refused = [line for line in log.splitlines() if "node b could not prove" in line]
    assert len(refused) == 1 and "on node b: the answer of `" in refused[0], log
    assert f"JSON nested {depth} levels deep" in refused[0] and len(refused[0]) < 4000, log


# -- the reconcile answers: scan and claim ----------------------------------------------------------------------

def _one_node(tmp_path: Path, answers: dict):
    from eagleflow.airflow.runtime import RunContext
    from eagleflow.config import load_config
    from eagleflow.layout import RunLayout
    cfg = load_config(data={"target_model": "/m", "run_root": str(tmp_path / "runs"), "server": {"dump_dir": "/d"},
                            "corpus": {"sources": [{"name": "chat", "path": str(SOURCE)}]},
                            "node": {"name": "gpu-node-7", "python": hostile_python(tmp_path, answers),
                                     "state_dir": str(tmp_path / "state")}})
    return RunContext(cfg=cfg, layout=RunLayout.for_run(cfg, "r"))


def _scan_entry(**kw) -> dict:
    return {"run_id": "r", "shard": 0, "num_shards": 2, "expected": 5, "stored": 1, "worker_alive": False,
            "run_config": "/runs/r/run-config.json", "phase": "extract", "finished": True, "needs_rerun": True,
            "line": "run r extract shard 0/2", **kw}


@pytest.mark.parametrize("entry, field", [
    (_scan_entry(run_id="../../home/train"), "run_id"),
    (_scan_entry(run_id="/etc"), "run_id"),
    (_scan_entry(stored=-3), "stored"),
    (_scan_entry(shard=1.5), "shard"),
    (_scan_entry(run_config="relative/run-config.json"), "run_config"),
    (_scan_entry(phase="train; rm -rf /"), "phase"),
])
def test_a_scan_answer_of_the_wrong_shape_is_refused_before_a_rerun_is_planned(tmp_path, entry, field):
    from types import SimpleNamespace

    from eagleflow.airflow.reconcile_operators import FindIncompleteShardsOperator
    ctx = _one_node(tmp_path, {"scan": {"shards": [_scan_entry(), entry]}})
    pushed = []
    ti = SimpleNamespace(xcom_push=lambda **kw: pushed.append(kw))
    with pytest.raises(NodeAnswerError, match=rf"on node gpu-node-7: .*shards\.1\.{field}"):
        FindIncompleteShardsOperator(task_id="find_incomplete_shards").run(ctx, {"ti": ti})
    assert pushed == []


@pytest.mark.parametrize("answer, says", [
    ({"action": "started", "reason": "ok", "shard": 7, "worker_pid": 4242}, "answered about shard 7 "),
    ({"action": "started", "reason": "ok", "shard": 1, "run_id": "other"}, "answered about run_id 'other' "),
    ({"action": "rm -rf", "reason": "ok"}, "action"),
    ({"action": "started", "reason": "ok", "worker_pid": -1}, "worker_pid"),
])
def test_a_claim_answer_about_another_shard_or_of_the_wrong_shape_is_refused(tmp_path, answer, says):
    from types import SimpleNamespace

    from eagleflow.airflow.reconcile_operators import RerunShardOperator
    ctx = _one_node(tmp_path, {"claim": answer})
    op = RerunShardOperator(task_id="rerun_shard", target={"run_id": "r", "phase": "extract", "shard": 1,
                                                           "run_config": "unused"}, deferrable=True)
    op._run_context = lambda context: ctx
    with pytest.raises(NodeAnswerError, match=rf"on node gpu-node-7: .*{says}"):
        op.execute({"ti": SimpleNamespace(try_number=1)})
