"""Drain rate of `upr tail --until-end --format json > /dev/null` and of the client library.

A node holding --docs documents (~150-200 B JSON, 1024 partitions, all persisted) is
drained end to end by the CLI (JSON formatting included) and by `DcpConsumer` alone;
each figure is printed beside its target, with node and client peak RSS.

Usage: python bench/tail.py [--docs 1000000]
Last line: tail_items_per_s=… library_items_per_s=… target=… client_rss_mb=… …
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _node import BenchNode

TARGET_ITEMS = 150_000
TARGET_RSS_MB = 200


def drain(uri: str) -> None:
    """Child mode: drain with the library, print items and seconds as JSON."""
    from upr_cli.dcp.consumer import DcpConsumer
    from upr_cli.net.uri import SourceUri
    from upr_cli.protocol.decoder import DcpRecord

    async def go() -> tuple[int, float]:
        consumer = DcpConsumer(SourceUri.parse(uri), until_end=True)
        await consumer.open()
        t = time.perf_counter()
        n = 0
        async for batch in consumer.batches():
            n += sum(1 for it in batch if type(it) is DcpRecord)
            consumer.commit()
        elapsed = time.perf_counter() - t
        await consumer.aclose()
        return n, elapsed

    n, secs = asyncio.run(go())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"items": n, "seconds": secs, "rss_mb": rss}))


def run_measured(cmd: list[str], stdout: int | None = None) -> float:
    """Run a child to completion; return its own peak RSS in MB (os.wait4)."""
    proc = subprocess.Popen(cmd, stdout=stdout)
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[2:4]} exited {proc.returncode}")
    return usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--drain", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drain:
        drain(args.drain)
        return
    with tempfile.TemporaryDirectory(prefix="upr-bench-tail-") as tmp:
        node = BenchNode(Path(tmp))
        try:
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "upr_cli", "load", node.uri, "--docs",
                            str(args.docs), "--json"], check=True, capture_output=True)  # fmt: skip
            print(
                f"loaded {args.docs:,} docs in {time.perf_counter() - t:.1f}s; "
                "waiting for persistence"
            )
            node.wait_persisted()
            with open(os.devnull, "w") as devnull:
                t = time.perf_counter()
                cmd = [sys.executable, "-m", "upr_cli", "tail", node.uri, "--until-end",
                       "--format", "json"]  # fmt: skip
                cli_rss = run_measured(cmd, stdout=devnull.fileno())
                cli_secs = time.perf_counter() - t
            out = subprocess.run([sys.executable, __file__, "--drain", node.uri], check=True,
                                 capture_output=True, text=True)  # fmt: skip
            lib = json.loads(out.stdout)
            node_rss = node.peak_rss_mb()
        finally:
            node.stop()
    cli_rate = args.docs / cli_secs
    lib_rate = lib["items"] / lib["seconds"]
    client_rss = max(cli_rss, lib["rss_mb"])
    print(f"node with {args.docs:,} documents (1024 partitions), drained to the end:")
    print(
        f"  upr tail --format json > /dev/null: {cli_rate:>10,.0f} items/s  "
        f"target >= {TARGET_ITEMS:,} {'MET' if cli_rate >= TARGET_ITEMS else 'MISSED'}"
    )
    print(
        f"  DcpConsumer (library only):          {lib_rate:>10,.0f} items/s  "
        f"({lib['items']:,} items)"
    )
    print(
        f"  client peak RSS: {client_rss:.0f} MB (target < {TARGET_RSS_MB} MB "
        f"{'MET' if client_rss < TARGET_RSS_MB else 'MISSED'}); node peak RSS {node_rss:.0f} MB"
    )
    print(
        f"tail_items_per_s={cli_rate:.0f} library_items_per_s={lib_rate:.0f} target={TARGET_ITEMS} "
        f"client_rss_mb={client_rss:.0f} rss_target_mb={TARGET_RSS_MB} node_rss_mb={node_rss:.0f}"
    )


if __name__ == "__main__":
    main()
