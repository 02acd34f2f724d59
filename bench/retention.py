"""`upr prune`, `upr merge` and `upr spark merge` on a chain of 30 backups, at --records.

Builds a repository chain with the library (no node: segments and manifests written
directly, as tests/repo/repo_helpers.py does) of 30 backups holding --records records in
total, 1024 partitions, JSON documents of 180-290 bytes: backup 0 is full (250,000
inserts), backup 1 an incremental of 25,000 records, backups 2-29 incrementals that
share the rest evenly. Every incremental record is an insert of a new key (65%), an
update of a live key (30%) or a deletion of one (5%). Backups 0 and 1 are the same at
every --records, so pruning just those two merges the same data however large the
repository is. Generation is timed on its own.

Then, each on a fresh copy of the chain and in a process of its own (time end to end,
process start included; peak RSS from wait4's rusage, and for Spark also the peak of the
whole process tree, JVM and Python workers, sampled from /proc every 0.1 s):

* `upr prune --keep-last 5 --apply`: 25 backups removed, merged forward into backup 25;
* `upr prune --keep-last 28 --apply`: only backups 0 and 1, merged into backup 2;
* `upr merge --through latest`: the whole chain into one full backup;
* `upr spark merge --through latest --master local[2]`.

References measured in the same run, so ratios compare on a noisy machine: a bare loop
that reads every record of the chain once with `SegmentReader` (checksums verified, as
the commands read), and `zstd -3` of the chain's keys and values (one core).

Usage: python bench/retention.py --records 1000000 [--seed 1] [--no-spark] [--dir DIR]
Last line: records=… load=… gen_s=… read_s=… zstd_s=… prune5_s=… prune5_rss_mb=… …
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from upr_cli.failover import FailoverLog
from upr_cli.net.bootstrap import partition_of
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import (
    BackupId,
    Manifest,
    PartitionEntry,
    Repository,
    SegmentEntry,
    Totals,
    format_segment_name,
)
from upr_cli.segments import SegmentHeader, SegmentReader, SegmentWriter
from upr_cli.segments.writer import new_compressor

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "default"
SOURCE = "upr://bench/default"
PARTITIONS = 1024
BACKUPS = 30
FULL, SECOND = 250_000, 25_000  # backups 0 and 1: the same at every --records
T0 = datetime(2026, 12, 1, tzinfo=UTC)
UUID = 0xBE7C4
LOG = FailoverLog.of([(UUID, 0)])
CITIES = ("Lisbon", "Oslo", "Nairobi", "Osaka", "Lima", "Tartu", "Perth", "Quebec")
BIO = (
    "Enjoys long walks through partitioned key spaces and reads change streams "
    "before breakfast; keeps backups in three places and tests every restore. "
) * 2


def sizes(records: int) -> list[int]:
    """Records per backup, oldest first."""
    rest = records - FULL - SECOND
    if rest < BACKUPS - 2:
        raise SystemExit(f"--records must be at least {FULL + SECOND + BACKUPS - 2}")
    each, extra = divmod(rest, BACKUPS - 2)
    return [FULL, SECOND, *(each + (i < extra) for i in range(BACKUPS - 2))]


def _value(kid: int, seq: int, rnd: random.Random) -> bytes:
    """A user document of 180-290 bytes (240 on average)."""
    bio = BIO[: rnd.randrange(40, 140)]
    return (b'{"type":"user","id":%d,"name":"User %d","email":"user%d@example.com",'
            b'"city":"%s","score":%d,"active":%s,"version":%d,"bio":"%s"}'
            % (kid, kid, kid, rnd.choice(CITIES).encode(), rnd.randrange(100000),
               b"true" if rnd.random() < 0.8 else b"false", seq, bio.encode()))  # fmt: skip


def generate(repo_dir: Path, records: int, seed: int, raw: Path) -> tuple[int, int]:
    """Write the chain; the keys and values of every record also go to `raw` (the
    zstd reference's input). Returns (records, segment bytes)."""
    repo = Repository(repo_dir)
    repo.init()
    rnd = random.Random(seed)
    zstd = new_compressor()
    live: list[int] = []  # key ids of the live documents
    next_id = 0
    seqs = [0] * PARTITIONS
    parent: BackupId | None = None
    total = seg_bytes = 0
    with raw.open("wb") as rawf:
        for n, count in enumerate(sizes(records)):
            rows: list[list[DcpRecord]] = [[] for _ in range(PARTITIONS)]
            starts = list(seqs)
            for _ in range(count):
                r = rnd.random()
                if n == 0 or r < 0.65 or not live:
                    kid, op = next_id, OP_MUTATION
                    next_id += 1
                    live.append(kid)
                elif r < 0.95:
                    kid, op = live[rnd.randrange(len(live))], OP_MUTATION
                else:
                    i = rnd.randrange(len(live))
                    kid, op = live[i], OP_DELETION
                    live[i] = live[-1]
                    live.pop()
                key = b"user::%09d" % kid
                p = partition_of(key, PARTITIONS)
                seq = seqs[p] = seqs[p] + 1
                if op == OP_MUTATION:
                    value = _value(kid, seq, rnd)
                    rows[p].append(DcpRecord(op, p, seq, seq, (seq << 16) | p, 0x2000000,
                                             0, 0, 1, key, value, 0))  # fmt: skip
                else:
                    value = b""
                    rows[p].append(DcpRecord(op, p, seq, seq, (seq << 16) | p, 0, 0,
                                             1764547200 + n * 3600, 0, key, value, 0))  # fmt: skip
                rawf.write(key)
                rawf.write(value)
            b = BackupId(T0 + timedelta(hours=n))
            d = repo.new_backup_dir(BUCKET, b)
            entries = []
            for p in range(PARTITIONS):
                start, high = (0 if n == 0 else starts[p]), seqs[p]
                if not rows[p] and n:
                    continue  # nothing new in this partition: no entry, as a backup does
                segs: tuple[SegmentEntry, ...] = ()
                if rows[p]:
                    hdr = SegmentHeader(BUCKET, p, LOG, start, high, ((start, high),),
                                        "2026-12-06T00:00:00.000000Z", SOURCE)  # fmt: skip
                    w = SegmentWriter(d / f"p{p}.open", hdr, compressor=zstd)
                    w.add(rows[p])
                    name = format_segment_name(p, rows[p][0].by_seqno, high)
                    info = w.finish(path=d / name, sync=False)
                    seg_bytes += info.bytes
                    segs = (SegmentEntry(name, info.first_seq, info.last_seq, info.records,
                                         info.bytes, info.checksum),)  # fmt: skip
                entries.append(PartitionEntry(p, UUID, LOG, start, high, high, high, segs))
            m = Manifest(b, BUCKET, SOURCE, b.time, b.time + timedelta(minutes=1),
                         parent is None, parent, tuple(entries),
                         Totals.derive(entries, 1))  # fmt: skip
            repo.write_manifest(m)
            parent = b
            total += count
    os.sync()
    return total, seg_bytes


def bare_read(repo_dir: Path) -> tuple[float, int]:
    """(seconds, records) of reading every record of every segment once, in a bare loop."""
    repo = Repository(repo_dir)
    t = time.perf_counter()
    n = 0
    for m in repo.manifests(BUCKET):
        for e in m.partitions:
            for s in e.segments:
                with SegmentReader(repo.segment_path(BUCKET, m.backup_id, s.file)) as rd:
                    for _rec in rd.records():
                        n += 1
    return time.perf_counter() - t, n


def zstd3(raw: Path) -> float:
    """Seconds of `zstd -3` (one thread) over `raw`, output discarded."""
    t = time.perf_counter()
    subprocess.run(["zstd", "-3", "-T1", "-q", "-c", str(raw)], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - t


def _tree_rss(root: int) -> int:
    """Bytes resident in `root` and all its descendants now (from /proc)."""
    kids: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            with open(f"/proc/{d}/statm") as f:
                rss[int(d)] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += kids.get(pid, [])
    return total


def measure(args: Sequence[str], tree: bool = False) -> tuple[float, float, float]:
    """(seconds, peak RSS MB of the process, peak RSS MB of its process tree or 0) of
    `upr ARGS` run in a process of its own, end to end. The peak comes from
    /usr/bin/time: a child forked from this (large) process would count this process's
    pages in its own peak, a child of `time` does not."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.NamedTemporaryFile(prefix="upr-bench-rss-") as out:
        t = time.perf_counter()
        proc = subprocess.Popen(["/usr/bin/time", "-f", "%M", "-o", out.name,
                                 sys.executable, "-m", "upr_cli", *args], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        peak = 0
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.1):
                peak = max(peak, _tree_rss(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        if tree:
            sampler.start()
        _out, err = proc.communicate()
        secs = time.perf_counter() - t
        done.set()
        if tree:
            sampler.join()
        if proc.returncode:
            raise SystemExit(f"upr {' '.join(args)} exited {proc.returncode}: "
                             f"{err.decode()[-2000:]}")  # fmt: skip
        rss_kb = int(Path(out.name).read_text().split()[-1])
    return secs, rss_kb / 1024, peak / (1 << 20)


def fresh(pristine: Path, scratch: Path) -> Path:
    """A copy of the chain that a command may change."""
    if scratch.exists():
        shutil.rmtree(scratch)
    shutil.copytree(pristine, scratch)
    os.sync()
    return scratch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-spark", action="store_true", help="skip upr spark merge")
    ap.add_argument("--dir", type=Path, default=None, help="scratch parent (default: TMPDIR)")
    args = ap.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="upr-bench-retention-", dir=args.dir) as tmp:
        t = Path(tmp)
        pristine, raw = t / "chain", t / "raw.bin"
        g0 = time.perf_counter()
        records, seg_bytes = generate(pristine, args.records, args.seed, raw)
        gen_s = time.perf_counter() - g0
        raw_mb = raw.stat().st_size / 1e6
        print(f"chain: {BACKUPS} backups, {records:,} records, {PARTITIONS} partitions, "
              f"{seg_bytes / 1e6:,.0f} MB of segments ({raw_mb:,.0f} MB of keys and values); "
              f"generated in {gen_s:.1f}s ({records / gen_s:,.0f} records/s)")  # fmt: skip
        read_s, read_n = bare_read(pristine)
        assert read_n == records, (read_n, records)
        zstd_s = zstd3(raw)
        raw.unlink()
        repo = str(t / "work")
        res: dict[str, tuple[float, float, float]] = {}
        for label, cmd in (
            ("prune5", ["prune", "--repo", repo, "--keep-last", "5", "--apply", "--json"]),
            ("prune28", ["prune", "--repo", repo, "--keep-last", "28", "--apply", "--json"]),
            ("merge", ["merge", "--repo", repo, "--through", "latest", "--no-progress",
                       "--json"]),
            ("spark", ["spark", "merge", "--repo", repo, "--through", "latest",
                       "--master", "local[2]", "--no-progress", "--json"]),
        ):  # fmt: skip
            if label == "spark" and args.no_spark:
                continue
            fresh(pristine, t / "work")
            res[label] = measure(cmd, tree=label == "spark")
    load_end = os.getloadavg()
    print(f"machine load (1-min average) {load[0]:.2f} at start, {load_end[0]:.2f} at end; "
          f"{os.cpu_count()} cores")  # fmt: skip
    print(f"  reference: bare SegmentReader loop over every record  {read_s:6.1f}s "
          f"({records / read_s:,.0f} records/s)")  # fmt: skip
    print(f"  reference: zstd -3 of the keys and values ({raw_mb:,.0f} MB)  {zstd_s:6.1f}s")
    names = {"prune5": "upr prune --keep-last 5 (25 backups merged)",
             "prune28": "upr prune --keep-last 28 (2 backups merged)",
             "merge": "upr merge --through latest",
             "spark": "upr spark merge (local[2])"}  # fmt: skip
    for label, (secs, rss, tree_rss) in res.items():
        extra = f", process tree {tree_rss:,.0f} MB" if tree_rss else ""
        print(f"  {names[label]:<46} {secs:6.1f}s  x{secs / read_s:4.2f} of the read  "
              f"peak RSS {rss:,.0f} MB{extra}")  # fmt: skip
    print(f"records={records} load={load[0]:.2f} gen_s={gen_s:.1f} read_s={read_s:.1f} "
          f"zstd_s={zstd_s:.1f} "
          + " ".join(f"{k}_s={s:.1f} {k}_rss_mb={r:.0f}" + (f" {k}_tree_mb={tr:.0f}" if tr else "")
                     for k, (s, r, tr) in res.items()))  # fmt: skip


if __name__ == "__main__":
    main()
