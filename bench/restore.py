"""`upr restore` beside its references, measured in one run.

Loads --docs JSON documents (150-200 B, --partitions partitions, 1024 by default) into a
local `upr serve`, waits until they are persisted and backs them up. Then, each part
unless --skip names it:

* node: --pairs pairs, the order alternating (restore first, then load first, ...):
  `upr restore --repo R upr://...` into a fresh node, and `upr load` of the same number
  of new documents (the documents the backup holds: same seed, same size) into another
  fresh node of as many partitions. items/s of each as its process's wall time (what an
  operator waits for, process start included), the ratio restore/load per pair, their
  median and spread, beside the goals: ratio >= 0.90 and restore >= 50,000 items/s.
  Each command's own rate (its summary) is printed beside it.
* cluster: the same into `upr cluster init --nodes 3 --replicas 1` clusters (a fresh
  one per run, same partitions), both commands given node n0's URI and writing through
  the map: ratio >= 0.90.
* sqlite: `upr restore ... sqlite:PATH` (its summary's items/s) beside one bare
  `executemany` of the same rows into the same schema in this process (bench/_ref.py,
  shared with bench/backup.py), alternating over --pairs pairs: share >= 0.75.
* rss: the peak RSS (VmHWM) of each process, the client and the node, beside the goal
  300 MB: load, backup, tail, replay (from the node and from the repository), verify,
  and restore into a node, a cluster and SQLite; for the run's documents (the restores'
  figures are the largest of their pairs) and (unless --skip large) for 100 documents
  of 5 MiB in 64 partitions. A node's peak is reset (/proc/PID/clear_refs) before each
  command, so it is that command's; the node's during `backup` is `upr serve` while it
  backfills.
* precheck: the pre-check's share of the restore's wall time (its summary's
  `precheck.seconds` over the node pairs' restores; limit 15%), and the pass timed alone
  in this process beside a bare read + CRC32 of the same segment files (and a bare read
  alone), for the repository of --partitions partitions and for one of
  --large-partitions partitions holding the same documents (larger segments).

Progress lines go to stderr; each part's figures go to stdout as soon as it ends (a run
cut short keeps those), the key=value line at the end. Everything runs on loopback;
temporary directories are removed and nodes stopped (SIGTERM, then SIGKILL) at the end,
on a failure and on Ctrl-C or SIGTERM.

Usage: python bench/restore.py [--docs 200000] [--pairs 3] [--partitions 1024]
    [--skip node,cluster,sqlite,rss,large,precheck] [--large-partitions 16]
Last line: commit=... docs=... node_ratio=... node_ratio_goal=0.9 restore_items_per_s=...
cluster_ratio=... sqlite_share=... rss_max_mb=... rss_goal_mb=300 precheck_share=... ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _node import UPR, BenchNode, peak_rss_mb, reset_peak_rss, run_measured, say
from _ref import bare_executemany, repo_rows

PARTS = ("node", "cluster", "sqlite", "rss", "large", "precheck")
NODE_RATIO_GOAL = 0.90  # restore at >= 0.90x the node's ingest rate (`upr load`)
NODE_RATE_GOAL = 50_000  # restore items/s into a node on this machine
CLUSTER_RATIO_GOAL = 0.90
SQLITE_SHARE_GOAL = 0.75  # restore into SQLite at >= 75% of a bare executemany
RSS_GOAL_MB = 300  # every process's peak RSS with the default --memory-limit
PRECHECK_LIMIT = 0.15  # the pre-check costs at most 15% of the restore's wall time
LARGE_DOCS, LARGE_SIZE, LARGE_PARTITIONS = 100, 5 << 20, 64
DOC_SIZE = 180  # `upr load`'s default document size

#: peak RSS in MB of one command: (client, node); node None where no node serves it
Peak = tuple[float, float | None]
#: a command's name in the key=value line (`rss_small_NAME_mb` for the client,
#: `rss_small_NAME_serve_mb` for the node serving it)
SLUGS = {"replay (node)": "replay_from_node", "replay (repository)": "replay_from_repo",
         "restore (node)": "restore_to_node", "restore (cluster)": "restore_to_cluster",
         "restore (SQLite)": "restore_to_sqlite"}  # fmt: skip


@dataclass
class Run:
    """One timed command: items written, wall seconds, its own rate, peak RSS."""

    items: int
    wall: float
    own_rate: float  # items/s as the command's summary counts them
    client_mb: float
    node_mb: float | None
    summary: dict[str, object]

    @property
    def rate(self) -> float:
        """items/s over the process's wall time."""
        return self.items / self.wall


