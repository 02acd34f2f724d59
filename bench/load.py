"""`upr load` throughput against a local node: sets/s beside a bare writer's, same run.

--pairs pairs, the order turning (load first, then the bare writer first, ...), each
into a fresh node (`upr serve`, --partitions partitions): `upr load` of --docs new JSON
documents (~180 B), and the reference, a bare pipelined writer (bench/_ref.py: as many
SET requests of ~180 B JSON, encoded before the clock starts, on one connection with at
most 1024 unanswered, the answers counted by a header loop: the node's ingest with no
client cost to speak of). The load's own rate (its summary), the bare rate, the ratio
per pair, their median and spread, the target (node ingest >= 60,000 sets/s) and the
node's peak RSS.

Usage: python bench/load.py [--docs 300000] [--partitions 1024] [--pairs 3]
Last line: load_sets_per_s=… bare_sets_per_s=… ratio=… ratio_min=… ratio_max=… target=…
node_peak_rss_mb=…
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _node import BenchNode, say
from _ref import bare_sets

TARGET = 60_000


def one_load(where: Path, docs: int, partitions: int) -> tuple[float, int, float]:
    """(sets/s, errors, node peak RSS MB) of `upr load` into a fresh node."""
    with BenchNode(where, partitions) as node:
        out = subprocess.run(
            [sys.executable, "-m", "upr_cli", "load", node.uri, "--docs", str(docs), "--json",
             "--no-progress"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        summary = json.loads(out.stdout)
        return float(summary["items_per_s"]), int(summary["errors"]), node.peak_rss_mb()


def one_bare(where: Path, docs: int, partitions: int) -> tuple[float, int, float]:
    """(sets/s, non-success answers, node peak RSS MB) of the bare writer."""
    with BenchNode(where, partitions) as node:
        rate, errors = bare_sets(node.uri, docs, partitions)
        return rate, errors, node.peak_rss_mb()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=300_000)
    ap.add_argument("--partitions", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="upr-bench-load-") as tmp:
        for k in range(args.pairs):
            got = {}
            for name in ("load", "bare") if k % 2 == 0 else ("bare", "load"):
                say(f"pair {k + 1}: {name}")
                run = one_load if name == "load" else one_bare
                got[name] = run(Path(tmp) / f"{name}-{k}", args.docs, args.partitions)
            pairs.append((got["load"], got["bare"]))
    print(f"{args.docs:,} new JSON documents (~180 B), {args.partitions} partitions, a fresh "
          f"node each; {args.pairs} pairs in turns: upr load beside a bare pipelined "
          f"writer")  # fmt: skip
    ratios = []
    for k, ((rate, errors, rss), (bare, bare_errors, bare_rss)) in enumerate(pairs, 1):
        ratios.append(rate / bare)
        print(f"  pair {k}: upr load {rate:>9,.0f} sets/s ({errors} errors, node {rss:.0f} MB);"
              f" bare {bare:>9,.0f} sets/s ({bare_errors} non-success answers, node "
              f"{bare_rss:.0f} MB); ratio {ratios[-1]:.2f}")  # fmt: skip
    rate = statistics.median(p[0][0] for p in pairs)
    bare = statistics.median(p[1][0] for p in pairs)
    ratio = statistics.median(ratios)
    rss = max(max(p[0][2], p[1][2]) for p in pairs)
    print(f"  upr load: median {rate:,.0f} sets/s   target >= {TARGET:,}  "
          f"{'MET' if rate >= TARGET else 'MISSED'}; bare writer (the reference) median "
          f"{bare:,.0f} sets/s; load / bare median {ratio:.2f} (pairs {min(ratios):.2f}-"
          f"{max(ratios):.2f}); node peak RSS {rss:.0f} MB")  # fmt: skip
    print(f"load_sets_per_s={rate:.0f} bare_sets_per_s={bare:.0f} ratio={ratio:.3f} "
          f"ratio_min={min(ratios):.3f} ratio_max={max(ratios):.3f} pairs={args.pairs} "
          f"target={TARGET} node_peak_rss_mb={rss:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
