"""Profile a capture worker's put (issue 53): ``MooncakeSink.put`` into a real store against ``DiskSink.put``.

Starts the run's store the way ``eagleflow store start`` does (``stores.mooncake.master.start_store``: the wheel's
master and segment holder on 127.0.0.1 free ports, recorded, stopped by their PIDs at the end), then times N puts of
synthetic samples (``--tokens`` x ``--hidden``: 400 x 128 is ~410 KB, the bench target's size) through the Mooncake
sink and through the disk sink (both fsync on, as a capture worker runs), and prints ms per put, the Mooncake put
broken down by its parts: encoding (``to_bytes``) and sha256, the node's flock, the room check (``_room``: the
master's ``/metrics`` reads it makes, and how many), the upsert (the TCP transfer into the segment holder), the
manifest append. Three modes, alternating over ``--rounds``: ``mooncake-per-put-read`` (the put as it was before
the node's bound, ``stores.mooncake.store.NodeBound``: the master's ``/metrics`` read at every put), ``mooncake``
(the put as it is) and ``disk``. The store's buffer is large enough that no put waits for room (the bound then
rarely reads the master: the figures are the put's cost when the trainer keeps up). ``--writers W`` runs W processes
at once (each its own shard, as a capture node's workers do) and reports each one's figures; ``--pin CORE`` pins
the writers to one core (the bench's capture core); ``--cprofile FILE`` writes the first writer's Mooncake puts'
profile (read it with pstats). ``--watch S`` instead watches, for S seconds, where the cores' time goes while
``bench/stream_vs_offline.py`` runs beside it (per mode, while its capture runs: each role's CPU seconds, each
core's busy and idle seconds).

    .venv/bin/python bench/profile_stream_put.py [--puts 300] [--rounds 2] [--writers 1] [--pin 0] [--json F.json]
    .venv/bin/python bench/profile_stream_put.py --watch 900 --watch-match /tmp/svo --json W.json &
    .venv/bin/python bench/stream_vs_offline.py --dir /tmp/svo ...
"""
from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))

import torch  # noqa: E402

from eagleflow.stores import StoreSettings  # noqa: E402
from eagleflow.stores.disk.store import DiskSink  # noqa: E402
from eagleflow.stores.encoding import EncodedSample, encode_sample  # noqa: E402

MIB = 1 << 20


def samples(n: int, tokens: int, hidden: int, seed: int) -> list[EncodedSample]:
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(tokens, 3 * hidden, generator=g).to(torch.bfloat16)
    hs = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    return [encode_sample(index=i, sample_id=f"src:{i}", input_ids=torch.arange(tokens) + i, loss_mask=[1] * tokens,
                          aux_hidden_states=aux, hidden_states=hs, aux_layers=[1, 2, 3], model="bench")
            for i in range(n)]


class Timed:
    """Wraps a callable, adding its wall time (and calls) to a named bucket."""

    def __init__(self, totals: dict[str, float], counts: dict[str, int], name: str, fn):
        self.totals, self.counts, self.name, self.fn = totals, counts, name, fn

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.totals[self.name] = self.totals.get(self.name, 0.0) + time.perf_counter() - t0
            self.counts[self.name] = self.counts.get(self.name, 0) + 1


def mooncake_puts(settings: StoreSettings, shard: int, enc: list[EncodedSample], profile: str = "",
                  bound: bool = True) -> dict:
    import fcntl

    from eagleflow.stores.mooncake import store as mstore
    if not bound:   # the put before the node's bound: the master's /metrics read at every put
        setattr(mstore.NodeBound, "applies", staticmethod(lambda settings, ep: False))
    sink = mstore.MooncakeSink(settings, shard)
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    # the parts of MooncakeSink.put, each timed where it is called from
    for obj, name, part in ((sink.client, "allocated_bytes", "metrics_read"), (sink, "_room", "room_check"),
                            (sink.client, "put", "upsert"), (sink.manifest, "append", "manifest_append")):
        setattr(obj, name, Timed(totals, counts, part, getattr(obj, name)))
    flock_timed = Timed(totals, counts, "flock", fcntl.flock)
    setattr(mstore, "fcntl", type("F", (), {"flock": staticmethod(flock_timed), "LOCK_EX": fcntl.LOCK_EX,
                                            "LOCK_UN": fcntl.LOCK_UN}))
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for e in enc:
        sink.put(e)
    if prof:
        prof.disable()
        prof.dump_stats(profile)
    total = time.perf_counter() - t0
    sink.close()
    sink.client.close()
    setattr(mstore, "fcntl", fcntl)
    # encoding and hashing, as put does them (to_bytes + sha256 of the bytes)
    import hashlib
    t1 = time.perf_counter()
    for e in enc:
        hashlib.sha256(e.to_bytes()).hexdigest()
    enc_hash = time.perf_counter() - t1
    n = len(enc)
    out = {"puts": n, "ms_per_put": 1e3 * total / n, "bytes": len(enc[0].to_bytes()),
           "bytes_put": sum(len(e.to_bytes()) for e in enc),
           "parts_ms_per_put": {k: round(1e3 * v / n, 3) for k, v in sorted(totals.items())},
           "calls_per_put": {k: round(v / n, 3) for k, v in sorted(counts.items())},
           "to_bytes_sha256_ms_per_put": round(1e3 * enc_hash / n, 3)}
    return out