def restore_cmd(repo: Path, target: str) -> list[str]:
    """The `upr restore` command line."""
    return [*UPR, "restore", "--repo", str(repo), target, "--json", "--no-progress"]


def load_cmd(uri: str, docs: int, size: int = DOC_SIZE) -> list[str]:
    """The `upr load` command line: `docs` new documents of about `size` bytes."""
    return [*UPR, "load", uri, "--docs", str(docs), "--size", str(size), "--json",
            "--no-progress"]  # fmt: skip


def timed(cmd: list[str], node_pids: list[int]) -> Run:
    """Run one restore or load; its node(s)' peak RSS is reset before and read after."""
    for pid in node_pids:
        reset_peak_rss(pid)
    secs, rss, out = run_measured(cmd)
    node = max((peak_rss_mb(p) for p in node_pids), default=None)
    summary = json.loads(out)
    items = int(summary["written"] if "written" in summary else summary["items"])
    own = float(summary["items_per_s"] or 0)
    if int(str(summary.get("errors", 0))):
        raise SystemExit(f"{cmd[3]} reported errors: {summary}")
    return Run(items, secs, own, rss, node, summary)


@contextmanager
def fresh_node(where: Path, partitions: int) -> Iterator[BenchNode]:
    """A new node in `where`, stopped and its files removed afterwards."""
    try:
        with BenchNode(where, partitions) as node:
            yield node
    finally:
        shutil.rmtree(where, ignore_errors=True)
        where.with_name(where.name + ".log").unlink(missing_ok=True)


@contextmanager
def fresh_cluster(where: Path, partitions: int) -> Iterator[tuple[str, list[int]]]:
    """A new `upr cluster init --nodes 3 --replicas 1`: (n0's URI, the nodes' pids);
    stopped (`upr cluster stop`, then SIGKILL for any node left) and removed after."""
    from upr_cli.cluster import spec

    pids: list[int] = []
    try:
        run_measured([*UPR, "cluster", "init", "--nodes", "3", "--replicas", "1",
                      "--num-partitions", str(partitions), "--data", str(where)])  # fmt: skip
        cl = spec.load(where)
        pids = [n.pid for n in cl.nodes if n.pid is not None]
        yield cl.uri(cl.nodes[0]), pids
    finally:
        if where.exists():
            subprocess.run([*UPR, "cluster", "stop", "--data", str(where)],
                           capture_output=True, check=False, timeout=120)  # fmt: skip
        for pid in pids:
            try:
                os.kill(pid, 0)
            except OSError:
                continue
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(where, ignore_errors=True)


