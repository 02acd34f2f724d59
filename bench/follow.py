"""`upr backup --follow`: lag behind the node under a steady load, CPU share, peak RSS;
restore, verify and info on a chain of many continuous commits against 10 backups.

Part `lag`. A local `upr serve` (1024 partitions). First a bare `upr load` at full speed
(--bare-docs operations, 30% updates, 10% deletes): the highest rate `upr load` holds
here, and the reference its paced run is held to; the rate asked for is
min(--rate, that rate). Then `upr backup --follow --commit-every C` catches up with what
the bare load left and keeps following, while `upr load --rate R` (same mix) runs for
--seconds. Meanwhile a thread samples the node's high seqnos every 100 ms on one open
connection (STAT vbucket-seqno; a slow node answers less often), each stamped with the
middle of its round trip (the node read its seqnos in between: the error is half the
round trip, printed), and another reads each commit's manifest as soon as it appears
(a rollup removes the commits it absorbs, so they cannot all be read after the run).
After the run, for each sample taken while the load ran: the first commit in chain
order whose partitions' end seqs, carried forward from the commits before, reach every
partition's sampled high seq; its lag is that commit's `finished` minus the sample's time (both this
machine's clock). p50, p99 and max beside the limit (p99 <= C + 1 s). CPU share
(utime + stime from /proc/PID/stat over the load's wall time) and peak RSS (VmHWM) of
the follower, beside the node's and `upr load`'s. --repeats more runs of
--repeat-seconds give the spread.

Part `chain`. A second node; repository A gets a follower with --chain-every (10 ms),
repository B nothing yet. A workload in 10 phases (`upr load --rate --chain-rate`, 30%
updates, 10% deletes, a seed per phase): each phase runs until the follower has reported
k/10 of --commits commits (so the chain gets about --commits commits; its rollups happen
on their own), then stops; once the follower has been quiet for a while (everything
committed), the phase's end time is noted and one ordinary `upr backup` goes into B.
After the last phase the follower runs on until its rollups are done (no commit and no
rollup for 30 s; at 10 ms commits they trail, at an operator's interval they keep pace),
then stops: A is the chain it leaves, and the time it took is printed beside A's
directory count when the load ended. Then, --pairs rounds, A and B in turns (the order
reversed every other round): `upr restore` of the latest state into SQLite, a restore to
the end of phase 5 (A: `--at-time` of that moment when restore has it, else `--at` the
follower's last commit id then; B: `--at` its fifth backup), `upr verify`, `upr info
--json`: the median wall time of each command (process start included) and A/B beside
the limit 2x. The two latest restores must hold the same documents (row count and
content hash, formats/store.md §6), and so must the two mid-point ones. A's layout
(backup directories, manifests, files) shows the rollups.

--skip lag,chain leaves a part out. --workdir DIR works in DIR and keeps it; a chain
built there before (DIR/chain.json) is restored again rather than rebuilt.

Usage: python bench/follow.py [--seconds 60] [--rate 20000] [--commit-every 2]
    [--repeats 3] [--repeat-seconds 30] [--commits 10000] [--chain-every 0.01]
    [--chain-rate 400] [--pairs 3] [--skip lag,chain] [--workdir DIR]
Last line: rate_asked=… bare_load_ops_per_s=… load_ops_per_s=… lag_p50_s=… lag_p99_s=…
lag_max_s=… lag_limit_s=… lag_met=yes|no follower_cpu=… follower_rss_mb=… node_cpu=…
load_cpu=… … chain_commits=… restore_ratio=… mid_ratio=… verify_ratio=… info_ratio=…
ratio_met=yes|no same_latest=yes|no same_mid=yes|no
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _node import UPR, BenchNode, CommandFailed, run_measured, say, stop_process

MIX = ["--update-ratio", "0.3", "--delete-ratio", "0.1"]
RATIO_LIMIT = 2.0
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a running process (None when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def hwm_mb(pid: int) -> float | None:
    """VmHWM in MB (None when the process is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def parse_time(text: str) -> float:
    """Seconds since the epoch of a manifest time (RFC 3339, Z)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values, nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


# -- a follower and what it reports -------------------------------------------------------


class Follower:
    """`upr backup --follow` as a child; its stderr read by a thread, each commit line
    ("upr: commit ID: …") stamped with the time it arrived."""

    def __init__(self, uri: str, repo: Path, every: str) -> None:
        self.proc = subprocess.Popen(
            [*UPR, "backup", uri, "--repo", str(repo), "--follow", "--commit-every", every,
             "--json", "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.commits: list[tuple[float, str]] = []
        self.rollups: list[float] = []  # when each "upr: rolled up …" line arrived
        self.other: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.startswith("upr: commit "):
                self.commits.append((time.time(), line.split()[2].rstrip(":")))
            elif line.startswith("upr: rolled up "):
                self.rollups.append(time.time())
            else:
                self.other.append(line.rstrip())

    def last_commit_at(self) -> float:
        return self.commits[-1][0] if self.commits else 0.0

    def last_rollup_at(self) -> float:
        return self.rollups[-1] if self.rollups else 0.0

    def stop(self) -> dict[str, Any]:
        """SIGTERM (commits what it holds, exits 0); its JSON summary."""
        stop_process(self.proc, 120)
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        self._reader.join(10)
        if self.proc.returncode != 0:
            raise SystemExit(f"the follower exited {self.proc.returncode}: "
                             f"{' | '.join(self.other[-5:])}")  # fmt: skip
        return dict(json.loads(out))


@dataclass
class Commit:
    """One manifest read as it appeared: its id, `finished` (epoch s), end seqs."""

    backup_id: str
    finished: float
    ends: dict[int, int]
    continuous: bool


class ManifestWatcher:
    """Reads every new backup directory's manifest.json under the bucket directory,
    every 50 ms, before a rollup can remove it. Revisions (rollups) are not commits."""

    def __init__(self, bucket_dir: Path) -> None:
        self.dir = bucket_dir
        self.seen: dict[str, Commit] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _scan(self) -> None:
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dir):
                if name in self.seen or not name[:1].isdigit() or "-r" in name:
                    continue
                try:
                    m = json.loads((self.dir / name / "manifest.json").read_text())
                except (OSError, ValueError):
                    continue
                ends = {int(p["partition"]): int(p["end_seq"]) for p in m["partitions"]}
                self.seen[name] = Commit(name, parse_time(m["finished"]), ends,
                                         "continuous" in m)  # fmt: skip

    def _run(self) -> None:
        while not self._stop.is_set():
            self._scan()
            self._stop.wait(0.05)

    def stop(self) -> list[Commit]:
        self._stop.set()
        self._thread.join(10)
        self._scan()
        return sorted(self.seen.values(), key=lambda c: c.backup_id)


class Sampler:
    """The node's high seqnos every `period` s on one connection (own event loop, own
    thread), and /proc readings of the given processes at each sample."""

    def __init__(self, uri: str, pids: dict[str, int], period: float = 0.1) -> None:
        self.uri, self.pids, self.period = uri, pids, period
        self.samples: list[tuple[float, dict[int, int]]] = []
        self.rtts: list[float] = []  # each STAT's round trip: the samples' time error
        self.procs: list[tuple[float, dict[str, tuple[float | None, float | None]]]] = []
        self._stop = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from upr_cli.errors import UprError

        try:
            asyncio.run(self._loop())
        except (OSError, UprError, KeyError, ValueError) as exc:  # reported by stop()
            self._error = exc

    async def _loop(self) -> None:
        from upr_cli.net.bootstrap import connect
        from upr_cli.net.uri import SourceUri

        s = await connect(SourceUri.parse(self.uri))
        try:
            nxt = time.monotonic()
            while not self._stop.is_set():
                sent = time.time()
                st = await s.conn.stats("vbucket-seqno")
                t = (sent + time.time()) / 2  # the node read its seqnos in between
                self.rtts.append(2 * (t - sent))
                highs = {int(k[3:].split(":")[0]): int(v) for k, v in st.items()
                         if k.endswith(":high_seqno")}  # fmt: skip
                self.samples.append((t, highs))
                self.procs.append((time.time(), {n: (cpu_seconds(p), hwm_mb(p))
                                                 for n, p in self.pids.items()}))  # fmt: skip
                nxt += self.period
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))
        finally:
            await s.conn.aclose()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if self._error is not None:
            raise SystemExit(f"the seqno sampler failed: {self._error!r}")


def lags(samples: list[tuple[float, dict[int, int]]], chain: list[Commit]
         ) -> tuple[list[float], int]:  # fmt: skip
    """(lag of each sample reached by a commit, samples no commit reached)."""
    per: dict[int, tuple[list[int], list[int]]] = {}  # partition: (cumulative ends, index)
    for i, c in enumerate(chain):
        for p, end in c.ends.items():
            ends, idx = per.setdefault(p, ([], []))
            if not ends or end > ends[-1]:
                ends.append(end)
                idx.append(i)
    out: list[float] = []
    unreached = 0
    for t, highs in samples:
        first = 0
        for p, high in highs.items():
            if high == 0:
                continue
            ends, idx = per.get(p, ([], []))
            k = bisect_left(ends, high)
            if k == len(ends):
                first = -1
                break
            first = max(first, idx[k])
        if first < 0:
            unreached += 1
        else:
            out.append(max(0.0, chain[first].finished - t))
    return out, unreached


# -- part lag ----------------------------------------------------------------------------


def bare_load(uri: str, docs: int) -> float:
    """ops/s of `upr load` at full speed (the mix), no follower."""
    _s, _rss, out = run_measured([*UPR, "load", uri, "--docs", str(docs), *MIX, "--seed", "1",
                                  "--json", "--no-progress"])  # fmt: skip
    return float(json.loads(out)["items_per_s"])


def lag_run(tmp: Path, tag: str, seconds: int, rate: int, every: float,
            bare_docs: int) -> dict[str, float]:  # fmt: skip
    """One run of the lag part on a fresh node (module docstring)."""
    node = BenchNode(tmp / f"{tag}-node", 1024)
    repo = tmp / f"{tag}-repo"
    res: dict[str, float] = {}
    procs_: list[subprocess.Popen[Any]] = []
    try:
        say(f"{tag}: bare upr load of {bare_docs:,} operations at full speed")
        res["bare"] = bare_load(node.uri, bare_docs)
        asked = min(rate, int(res["bare"]))
        res["asked"] = asked
        node.wait_persisted()
        follower = Follower(node.uri, repo, f"{int(every * 1000)}ms")
        procs_.append(follower.proc)
        deadline = time.monotonic() + 300
        while not any((d / "manifest.json").exists() for d in (repo / "default").glob("2*")):
            if follower.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the follower did not catch up: {follower.other[-5:]}")
            time.sleep(0.1)
        time.sleep(1.0)  # the session's streams open
        watcher = ManifestWatcher(repo / "default")
        say(f"{tag}: caught up; upr load --rate {asked:,} for {seconds} s, follower "
            f"--commit-every {every:g}s")  # fmt: skip
        load = subprocess.Popen([*UPR, "load", node.uri, "--docs", str(asked * seconds), *MIX,
                                 "--rate", str(asked), "--seed", "2", "--prefix", "lag",
                                 "--no-progress"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        procs_.append(load)
        pids = {"follower": follower.proc.pid, "node": node.proc.pid, "load": load.pid}
        sampler = Sampler(node.uri, pids)
        t0 = time.time()
        pid, status, usage = os.wait4(load.pid, os.WNOHANG)
        while pid == 0 and time.time() - t0 < seconds:
            time.sleep(0.05)
            pid, status, usage = os.wait4(load.pid, os.WNOHANG)
        if pid == 0:  # it did not hold the rate: the window ends at --seconds
            load.send_signal(signal.SIGINT)
            _pid, status, usage = os.wait4(load.pid, 0)
        t1 = time.time()
        load.returncode = os.waitstatus_to_exitcode(status)
        time.sleep(every + 2.0)  # the last samples' commits
        sampler.stop()
        summary = follower.stop()
        chain = watcher.stop()
    finally:
        for proc in procs_:
            if proc.returncode is None and proc.poll() is None:
                stop_process(proc, 10)
        node.stop()
    window = [(t, h) for t, h in sampler.samples if t0 <= t <= t1]
    got_lags, unreached = lags(window, chain)
    if not got_lags:
        raise SystemExit(f"{tag}: no sample was reached by a commit")
    procs = [(t, r) for t, r in sampler.procs if t0 <= t <= t1 + 0.2]
    (ta, first), (tb, last) = procs[0], procs[-1]
    for name in ("follower", "node"):
        a, b = first[name][0], last[name][0]
        res[f"{name}_cpu"] = (b - a) / (tb - ta) if a is not None and b is not None else 0.0
        res[f"{name}_rss"] = max((r[name][1] or 0.0) for _t, r in sampler.procs)
    res["load_cpu"] = (usage.ru_utime + usage.ru_stime) / (t1 - t0)
    res["load_rss"] = max((r["load"][1] or 0.0) for _t, r in sampler.procs)
    ops = sum(window[-1][1].values()) - sum(window[0][1].values())
    res |= {"load_rate": ops / (window[-1][0] - window[0][0]), "items": float(ops),
            "p50": pct(got_lags, 0.5), "p99": pct(got_lags, 0.99), "max": max(got_lags),
            "samples": len(got_lags), "unreached": unreached,
            "commits": float(summary["commits"]),
            "rollups": float(summary.get("rollups", 0)),
            "seen": float(sum(c.continuous for c in chain)),
            "seconds": t1 - t0, "rtt": statistics.median(sampler.rtts)}  # fmt: skip
    say(f"{tag}: load {res['load_rate']:,.0f} ops/s, lag p50 {res['p50']:.2f} s p99 "
        f"{res['p99']:.2f} s max {res['max']:.2f} s, {int(res['commits'])} commits, "
        f"{int(res['rollups'])} rollups")  # fmt: skip
    return res


def lag_part(args: argparse.Namespace, tmp: Path, keys: dict[str, object]) -> None:
    main = lag_run(tmp, "lag", args.seconds, args.rate, args.commit_every, args.bare_docs)
    reps = [
        lag_run(tmp, f"lag{k + 1}", args.repeat_seconds, int(main["asked"]),
                args.commit_every, args.bare_docs // 4)
        for k in range(args.repeats)
    ]  # fmt: skip
    limit = args.commit_every + 1.0
    print(f"lag: upr load at full speed (bare, no follower, {args.bare_docs:,} ops, 30% "
          f"updates, 10% deletes): {main['bare']:,.0f} ops/s; rate asked "
          f"{int(main['asked']):,} ops/s (goal 20,000)")  # fmt: skip
    print(f"  paced load with the follower: {main['load_rate']:,.0f} ops/s for "
          f"{main['seconds']:.0f} s ({int(main['items']):,} ops), follower --commit-every "
          f"{args.commit_every:g}s: {int(main['commits'])} commits "
          f"({int(main['seen'])} read as they appeared), {int(main['rollups'])} "
          "rollups")  # fmt: skip
    print(f"  lag behind the node ({int(main['samples'])} samples, one every 100 ms or "
          f"one STAT round trip, median {main['rtt']:.2f} s: each stamped at its middle, "
          f"+-{main['rtt'] / 2:.2f} s; {int(main['unreached'])} unreached): p50 "
          f"{main['p50']:.2f} s, p99 {main['p99']:.2f} s, max {main['max']:.2f} s; "
          f"limit p99 <= {limit:g} s: "
          f"{'met' if main['p99'] <= limit else 'MISSED'}")  # fmt: skip
    for name in ("follower", "node", "load"):
        print(f"  {name:8} CPU {main[f'{name}_cpu']:.0%} of a core, peak RSS "
              f"{main[f'{name}_rss']:.0f} MB")  # fmt: skip
    if reps:

        def spread(k: str) -> str:
            v = [r[k] for r in reps]
            return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"

        print(f"  {len(reps)} more runs of {args.repeat_seconds} s, median (spread): "
              f"load {spread('load_rate')} ops/s, p50 {spread('p50')} s, p99 "
              f"{spread('p99')} s, max {spread('max')} s, follower CPU "
              f"{spread('follower_cpu')}, RSS {spread('follower_rss')} MB")  # fmt: skip
    keys |= {
        "rate_asked": int(main["asked"]),
        "bare_load_ops_per_s": round(main["bare"]),
        "load_ops_per_s": round(main["load_rate"]),
        "commit_every_s": args.commit_every,
        "lag_p50_s": round(main["p50"], 2),
        "lag_p99_s": round(main["p99"], 2),
        "lag_max_s": round(main["max"], 2),
        "stat_rtt_s": round(main["rtt"], 2),
        "lag_limit_s": limit,
        "lag_met": "yes" if main["p99"] <= limit else "no",
        "rollups": int(main["rollups"]),
        "follower_cpu": round(main["follower_cpu"], 2),
        "follower_rss_mb": round(main["follower_rss"]),
        "node_cpu": round(main["node_cpu"], 2),
        "node_rss_mb": round(main["node_rss"]),
        "load_cpu": round(main["load_cpu"], 2),
        "load_rss_mb": round(main["load_rss"]),
    }
    if reps:
        keys |= {
            "repeats": len(reps),
            "rep_p99_s": ",".join(f"{r['p99']:.2f}" for r in reps),
            "rep_p50_s": ",".join(f"{r['p50']:.2f}" for r in reps),
            "rep_load_ops_per_s": ",".join(f"{r['load_rate']:.0f}" for r in reps),
        }


# -- part chain --------------------------------------------------------------------------


@dataclass
class Chain:
    a: Path
    b: Path
    mid_time: str = ""
    mid_commit: str = ""
    b_ids: list[str] = field(default_factory=list)
    commits: int = 0
    ops: int = 0
    seconds: float = 0.0
    rollups: int = 0
    dirs_at_end: int = 0  # A's backup directories when the last phase ended
    settle_seconds: float = 0.0  # then until the follower's rollups were done
    warnings: list[str] = field(default_factory=list)


def quiet(f: Follower, secs: float, timeout: float = 300.0, *, rollups: bool = False) -> None:
    """Wait until the follower has reported no commit (nor, with `rollups`, a rollup)
    for `secs` seconds."""
    deadline = time.monotonic() + timeout
    while time.time() - max(f.last_commit_at(), f.last_rollup_at() if rollups else 0) < secs:
        if time.monotonic() > deadline or f.proc.poll() is not None:
            raise SystemExit(f"the follower did not go quiet: {f.other[-5:]}")
        time.sleep(0.1)


def build_chain(args: argparse.Namespace, tmp: Path) -> Chain:
    """The node, the 10 phases, follower into A, a backup into B after each."""
    ch = Chain(tmp / "A", tmp / "B")
    node = BenchNode(tmp / "chain-node", 1024)
    f: Follower | None = None
    load: subprocess.Popen[bytes] | None = None
    try:
        f = Follower(node.uri, ch.a, f"{int(args.chain_every * 1000)}ms")
        deadline = time.monotonic() + 120
        while not any((d / "manifest.json").exists() for d in (ch.a / "default").glob("2*")):
            if f.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the follower did not start: {f.other[-5:]}")
            time.sleep(0.1)
        time.sleep(1.0)
        t0 = time.monotonic()
        for k in range(1, 11):
            target = args.commits * k // 10
            load = subprocess.Popen([*UPR, "load", node.uri, "--docs", "100000000", *MIX,
                                     "--rate", str(args.chain_rate), "--seed", str(k),
                                     "--no-progress"],
                                    stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)  # fmt: skip
            while len(f.commits) < target:
                if load.poll() is not None or f.proc.poll() is not None:
                    raise SystemExit(f"phase {k}: the load or the follower ended early")
                time.sleep(0.05)
            load.send_signal(signal.SIGINT)
            load.communicate(timeout=60)
            quiet(f, 2.0)
            now = datetime.now(UTC)
            if k == 5:
                ch.mid_time = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                ch.mid_commit = f.commits[-1][1]
            _s, _r, bout = run_measured([*UPR, "backup", node.uri, "--repo", str(ch.b),
                                         "--json", "--no-progress"])  # fmt: skip
            ch.b_ids.append(json.loads(bout)["backup_id"])
            say(f"chain: phase {k}: {len(f.commits)} commits, backup {ch.b_ids[-1]} into B")
            time.sleep(0.05)
        ch.seconds = time.monotonic() - t0
        # the chain as the follower leaves it once its rollups are done: at a commit
        # interval an operator would use they keep pace; at 10 ms they trail the commits
        ch.dirs_at_end = layout(ch.a)[0]
        t1 = time.monotonic()
        quiet(f, 30.0, 1800.0, rollups=True)
        # the rollups were done when the last rollup (or commit) was said
        ch.settle_seconds = max(0.0, max(f.last_commit_at(), f.last_rollup_at())
                                - (time.time() - (time.monotonic() - t1)))  # fmt: skip
        summary = f.stop()
        ch.commits = int(summary["commits"])
        ch.rollups = int(summary["rollups"])
        ch.warnings = list(summary["warnings"])
        ch.ops = high_sum(node.uri)
    finally:
        for proc in (load, f and f.proc):
            if proc is not None:
                stop_process(proc, 10)  # type: ignore[arg-type]
        node.stop()
    return ch


def high_sum(uri: str) -> int:
    """The sum of the node's high seqnos: every write it took."""
    from upr_cli.net.bootstrap import connect
    from upr_cli.net.uri import SourceUri

    async def read() -> int:
        s = await connect(SourceUri.parse(uri))
        try:
            st = await s.conn.stats("vbucket-seqno")
        finally:
            await s.conn.aclose()
        return sum(int(v) for k, v in st.items() if k.endswith(":high_seqno"))

    return asyncio.run(read())


