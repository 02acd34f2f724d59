"""Run a benchmark on two commits in turns and print the ratios head/base.

Every change to a hot path is checked against the commit before it on the same machine
in the same run: a single rate on this noisy machine orients, a ratio of runs taken in
turns decides.

Each commit is checked out with `git worktree add --detach` under bench/out/ (ignored by
git), byte-compiled once, and run as `python -m upr_cli` with PYTHONPATH and the working
directory set to that worktree; the script checks that `upr_cli` resolves into it. Runs
go in pairs, base then head, then head then base, and so on, so that a machine that
slows down or speeds up during the run weighs on both sides alike. Each run starts a
node (`upr serve`, loopback, a free port, 1024 partitions), loads --docs documents
with `upr load`, waits until they are persisted, then times each benchmark:

* `drain`: `upr tail --until-end --format json > /dev/null`, end to end (process start
  included, as bench/tail.py measures it), items/s;
* `library`: `DcpConsumer` alone drains the node (as bench/tail.py's library figure),
  items/s; skipped with a message when the consumer's constructor refuses the call on
  either commit;
* `replay`: `upr replay` from the node into a new SQLite file, items/s as its own
  summary counts them (as bench/replay.py);
* `backup`: `upr backup` of the node into a new repository, end to end (process start
  included), items/s;
* `decode`: the codec alone, no node: --docs mutations of 150-200 B values in 1024
  partitions encoded once, then decoded by `FrameDecoder.read_rows` in 256 KiB reads
  (as bench/codec.py), best of three, frames/s.

The node runs the client's commit (`--node same`, the default), or always the base's or
the head's (`--node base|head`), to tell a client-side cost from a node-side one. The
documents are loaded with the node's commit. Worktrees and nodes are removed at the
end, also after Ctrl-C. Only commits are compared: uncommitted changes are not in any
worktree.

Usage: python bench/compare.py --base bbd2930 --head HEAD --bench drain,replay --pairs 3
       [--docs 300000] [--node same|base|head]
Last line: base=… head=… node=… docs=… pairs=… drain_ratio=… drain_ratio_min=… …
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# No sys.path entry for this checkout: the child modes below must import upr_cli from
# the worktree named in PYTHONPATH, never from the repository this script lives in.
ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
BENCHES = ("drain", "library", "replay", "backup", "decode")
PARTITIONS = 1024


@dataclass
class Tree:
    """One commit checked out in a worktree of its own."""

    label: str  # "base" or "head"
    rev: str
    sha: str
    path: Path

    @property
    def short(self) -> str:
        """The commit's first 7 hex digits."""
        return self.sha[:7]

    def env(self) -> dict[str, str]:
        """The environment of a process that runs this commit's code."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["PYTHONPATH"] = str(self.path)
        return env

    def run(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        """`upr ARGS` from this commit, to its end; a failure stops the comparison."""
        out: subprocess.CompletedProcess[str] = subprocess.run(
            self.upr(*args), cwd=self.path, env=self.env(), text=True, **kw
        )
        if out.returncode != 0:
            raise SystemExit(f"{self.label}: upr {args[0]} exited {out.returncode}: "
                             f"{(out.stderr or '').strip()[-2000:]}")  # fmt: skip
        return out

    @staticmethod
    def upr(*args: str) -> list[str]:
        """A `upr` command line in this interpreter."""
        return [sys.executable, "-m", "upr_cli", *args]

    def child(self, *args: str) -> dict[str, object]:
        """Run this script's child mode with this commit's code; its JSON answer."""
        out = subprocess.run([sys.executable, __file__, "--child", *args, "--tree",
                              str(self.path)], cwd=self.path, env=self.env(), text=True,
                             capture_output=True)  # fmt: skip
        if out.returncode != 0:
            raise SystemExit(f"{self.label}: child {args[0]} exited {out.returncode}: "
                             f"{out.stderr.strip()[-2000:]}")  # fmt: skip
        answer: dict[str, object] = json.loads(out.stdout)
        return answer


def git(*args: str) -> str:
    """`git ARGS` in this repository; its stdout, stripped."""
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.strip()


def add_tree(label: str, rev: str, where: Path) -> Tree:
    """Check `rev` out under `where`, byte-compile it and check that imports resolve there."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = where / label
    git("worktree", "add", "--detach", str(path), sha)
    tree = Tree(label, rev, sha, path)
    # compiled once here, so that no run pays for it inside a timed process start
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(path / "upr_cli")],
                   check=True, capture_output=True)  # fmt: skip
    # the same interpreter, cwd and environment as every `python -m upr_cli` of this tree
    out = subprocess.run([sys.executable, "-c", "import upr_cli; print(upr_cli.__file__)"],
                         cwd=path, env=tree.env(), text=True, check=True,
                         capture_output=True)  # fmt: skip
    found = Path(out.stdout.strip()).resolve()
    if not found.is_relative_to(path.resolve()):
        raise SystemExit(f"{label}: upr_cli resolves to {found}, not into {path}")
    print(f"{label}: {rev} = {tree.short} in {path.relative_to(ROOT)} "
          f"(upr_cli from {found.relative_to(ROOT)})")  # fmt: skip
    return tree