def pairs_of(n: int, a: Callable[[int], Run], b: Callable[[int], Run]) -> list[tuple[Run, Run]]:
    """`n` pairs (a, b), run in turns: a then b, b then a, ..."""
    out = []
    for k in range(n):
        if k % 2 == 0:
            ra = a(k)
            rb = b(k)
        else:
            rb = b(k)
            ra = a(k)
        out.append((ra, rb))
    return out


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def plural(n: int, noun: str) -> str:
    """The count and the noun, plural unless 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def verdict(ok: bool) -> str:
    """MET or MISSED."""
    return "MET" if ok else "MISSED"


class Report:
    """The report's lines, printed on stdout as each part ends (a run cut short keeps the
    parts it finished), and the one key=value line printed at the end."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def line(self, text: str) -> None:
        """One line of the report, printed now."""
        print(text, flush=True)

    def key(self, **kv: object) -> None:
        """Fields of the last line (floats with 3 significant decimals or as integers)."""
        for k, v in kv.items():
            if isinstance(v, float):
                v = f"{v:.0f}" if abs(v) >= 100 else f"{v:.3f}"
            self.keys.append(f"{k}={v}")

    def ratio(self, name: str, values: list[float], goal: float, what: str) -> None:
        """A ratio's median and spread beside its goal (line and keys)."""
        med, lo, hi = spread(values)
        self.line(f"  {what}: median {med:.2f} (pairs {lo:.2f}-{hi:.2f}, "
                  f"{', '.join(f'{v:.2f}' for v in values)})  goal >= {goal:.2f} "
                  f"{verdict(med >= goal)}")  # fmt: skip
        self.key(**{name: med, f"{name}_min": lo, f"{name}_max": hi, f"{name}_goal": goal})


def compare_part(report: Report, name: str, title: str, pairs: list[tuple[Run, Run]],
                 goal: float) -> None:  # fmt: skip
    """Restore and load pairs: per pair lines, the ratio beside its goal."""
    report.line(title)
    ratios = []
    for k, (r, ld) in enumerate(pairs, 1):
        ratios.append(r.rate / ld.rate)
        report.line(f"  pair {k}: restore {r.items:,} items in {r.wall:.2f} s = "
                    f"{r.rate:,.0f} items/s (own {r.own_rate:,.0f}); load {ld.items:,} in "
                    f"{ld.wall:.2f} s = {ld.rate:,.0f} sets/s (own {ld.own_rate:,.0f}); "
                    f"ratio {ratios[-1]:.2f} (own {r.own_rate / ld.own_rate:.2f})")  # fmt: skip
    report.ratio(f"{name}_ratio", ratios, goal, "restore / load")
    own = [r.own_rate / ld.own_rate for r, ld in pairs]
    rates = spread([r.rate for r, _ in pairs])
    loads = spread([ld.rate for _, ld in pairs])
    report.line(f"  restore {rates[0]:,.0f} items/s (runs {rates[1]:,.0f}-{rates[2]:,.0f}), "
                f"load {loads[0]:,.0f} sets/s (runs {loads[1]:,.0f}-{loads[2]:,.0f}); "
                f"ratio of their own rates: median {statistics.median(own):.2f}")  # fmt: skip
    report.key(**{f"{name}_restore_items_per_s": rates[0], f"{name}_load_items_per_s": loads[0],
                  f"{name}_own_ratio": statistics.median(own)})  # fmt: skip


def make_source(where: Path, docs: int, size: int, partitions: int, *,
                reads: bool) -> tuple[Path, dict[str, Peak]]:  # fmt: skip
    """Load `docs` documents into a node, wait until persisted, back it up into
    where/repo; with `reads`, also drain it (`upr tail`) and replay it into SQLite. The
    peak RSS of each command and of the node during it."""
    peaks: dict[str, Peak] = {}
    repo = where / "repo"
    with fresh_node(where / "node", partitions) as node:
        say(f"load {docs:,} documents of {size:,} B into a node of {partitions} partitions")
        run = timed(load_cmd(node.uri, docs, size), [node.proc.pid])
        peaks["load"] = (run.client_mb, run.node_mb)
        node.wait_persisted()
        say("backup")
        node.reset_peak()
        _s, rss, _o = run_measured([*UPR, "backup", node.uri, "--repo", str(repo), "--json",
                                    "--no-progress"])  # fmt: skip
        peaks["backup"] = (rss, node.peak_rss_mb())
        if reads:
            say("tail --until-end")
            node.reset_peak()
            _s, rss, _o = run_measured([*UPR, "tail", node.uri, "--until-end", "--format",
                                        "json"], discard=True)  # fmt: skip
            peaks["tail"] = (rss, node.peak_rss_mb())
            say("replay from the node")
            node.reset_peak()
            _s, rss, _o = run_measured([*UPR, "replay", node.uri, "--into",
                                        str(where / "replay-node.db"), "--json",
                                        "--no-progress"])  # fmt: skip
            peaks["replay (node)"] = (rss, node.peak_rss_mb())
            (where / "replay-node.db").unlink(missing_ok=True)
    return repo, peaks