def disk_puts(shard_dir: Path, enc: list[EncodedSample]) -> dict:
    sink = DiskSink(shard_dir, fsync=True)
    t0 = time.perf_counter()
    for e in enc:
        sink.put(e)
    total = time.perf_counter() - t0
    sink.close()
    return {"puts": len(enc), "ms_per_put": 1e3 * total / len(enc)}


def writer(kind: str, settings: StoreSettings, shard: int, args, profile: str, q) -> None:
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    torch.set_num_threads(1)
    enc = samples(args.puts, args.tokens, args.hidden, seed=shard)
    if kind.startswith("mooncake"):
        q.put((shard, mooncake_puts(settings, shard, enc, profile, bound=kind == "mooncake")))
    else:
        q.put((shard, disk_puts(Path(settings.root) / f"disk_{shard:05d}", enc)))


def run_writers(kind: str, settings: StoreSettings, args) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=writer, args=(kind, settings, w, args,
                                              args.cprofile if (w == 0 and kind == "mooncake") else "", q))
             for w in range(args.writers)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    res = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    wall = time.perf_counter() - t0
    return [{"writer": w, **res[w], "wall_s_all_writers": round(wall, 2)} for w in sorted(res)]


def _procs(match: str = "") -> dict[int, tuple[str, float, str]]:
    """Every process: (its role by its command line, its CPU seconds so far, its cores). ``match``: the bench's
    own processes (capture, trainer) have it in their command line (its --dir); others' are "other"."""
    tck = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode("utf-8", "replace")
            f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            cores = ",".join(map(str, sorted(os.sched_getaffinity(int(d)))))
        except (OSError, IndexError):
            continue
        ours = match in cmd
        mode = "streaming" if "config-streaming" in cmd else "offline" if "config-offline" in cmd else ""
        role = ("store" if "mooncake" in cmd else
                f"capture_{mode}" if ours and ("capture run" in cmd or "capture serve" in cmd) else
                "trainer" if ours and " train " in f"{cmd} " else
                "bench" if "stream_vs_offline" in cmd or "profile_stream_put" in cmd else "other")
        if role.startswith("capture") and "capture run" in cmd:
            role += ":worker"
        out[int(d)] = (role, (int(f[11]) + int(f[12])) / tck, cores)
    return out


def _cpu_jiffies() -> dict[str, tuple[float, float]]:
    """Per core: (busy seconds, idle seconds) so far."""
    tck = os.sysconf("SC_CLK_TCK")
    out = {}
    for line in open("/proc/stat"):
        if line.startswith("cpu") and line[3].isdigit():
            v = [int(x) for x in line.split()[1:]]
            idle = v[3] + v[4]
            out[line.split()[0]] = ((sum(v[:8]) - idle) / tck, idle / tck)
    return out


def watch(seconds: float, match: str, every: float = 1.0, out: str = "") -> dict:
    """Where the cores' time goes while a capture runs (bench/stream_vs_offline.py beside this): over each window in
    which an ``eagleflow capture run`` worker lives, the CPU seconds of each role (capture: the workers and the
    capture server, pinned to core 0 by that bench; store: Mooncake's master and segment holder; trainer; other:
    everything else on the machine, other sessions' work included), and each core's busy and idle seconds; per
    mode (streaming while a Mooncake process lives, else offline)."""
    acc: dict[str, dict[str, float]] = {}
    prev, prev_cpu = _procs(match), _cpu_jiffies()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(every)
        cur, cpu = _procs(match), _cpu_jiffies()
        modes = {r.split("_", 1)[1].split(":")[0] for r, _, _ in cur.values() if r.endswith(":worker")}
        if len(modes) == 1:
            a = acc.setdefault(modes.pop(), {})
            a["seconds"] = a.get("seconds", 0.0) + every
            for pid, (role, t, _) in cur.items():
                if pid in prev:
                    role = role.split(":")[0].split("_")[0]
                    a[f"cpu_s_{role}"] = a.get(f"cpu_s_{role}", 0.0) + max(0.0, t - prev[pid][1])
            for core, (busy, idle) in cpu.items():
                a[f"{core}_busy_s"] = a.get(f"{core}_busy_s", 0.0) + busy - prev_cpu[core][0]
                a[f"{core}_idle_s"] = a.get(f"{core}_idle_s", 0.0) + idle - prev_cpu[core][1]
            a["load_sum"] = a.get("load_sum", 0.0) + os.getloadavg()[0] * every
            if out:    # so far, every window: the watch may be stopped at any time
                Path(out).write_text(json.dumps(_summary(acc), indent=1))
        prev, prev_cpu = cur, cpu
    return _summary(acc)