def remove_tree(path: Path) -> None:
    """Remove a worktree and its directory; never raises."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                   capture_output=True)  # fmt: skip
    shutil.rmtree(path, ignore_errors=True)


class Node:
    """A `upr serve` child process of one commit, on loopback and a free port."""

    def __init__(self, tree: Tree, data: Path) -> None:
        self.log = data.with_suffix(".log")
        data.mkdir(parents=True)
        helptext = subprocess.run(
            tree.upr("serve", "--help"),
            cwd=tree.path,
            env=tree.env() | {"COLUMNS": "200"},
            capture_output=True,
            text=True,
        ).stdout
        flag = "--num-partitions" if "--num-partitions" in helptext else "--partitions"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                tree.upr("serve", "--data", str(data), "--host", "127.0.0.1", "--port", "0",
                         "--no-auth", flag, str(PARTITIONS)),
                cwd=tree.path, env=tree.env(), stdout=subprocess.PIPE, stderr=log, text=True,
            )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening "):
            self.stop()
            raise SystemExit(f"upr serve ({tree.label}) did not start: {self.log.read_text()}")
        self.uri = line.split()[1]
        host = urlsplit(self.uri).hostname or ""
        if not ipaddress.ip_address(host).is_loopback:
            self.stop()
            raise SystemExit(f"the node listens on {host}, not on loopback")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Run:
    """One run: one client commit, its node, its rates by benchmark."""

    client: Tree
    node: Tree
    rates: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def measure(run: Run, benches: list[str], docs: int, scratch: Path) -> None:
    """Start a node, load it, time each benchmark with the client's commit; stop it."""
    node = Node(run.node, scratch / "node")
    try:
        t = time.perf_counter()
        run.node.run("load", node.uri, "--docs", str(docs), "--json", capture_output=True)
        loaded = time.perf_counter() - t
        run.node.child("wait", node.uri)
        print(f"    loaded {docs:,} documents in {loaded:.1f}s, persisted", flush=True)
        for bench in benches:
            if bench == "drain":
                with open(os.devnull, "w") as devnull:
                    t = time.perf_counter()
                    run.client.run("tail", node.uri, "--until-end", "--format", "json",
                                   stdout=devnull)  # fmt: skip
                    run.rates[bench] = docs / (time.perf_counter() - t)
            elif bench == "library":
                answer = run.client.child("library", node.uri)
                if "skip" in answer:
                    run.skipped[bench] = str(answer["skip"])
                    continue
                items = int(str(answer["items"]))
                if items != docs:
                    print(f"    library: {items:,} records counted, not {docs:,}")
                run.rates[bench] = items / float(str(answer["seconds"]))
            elif bench == "backup":
                t = time.perf_counter()
                run.client.run("backup", node.uri, "--repo", str(scratch / "repo"), "--json",
                               capture_output=True)  # fmt: skip
                run.rates[bench] = docs / (time.perf_counter() - t)
            elif bench == "decode":
                answer = run.client.child("decode", str(docs))
                run.rates[bench] = float(str(answer["frames_per_s"]))
            else:
                db = scratch / "replay.db"
                out = run.client.run("replay", node.uri, "--into", str(db), "--json",
                                     capture_output=True)  # fmt: skip
                summary = json.loads(out.stdout)
                if summary["applied"] != docs:
                    print(f"    replay: {summary['applied']:,} applied, not {docs:,}")
                run.rates[bench] = summary["applied"] / summary["seconds"]
    finally:
        node.stop()


