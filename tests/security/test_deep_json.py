"""Issue 52, item 1: every node answer and every file read back is parsed within a size and a depth bound.

The break: a node answer nested about 3,000 deep made ``json.loads`` raise RecursionError, no ValueError: it
escaped ``parse_answer`` as no node error and failed the fleet's takeover whole, honest nodes included;
``promoted.json`` nested 100,000 deep gave the same crude error. Now ``eagleflow.bounded_json`` refuses both
before parsing (``JsonRefused``, a ValueError naming the node and command, or the file), and a node's answer
beyond the bound is that node's refused answer (``NodeAnswerRefused``, a NodeAnswerError). Real paths: a
LocalNode whose python answers with the deep JSON (the node command really runs), the FakeNode's answers
through the base class's own parsing, ``draft_in_service`` on a real file, the worker's server info file.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from eagleflow import bounded_json
from eagleflow.bounded_json import JsonRefused
from eagleflow.nodes import LocalNode, NodeAnswerError, NodeAnswerRefused
from tests.fixtures.fake_node import FakeNode, Reply

pytestmark = pytest.mark.timeout(120)


def deep(n: int) -> str:
    return "[" * n + "]" * n


def hostile_python(tmp_path: Path, word: str, answer: str) -> str:
    """A node's python that prints ``answer`` for any command with ``word`` in its argv (else runs the real one)."""
    (tmp_path / "answer.txt").write_text(answer)
    path = tmp_path / "hostile-python"
    path.write_text(f"""#!{sys.executable}
import os, sys
if {word!r} in sys.argv[1:]:
    sys.stdout.write(open({str(tmp_path / "answer.txt")!r}).read() + "\\n")
    sys.exit(0)
os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])
""")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("depth", [3000, 100_000])
def test_a_real_node_answering_json_nested_thousands_deep_is_a_typed_refusal_naming_the_node(tmp_path, depth):
    node = LocalNode("gpu-node-9", python=hostile_python(tmp_path, "eagleflow.nodes.detach", deep(depth)))
    with pytest.raises(NodeAnswerRefused) as e:   # the real detach command line, its answer parsed by the base
        node.spawn_detached(["sleep", "60"], role="worker_shard_00000", pid_file=str(tmp_path / "p.json"),
                            log_file=str(tmp_path / "w.log"))
    assert isinstance(e.value, NodeAnswerError) and e.value.node == "gpu-node-9"
    assert isinstance(e.value.refusal, JsonRefused) and isinstance(e.value.refusal, ValueError)
    msg = str(e.value)
    assert msg.startswith("on node gpu-node-9: the answer of `") and "eagleflow.nodes.detach" in msg
    assert f"JSON nested {depth} levels deep, deeper than the {bounded_json.MAX_DEPTH} allowed" in msg
    assert len(msg) < 3000   # the answer itself is not echoed


@pytest.mark.parametrize("depth", [3000, 100_000])
def test_a_fake_node_answering_json_nested_thousands_deep_is_refused_by_run_json(depth):
    node = FakeNode("b").on(("reconcile", "hand-over"), Reply(deep(depth) + "\n"))
    with pytest.raises(NodeAnswerRefused, match=rf"on node b: the answer of .*nested {depth} levels deep"):
        node.run_json(node.eagleflow_argv("reconcile", "hand-over"), dict)


def test_an_answer_within_the_bounds_still_parses_and_brackets_inside_strings_do_not_count():
    text = json.dumps({"kept": {"3": "[" * 5000 + '\\"{' * 100}, "handed_over": [[[[1]]]], "node": "b"})
    node = FakeNode("b").on(("reconcile", "hand-over"), Reply(text + "\n"))
    got = node.run_json(node.eagleflow_argv("reconcile", "hand-over"), dict)
    assert got["handed_over"] == [[[[1]]]] and got["kept"]["3"].startswith("[[[")
    assert bounded_json.depth(text) == 5 and bounded_json.depth(deep(70)) == 70
    assert bounded_json.loads(deep(bounded_json.MAX_DEPTH), source="x") is not None


def test_an_answer_over_the_size_bound_is_refused_unread():
    with pytest.raises(JsonRefused, match=r"^on node b: .* more than the 100 allowed"):
        bounded_json.loads('"' + "x" * 200 + '"', source="on node b: the answer of `x`", max_bytes=100)


def test_promoted_json_nested_100000_deep_is_a_clear_error_naming_the_file(tmp_path):
    from eagleflow.config import load_config
    from eagleflow.evaluate.run import draft_in_service
    cfg = load_config(data={"target_model": "/m", "run_root": str(tmp_path / "runs")})
    promoted = tmp_path / "runs" / "promoted.json"
    promoted.parent.mkdir()
    promoted.write_text(deep(100_000))
    with pytest.raises(ValueError) as e:
        draft_in_service(cfg)
    msg = str(e.value)
    assert msg.startswith(f"{promoted} (the draft in service) cannot be read (") and "nested 100000 levels" in msg
    assert "eval.baseline_draft: none" in msg and len(msg) < 2000


@pytest.mark.parametrize("reader", ["pid record", "lock holder", "hand-over mark", "heartbeat", "server info"])
def test_records_read_back_nested_100000_deep_are_refused_not_a_recursion_error(tmp_path, reader):
    from eagleflow.fleet.takeover import mark_of
    from eagleflow.heartbeat import Heartbeat
    from eagleflow.nodes.locks import read_holder
    from eagleflow.nodes.process_record import RecordRefused, load_record
    from eagleflow.phase_jobs import server_url_in
    f = tmp_path / "doc.json"
    f.write_text(deep(100_000))
    os.chmod(f, 0o600)
    if reader == "pid record":
        with pytest.raises(RecordRefused, match="nested 100000 levels deep"):
            load_record(f)
    elif reader == "lock holder":
        assert read_holder(f) == {}
    elif reader == "hand-over mark":   # unreadable still means: not this node's any more
        assert mark_of(f.read_text())["to"] == "(unreadable mark)"
    elif reader == "heartbeat":
        with pytest.raises(JsonRefused, match="nested 100000 levels deep"):
            Heartbeat.read(f)
    else:   # an info file is small: 100,000 deep is over its size bound; 30,000 deep is within it
        with pytest.raises(JsonRefused, match=f"^{f}: larger than the 65536 bytes allowed"):
            server_url_in(str(f))
        f.write_text(deep(30_000))
        with pytest.raises(JsonRefused, match=f"^{f}: JSON nested 30000 levels deep"):
            server_url_in(str(f))


def test_a_verification_record_nested_100000_deep_refuses_training_naming_the_file(tmp_path):
    from eagleflow.capture.verify import RECORD_FILE, NotVerifiedError, require_verified
    (tmp_path / RECORD_FILE).write_text(deep(100_000))
    with pytest.raises(NotVerifiedError, match=rf"refusing to train: {tmp_path / RECORD_FILE} is not readable JSON "
                                               r"\(.*nested 100000 levels deep"):
        require_verified(tmp_path)
