"""A partition moves under the consumer: two in-process nodes in one cluster map, the
active copy on A replicated to B, then a failover makes B active. The consumer follows
the map (NOT_MY_VBUCKET carries the new one) and resumes on B without loss, duplicates
or rollback, since B's history holds what it streamed (formats/cluster.md §4 and §5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.dcp.inprocess import InProcessNode, Received, consume_until, nodes, run
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import Rollback, StreamEnded, StreamOpened
from upr_cli.node.partition import ACTIVE, DEAD, REPLICA

VB = 0


def _cluster_map(rev: int, servers: list[str], rows: list[list[int]]) -> dict[str, Any]:
    return {"rev": rev, "name": "default", "nodeLocator": "vbucket",
            "vBucketServerMap": {"hashAlgorithm": "CRC", "numReplicas": 1,
                                 "serverList": servers, "vBucketMap": rows}}  # fmt: skip


async def _push(node: InProcessNode, config: dict[str, Any]) -> None:
    """What an orchestrator does over SET_CLUSTER_CONFIG, through the bucket's own API."""
    node.bucket.set_cluster_map(node.bucket.state_cas, config)


async def _set_state(node: InProcessNode, state: str, rev: int, *, failover: bool = False) -> None:
    bucket = node.bucket
    await bucket.set_partition_state(VB, state, cas=bucket.state_cas, rev=rev, failover=failover)


def test_a_failover_moves_the_partition_and_the_consumer_follows(tmp_path: Path) -> None:
    a, b = (InProcessNode(tmp_path / n, partitions=1) for n in "ab")

    async def scenario() -> tuple[Received, tuple[str, int]]:
        async with nodes(a, b):
            servers = [a.address, b.address]
            for n in (a, b):
                await _push(n, _cluster_map(1, servers, [[0, 1]]))
                n.bucket.traffic = True  # as the orchestrator's ENABLE_TRAFFIC
            await _set_state(b, REPLICA, 1)
            a.write(VB, 6)
            replica = b.bucket.partitions[VB]
            await b.wait_for("B to persist the replica", lambda: replica.complete_seq == 6)
            got = Received()
            async with DcpConsumer(a.uri, partitions=[VB], noop_interval=0.5) as consumer:
                await consume_until(consumer, got, lambda g: len(g.records) == 6)
                # failover: B is promoted, A's copy dies, the map says so everywhere
                for n in (a, b):
                    await _push(n, _cluster_map(2, servers, [[1, -1]]))
                await _set_state(b, ACTIVE, 2, failover=True)
                await _set_state(a, DEAD, 2)
                b.write(VB, 4, prefix="on-b")
                await consume_until(consumer, got, lambda g: len(g.records) == 10)
                where = consumer.parts[VB].addr
            return got, where

    got, where = run(scenario())
    assert where == ("127.0.0.1", b.config.port)
    assert got.seqs(VB) == list(range(1, 11))  # nothing lost, nothing twice
    assert got.of(Rollback) == []  # B's history holds everything A streamed
    assert [bytes(r.key) for r in got.records[6:]] == [b"on-b0", b"on-b1", b"on-b2", b"on-b3"]
    opened = got.of(StreamOpened)
    assert [e.position.seq for e in opened] == [0, 6]
    assert len(got.of(StreamEnded)) == 1  # A ended the stream when its copy died
