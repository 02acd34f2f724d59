"""Each partition's live state, asked of its active node: the one partition-states query.

A replica or dead copy of a partition has its own failover log and seqs, not the history
clients stream, so every partition is asked of the node the cluster map names its
active (formats/cluster.md §4), one connection per node (`net.bootstrap.on_active_nodes`).
One node answers STAT `vbucket-seqno` (uuid, high seq and purge seq of each partition it
holds) and, when asked for, GET_FAILOVER_LOG per partition, pipelined.
"""

from __future__ import annotations

from dataclasses import dataclass

from upr_cli.failover import FailoverLog
from upr_cli.net.bootstrap import on_active_nodes
from upr_cli.net.connection import Connection
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.header import Opcode
from upr_cli.protocol.messages import FailoverLogResponse, GetFailoverLog


@dataclass(frozen=True, slots=True)
class PartitionState:
    """One partition as its active node holds it now; `failover_log` is None when it was
    not asked for or the node has none for the partition."""

    uuid: int
    high_seq: int
    purge_seq: int = 0
    failover_log: FailoverLog | None = None


async def states_on(
    conn: Connection, partitions: list[int], *, failover_logs: bool
) -> dict[int, PartitionState]:
    """The states of `partitions` held by the node at the other end of `conn`."""
    futs = [
        (p, conn.start_request(GetFailoverLog(opcode=Opcode.GET_FAILOVER_LOG, vbucket=p,
                                              opaque=conn.next_opaque())))
        for p in (partitions if failover_logs else ())
    ]  # fmt: skip
    stats = await conn.stats("vbucket-seqno")
    logs: dict[int, FailoverLog] = {}
    for p, fut in futs:
        resp = (await fut)[0]
        if isinstance(resp, FailoverLogResponse):
            logs[p] = FailoverLog.sanitised(resp.failover_log)
    return {
        p: PartitionState(
            int(stats.get(f"vb_{p}:uuid", 0)),
            int(stats.get(f"vb_{p}:high_seqno", 0)),
            int(stats.get(f"vb_{p}:purge_seqno", 0)),
            logs.get(p),
        )
        for p in partitions
    }


async def partition_states(
    uri: SourceUri,
    partitions: list[int] | None,
    *,
    failover_logs: bool,
    name: str,
    wait_for: float = 60.0,
) -> tuple[dict[int, PartitionState], int]:
    """Every partition's state (all of the bucket's when `partitions` is None) from its
    active node, and the bucket's partition count. A node that cannot be reached is
    asked again under a re-read map for up to `wait_for` seconds (0: fail at once)."""

    async def ask(conn: Connection, parts: list[int]) -> dict[int, PartitionState]:
        return await states_on(conn, parts, failover_logs=failover_logs)

    return await on_active_nodes(uri, partitions, ask, name=name, wait_for=wait_for)


__all__ = ["PartitionState", "partition_states", "states_on"]
