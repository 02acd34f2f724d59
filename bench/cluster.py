"""A local cluster: replication throughput, failover and rebalance times.

Starts `upr cluster init --nodes 3 --replicas 1` (1024 partitions), writes N documents
with `upr load` through the map, and measures:

* replication: items/s from the first write until every replica holds its active's
  high seqs, beside the rate of the `upr load` that wrote them (the reference: a
  replica keeps pace when the ratio is near 1), and how far the last replica trailed
  the last write;
* catch-up: replication into one node paused while N more are written, then resumed:
  items/s until it caught up, beside the same run's `DcpConsumer` drain rate of the
  cluster (the client path replicas use; the limit a replica stream can reach here);
* a hard failover of a SIGKILLed node: the command's time and the partitions promoted;
* `rebalance --add new` while `upr load` writes: its time, partitions moved, write errors.

Usage: python bench/cluster.py [--docs 200000]
Last line: replication_items_per_s=… load_items_per_s=… replication_ratio=… …
    drain_items_per_s=… catchup_ratio=… failover_s=… rebalance_s=… …
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _node import UPR, upr

from upr_cli.cluster import spec
from upr_cli.cluster.control import NodeStatus, node_status
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.decoder import DcpRecord


def statuses(data: Path) -> list[NodeStatus]:
    cl = spec.load(data)

    async def go() -> list[NodeStatus]:
        return list(await asyncio.gather(*(node_status(cl, n) for n in cl.nodes if n.member)))

    return asyncio.run(go())


def replicated(data: Path) -> bool:
    cl = spec.load(data)
    sts = {s.name: s for s in statuses(data)}
    for p, row in enumerate(cl.vbmap):
        want = sts[cl.nodes[row[0]].name].highs.get(p, 0)
        for i in row[1:]:
            st = sts[cl.nodes[i].name]
            if st.persisted.get(p, 0) < want:
                return False
    return True


async def drain(uri: str) -> int:
    n = 0
    async with DcpConsumer(SourceUri.parse(uri), until_end=True) as c:
        async for batch in c.batches():
            n += sum(1 for it in batch if type(it) is DcpRecord)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=200_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="upr-bench-cluster-") as tmp:
        data = Path(tmp) / "cl"
        t0 = time.monotonic()
        upr("cluster", "init", "--nodes", "3", "--replicas", "1", "--num-partitions", "1024",
            "--data", str(data))  # fmt: skip
        init_s = time.monotonic() - t0
        try:
            cl = spec.load(data)
            uri = cl.uri(cl.nodes[1])
            t0 = time.monotonic()
            upr("load", uri, "--docs", str(args.docs))
            load_s = time.monotonic() - t0
            while not replicated(data):
                time.sleep(0.05)
            repl_s = time.monotonic() - t0
            t0 = time.monotonic()
            drained = asyncio.run(drain(uri))
            drain_rate = drained / (time.monotonic() - t0)
            repl_rate = args.docs / repl_s
            # catch-up: replication into n2 paused while 100k more are written, then resumed
            upr("cluster", "pause", "n2", "--data", str(data))
            upr("load", uri, "--docs", str(args.docs), "--prefix", "behind")
            t0 = time.monotonic()
            upr("cluster", "resume", "n2", "--data", str(data))
            while not replicated(data):
                time.sleep(0.05)
            catch_s = time.monotonic() - t0
            behind = (
                sum(1 for row in spec.load(data).vbmap if 2 in row[1:]) * args.docs // 1024
            )  # about: n2's replica share of the new writes
            catch_rate = behind / catch_s
            # hard failover of a SIGKILLed node
            pid = spec.load(data).nodes[0].pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
            t0 = time.monotonic()
            out = json.loads(upr("cluster", "failover", "n0", "--data", str(data),
                                 "--json").stdout)  # fmt: skip
            failover_s = time.monotonic() - t0
            promoted = len(out["promoted"])
            # rebalance --add new under load
            load = subprocess.Popen([*UPR, "load", uri, "--docs",
                                     "40000", "--update-ratio", "0.5", "--rate", "4000",
                                     "--prefix", "during", "--json"],
                                    stdout=subprocess.PIPE, text=True)  # fmt: skip
            time.sleep(0.5)
            t0 = time.monotonic()
            reb = json.loads(upr("cluster", "rebalance", "--add", "new", "--data", str(data),
                                 "--json").stdout)  # fmt: skip
            rebalance_s = time.monotonic() - t0
            lsum = json.loads(load.communicate(timeout=600)[0])
        finally:
            subprocess.run([*UPR, "cluster", "stop", "--data", str(data)], capture_output=True,
                           check=False)  # fmt: skip
    moved = len(reb["moved"])
    print(f"3 nodes, 1 replica, 1024 partitions; init {init_s:.1f}s")
    print(f"  load {args.docs:,} docs: {load_s:.1f}s; every replica persisted them after "
          f"{repl_s:.1f}s")  # fmt: skip
    load_rate = args.docs / load_s
    print(f"  replication: {repl_rate:,.0f} items/s, the last replica {repl_s - load_s:.1f}s "
          f"behind the last write   reference (same run): upr load through the map "
          f"{load_rate:,.0f} sets/s ({repl_rate / load_rate:.2f})")  # fmt: skip
    print(f"  catch-up after a pause: about {behind:,} items in {catch_s:.1f}s = "
          f"{catch_rate:,.0f} items/s   limit (same run): DcpConsumer drain of the cluster "
          f"{drain_rate:,.0f} items/s ({catch_rate / drain_rate:.0%})")  # fmt: skip
    print(f"  hard failover of a killed node: {failover_s:.2f}s, {promoted} partitions promoted")
    print(f"  rebalance --add new under 4,000 writes/s: {rebalance_s:.1f}s, {moved} partitions "
          f"moved, {lsum['errors']} write errors, {lsum['retries']} retries")  # fmt: skip
    print(f"replication_items_per_s={repl_rate:.0f} load_items_per_s={load_rate:.0f} "
          f"replication_ratio={repl_rate / load_rate:.3f} catchup_items_per_s={catch_rate:.0f} "
          f"drain_items_per_s={drain_rate:.0f} catchup_ratio={catch_rate / drain_rate:.3f} "
          f"failover_s={failover_s:.2f} promoted={promoted} rebalance_s={rebalance_s:.1f} "
          f"moved={moved} write_errors={lsum['errors']}")  # fmt: skip


if __name__ == "__main__":
    main()
