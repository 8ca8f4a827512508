"""gpu_node_health's incident book: one mail per incident, backed-off reminders, one resolved mail."""
from __future__ import annotations

import pytest

from eagleflow.health import incidents as hi
from eagleflow.health.durations import duration
from eagleflow.health.rules import HealthAlert
from eagleflow.gpu.snapshot import GpuProcess, GpuSnapshot

CMD = "python3 -m sglang.launch_server --model-path /models/kimi-k2.5 --api-key sk-secret"


def _snaps(held=(0, 1, 2, 3), mib=90000):
    return [GpuSnapshot(index=i, uuid=f"GPU-{i}", name="NVIDIA H20", memory_used_mib=mib if i in held else 3,
                        memory_total_mib=97887, utilization_pct=0,
                        processes=(GpuProcess(31000 + i, CMD, 89990, user="svc"),) if i in held else ())
            for i in range(8)]


def _held(now, since, held=(0, 1, 2, 3)):
    snaps = _snaps(held)
    alerts = [HealthAlert("gpu-node-1", s.uuid, s.index, "memory_held_idle", "x") for s in snaps if s.index in held]
    state = {s.uuid: {"held_idle_since": since} for s in snaps if s.index in held}
    return hi.held_idle_finding("gpu-node-1", alerts, snaps, state, now)


def test_the_finding_states_the_fact_and_never_a_command_line():
    f = _held(now=1000.0 + 660, since=1000.0)
    assert f.subject == "gpu-node-1: 4 GPUs hold 88 GiB each at 0 % for 11 min"
    assert "pid 31000 `python3` (svc, 89990 MiB)" in f.detail
    assert "sglang" not in f.detail and "sk-secret" not in f.detail and "--model-path" not in f.detail
    one = _held(now=1000.0 + 60, since=1000.0, held=(2,))
    assert one.subject == "gpu-node-1: 1 GPU holds 88 GiB at 0 % for 60 s"


def test_one_mail_to_open_backed_off_reminders_one_to_resolve():
    book, mails, t0 = {}, [], 10_000.0
    for minute in range(0, 8 * 60 + 1):      # one check a minute for 8 hours, the same finding
        now = t0 + 60 * minute
        book, due = hi.step(book, [_held(now, t0 - 600)], observed={"gpus:gpu-node-1"}, now=now,
                            remind_after_s=1800)
        mails += [(minute, d.kind, d.subject) for d in due]
    assert [m[:2] for m in mails] == [(0, "opened"), (30, "reminder"), (90, "reminder"), (210, "reminder"),
                                      (450, "reminder")]   # 30 min, then 60, 120, 240 between reminders
    assert mails[1][2].endswith("(still open, reminder 1; next in 60 min)")
    now = t0 + 60 * 481
    book, due = hi.step(book, [], observed={"gpus:gpu-node-1"}, now=now, remind_after_s=1800)
    assert [(d.kind, d.subject) for d in due] == [
        ("resolved", "resolved: gpu-node-1: GPU memory held at 0 % with no eagleflow job (open 8 h 01 min)")]
    assert book == {}
    book, due = hi.step(book, [], observed={"gpus:gpu-node-1"}, now=now + 60, remind_after_s=1800)
    assert due == [] and book == {}


def test_an_unreachable_node_neither_resolves_its_gpu_incident_nor_pages_on_a_blip():
    t0 = 50_000.0
    book, due = hi.step({}, [_held(t0, t0 - 700)], observed={"gpus:gpu-node-1", "link:gpu-node-1"}, now=t0,
                        remind_after_s=1800)
    assert [d.kind for d in due] == ["opened"]
    down = hi.unreachable_finding("gpu-node-1", "connection refused", after_s=180)
    for k in range(1, 4):   # 3 checks unreachable (< 180 s): pending, no mail; the GPU incident stays open
        book, due = hi.step(book, [down], observed={"link:gpu-node-1"}, now=t0 + 60 * k, remind_after_s=1800)
        assert due == []
    assert book["gpu-node-1:memory_held_idle"]["state"] == "open"
    book, due = hi.step(book, [down], observed={"link:gpu-node-1"}, now=t0 + 60 * 4, remind_after_s=1800)
    assert [(d.kind, d.subject) for d in due] == [("opened", "gpu-node-1: unreachable (connection refused)")]
    # it answers again and its GPUs are free: both close, one mail each
    book, due = hi.step(book, [], observed={"link:gpu-node-1", "gpus:gpu-node-1"}, now=t0 + 300, remind_after_s=1800)
    assert sorted(d.subject.split(" (open")[0] for d in due) == [
        "resolved: gpu-node-1: GPU memory held at 0 % with no eagleflow job", "resolved: gpu-node-1: node unreachable"]


def test_a_blip_shorter_than_its_hold_off_is_forgotten_without_mail():
    down = hi.unreachable_finding("n", "cannot connect", after_s=180)
    book, due = hi.step({}, [down], observed={"link:n"}, now=0.0, remind_after_s=60)
    book, due2 = hi.step(book, [], observed={"link:n"}, now=60.0, remind_after_s=60)
    assert due == due2 == [] and book == {}


def test_ecc_rises_are_notices_each_mailed_once():
    alert = HealthAlert("n", "GPU-1", 1, "ecc_rising", "node n GPU 1: uncorrected ECC errors rose from 0 to 2")
    book, due = hi.step({}, hi.ecc_findings("n", [alert]), observed={"gpus:n"}, now=0.0, remind_after_s=60)
    assert [(d.kind, d.subject) for d in due] == [("notice", "n: GPU 1 uncorrected ECC errors rose")]
    book, due = hi.step(book, [], observed={"gpus:n"}, now=60.0, remind_after_s=60)
    assert due == [] and book == {}         # no "resolved" for a notice
    book, due = hi.step(book, hi.ecc_findings("n", [alert]), observed={"gpus:n"}, now=120.0, remind_after_s=60)
    assert [d.kind for d in due] == ["notice"]   # a further rise is a new notice


def test_an_incident_of_a_node_no_longer_configured_is_closed_once():
    t0 = 0.0
    book, _ = hi.step({}, [_held(t0, t0 - 700)], observed={"gpus:gpu-node-1"}, now=t0, remind_after_s=1e6)
    book, due = hi.step(book, [], observed=set(), now=t0 + 3000, remind_after_s=1e6, forget_after_s=3600)
    assert due == [] and "gpu-node-1:memory_held_idle" in book
    book, due = hi.step(book, [], observed=set(), now=t0 + 4000, remind_after_s=1e6, forget_after_s=3600)
    assert [d.subject for d in due] == ["no longer checked: gpu-node-1: GPU memory held at 0 % with no eagleflow job"]
    assert book == {}


@pytest.mark.parametrize("bad", [0, -5])
def test_reminders_need_a_positive_interval(bad):
    with pytest.raises(ValueError, match=f"remind_after_s={bad}"):
        hi.step({}, [], observed=set(), now=0.0, remind_after_s=bad)


def test_durations_read_as_a_person_says_them():
    assert [duration(s) for s in (0, 45, 119, 660, 7199, 7500, 30 * 3600)] == [
        "0 s", "45 s", "119 s", "11 min", "119 min", "2 h 05 min", "30 h 00 min"]
