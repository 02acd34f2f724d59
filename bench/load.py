"""`upr load` throughput against a local node: sets/s beside the target.

Usage: python bench/load.py [--docs 300000] [--partitions 1024]
Last line: load_sets_per_s=… target=… node_peak_rss_mb=…
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _node import BenchNode

TARGET = 50_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=300_000)
    ap.add_argument("--partitions", type=int, default=1024)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="upr-bench-load-") as tmp:
        node = BenchNode(Path(tmp), args.partitions)
        try:
            out = subprocess.run(
                [sys.executable, "-m", "upr_cli", "load", node.uri, "--docs", str(args.docs),
                 "--json"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            summary = json.loads(out.stdout)
            rss = node.peak_rss_mb()
        finally:
            node.stop()
    rate = summary["items_per_s"]
    print(f"upr load: {args.docs:,} new JSON documents (~180 B), {args.partitions} partitions, "
          f"pipelined on one connection")  # fmt: skip
    print(f"  sets/s: {rate:>10,}   target >= {TARGET:,}  {'MET' if rate >= TARGET else 'MISSED'}")
    print(f"  errors: {summary['errors']}, node peak RSS {rss:.0f} MB")
    print(f"load_sets_per_s={rate} target={TARGET} node_peak_rss_mb={rss:.0f}")


if __name__ == "__main__":
    main()
