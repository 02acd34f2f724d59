"""Drain rate of `upr tail --until-end --format json > /dev/null` and of the client library.

A node holding --docs documents (~150-200 B JSON, 1024 partitions, all persisted) is
drained end to end by the CLI (JSON formatting included), by `DcpConsumer` alone and,
the reference, by a bare loop (bench/_ref.py: one connection, every stream requested at
once, a loop that only reads headers and counts records: the node's send rate), each
--rounds times in turns (the order turning each round); the median rates, each client's
median ratio to the bare loop with its spread, the target, node and client peak RSS. The
same is
measured in the same run with the documents spread over --collections collections (the
reference is the default collection alone): the cost of collections on the wire (one
LEB128 byte a key, the system events) and in the client (split ids, names per line).

Usage: python bench/tail.py [--docs 1000000] [--collections 8] [--rounds 3]
Last line: tail_items_per_s=… library_items_per_s=… bare_items_per_s=… tail_ratio=… …
    coll_tail_items_per_s=… coll_tail_ratio=…
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _node import BenchNode, run_measured, say
from _ref import bare_drain

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


def measure(docs: int, collections: int, rounds: int) -> dict[str, float]:
    """Load `docs` documents (spread over `collections` named collections, or the default
    one when 0), then drain them `rounds` times each with the CLI, the library and (the
    default collection only) the bare loop, the order turning each round; median rates,
    the median ratios to the bare loop's with their spread, and peak RSS."""
    names = [f"bench.c{i}" for i in range(collections)]
    with tempfile.TemporaryDirectory(prefix="upr-bench-tail-") as tmp:
        extra = ("--collections", ",".join(names)) if names else ()
        node = BenchNode(Path(tmp) / "node", 1024, *extra)
        try:
            t = time.perf_counter()
            load = [sys.executable, "-m", "upr_cli", "load", node.uri, "--docs", str(docs)]
            subprocess.run([*load, "--json", *extra], check=True, capture_output=True)
            say(f"loaded {docs:,} docs into {collections or 'the default'} collection"
                f"{'s' if collections else ''} in {time.perf_counter() - t:.1f}s")  # fmt: skip
            node.wait_persisted()
            rss = [0.0]

            def cli() -> float:
                cmd = [sys.executable, "-m", "upr_cli", "tail", node.uri, "--until-end",
                       "--format", "json"]  # fmt: skip
                secs, cli_rss, _out = run_measured(cmd, discard=True)
                rss[0] = max(rss[0], cli_rss)
                return docs / secs

            def lib() -> float:
                out = subprocess.run([sys.executable, __file__, "--drain", node.uri],
                                     check=True, capture_output=True, text=True)  # fmt: skip
                got = json.loads(out.stdout)
                rss[0] = max(rss[0], got["rss_mb"])
                return float(got["items"] / got["seconds"])

            def bare() -> float:
                rate, items = bare_drain(node.uri)
                assert items == docs, (items, docs)
                return rate

            runs: dict[str, Callable[[], float]] = {"cli": cli, "lib": lib}
            if not collections:
                runs["bare"] = bare
            got: dict[str, list[float]] = {k: [] for k in runs}
            order = list(runs)
            for k in range(rounds):
                for name in order[k % len(order) :] + order[: k % len(order)]:
                    say(f"round {k + 1}: {name}")
                    got[name].append(runs[name]())
            node_rss = node.peak_rss_mb()
        finally:
            node.stop()
    out = {k: statistics.median(v) for k, v in got.items()}
    if "bare" in got:
        for name in ("cli", "lib"):
            ratios = [a / b for a, b in zip(got[name], got["bare"], strict=True)]
            out[f"{name}_ratio"] = statistics.median(ratios)
            out[f"{name}_ratio_min"], out[f"{name}_ratio_max"] = min(ratios), max(ratios)
    return out | {"client_rss": rss[0], "node_rss": node_rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--collections", type=int, default=8, help="0: the default one only")
    ap.add_argument("--rounds", type=int, default=3, help="drains of each kind, in turns")
    ap.add_argument("--drain", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drain:
        drain(args.drain)
        return
    base = measure(args.docs, 0, args.rounds)
    coll = measure(args.docs, args.collections, 1) if args.collections else base
    cli_rate, lib_rate, client_rss = base["cli"], base["lib"], base["client_rss"]
    print(f"node with {args.docs:,} documents (1024 partitions), drained to the end:")
    print(f"  bare DCP drain (the reference):      {base['bare']:>10,.0f} items/s  (one "
          f"connection, every stream at once, a header-counting loop)")  # fmt: skip
    print(f"  upr tail --format json > /dev/null: {cli_rate:>10,.0f} items/s = "
          f"{base['cli_ratio']:.2f} x bare (rounds {base['cli_ratio_min']:.2f}-"
          f"{base['cli_ratio_max']:.2f})  target >= {TARGET_ITEMS:,} "
          f"{'MET' if cli_rate >= TARGET_ITEMS else 'MISSED'}")  # fmt: skip
    print(f"  DcpConsumer (library only):          {lib_rate:>10,.0f} items/s = "
          f"{base['lib_ratio']:.2f} x bare (rounds {base['lib_ratio_min']:.2f}-"
          f"{base['lib_ratio_max']:.2f})")  # fmt: skip
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
        f"tail_items_per_s={cli_rate:.0f} library_items_per_s={lib_rate:.0f} "
        f"bare_items_per_s={base['bare']:.0f} tail_ratio={base['cli_ratio']:.3f} "
        f"library_ratio={base['lib_ratio']:.3f} rounds={args.rounds} target={TARGET_ITEMS} "
        f"client_rss_mb={client_rss:.0f} rss_target_mb={TARGET_RSS_MB} "
        f"node_rss_mb={base['node_rss']:.0f} collections={args.collections} "
        f"coll_tail_items_per_s={coll['cli']:.0f} coll_library_items_per_s={coll['lib']:.0f} "
        f"coll_tail_ratio={coll['cli'] / cli_rate:.3f} "
        f"coll_library_ratio={coll['lib'] / lib_rate:.3f}"
    )


if __name__ == "__main__":
    main()