def repo_peaks(repo: Path, where: Path) -> dict[str, Peak]:
    """Peak RSS of `upr verify` and `upr replay repo:...` (clients alone)."""
    say("verify")
    _s, rss, _o = run_measured([*UPR, "verify", "--repo", str(repo), "--json",
                                "--no-progress"])  # fmt: skip
    peaks: dict[str, Peak] = {"verify": (rss, None)}
    say("replay from the repository")
    db = where / "replay-repo.db"
    _s, rss, _o = run_measured([*UPR, "replay", f"repo:{repo}", "--into", str(db), "--json",
                                "--no-progress"])  # fmt: skip
    db.unlink(missing_ok=True)
    peaks["replay (repository)"] = (rss, None)
    return peaks


def large_peaks(where: Path, *, cluster: bool) -> dict[str, Peak]:
    """Every command's peak RSS with 100 documents of 5 MiB in 64 partitions."""
    repo, peaks = make_source(where, LARGE_DOCS, LARGE_SIZE, LARGE_PARTITIONS, reads=True)
    peaks |= repo_peaks(repo, where)
    say("restore the large documents into a node")
    with fresh_node(where / "dst", LARGE_PARTITIONS) as node:
        run = timed(restore_cmd(repo, node.uri), [node.proc.pid])
        peaks["restore (node)"] = (run.client_mb, run.node_mb)
    if cluster:
        say("restore the large documents into a cluster")
        with fresh_cluster(where / "cl", LARGE_PARTITIONS) as (uri, pids):
            run = timed(restore_cmd(repo, uri), pids)
            peaks["restore (cluster)"] = (run.client_mb, run.node_mb)
    say("restore the large documents into SQLite")
    run = timed(restore_cmd(repo, f"sqlite:{where / 'large.db'}"), [])
    peaks["restore (SQLite)"] = (run.client_mb, None)
    return peaks


def rss_part(report: Report, small: dict[str, Peak], large: dict[str, Peak],
             docs: int) -> None:  # fmt: skip
    """The peak RSS table beside the goal."""
    names = list(dict.fromkeys([*small, *large]))
    report.line(f"peak RSS (VmHWM, MB) of each process, the client and the node serving it; "
                f"goal < {RSS_GOAL_MB} MB each (! marks a miss)")  # fmt: skip
    report.line(f"  {'command':<22} {f'{docs:,} docs client':>18} {'node':>7}   "
                f"{'100 x 5 MiB client':>18} {'node':>7}")  # fmt: skip

    def cell(p: Peak | None, i: int) -> str:
        v = None if p is None else p[i]
        return "-" if v is None else f"{v:.0f}{'!' if v >= RSS_GOAL_MB else ''}"

    worst = 0.0
    for name in names:
        s, lg = small.get(name), large.get(name)
        report.line(f"  {name:<22} {cell(s, 0):>18} {cell(s, 1):>7}   {cell(lg, 0):>18} "
                    f"{cell(lg, 1):>7}")  # fmt: skip
        slug = SLUGS.get(name, name)
        for label, got in (("small", s), ("large", lg)):
            if got is None:
                continue
            report.key(**{f"rss_{label}_{slug}_mb": round(got[0])})
            if got[1] is not None:
                report.key(**{f"rss_{label}_{slug}_serve_mb": round(got[1])})
            worst = max(worst, got[0], got[1] or 0.0)
    if "backup" in large and large["backup"][1] is not None:
        report.line(f"  upr serve while it backfills the large documents (during backup): "
                    f"{large['backup'][1]:.0f} MB")  # fmt: skip
    report.line(f"  largest: {worst:.0f} MB  goal < {RSS_GOAL_MB} MB "
                f"{verdict(worst < RSS_GOAL_MB)}")  # fmt: skip
    report.key(rss_max_mb=round(worst), rss_goal_mb=RSS_GOAL_MB)


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