def surviving(repo: Path, at: str) -> str:
    """`at` when its backup directory is still there, else the newest backup id below
    it that is (a rollup absorbed it: the nearest state an id still names)."""
    ids = sorted({d.name.split("-r")[0] for d in (repo / "default").iterdir()
                  if (d / "manifest.json").exists()})  # fmt: skip
    return max((i for i in ids if i <= at), default=ids[0])


def layout(repo: Path) -> tuple[int, int, int]:
    """(backup directories, manifests, files) under the repository's bucket."""
    dirs = [d for d in (repo / "default").iterdir() if d.is_dir() and d.name[:1].isdigit()]
    files = sum(1 for d in dirs for x in d.rglob("*") if x.is_file())
    return len(dirs), sum((d / "manifest.json").exists() for d in dirs), files


def store_of(db: Path) -> tuple[int, str]:
    """(documents, content hash) of a SQLite store."""
    from upr_cli.store import Store

    with Store(db) as s:
        return s.count(), s.content_hash()


def timed(cmd: list[str]) -> float:
    secs, _rss, _out = run_measured(cmd, discard=True)
    return secs


def chain_part(args: argparse.Namespace, tmp: Path, keys: dict[str, object]) -> None:
    say(f"chain: {args.commits:,} commits at --commit-every {args.chain_every:g}s, load "
        f"--rate {args.chain_rate}, 10 phases")  # fmt: skip
    saved = tmp / "chain.json"
    if saved.exists():  # --workdir of an earlier run: its repositories, restored again
        got = json.loads(saved.read_text())
        ch = Chain(Path(got.pop("a")), Path(got.pop("b")), **got)
        say(f"chain: reusing {ch.a} and {ch.b} ({ch.commits:,} commits)")
    else:
        ch = build_chain(args, tmp)
        saved.write_text(json.dumps({**vars(ch), "a": str(ch.a), "b": str(ch.b)}))
    mid_a = ["--at-time", ch.mid_time]
    try:
        run_measured([*UPR, "restore", "--repo", str(ch.a), *mid_a, "--dry-run",
                      "sqlite:" + str(tmp / "probe.db")], discard=True)  # fmt: skip
    except CommandFailed as exc:
        say(f"restore --at-time refused ({exc.last_line}): A's mid-point is --at "
            f"{ch.mid_commit}")  # fmt: skip
        mid_a = ["--at", surviving(ch.a, ch.mid_commit)]
        if mid_a[1] != ch.mid_commit:
            say(f"{ch.mid_commit} was rolled up: A's mid-point is the nearest older id, "
                f"{mid_a[1]} (not the same state as B's)")  # fmt: skip
    mid = {"A": mid_a, "B": ["--at", ch.b_ids[4]]}
    repos = {"A": ch.a, "B": ch.b}
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.pairs):
        for x in "AB" if r % 2 == 0 else "BA":
            repo = str(repos[x])
            for db in (f"{x}-latest-{r}.db", f"{x}-mid-{r}.db"):
                (tmp / db).unlink(missing_ok=True)
            runs = {
                "restore": [*UPR, "restore", "--repo", repo, "--no-progress",
                            "sqlite:" + str(tmp / f"{x}-latest-{r}.db")],
                "mid": [*UPR, "restore", "--repo", repo, *mid[x], "--no-progress",
                        "sqlite:" + str(tmp / f"{x}-mid-{r}.db")],
                "verify": [*UPR, "verify", "--repo", repo, "--no-progress"],
                "info": [*UPR, "info", "--repo", repo, "--json"],
            }  # fmt: skip
            for what, cmd in runs.items():
                times.setdefault((x, what), []).append(timed(cmd))
        say(f"chain: round {r + 1}: " + ", ".join(
            f"{w} {times['A', w][-1]:.2f}/{times['B', w][-1]:.2f} s"
            for w in ("restore", "mid", "verify", "info")))  # fmt: skip
    latest = {x: store_of(tmp / f"{x}-latest-0.db") for x in "AB"}
    mids = {x: store_of(tmp / f"{x}-mid-0.db") for x in "AB"}
    same_latest, same_mid = latest["A"] == latest["B"], mids["A"] == mids["B"]
    lay = layout(ch.a), layout(ch.b)
    print(
        f"chain: {ch.commits:,} commits into A (--commit-every {args.chain_every:g}s) "
        f"over {ch.seconds:.0f} s, {ch.ops:,} ops in 10 phases; B: 10 backups"
    )
    print(f"  A's layout: {lay[0][0]} backup directories, {lay[0][1]} manifests, "
          f"{lay[0][2]} files; B's: {lay[1][0]}, {lay[1][1]}, {lay[1][2]}")  # fmt: skip
    print(f"  A's rollups: {ch.rollups:,}; {ch.dirs_at_end} directories when the load "
          f"ended, done {ch.settle_seconds:.0f} s later; follower warnings: "
          f"{len(ch.warnings)}{' (' + ch.warnings[0] + ')' if ch.warnings else ''}")  # fmt: skip
    print(f"  mid-point: A {' '.join(mid_a)}, B --at {ch.b_ids[4]}")
    ratios: dict[str, float] = {}
    for w in ("restore", "mid", "verify", "info"):
        a, b = times["A", w], times["B", w]
        rs = [x / y for x, y in zip(a, b, strict=True)]
        ratios[w] = statistics.median(rs)
        print(f"  {w:8} A {statistics.median(a):6.2f} s  B {statistics.median(b):6.2f} s  "
              f"A/B {ratios[w]:.2f} ({min(rs):.2f}-{max(rs):.2f}); limit {RATIO_LIMIT:g}x: "
              f"{'met' if ratios[w] <= RATIO_LIMIT else 'MISSED'}")  # fmt: skip
    print(
        f"  latest restores: A {latest['A'][0]:,} docs {latest['A'][1][:12]}, B "
        f"{latest['B'][0]:,} {latest['B'][1][:12]}: {'same' if same_latest else 'DIFFER'}"
    )
    print(
        f"  mid-point restores: A {mids['A'][0]:,} docs {mids['A'][1][:12]}, B "
        f"{mids['B'][0]:,} {mids['B'][1][:12]}: {'same' if same_mid else 'DIFFER'}"
    )
    keys |= {"chain_commits": ch.commits, "chain_ops": ch.ops, "pairs": args.pairs,
             "rollups": ch.rollups, "dirs_at_end": ch.dirs_at_end,
             "settle_s": round(ch.settle_seconds), "warnings": len(ch.warnings),
             "a_dirs": lay[0][0], "a_manifests": lay[0][1], "a_files": lay[0][2],
             **{f"{w}_a_s": round(statistics.median(times['A', w]), 2) for w in ratios},
             **{f"{w}_b_s": round(statistics.median(times['B', w]), 2) for w in ratios},
             **{f"{w}_ratio": round(v, 2) for w, v in ratios.items()},
             "ratio_met": "yes" if max(ratios.values()) <= RATIO_LIMIT else "no",
             "same_latest": "yes" if same_latest else "no",
             "same_mid": "yes" if same_mid else "no",
             "mid_by": "time" if mid_a[0] == "--at-time" else "id"}  # fmt: skip


