"""A node's bound on the Mooncake master's allocated bytes, real (issue 53): two capture processes putting at once
through ``MooncakeSink`` into a real store (started from the wheel on 127.0.0.1 free ports, stopped by PID), a
slow trainer taking the samples; the master's own ``master_allocated_bytes``, sampled, never passes the buffer,
while most puts are admitted by the node's bound without reading the master. The control puts with a bound that
counts nothing per put (``charged_bytes`` 0): the same check then passes the buffer, so the sampling would see it."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from eagleflow.stores import StoreSettings
from eagleflow.stores.encoding import encode_sample
from tests.fixtures.stream_run import Peak

pytest.importorskip("mooncake.store", reason="the stream extra (mooncake-transfer-engine-non-cuda) is not installed")

from eagleflow.stores.mooncake.master import start_store, stop_store  # noqa: E402
from eagleflow.stores.mooncake.store import MooncakeSource  # noqa: E402

PUTS = 12           # per writer process
N, H = 64, 256      # a sample of ~130 KB

WRITER = textwrap.dedent("""
    import json, sys
    import torch
    from eagleflow.stores import StoreSettings, store_for
    from eagleflow.stores.encoding import encode_sample
    from eagleflow.stores.mooncake import store as mstore
    args = json.loads(sys.argv[1])
    if args["control"]:
        mstore.charged_bytes = lambda size: 0
    sink = store_for("mooncake").open_sink(StoreSettings(**args["settings"]), args["shard"])
    reads = [0]
    real = sink.client.allocated_bytes
    def counted():
        reads[0] += 1
        return real()
    sink.client.allocated_bytes = counted
    unread = 0
    for i in range(args["puts"]):
        before = reads[0]
        g = torch.Generator().manual_seed(1000 * args["shard"] + i)
        sink.put(encode_sample(index=i, sample_id=f"s{args['shard']}:{i}", input_ids=torch.arange(args["n"]),
                               loss_mask=[1] * args["n"], model="tiny", aux_layers=[1, 2, 3],
                               aux_hidden_states=torch.randn(args["n"], 3 * args["h"], generator=g).to(torch.bfloat16),
                               hidden_states=torch.randn(args["n"], args["h"], generator=g).to(torch.bfloat16)))
        unread += reads[0] == before
    sink.close()
    print(json.dumps({"reads": reads[0], "puts": args["puts"], "unread": unread}))
""")


def _one_sample_bytes() -> int:
    g = torch.Generator().manual_seed(0)
    return encode_sample(index=0, sample_id="s0:0", input_ids=torch.arange(N), loss_mask=[1] * N, model="tiny",
                         aux_layers=[1, 2, 3], aux_hidden_states=torch.randn(N, 3 * H, generator=g).to(torch.bfloat16),
                         hidden_states=torch.randn(N, H, generator=g).to(torch.bfloat16)).size


@pytest.mark.parametrize("control", [False, True], ids=["bound", "control-counting-nothing"])
def test_two_writer_processes_with_the_nodes_bound_never_pass_the_buffer(tmp_path, control):
    ep_file = tmp_path / "run" / "store_endpoint.json"
    ep = start_store(state_dir=tmp_path / "state", run_id="r1", segment_bytes=64 << 20, endpoint_file=ep_file)
    writers: list[subprocess.Popen] = []
    try:
        one = _one_sample_bytes()
        buffer_bytes = 3 * one + one // 2                 # three samples fit, never four
        settings = StoreSettings(run_id="r1", root=str(tmp_path / "run" / "hs"), fsync=False,
                                 buffer_bytes=buffer_bytes, endpoint_file=str(ep_file), put_timeout_s=60)
        peak = Peak(ep, every=0.005)
        writers = [subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(
            {"settings": settings.__dict__, "shard": shard, "puts": PUTS, "n": N, "h": H, "control": control})],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for shard in (0, 1)]
        source = MooncakeSource(settings)
        taken: set[tuple[int, int]] = set()
        deadline = time.monotonic() + 120
        while len(taken) < 2 * PUTS and time.monotonic() < deadline:   # a slow trainer: one sample per 0.1 s
            fresh = [r for r in source.scan() if (r.shard, r.index) not in taken]
            if fresh:
                time.sleep(0.1)
                source.open(fresh[0]).read()
                source.release(fresh[0])
                taken.add((fresh[0].shard, fresh[0].index))
            else:
                time.sleep(0.02)
        outs = []
        for w in writers:
            out, err = w.communicate(timeout=60)
            assert w.returncode == 0, out[-2000:] + err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
        top = peak.stop()
        source.close()
        assert len(taken) == 2 * PUTS and peak.samples > 50, (len(taken), peak.samples)
        unread = sum(o["unread"] for o in outs)           # puts admitted without reading the master
        if control:
            assert top >= 4 * one > buffer_bytes, (top, buffer_bytes, one)
        else:
            assert top <= buffer_bytes, (top, buffer_bytes, one)
            # the bound did admit puts without asking the master (else this would test the per-put read only)
            assert unread >= 2, outs
    finally:
        for w in writers:                                  # only ours, by PID
            if w.poll() is None:
                w.kill()
                w.wait(10)
        for res in stop_store(ep, grace_s=2.0):
            assert res.outcome in ("terminated", "killed", "already_gone", "not_recorded"), res.describe()