def _summary(acc: dict[str, dict[str, float]]) -> dict:
    res = {}
    for k, a in acc.items():
        b = dict(a)
        b["load_avg_mean"] = b.pop("load_sum") / b["seconds"]
        b["core0_not_capture_s"] = b.get("cpu0_busy_s", 0.0) - b.get("cpu_s_capture", 0.0)
        res[k] = {n: round(v, 2) for n, v in b.items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--puts", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--writers", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the three modes, alternating")
    ap.add_argument("--pin", type=int, default=None, help="pin the writers to this core")
    ap.add_argument("--cprofile", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--watch", type=float, default=0.0, help="instead: watch the cores for this many seconds "
                    "while bench/stream_vs_offline.py runs beside it (where core 0's time goes during capture)")
    ap.add_argument("--watch-match", default="", help="with --watch: the bench's --dir (its processes' command "
                    "lines name it)")
    args = ap.parse_args()
    if args.watch:
        res = watch(args.watch, args.watch_match, out=args.json)
        print(json.dumps(res, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        return
    from eagleflow.stores.mooncake.master import metrics, start_store, stop_store
    from eagleflow.stores.mooncake.store import MooncakeClient
    tmp = Path(tempfile.mkdtemp(prefix="eagleflow-put-"))
    size = len(samples(1, args.tokens, args.hidden, 0)[0].to_bytes())
    segment = max(256 * MIB, 2 * size * args.puts * args.writers)
    ep_file = tmp / "state" / "store_endpoint.json"
    ep = start_store(state_dir=tmp / "state", run_id="bench", segment_bytes=segment, endpoint_file=ep_file)
    try:
        settings = StoreSettings(run_id="bench", root=str(tmp / "hs"), fsync=True, buffer_bytes=segment,
                                 endpoint_file=str(ep_file))
        def at(i: int) -> StoreSettings:   # each round's writers their own shards (keys), so no put replaces one
            return StoreSettings(**{**settings.__dict__, "run_id": f"bench{i}"})
        rounds: list[dict] = []
        for r in range(args.rounds):
            fig: dict = {}
            for kind in ("mooncake-per-put-read", "mooncake", "disk"):
                before = metrics(ep)["master_allocated_bytes"]
                fig[kind] = run_writers(kind, at(len(rounds) * 3 + len(fig)), args)
                if kind != "disk":
                    fig[kind + "-growth-over-bytes-put"] = (metrics(ep)["master_allocated_bytes"] - before
                                                            - sum(w["bytes_put"] for w in fig[kind]))
                    cleaner = MooncakeClient(ep)      # the next mode starts from an empty store
                    cleaner.remove_matching("^bench.*")
                    cleaner.close()
            rounds.append(fig)
    finally:
        for stopped in stop_store(ep, grace_s=2.0):
            print(stopped.describe(), file=sys.stderr)
    out = {"sample_bytes": size, "writers": args.writers, "pin": args.pin, "load_avg": os.getloadavg(),
           "rounds": rounds}
    for i, fig in enumerate(rounds):
        for kind in ("mooncake-per-put-read", "mooncake", "disk"):
            for w in fig[kind]:
                parts = (f"  parts {w['parts_ms_per_put']}  calls {w['calls_per_put']}  (to_bytes+sha256 "
                         f"{w['to_bytes_sha256_ms_per_put']} ms)") if kind != "disk" else ""
                print(f"round {i} {kind:22s} writer {w['writer']}: {w['ms_per_put']:.2f} ms/put{parts}")
        print(f"round {i}: master_allocated_bytes grew by the bytes put plus {fig['mooncake-growth-over-bytes-put']:g} "
              f"(every put counted exactly when 0)")
    for kind in ("mooncake-per-put-read", "mooncake", "disk"):
        print(f"median ms/put {kind}: %.2f" % statistics.median(w["ms_per_put"] for f in rounds for w in f[kind]))
    print(f"load {out['load_avg']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