def read_line(report: Report, prefix: str, label: str, repo: Path) -> None:
    """The pre-check alone beside a bare read + CRC32 of the same files."""
    mb = 1 << 20
    alone, checked = precheck_alone(repo)
    bare, read = bare_read(repo, crc=True)
    plain, _n = bare_read(repo, crc=False)
    rate, ref = checked / mb / alone, read / mb / bare
    report.line(f"  {label}: pre-check alone {checked / mb:,.1f} MiB in {alone:.3f} s = "
                f"{rate:,.0f} MiB/s; bare read + CRC32 of the same files {ref:,.0f} MiB/s "
                f"(the reference; bare read alone {read / mb / plain:,.0f} MiB/s); ratio "
                f"{rate / ref:.2f}")  # fmt: skip
    report.key(**{f"{prefix}precheck_mb_per_s": rate, f"{prefix}bare_read_mb_per_s": ref,
                  f"{prefix}read_ratio": rate / ref})  # fmt: skip


def precheck_part(report: Report, restores: list[Run], repo: Path, where: Path, docs: int,
                  partitions: int, large_partitions: int) -> None:  # fmt: skip
    """The pre-check's share of the restores, and its pass alone beside a bare read."""
    report.line("pre-check (the checksum pass before the first write)")
    if restores:
        shares = []
        for r in restores:
            pc = r.summary["precheck"]
            assert isinstance(pc, dict)
            shares.append(float(pc["seconds"]) / r.wall)
        med, lo, hi = spread(shares)
        report.line(f"  share of the restore's wall time (node pairs): median {med:.1%} "
                    f"(runs {lo:.1%}-{hi:.1%})  limit <= {PRECHECK_LIMIT:.0%} "
                    f"{verdict(hi <= PRECHECK_LIMIT)}")  # fmt: skip
        report.key(precheck_share=med, precheck_share_max=hi, precheck_limit=PRECHECK_LIMIT)
    read_line(report, "", f"{partitions} partitions", repo)
    big, _peaks = make_source(where, docs, DOC_SIZE, large_partitions, reads=False)
    read_line(report, "large_", f"{large_partitions} partitions (larger segments)", big)


def git_head() -> str:
    """The commit this run measures, with "+dirty" when upr_cli/ has uncommitted changes."""
    root = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                         capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "upr_cli"], cwd=root,
                           capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    return (sha or "unknown") + ("+dirty" if dirty else "")


def on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    """SIGTERM as Ctrl-C: the finally blocks stop the nodes and remove the files."""
    raise KeyboardInterrupt


def parse_skip(text: str) -> set[str]:
    """The parts --skip names; an unknown one is a usage error."""
    skip = {s.strip() for s in text.split(",") if s.strip()}
    if unknown := skip - set(PARTS):
        raise SystemExit(f"--skip: unknown part(s) {', '.join(sorted(unknown))}; "
                         f"parts: {', '.join(PARTS)}")  # fmt: skip
    return skip