def order(pairs: int) -> list[str]:
    """base head, head base, base head, …: drift during the run falls on both sides."""
    return [side for i in range(pairs) for side in (("base", "head"), ("head", "base"))[i % 2]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the commit before (any git revision; required)")
    ap.add_argument("--head", default="HEAD", help="the commit checked (default HEAD)")
    ap.add_argument(
        "--bench",
        default="drain,replay",
        help=f"comma-separated, of {', '.join(BENCHES)} (default drain,replay)",
    )
    ap.add_argument("--pairs", type=int, default=3, help="base/head pairs (default 3)")
    ap.add_argument("--docs", type=int, default=300_000, help="documents loaded per run")
    ap.add_argument(
        "--node",
        choices=["same", "base", "head"],
        default="same",
        help="which commit runs the node: the client's (default), base or head",
    )
    ap.add_argument("--child", nargs=2, metavar=("MODE", "URI"), help=argparse.SUPPRESS)
    ap.add_argument("--tree", type=Path, help=argparse.SUPPRESS)  # fmt: skip
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.tree)
        return
    benches = [b.strip() for b in args.bench.split(",") if b.strip()]
    if not args.base:
        ap.error("--base is required")
    if not benches or any(b not in BENCHES for b in benches) or args.pairs < 1:
        ap.error(f"--bench takes {', '.join(BENCHES)}; --pairs at least 1")
    where = OUT / f"compare-{os.getpid()}"
    where.mkdir(parents=True)
    # SIGTERM as Ctrl-C: the same cleanup
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    trees: dict[str, Tree] = {}
    try:
        for label, rev in (("base", args.base), ("head", args.head)):
            trees[label] = add_tree(label, rev, where)
        runs = compare(trees, benches, args, where)
    except KeyboardInterrupt:
        print("interrupted: worktrees and nodes removed", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        # a second Ctrl-C must not leave a worktree half removed
        held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        for tree in trees.values():
            remove_tree(tree.path)
        shutil.rmtree(where, ignore_errors=True)
        git("worktree", "prune")
        for s, handler in held.items():
            signal.signal(s, handler)
    report(trees, runs, benches, args)


def compare(trees: dict[str, Tree], benches: list[str], args: argparse.Namespace,
            where: Path) -> list[Run]:  # fmt: skip
    """Every run, in turns; each printed as it ends."""
    sides = order(args.pairs)
    runs: list[Run] = []
    node_says = "the client's own commit" if args.node == "same" else f"{args.node} always"
    print(f"{args.pairs} pairs, {args.docs:,} documents, {PARTITIONS} partitions; the node "
          f"runs {node_says}; load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for i, side in enumerate(sides, 1):
        client = trees[side]
        node = client if args.node == "same" else trees[args.node]
        run = Run(client, node)
        print(f"run {i}/{len(sides)}: client {side} {client.short}, node {node.label} "
              f"{node.short}", flush=True)  # fmt: skip
        scratch = where / f"run{i}"
        try:
            measure(run, benches, args.docs, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        figures = "; ".join(f"{b} {r:,.0f} items/s" for b, r in run.rates.items())
        for b, why in run.skipped.items():
            figures += f"; {b} skipped: {why}"
        print(f"    {figures}  (load average {os.getloadavg()[0]:.2f})", flush=True)
        runs.append(run)
    return runs


def report(trees: dict[str, Tree], runs: list[Run], benches: list[str],
           args: argparse.Namespace) -> None:  # fmt: skip
    """Per benchmark, the median ratio head/base over the pairs with its spread; the
    key=value line."""
    base, head = trees["base"], trees["head"]
    print(f"head {head.short} ({args.head}) / base {base.short} ({args.base}), "
          f"{args.docs:,} documents, node {args.node}, {args.pairs} pairs:")  # fmt: skip
    keys = [f"base={base.short}", f"head={head.short}", f"node={args.node}",
            f"docs={args.docs}", f"pairs={args.pairs}"]  # fmt: skip
    for bench in benches:
        skipped = {r.skipped[bench] for r in runs if bench in r.skipped}
        if skipped:
            print(f"  {bench}: skipped on at least one commit: {'; '.join(sorted(skipped))}")
            keys.append(f"{bench}=skipped")
            continue
        b = [r.rates[bench] for r in runs if r.client is base]
        h = [r.rates[bench] for r in runs if r.client is head]
        ratios = [hr / br for hr, br in zip(h, b, strict=True)]
        med = statistics.median(ratios)
        bm, hm = statistics.median(b), statistics.median(h)
        print(f"  {bench:8} ratio {med:.2f} (pairs {min(ratios):.2f}-{max(ratios):.2f}: "
              f"{', '.join(f'{x:.2f}' for x in ratios)}); head median {hm:,.0f} items/s, "
              f"base median {bm:,.0f}")  # fmt: skip
        keys += [f"{bench}_ratio={med:.3f}", f"{bench}_ratio_min={min(ratios):.3f}",
                 f"{bench}_ratio_max={max(ratios):.3f}", f"{bench}_head={hm:.0f}",
                 f"{bench}_base={bm:.0f}"]  # fmt: skip
    print(" ".join(keys))


def child(mode: str, uri: str, tree: Path) -> None:
    """Child modes, run with one commit's code: `wait` until the node has persisted every
    write; `library` drains it with DcpConsumer. One JSON object on stdout."""
    import upr_cli

    found = Path(upr_cli.__file__).resolve()
    if not found.is_relative_to(tree.resolve()):
        raise SystemExit(f"upr_cli resolves to {found}, not into {tree}")
    if mode == "wait":
        wait_persisted(uri)
        print(json.dumps({"persisted": True}))
    elif mode == "library":
        print(json.dumps(library_drain(uri)))
    elif mode == "decode":
        print(json.dumps(decode_rate(int(uri))))
    else:
        raise SystemExit(f"unknown child mode {mode}")


def wait_persisted(uri: str, timeout: float = 600.0) -> None:
    """Poll STAT vbucket-seqno until every partition's persisted seq is its high seq."""
    from upr_cli.net.bootstrap import connect
    from upr_cli.net.uri import SourceUri

    async def done() -> bool:
        s = await connect(SourceUri.parse(uri))
        try:
            st = await s.conn.stats("vbucket-seqno")
        finally:
            await s.conn.aclose()
        highs = {k[: -len(":high_seqno")]: v for k, v in st.items() if k.endswith(":high_seqno")}
        return all(st[f"{vb}:last_persisted_seqno"] == h for vb, h in highs.items())

    deadline = time.monotonic() + timeout
    while not asyncio.run(done()):
        if time.monotonic() > deadline:
            raise SystemExit("the node did not persist its writes in time")
        time.sleep(0.2)


def decode_rate(frames: int) -> dict[str, object]:
    """`frames` mutations (150-200 B values, 1024 partitions) encoded once with the
    commit's encoder, then decoded by its FrameDecoder in 256 KiB reads: the best of
    three runs, frames/s."""
    import random

    from upr_cli.protocol import FrameDecoder
    from upr_cli.protocol.fast import encode_mutation

    rng = random.Random(7)
    parts = []
    for i in range(frames):
        value = b'{"v":"' + rng.randbytes(rng.randrange(70, 95)).hex().encode() + b'"}'
        parts.append(encode_mutation(i % 1024, 1, 0x16 << 56 | i, 1, i // 1024 + 1, 1, 0, 0,
                                     f"user::{i:08d}".encode(), value))  # fmt: skip
    buf = b"".join(parts)
    del parts
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        dec, mv, count = FrameDecoder(), memoryview(buf), 0
        for pos in range(0, len(buf), 256 * 1024):
            dec.feed(mv[pos : pos + 256 * 1024])
            while rows := dec.read_rows():
                count += len(rows)
        best = min(best, time.perf_counter() - t)
        if count != frames:
            raise SystemExit(f"decoded {count} frames, not {frames}")
    return {"frames_per_s": frames / best}


def library_drain(uri: str) -> dict[str, object]:
    """Drain the node to its end with DcpConsumer alone: items and seconds, or why not."""
    from upr_cli.dcp.consumer import DcpConsumer
    from upr_cli.net.uri import SourceUri

    try:  # the named record; data records were plain row tuples before it
        from upr_cli.protocol.decoder import DcpRecord

        record: type = DcpRecord
    except ImportError:
        record = tuple

    async def go() -> dict[str, object]:
        try:
            consumer = DcpConsumer(SourceUri.parse(uri), until_end=True)
        except TypeError as e:
            return {"skip": f"DcpConsumer(uri, until_end=True) refused: {e}"}
        await consumer.open()
        t = time.perf_counter()
        n = 0
        async for batch in consumer.batches():
            n += sum(1 for it in batch if type(it) is record)
            consumer.commit()
        elapsed = time.perf_counter() - t
        await consumer.aclose()
        return {"items": n, "seconds": elapsed}

    return asyncio.run(go())


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
