"""Replication into this node's replica and pending partitions (formats/cluster.md §5).

The UPR design specification, "How KV mutations flow into Replicas": a replica partition
is fed by a UPR client streaming from its active copy; the replica keeps the seqnos, cas
and rev seqs it is sent, persists in seq order (the flusher commits each partition's queue
in one transaction) and records the last complete snapshot it persisted.

Theory of operation. The node's cluster map names, per partition, the active node. The
`Replicator` groups this node's replica and pending partitions by their active node and
runs one `DcpConsumer` (our client library, one connection) per active node. Each
stream starts from the partition's own position (its newest failover uuid, high seq and
snapshot), so the active's producer rule decides any rollback (docs/protocol.md §4.2);
the replica adopts the active's whole failover log from the stream response
(docs/protocol.md §4.3).

ROLLBACK(r) takes a partition back to a snapshot boundary, not to r: inside a
deduplicated snapshot a seq is not a state the source ever had (the UPR design
specification: a replica rolls back onto a snapshot boundary it received before r). The
consumer is given the boundaries the partition's undo reaches (`Partition.boundaries`)
and picks the newest at or below r; the bucket undoes back to it, or, when that one is
out of its reach (its write queue deduplicated across it), to the newest below, and the
link restarts from there. With no boundary in reach the partition is emptied and
streams again from 0.

A map or state change (SET_CLUSTER_CONFIG, SET_VBUCKET) wakes the replicator, which
restarts the links whose partition set changed. A link that fails (the active died,
NOT_MY_VBUCKET during a rebalance) is restarted after a short wait, against whatever the
map then says.

Collections (formats/wire.md "Collections on DCP"): the link negotiates them and asks
for every collection, so the active sends each document with its collection id and each
collection or scope change as a system event at its seq. The replica stores a document
under its qualified key (`join_key(collection, key)`) and a change as the system row
the active holds for it (`sysevents.system_row`), both at the seqs the active gave them,
so that both copies end with the same rows.

Xattrs (formats/wire.md "Xattrs"): the link negotiates them and opens with
IncludeXattrs and IncludeDeletedUserXattrs, so the active sends every version with its
blob; the consumer splits it off (`DcpRecord.xattrs`) and the replica joins it back, so
a document and a tombstone keep their xattrs on both copies.

Pausing (for staging the UPR design specification's walkthrough): `pause(vbs, after)`
lets partitions apply items up to seq `after` (default: what they have now) and then
closes their streams; `resume` reopens them from where they stand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from upr_cli.collections import ManifestChange
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import Event, Rollback, Snapshot, StreamOpened
from upr_cli.dcp.sink import SinkBase, drive
from upr_cli.errors import UprError
from upr_cli.net.aio import cancel_and_wait
from upr_cli.net.uri import SourceUri
from upr_cli.node.bucket import Bucket
from upr_cli.node.partition import Partition
from upr_cli.node.storage import DocRow
from upr_cli.node.sysevents import system_row
from upr_cli.node.undo import FED
from upr_cli.position import StreamPosition
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.protocol.leb128 import join_key
from upr_cli.protocol.status import NotMyVbucket
from upr_cli.protocol.xattrs import join

log = logging.getLogger(__name__)

RETRY_S = 0.5  # wait before restarting a failed link
_LOOPBACK = {"127.0.0.1", "localhost", "$HOST", "::1", "[::1]"}


class _Restart(Exception):
    """A rollback went further back than the stream (to an older snapshot boundary, or
    an emptied partition): restart the link from where the partitions stand."""


@dataclass
class _Link:
    source: str  # host:port of the active node
    partitions: frozenset[int]
    task: asyncio.Task[None]


def resume_position(part: Partition) -> StreamPosition:
    """Where a replica partition resumes: its newest uuid, high seq and the snapshot
    holding it (a marker received but not yet persisted past, else the stored one)."""
    high = part.high_seq
    snap = (part.snap_start, part.snap_end)
    for start, end in part.markers:
        if start <= high <= end:
            snap = (min(start, part.complete_seq), end)
    if not snap[0] <= high <= snap[1]:
        snap = (high, high)
    return StreamPosition(part.vbucket, part.uuid, high, snap[0], snap[1])


class Replicator:
    """Feeds the bucket's replica and pending partitions from their active nodes."""

    def __init__(self, bucket: Bucket, *, port: int, user: str | None,
                 password: str | None) -> None:  # fmt: skip
        self.bucket = bucket
        self.port = port
        self.user, self.password = user, password
        self.pause_after: dict[int, int] = {}  # partition → apply up to this seq, then stop
        self.stopped: set[int] = set()  # paused partitions that reached their seq
        self.errors: dict[str, str] = {}  # source → the last error of its link
        self._links: dict[str, _Link] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        bucket.listeners.append(self._wake.set)

    # -- control ------------------------------------------------------------------

    def start(self) -> None:
        """Start following the map (in the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="replicator")

    async def stop(self) -> None:
        """Stop every link."""
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        await self._cancel(list(self._links))

    def pause(self, partitions: list[int] | None, after: int | None) -> list[int]:
        """Replicate the partitions up to seq `after` (None: their high seq now), then stop."""
        vbs = self._fed(partitions)
        for vb in vbs:
            part = self.bucket.partitions[vb]
            self.pause_after[vb] = part.high_seq if after is None else after
            if part.high_seq >= self.pause_after[vb]:
                self.stopped.add(vb)
            else:
                self.stopped.discard(vb)  # a later seq: stream on until it
        self._wake.set()
        return vbs

    def resume(self, partitions: list[int] | None) -> list[int]:
        """Let paused partitions stream again from where they stand."""
        vbs = sorted(self.pause_after) if partitions is None else sorted(partitions)
        for vb in vbs:
            self.pause_after.pop(vb, None)
            self.stopped.discard(vb)
        self._wake.set()
        return vbs

    def wake(self) -> None:
        """Have the replicator look at its links again (a partition paused, the map moved)."""
        self._wake.set()

    def _fed(self, partitions: list[int] | None) -> list[int]:
        parts = self.bucket.partitions
        if partitions is None:
            return sorted(vb for vb, p in parts.items() if p.state in FED)
        return sorted(vb for vb in partitions if vb in parts)

    def status(self) -> dict[str, Any]:
        """Links, paused partitions and link errors (STAT replication)."""
        return {
            "links": {s: sorted(link.partitions) for s, link in self._links.items()},
            "paused": {str(vb): seq for vb, seq in sorted(self.pause_after.items())},
            "errors": dict(self.errors),
        }

    # -- the map ------------------------------------------------------------------

    def desired(self) -> dict[str, frozenset[int]]:
        """Per active node (host:port), the partitions this node must stream from it."""
        cmap = self.bucket.cluster_map
        if not cmap:
            return {}
        try:
            smap: Any = cmap["vBucketServerMap"]
            servers: list[str] = list(smap["serverList"])
            vbmap: list[list[int]] = list(smap["vBucketMap"])
        except (KeyError, TypeError):
            return {}
        me = {i for i, s in enumerate(servers) if _is_me(s, self.port)}
        out: dict[str, set[int]] = {}
        for vb, part in self.bucket.partitions.items():
            if part.state not in FED or vb in self.stopped or vb >= len(vbmap) or not vbmap[vb]:
                continue
            active = vbmap[vb][0]
            if 0 <= active < len(servers) and active not in me:
                out.setdefault(servers[active], set()).add(vb)
        return {s: frozenset(v) for s, v in out.items()}

    async def _run(self) -> None:
        while True:
            want = self.desired()
            stale = [
                s for s, link in self._links.items()
                if want.get(s) != link.partitions or link.task.done()
            ]  # fmt: skip
            await self._cancel(stale)
            for source, vbs in want.items():
                if source not in self._links:
                    task = asyncio.get_running_loop().create_task(
                        self._link(source, vbs), name=f"replication from {source}"
                    )
                    self._links[source] = _Link(source, vbs, task)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RETRY_S):  # not wait_for (net/aio.py)
                    await self._wake.wait()

    async def _cancel(self, sources: list[str]) -> None:
        tasks = {self._links.pop(s).task for s in sources}
        while tasks:
            for task in tasks:
                task.cancel()
            _, tasks = await asyncio.wait(tasks, timeout=1.0)  # re-cancel if one was lost

    # -- one link: a DCP stream of several partitions from one active node ----------

    def _uri(self, source: str) -> SourceUri:
        host, _, port = source.rpartition(":")
        host = "127.0.0.1" if host in _LOOPBACK else host.strip("[]")
        return SourceUri(scheme="upr", host=host, port=int(port), bucket=self.bucket.name,
                         username=self.user, password=self.password)  # fmt: skip

    async def _link(self, source: str, vbs: frozenset[int]) -> None:
        parts = self.bucket.partitions
        try:
            consumer = DcpConsumer(
                self._uri(source), partitions=sorted(vbs),
                positions={vb: resume_position(parts[vb]) for vb in vbs},
                failover_logs={vb: parts[vb].failover for vb in vbs},
                boundaries={vb: parts[vb].boundaries() for vb in vbs},
                reconnect_attempts=1, connect_timeout=3.0, name="upr-replication",
            )  # fmt: skip
            async with consumer:
                self.errors.pop(source, None)
                await drive(consumer, _ReplicaSink(self, consumer))
        except asyncio.CancelledError:
            raise
        except _Restart:
            log.info("replication from %s restarts (a partition rolled back further than its "
                     "stream asked)", source)  # fmt: skip
        except (UprError, OSError, NotMyVbucket) as exc:
            self.errors[source] = str(exc)
            log.info("replication from %s stopped: %s", source, exc)
        self._wake.set()


class _ReplicaSink(SinkBase):
    """Applies one link's stream to the bucket's replica partitions: records up to each
    paused partition's seq, markers, adopted failover logs and rollbacks."""

    def __init__(self, replicator: Replicator, consumer: DcpConsumer) -> None:
        self.replicator = replicator
        self.bucket = replicator.bucket
        self.consumer = consumer

    def _paused(self, vb: int, seq: int) -> bool:
        """True if `vb` is paused at a seq below `seq` (the item is not applied); marks a
        paused partition stopped once it reached its seq."""
        repl = self.replicator
        pause, stopped = repl.pause_after, repl.stopped
        if vb not in pause or seq < pause[vb]:
            return False
        if vb not in stopped:
            stopped.add(vb)
            repl.wake()
        return seq > pause[vb]

    async def records(self, records: list[DcpRecord]) -> None:
        await self.bucket.wait_room()  # a full write queue holds the stream back
        apply, paused = self.bucket.apply_replica, self._paused
        for rec in records:
            vb, seq = rec.vbucket, rec.by_seqno
            if paused(vb, seq):
                continue
            deleted = rec.opcode != OP_MUTATION
            # the consumer split the xattrs off: the replica stores them joined again,
            # a tombstone's (system, and user where the active kept them) included
            datatype, value = join(rec.xattrs, b"" if deleted else rec.value,
                                   0 if deleted else rec.datatype)  # fmt: skip
            apply(DocRow(
                vbucket=vb, key=join_key(rec.collection, bytes(rec.key)), seq=seq,
                rev_seq=rec.rev_seqno, cas=rec.cas, flags=rec.flags,
                expiry=0 if deleted else rec.expiration, datatype=datatype, deleted=deleted,
                delete_time=rec.delete_time, value=value,
            ))  # fmt: skip

    def _system_event(self, change: ManifestChange) -> None:
        """Store a collection or scope change as the system row the active holds for it:
        its key, event, version and value, at the active's seq; a drop is a deletion."""
        vb, seq = change.partition, change.seq
        if self._paused(vb, seq):
            return
        key, flags, expiry, value, deleted = system_row(change)
        self.bucket.fed_partition(vb)  # NOT_MY_VBUCKET before the lookup, as for records
        prev = self.bucket.lookup(vb, key)  # the rev seq as the active computes it
        self.bucket.apply_replica(DocRow(
            vbucket=vb, key=key, seq=seq, rev_seq=prev.rev_seq + 1 if prev else 1, cas=0,
            flags=flags, expiry=expiry, datatype=0, deleted=deleted,
            delete_time=int(time.time()) if deleted else 0, value=value,
        ))  # fmt: skip

    async def event(self, event: Event) -> None:
        bucket = self.bucket
        if isinstance(event, ManifestChange):
            self._system_event(event)
        elif isinstance(event, Snapshot):
            bucket.replica_marker(event.partition, event.start, event.end)
        elif isinstance(event, StreamOpened):
            await bucket.adopt_failover_log(event.partition, event.failover_log)
        elif isinstance(event, Rollback):
            got = await bucket.rollback_replica(event.partition, event.to_seq, asked=event.asked)
            if got != event.to_seq:  # further back than the stream restarts from
                raise _Restart

    async def batch_done(self) -> bool:
        self.consumer.commit()
        return False


def _is_me(server: str, port: int) -> bool:
    host, _, p = server.rpartition(":")
    return p.isdigit() and int(p) == port and host in _LOOPBACK