def run(args: argparse.Namespace, skip: set[str], t: Path, report: Report) -> None:
    """Every part not skipped, into `report`."""
    n, parts = args.docs, args.partitions
    repo, small = make_source(t / "src", n, DOC_SIZE, parts, reads="rss" not in skip)
    items = 0
    node_pairs: list[tuple[Run, Run]] = []
    if "node" not in skip:
        node_pairs = pairs_of(
            args.pairs,
            lambda k: into_node(lambda uri: restore_cmd(repo, uri), t / f"r{k}", parts, k),
            lambda k: into_node(lambda uri: load_cmd(uri, n), t / f"l{k}", parts, k),
        )
        items = node_pairs[0][0].items
        compare_part(report, "node", f"into a fresh node ({parts} partitions), "
                     f"{plural(args.pairs, 'pair')} in turns: restore beside `upr load` of as "
                     f"many new documents",
                     node_pairs, NODE_RATIO_GOAL)  # fmt: skip
        med = statistics.median(r.rate for r, _ in node_pairs)
        report.line(f"  restore rate: median {med:,.0f} items/s  goal >= {NODE_RATE_GOAL:,} "
                    f"{verdict(med >= NODE_RATE_GOAL)}")  # fmt: skip
        report.key(node_rate_goal=NODE_RATE_GOAL)
        small["restore (node)"] = peak_of(r for r, _ in node_pairs)
        small["load"] = peak_of((ld for _, ld in node_pairs), small["load"])
    if "cluster" not in skip:
        cl_pairs = pairs_of(
            args.pairs,
            lambda k: into_cluster(lambda uri: restore_cmd(repo, uri), t / f"cr{k}", parts, k),
            lambda k: into_cluster(lambda uri: load_cmd(uri, n), t / f"cl{k}", parts, k),
        )
        compare_part(report, "cluster", f"into a fresh cluster (3 nodes, 1 replica, {parts} "
                     f"partitions), {plural(args.pairs, 'pair')} in turns: restore beside "
                     f"`upr load` through the same map", cl_pairs, CLUSTER_RATIO_GOAL)  # fmt: skip
        small["restore (cluster)"] = peak_of(r for r, _ in cl_pairs)
        items = items or cl_pairs[0][0].items
    if "sqlite" not in skip:
        sqlite_part(report, repo, t, args.pairs, small)
    if "rss" not in skip:
        small |= repo_peaks(repo, t)
        if "restore (node)" not in small:  # the node part was skipped: one restore
            say("restore into a fresh node (peak RSS)")
            with fresh_node(t / "rss-node", parts) as node:
                got = timed(restore_cmd(repo, node.uri), [node.proc.pid])
            small["restore (node)"] = (got.client_mb, got.node_mb)
            items = items or got.items
        if "restore (SQLite)" not in small:  # the sqlite part was skipped: one restore
            say("restore into SQLite (peak RSS)")
            got = timed(restore_cmd(repo, f"sqlite:{t / 'rss.db'}"), [])
            (t / "rss.db").unlink(missing_ok=True)
            small["restore (SQLite)"] = (got.client_mb, None)
        large: dict[str, Peak] = {}
        if "large" not in skip:
            large = large_peaks(t / "large", cluster="cluster" not in skip)
            shutil.rmtree(t / "large", ignore_errors=True)
        rss_part(report, small, large, n)
    if "precheck" not in skip:
        say(f"pre-check: a repository of {args.large_partitions} partitions")
        precheck_part(report, [r for r, _ in node_pairs], repo, t / "big", n, parts,
                      args.large_partitions)  # fmt: skip
    report.key(restored_items=items)


def peak_of(runs: Iterable[Run], also: Peak | None = None) -> Peak:
    """The largest client and node peaks of some runs (and of `also`)."""
    got = list(runs)
    clients = [r.client_mb for r in got] + ([also[0]] if also else [])
    nodes = [r.node_mb for r in got if r.node_mb is not None]
    if also and also[1] is not None:
        nodes.append(also[1])
    return max(clients), max(nodes) if nodes else None


def into_node(cmd: Callable[[str], list[str]], where: Path, partitions: int, k: int) -> Run:
    """One command into a fresh node."""
    say(f"pair {k + 1}: {cmd('URI')[3]} into a fresh node")
    with fresh_node(where, partitions) as node:
        return timed(cmd(node.uri), [node.proc.pid])


