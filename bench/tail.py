"""Drain rate of `upr tail --until-end --format json > /dev/null` and of the client library.

A node holding --docs documents (~150-200 B JSON, 1024 partitions, all persisted) is
drained end to end by the CLI (JSON formatting included) and by `DcpConsumer` alone;
each figure is printed beside its target, with node and client peak RSS. The same is
measured in the same run with the documents spread over --collections collections (the
reference is the default collection alone): the cost of collections on the wire (one
LEB128 byte a key, the system events) and in the client (split ids, names per line).

Usage: python bench/tail.py [--docs 1000000] [--collections 8]
Last line: tail_items_per_s=… library_items_per_s=… … coll_tail_items_per_s=… ratio=…
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _node import BenchNode, run_measured

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


def measure(docs: int, collections: int) -> dict[str, float]:
    """Load `docs` documents (spread over `collections` named collections, or the default
    one when 0), then drain them with the CLI and the library; rates and peak RSS."""
    names = [f"bench.c{i}" for i in range(collections)]
    with tempfile.TemporaryDirectory(prefix="upr-bench-tail-") as tmp:
        extra = ("--collections", ",".join(names)) if names else ()
        node = BenchNode(Path(tmp), 1024, *extra)
        try:
            t = time.perf_counter()
            load = [sys.executable, "-m", "upr_cli", "load", node.uri, "--docs", str(docs)]
            subprocess.run([*load, "--json", *extra], check=True, capture_output=True)
            print(f"loaded {docs:,} docs into {collections or 'the default'} collection"
                  f"{'s' if collections else ''} in {time.perf_counter() - t:.1f}s")  # fmt: skip
            node.wait_persisted()
            cmd = [sys.executable, "-m", "upr_cli", "tail", node.uri, "--until-end",
                   "--format", "json"]  # fmt: skip
            cli_secs, cli_rss, _out = run_measured(cmd, discard=True)
            out = subprocess.run([sys.executable, __file__, "--drain", node.uri], check=True,
                                 capture_output=True, text=True)  # fmt: skip
            lib = json.loads(out.stdout)
            node_rss = node.peak_rss_mb()
        finally:
            node.stop()
    return {"cli": docs / cli_secs, "lib": lib["items"] / lib["seconds"], "items": lib["items"],
            "client_rss": max(cli_rss, lib["rss_mb"]), "node_rss": node_rss}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--collections", type=int, default=8, help="0: the default one only")
    ap.add_argument("--drain", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drain:
        drain(args.drain)
        return
    base = measure(args.docs, 0)
    coll = measure(args.docs, args.collections) if args.collections else base
    cli_rate, lib_rate, client_rss = base["cli"], base["lib"], base["client_rss"]
    print(f"node with {args.docs:,} documents (1024 partitions), drained to the end:")
    print(
        f"  upr tail --format json > /dev/null: {cli_rate:>10,.0f} items/s  "
        f"target >= {TARGET_ITEMS:,} {'MET' if cli_rate >= TARGET_ITEMS else 'MISSED'}"
    )
    print(
        f"  DcpConsumer (library only):          {lib_rate:>10,.0f} items/s  "
        f"({base['items']:,.0f} items)"
    )
    print(
        f"  over {args.collections} collections: tail {coll['cli']:>10,.0f} items/s "
        f"({coll['cli'] / cli_rate:.2f} of the default collection's), library "
        f"{coll['lib']:,.0f} ({coll['lib'] / lib_rate:.2f})"
    )
    print(
        f"  client peak RSS: {client_rss:.0f} MB (target < {TARGET_RSS_MB} MB "
        f"{'MET' if client_rss < TARGET_RSS_MB else 'MISSED'}); node peak RSS "
        f"{base['node_rss']:.0f} MB"
    )
    print(
        f"tail_items_per_s={cli_rate:.0f} library_items_per_s={lib_rate:.0f} target={TARGET_ITEMS} "
        f"client_rss_mb={client_rss:.0f} rss_target_mb={TARGET_RSS_MB} "
        f"node_rss_mb={base['node_rss']:.0f} collections={args.collections} "
        f"coll_tail_items_per_s={coll['cli']:.0f} coll_library_items_per_s={coll['lib']:.0f} "
        f"coll_tail_ratio={coll['cli'] / cli_rate:.3f} "
        f"coll_library_ratio={coll['lib'] / lib_rate:.3f}"
    )


if __name__ == "__main__":
    main()
