"""`Node.run_json`: the one way the control plane reads a node command's answer; LocalNode timeouts end the group."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import pytest
from pydantic import BaseModel

from eagleflow.nodes import LocalNode, NodeAnswerError, NodeCommandFailed, NodeCommandTimeout
from tests.fixtures.processes import alive


class Answer(BaseModel):
    ok: bool
    count: int


@dataclass
class Point:
    x: int
    y: int = 0


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_last_stdout_line_is_the_answer_and_stderr_is_logged():
    lines: list[str] = []
    node = LocalNode(name="n1")
    got = node.run_json(py("import sys; print('progress 1'); print('{\"x\": 1}'); print('note', file=sys.stderr);"
                           "print('{\"ok\": true, \"count\": 3}'); print()"), Answer, log=lines.append)
    assert got == Answer(ok=True, count=3) and lines == ["note"]
    assert node.run_json(py("print('{\"x\": 5, \"extra\": 1}')"), Point) == Point(5, 0)


def test_exit_codes_are_mapped_one_way():
    node = LocalNode(name="n1")
    with pytest.raises(NodeCommandFailed, match=r"on node n1: .* exited 7: went wrong") as e:
        node.run_json(py("import sys; print('{\"ok\": true, \"count\": 1}'); sys.stderr.write('went wrong'); "
                         "sys.exit(7)"), Answer)
    assert e.value.exit_code == 7 and e.value.stderr == "went wrong"
    # a command whose non-zero codes still carry an answer says so
    got = node.run_json(py("import sys; print('{\"ok\": false, \"count\": 0}'); sys.exit(4)"), Answer,
                        answer_codes=(0, 4))
    assert got.ok is False


def test_a_missing_or_malformed_answer_names_the_command_and_the_line():
    node = LocalNode(name="n1")
    with pytest.raises(NodeAnswerError, match="printed no answer; stderr: boom"):
        node.run_json(py("import sys; sys.stderr.write('boom')"), Answer)
    with pytest.raises(NodeAnswerError, match=r"is not JSON .*'Traceback \(most recent call last\)'"):
        node.run_json(py("print('Traceback (most recent call last)')"), Answer)
    with pytest.raises(NodeAnswerError, match=r"does not fit Answer .*count"):
        node.run_json(py("print('{\"ok\": true}')"), Answer)


def test_local_timeout_ends_the_command_and_its_children():
    node = LocalNode(name="n1")
    t0 = time.monotonic()
    with pytest.raises(NodeCommandTimeout, match="did not finish within 1 s; its process group was ended"):
        node.run(["sh", "-c", "sleep 41.5 & echo $! > /dev/stderr; sleep 42.5; wait"], timeout=1)
    assert time.monotonic() - t0 < 8
    from pathlib import Path
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and alive(int(p.name))
            and _cmdline(p) in (b"sleep\x0041.5\x00", b"sleep\x0042.5\x00")]
    assert left == []


def _cmdline(p) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def test_a_node_command_prints_its_answer_through_the_class_its_reader_parses_it_with():
    """answer_line: what `eagleflow reconcile ...` prints is validated into the model the control plane reads it
    with, so the node refuses to print what its reader would refuse, and the line parses back to the same."""
    import json

    from pydantic import ValidationError

    from eagleflow.protocol import ClaimAnswer, HandOverAnswer, answer_line
    line = answer_line(HandOverAnswer, {"handed_over": [2, 3], "kept": {"1": "a live worker"}, "node": "n2"})
    assert HandOverAnswer.model_validate(json.loads(line)) == \
        HandOverAnswer(handed_over=[2, 3], kept={"1": "a live worker"}, node="n2")
    claim = json.loads(answer_line(ClaimAnswer, {"action": "started", "reason": "r", "shard": 1, "extra": 5}))
    assert claim["extra"] == 5 and claim["worker_pid"] is None   # what the reader keeps, it gets
    with pytest.raises(ValidationError):
        answer_line(HandOverAnswer, {"handed_over": [-1], "kept": {}, "node": "n2"})