def git_head() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse",
                               "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--rate", type=int, default=20_000)
    ap.add_argument("--commit-every", type=float, default=2.0)
    ap.add_argument("--bare-docs", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repeat-seconds", type=int, default=30)
    ap.add_argument("--commits", type=int, default=10_000)
    ap.add_argument("--chain-every", type=float, default=0.01)
    ap.add_argument("--chain-rate", type=int, default=400)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--skip", default="", help="parts to leave out: lag,chain")
    ap.add_argument("--workdir", help="kept, not a temporary directory; a chain built "
                    "there earlier (chain.json) is restored again, not rebuilt")  # fmt: skip
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    if skip - {"lag", "chain"}:
        raise SystemExit(f"--skip takes lag,chain, not {','.join(skip - {'lag', 'chain'})}")
    if min(args.seconds, args.rate, args.bare_docs, args.commits, args.pairs) < 1:
        raise SystemExit("--seconds, --rate, --bare-docs, --commits and --pairs are >= 1")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    keys: dict[str, object] = {"commit": git_head()}
    print(f"follow benchmark, commit {keys['commit']}, 1024 partitions, {os.cpu_count()} "
          f"cores, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    try:
        with contextlib.ExitStack() as stack:
            if args.workdir:
                tmp = str(Path(args.workdir).resolve())
                Path(tmp).mkdir(parents=True, exist_ok=True)
            else:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="upr-bench-follow-"))
            if "lag" not in skip:
                lag_part(args, Path(tmp), keys)
            if "chain" not in skip:
                chain_part(args, Path(tmp), keys)
    except KeyboardInterrupt:
        say("interrupted: nodes stopped, temporary files removed")
        raise SystemExit(130) from None
    print(" ".join(f"{k}={v}" for k, v in keys.items()))


if __name__ == "__main__":
    main()
