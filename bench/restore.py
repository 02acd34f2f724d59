"""The cost of `upr restore`'s checksum pass before the first write, into a node.

Loads --docs JSON documents (150-200 B, 1024 partitions) into a local `upr serve`, waits
until they are persisted and backs them up. Then, --runs times, restores the backup into
a fresh node twice, with the pre-check (the default) and with --no-check, in turns (the
first of each pair alternates), each timed end to end as a process. The figure held to
the limit is the pre-check's share of the whole restore: (with - without) / with, and
the pre-check's own time (`precheck.seconds` in the summary) beside it. The pass is also
timed alone in this process, beside its reference: a bare sequential read of the same
segment files that computes the CRC32 of every byte (the least a checksum pass does;
the page cache warm for both), and beside a bare read alone, so "as fast as the disk
allows" is a ratio measured in the same run; 1024 partitions make small files, whose cost is per
file, so the same documents are also backed up from a node of --large-partitions
partitions and that repository checked and read the same way (the cost per byte).

Usage: python bench/restore.py [--docs 200000] [--runs 3] [--large-partitions 16]
Last line: docs=… restore_s=… no_check_s=… precheck_s=… share=… share_max=… limit=…
precheck_mb_per_s=… bare_read_mb_per_s=… read_ratio=… large_precheck_mb_per_s=…
large_bare_read_mb_per_s=… large_read_ratio=…
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _node import UPR, BenchNode, upr

LIMIT = 0.15  # the pre-check costs at most 15% of the restore's wall time


def timed_restore(repo: Path, data: Path, *extra: str) -> tuple[float, dict[str, object]]:
    """(wall seconds of the `upr restore` process, its JSON summary) into a new node."""
    node = BenchNode(data, 1024)
    try:
        t = time.perf_counter()
        out = subprocess.run([*UPR, "restore", "--repo", str(repo), node.uri, "--json",
                              "--no-progress", *extra], capture_output=True, text=True,
                             check=True)  # fmt: skip
        secs = time.perf_counter() - t
    finally:
        node.stop()
    return secs, json.loads(out.stdout)


def precheck_alone(repo: Path) -> tuple[float, int]:
    """(best seconds of 3, bytes checked) of the pre-check in this process."""
    from upr_cli.jobs.state import precheck, select
    from upr_cli.source import open_bucket

    r, b, manifests = open_bucket(repo, None)
    sel = select(manifests)
    best, n = float("inf"), 0
    for _ in range(3):
        t = time.perf_counter()
        got = precheck(r, b, manifests, sel)
        best = min(best, time.perf_counter() - t)
        n = got.bytes
        assert not got.damage
    return best, n


def bare_read(repo: Path, crc: bool) -> tuple[float, int]:
    """(best seconds of 3, bytes) of reading every segment file whole, in 1 MiB reads,
    with `crc` the CRC32 of every byte computed too."""
    files = sorted(repo.glob("*/*/p*.seg"))
    best, n = float("inf"), 0
    for _ in range(3):
        t, n = time.perf_counter(), 0
        for f in files:
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    n += len(chunk)
                    if crc:
                        zlib.crc32(chunk)
        best = min(best, time.perf_counter() - t)
    return best, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--large-partitions", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="upr-bench-restore-") as tmp:
        t = Path(tmp)
        src = BenchNode(t / "src", 1024)
        try:
            upr("load", src.uri, "--docs", str(args.docs), "--json")
            src.wait_persisted()
            upr("backup", src.uri, "--repo", str(t / "repo"), "--json")
        finally:
            src.stop()
        repo = t / "repo"
        pairs = []  # (with, without, precheck seconds, items)
        for k in range(args.runs):
            order = (True, False) if k % 2 == 0 else (False, True)
            got: dict[bool, tuple[float, dict[str, object]]] = {}
            for check in order:
                extra = () if check else ("--no-check",)
                got[check] = timed_restore(repo, t / f"dst-{k}-{int(check)}", *extra)
            (w, ws), (wo, _wos) = got[True], got[False]
            pc = ws["precheck"]
            assert isinstance(pc, dict)
            pairs.append((w, wo, float(pc["seconds"]), int(str(ws["items"]))))
        alone, checked = precheck_alone(repo)
        bare, read = bare_read(repo, crc=True)
        plain, _n = bare_read(repo, crc=False)
        big = BenchNode(t / "big", args.large_partitions)
        try:
            upr("load", big.uri, "--docs", str(args.docs), "--json")
            big.wait_persisted()
            upr("backup", big.uri, "--repo", str(t / "big-repo"), "--json")
        finally:
            big.stop()
        big_alone, big_checked = precheck_alone(t / "big-repo")
        big_bare, big_read = bare_read(t / "big-repo", crc=True)
        big_plain, _n = bare_read(t / "big-repo", crc=False)
    items = pairs[0][3]
    shares = [(w - wo) / w for w, wo, _p, _i in pairs]
    own = [p / w for w, _wo, p, _i in pairs]
    print(f"restore of {items:,} documents (1024 partitions) into a fresh node, "
          f"{args.runs} runs, each with and without the pre-check")  # fmt: skip
    for k, (w, wo, p, _i) in enumerate(pairs, 1):
        print(f"  run {k}: with {w:6.2f} s, --no-check {wo:6.2f} s, pre-check {p:5.2f} s "
              f"({p / w:.1%} of the restore); difference {shares[k - 1]:+.1%}")  # fmt: skip
    med = statistics.median(own)
    print(f"  pre-check share of the whole restore: median {med:.1%} (runs {min(own):.1%}-"
          f"{max(own):.1%}); with - without: median {statistics.median(shares):+.1%} (runs "
          f"{min(shares):+.1%} to {max(shares):+.1%})  limit <= {LIMIT:.0%} "
          f"{'MET' if max(own) <= LIMIT else 'MISSED'}")  # fmt: skip
    mb = 1 << 20
    rate = checked / mb / alone
    print(f"  pre-check alone: {checked / mb:,.1f} MiB in {alone:.3f} s = {rate:,.0f}"
          f" MiB/s; bare read + CRC32 of the same files: {read / mb:,.1f} MiB in {bare:.3f} s"
          f" = {read / mb / bare:,.0f} MiB/s (the reference; bare read alone "
          f"{read / mb / plain:,.0f} MiB/s); ratio "
          f"{(checked / alone) / (read / bare):.2f}")  # fmt: skip
    big_rate, big_ref = big_checked / mb / big_alone, big_read / mb / big_bare
    print(f"  {args.large_partitions} partitions (large segments): pre-check "
          f"{big_checked / mb:,.1f} MiB in {big_alone:.3f} s = {big_rate:,.0f} MiB/s; bare "
          f"read + CRC32 {big_read / mb:,.1f} MiB in {big_bare:.3f} s = {big_ref:,.0f} MiB/s "
          f"(bare read alone {big_read / mb / big_plain:,.0f} MiB/s); ratio "
          f"{big_rate / big_ref:.2f}")  # fmt: skip
    print(
        f"docs={items} restore_s={statistics.median(w for w, *_ in pairs):.2f} "
        f"no_check_s={statistics.median(wo for _w, wo, *_ in pairs):.2f} "
        f"precheck_s={statistics.median(p for _w, _wo, p, _i in pairs):.3f} share={med:.3f} "
        f"share_max={max(own):.3f} limit={LIMIT} precheck_mb_per_s={checked / mb / alone:.0f} "
        f"bare_read_mb_per_s={read / mb / bare:.0f} "
        f"read_ratio={(checked / alone) / (read / bare):.2f} "
        f"large_precheck_mb_per_s={big_rate:.0f} large_bare_read_mb_per_s={big_ref:.0f} "
        f"large_read_ratio={big_rate / big_ref:.2f}"
    )


if __name__ == "__main__":
    main()
