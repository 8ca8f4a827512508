"""What one streaming draw costs the trainer in scanning while capture appends (issue 53), side by side:

* **rebuilt**: every scan builds the list of refs anew and the loader reads all of it (what each scan did before the
  scan's tail: the source rebuilt its list whenever a manifest grew, as it does all the time during capture; it is
  still what a redone line or a new store incarnation costs);
* **tail**: the source extends the list it returned before with the lines appended, the loader reads only those.

Two shards' manifests (synthetic lines of the real format, ``ManifestEntry.to_line``) grow by one line each per
draw, as while a trainer keeps pace with capture; the loader (``StreamLoader._refill`` and a draw from its window)
runs over the real ``MooncakeSource.scan`` (no store is asked: the manifests say what was put).

    .venv/bin/python bench/stream_scan.py [--samples 4000]

Prints ms per draw both ways over the whole corpus and over its last tenth, and the ratio."""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))

from eagleflow.capture.manifest import ManifestEntry  # noqa: E402
from eagleflow.stores import StoreSettings  # noqa: E402
from eagleflow.stores.ledger import EpochLedger  # noqa: E402
from eagleflow.stores.mooncake.master import MooncakeEndpoint  # noqa: E402
from eagleflow.stores.mooncake.store import MooncakeSource  # noqa: E402
from eagleflow.train.data import StreamLoader  # noqa: E402


class _NoClient:
    label = "bench store"

    def close(self) -> None:
        pass


def draws(samples: int, rebuild: bool, work: Path) -> list[float]:
    """Seconds of each draw (refill and pick) while ``samples`` lines arrive, two per draw."""
    root = work / ("rebuilt" if rebuild else "tail") / "hs"
    files = {}
    for s in (0, 1):
        (root / f"shard_{s:05d}").mkdir(parents=True)
        files[s] = open(root / f"shard_{s:05d}" / "manifest.jsonl", "a")
    ep_file = root.parent / "endpoint.json"
    ep_file.write_text(MooncakeEndpoint("127.0.0.1", 1, 2, 3, 1 << 30, store_id="s1").to_json())
    src = MooncakeSource(StoreSettings(run_id="bench", root=str(root), fsync=False, buffer_bytes=1 << 40,
                                       endpoint_file=str(ep_file)), client=_NoClient())   # type: ignore[arg-type]
    loader = StreamLoader(src, EpochLedger(root.parent / "ledger.jsonl", fsync=False), batch_size=4,
                          corpus_size=samples, shuffle_window=64, read_ahead=False)
    out: list[float] = []
    n = 0
    try:
        while n < samples:
            for s in (0, 1):
                i = n
                files[s].write(ManifestEntry(id=f"src{s}:{i}", index=i, file=f"bench/shard_{s:05d}/{i:08d}",
                                             tokens=96 + i % 225, bytes=400_000 + i, sha256="ab" * 32,
                                             store_id="s1").to_line())
                files[s].flush()
                n += 1
            t0 = time.perf_counter()
            if rebuild:
                src._refs = None          # the list built anew, the loader reads it all (new ref objects)
            loader._refill()
            if loader._window:
                loader._window.pop(0)
            out.append(time.perf_counter() - t0)
    finally:
        for f in files.values():
            f.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4000)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eagleflow-stream-scan-"))
    try:
        rebuilt = draws(a.samples, True, work)
        tail = draws(a.samples, False, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    last = max(1, len(rebuilt) // 10)
    ms = lambda v: 1e3 * sum(v) / len(v)  # noqa: E731
    print(f"{a.samples} samples arriving, {len(rebuilt)} draws: ms a draw rebuilt {ms(rebuilt):.3f}, tail "
          f"{ms(tail):.3f} (ratio {ms(tail) / ms(rebuilt):.3f}); over the last tenth rebuilt {ms(rebuilt[-last:]):.3f}, "
          f"tail {ms(tail[-last:]):.3f} (ratio {ms(tail[-last:]) / ms(rebuilt[-last:]):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