def into_cluster(cmd: Callable[[str], list[str]], where: Path, partitions: int, k: int) -> Run:
    """One command into a fresh 3-node cluster, through its map."""
    say(f"pair {k + 1}: {cmd('URI')[3]} into a fresh cluster")
    with fresh_cluster(where, partitions) as (uri, pids):
        return timed(cmd(uri), pids)


def sqlite_part(report: Report, repo: Path, t: Path, pairs: int,
                small: dict[str, Peak]) -> None:  # fmt: skip
    """Restore into SQLite beside a bare executemany of the same rows, in turns."""
    say("read the rows of the restored state for the bare executemany")
    rows = repo_rows(repo)

    def restore(k: int) -> Run:
        say(f"pair {k + 1}: restore into SQLite")
        db = t / f"restore-{k}.db"
        try:
            return timed(restore_cmd(repo, f"sqlite:{db}"), [])
        finally:
            db.unlink(missing_ok=True)

    def bare(k: int) -> Run:
        say(f"pair {k + 1}: bare executemany")
        db = t / f"bare-{k}.db"
        try:
            rate = bare_executemany(rows, db)
        finally:
            db.unlink(missing_ok=True)
        return Run(len(rows), len(rows) / rate, rate, 0.0, None, {})

    got = pairs_of(pairs, restore, bare)
    rows.clear()  # the memory back before the next parts
    report.line(f"into SQLite, {plural(pairs, 'pair')} in turns: restore (its own items/s) "
                f"beside one bare executemany of the same rows into the same schema")  # fmt: skip
    shares = []
    for k, (r, b) in enumerate(got, 1):
        shares.append(r.own_rate / b.own_rate)
        report.line(f"  pair {k}: restore {r.items:,} items at {r.own_rate:,.0f} items/s "
                    f"({r.wall:.2f} s with process start); bare {b.own_rate:,.0f} rows/s; "
                    f"share {shares[-1]:.2f}")  # fmt: skip
    report.ratio("sqlite_share", shares, SQLITE_SHARE_GOAL, "restore / bare executemany")
    report.key(sqlite_restore_items_per_s=statistics.median(r.own_rate for r, _ in got),
               sqlite_bare_rows_per_s=statistics.median(b.own_rate for _, b in got))  # fmt: skip
    small["restore (SQLite)"] = peak_of(r for r, _ in got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--pairs", "--runs", type=int, default=3)  # --runs: the older name
    ap.add_argument("--partitions", type=int, default=1024)
    ap.add_argument("--skip", default="", help=f"parts to leave out: {','.join(PARTS)}")
    ap.add_argument("--large-partitions", type=int, default=16)
    args = ap.parse_args()
    skip = parse_skip(args.skip)
    if args.docs < 1 or args.pairs < 1 or args.partitions < 1 or args.large_partitions < 1:
        raise SystemExit("--docs, --pairs, --partitions and --large-partitions are >= 1")
    signal.signal(signal.SIGTERM, on_sigterm)
    commit = git_head()
    report = Report()
    report.key(commit=commit, docs=args.docs, partitions=args.partitions, pairs=args.pairs)
    report.line(f"restore benchmark, commit {commit}, {args.docs:,} documents of ~{DOC_SIZE} "
                f"B, {args.partitions} partitions")  # fmt: skip
    say(f"commit {commit}: {args.docs:,} documents, {args.partitions} partitions, "
        f"{args.pairs} pairs; skipping {','.join(sorted(skip)) or 'nothing'}")  # fmt: skip
    try:
        with tempfile.TemporaryDirectory(prefix="upr-bench-restore-") as tmp:
            run(args, skip, Path(tmp), report)
    except KeyboardInterrupt:
        say("interrupted: nodes stopped, temporary files removed")
        raise SystemExit(130) from None
    print(" ".join(report.keys))


if __name__ == "__main__":
    main()
