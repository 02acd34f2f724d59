"""The stream loop of the node's DCP producer: disk backfills and memory snapshots
(docs/protocol.md §2.7, §4; the UPR design specification, "How ep-engine streams a
consistent snapshot for a partition").

A stream first backfills from disk what is at or below the partition's persisted seq,
then follows the write queue in Memory snapshots (0x01). The disk holds one row per key
and the queue one entry per key, so both phases deduplicate. The first marker carries
the requested start, later ones their first item's seq (docs/protocol.md §2.7).

The rule: **every snapshot marker ends at a state the partition had**, so that a client
holding a snapshot whole holds the source's state at its end (the UPR protocol draft,
"Snapshot Markers and Deduplication"; docs/design.md "Snapshot boundaries"), the only
seqs its consumers roll back to. Deduplication makes a snapshot whole only as a whole
deduplicated range: a key written at x ≤ e and again at y > e is held only at y, so an
end e cut out of a range lacks the key's version x. Hence:

* a Disk snapshot (0x06) is ONE read transaction under ONE marker ending at the highest
  seq it read; its rows go out in batches, never under several markers;
* a Memory snapshot takes every queued item after the cursor in one synchronous step
  (the event loop is the queue's only writer) and sends ONE marker ending at the last
  of them, then the items in bounded batches (references to versions the queue already
  held, so memory stays bounded by the queue);
* a replica copy (served to a client that did not ask ActiveVbOnly) holds what its
  active sent, possibly part of a snapshot: its memory snapshots end only on the end of
  one it received whole whose state its queue still holds (`_whole_end`), and its disk
  is streamed only while the state persisted is such an end (`snap_end`, as the flusher
  records it). Until then the stream waits; a replica set dead then ends StateChanged.

A finite stream ends with STREAM_END(OK) after the snapshot that reaches its end seq, so
the client always stops on a snapshot boundary (a consistent cut), possibly past end:
as far as the range the snapshot had to cover whole.

Streams hand the connection's sender bounded batches, so a client that never acks
stalls its streams without the node's memory growing (docs/protocol.md §7.1).
"""

from __future__ import annotations

import asyncio
from bisect import bisect_right
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from upr_cli.node.barriers import BarrierCookies
from upr_cli.node.bucket import Bucket
from upr_cli.node.dcp_encoder import StreamEncoder
from upr_cli.node.partition import ACTIVE, DEAD, REPLICA, Partition
from upr_cli.node.storage import ROW_SEQ, Backfill, DocRow, StorageReader
from upr_cli.node.stream_view import StreamSpec
from upr_cli.protocol.dcp import (
    END_FILTER_EMPTY,
    END_OK,
    END_STATE_CHANGED,
    MARKER_DISK_CHECKPOINT,
    MARKER_MEMORY,
)  # snapshot marker flags and stream-end statuses (docs/protocol.md §2.6, §2.7)
from upr_cli.protocol.messages import SeqnoAdvanced, SnapshotMarker

if TYPE_CHECKING:
    from upr_cli.node.producer import DcpSender

_T = TypeVar("_T")

BACKFILLS_PER_CONNECTION = 6  # open disk snapshots per DCP connection
BATCH_ITEMS = 512
BATCH_BYTES = 64 * 1024
BACKFILL_ROWS = 1000
# a batch's bytes (keys and values) by default: the node's share of --memory-limit for
# backfills (an eighth of 192 MiB) over the open backfills of one connection
DEFAULT_BATCH_BYTES = 4 * 1024 * 1024


class SnapshotStreamer:
    """Sends the snapshots of one connection's streams, each until its end seq."""

    def __init__(
        self,
        bucket: Bucket,
        sender: DcpSender,
        encoder: StreamEncoder,
        cookies: BarrierCookies,
        backfill_pool: ThreadPoolExecutor,
        backfill_slots: asyncio.Semaphore,
        *,
        collections: bool,
        batch_bytes: int,
    ) -> None:
        self.bucket = bucket
        self.sender = sender
        self.collections = collections  # HELLO Collections: FilterEmpty, SEQNO_ADVANCED
        self._encode = encoder.encode
        self._encode_rows = encoder.encode_rows
        self._sent_whole = cookies.sent_whole
        self._pool = backfill_pool
        self._slots = backfill_slots  # server-wide: concurrent SQLite reads
        self._own = asyncio.Semaphore(BACKFILLS_PER_CONNECTION)  # open backfills (snapshots)
        # what one stream reads from disk (or encodes from the queue) at a time, in keys
        # and values: each open backfill holds at most one such batch while it waits for
        # flow-control credit
        self.batch_bytes = batch_bytes
        self._readers: list[StorageReader] = []  # idle read connections, reused

    def close(self) -> None:
        """Close the idle read connections (the streams have stopped)."""
        readers, self._readers = self._readers, []
        for r in readers:  # idle: no thread uses them, so close here (also when cancelled)
            r.close()

    async def run(self, spec: StreamSpec) -> int:
        """Send snapshots until the end seq is passed; returns the STREAM_END status."""
        vb, end = spec.vbucket, spec.end
        part = self.bucket.partitions[vb]
        cursor, first = spec.start, True
        allowed = spec.states
        while True:
            if self.bucket.partitions.get(vb) is not part:
                return END_STATE_CHANGED
            if part.state not in allowed and not (part.state == DEAD and cursor < part.high_seq):
                # a partition set dead accepts no more writes, and its streams first send
                # everything it holds, then end StateChanged (the UPR design specification,
                # "How ns_server performs a partition rebalance", step 4)
                return END_STATE_CHANGED
            if cursor >= end:
                return END_OK
            if cursor < part.persisted_seq:
                done = await self._backfill(spec, part, cursor, first)
                if done is None:  # the disk holds no whole received snapshot's state yet
                    if part.state == DEAD:
                        return END_STATE_CHANGED  # nothing more to come that could end one
                    await part.wait_change(timeout=1.0)
                    continue
                cursor, sent = done
                first = first and not sent
                if spec.view.ended:
                    return self._filter_empty()
                continue
            # From the persisted check to the capture: one synchronous step, so the queue
            # holds exactly the newest version of every key written above `cursor`.
            snap = _memory_snapshot(part, cursor)
            if snap is None:
                if part.state == DEAD and part.markers:
                    return END_STATE_CHANGED  # a dead replica's copy: no more whole ends
                await part.wait_change(timeout=1.0)
                continue
            items, snap_end = snap
            if not items or spec.view.hides_all(items):
                # a whole received snapshot of purged tombstones only, or one of other
                # collections than a stream without collections sees
                cursor = snap_end
                self._sent_whole(vb, cursor)
                continue
            marker = SnapshotMarker(
                vbucket=vb, opaque=spec.opaque, start_seqno=spec.start if first else items[0].seq,
                end_seqno=snap_end, flags=MARKER_MEMORY,
            ).encode()  # fmt: skip
            first = False
            # One marker for the whole capture, its items in bounded batches: the writers
            # may replace queued versions meanwhile, but the captured references keep the
            # state at `snap_end` (and hold no more memory than the queue already did).
            head = [marker]
            for chunk in _chunks(items, BATCH_ITEMS, self.batch_bytes):
                await self.sender.send_made(partial(self._encoded, spec, head, chunk))
                head = []
                if spec.view.ended:
                    return self._filter_empty()
            await self._advance(spec, snap_end)
            cursor = snap_end
            self._sent_whole(vb, cursor)

    def _filter_empty(self) -> int:
        """The STREAM_END status once a stream's filter has nothing left (the default
        collection's drop ends a stream without collections too, with OK as kv_engine
        reports FilterEmpty to such a client)."""
        return END_FILTER_EMPTY if self.collections else END_OK

    async def _advance(self, spec: StreamSpec, snap_end: int) -> None:
        """SEQNO_ADVANCED to a snapshot's end when the stream held back its last items
        (kv_engine's seqno-advanced.md): the client then holds the snapshot whole."""
        if self.collections and spec.view.last_sent < snap_end:
            msg = SeqnoAdvanced(vbucket=spec.vbucket, opaque=spec.opaque, by_seqno=snap_end)
            await self.sender.send([msg.encode()])
            spec.view.last_sent = snap_end

    async def _pool_call(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` on the backfill pool under a server-wide slot.

        A cancelled caller still waits for `fn` to finish: a SQLite connection must not be
        closed (by the caller's cleanup, on another thread) while a fetch is using it.
        """
        async with self._slots:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, fn)
            try:
                return await asyncio.shield(fut)
            except asyncio.CancelledError:
                await asyncio.wait([fut])
                raise

    async def _backfill(
        self, spec: StreamSpec, part: Partition, cursor: int, first: bool
    ) -> tuple[int, bool] | None:
        """Stream one consistent disk snapshot of (cursor, disk high]; returns the new cursor
        and whether a marker was sent, or None when the disk holds no whole snapshot's state
        now (a replica's copy persisted in the middle of a snapshot it is receiving).

        The rows come from ONE read transaction and go under ONE marker whose end is the
        highest seq in it: the state persisted there, which the client holds once it has
        them all (fetched and sent in batches, but never split into several markers: an
        end inside the range would lack the keys whose newest version lies above it).

        The server-wide slots are held only around each SQLite call, never while waiting for
        flow-control credit, so a client that stops acknowledging stalls only itself. Rows
        are encoded in the same pool call that fetches them (no DocRow objects).
        """
        storage = self.bucket.storage

        readers = self._readers

        def open_and_fetch() -> tuple[StorageReader, Backfill, list[bytes], int]:
            reader = readers.pop() if readers else storage.open_reader()
            try:
                bf = reader.backfill(spec.vbucket, cursor, batch=BACKFILL_ROWS,
                                     max_bytes=self.batch_bytes)  # fmt: skip
                rows = bf.fetch_rows()
            except BaseException:
                reader.close()
                raise
            return reader, bf, self._encode_rows(spec, rows), ROW_SEQ(rows[0]) if rows else 0

        def close(reader: StorageReader, bf: Backfill) -> None:
            try:
                bf.close()  # ends the read transaction; the connection stays for the next one
            except BaseException:
                reader.close()
                raise
            if len(readers) < BACKFILLS_PER_CONNECTION:
                readers.append(reader)
            else:
                reader.close()

        async with self._own:
            # The read below starts later and sees at least the commit that persisted
            # `persisted`; any later one writes seqs above it (a flush writes the queue).
            persisted = part.persisted_seq
            if part.state != ACTIVE and part.snap_end != persisted:
                return None  # a replica persisted mid-snapshot: that state is not the active's
            reader, bf, msgs, first_seq = await self._pool_call(open_and_fetch)
            try:
                if part.state != ACTIVE and (
                    bf.high_seq > persisted or part.persisted_seq < persisted
                ):
                    # a flush (or a rollback) moved the disk under the read: what it saw is
                    # not known to be whole; look again
                    return cursor, False
                if not first_seq:
                    # only purged tombstones lay between cursor and what was read (not the
                    # persisted seq now: a flush since may have persisted more rows)
                    cursor = max(cursor, bf.high_seq, persisted)
                    self._sent_whole(spec.vbucket, cursor)  # nothing else changed up to it
                    return cursor, False
                marker = SnapshotMarker(
                    vbucket=spec.vbucket, opaque=spec.opaque,
                    start_seqno=spec.start if first else first_seq,
                    end_seqno=bf.high_seq, flags=MARKER_DISK_CHECKPOINT,
                )  # fmt: skip
                await self.sender.send([marker.encode()])
                while True:  # a batch may be empty: the stream's filter held back its rows
                    await self._send_batched(msgs)
                    if spec.view.ended:
                        return cursor, True  # the filter has nothing left: the stream ends
                    if bf.done:
                        break
                    msgs = await self._pool_call(lambda: self._encode_rows(spec, bf.fetch_rows()))
                await self._advance(spec, bf.high_seq)
                self._sent_whole(spec.vbucket, bf.high_seq)  # one read transaction: whole
                return max(cursor, bf.high_seq), True
            finally:
                await _finish(self._pool_call(lambda: close(reader, bf)))

    def _encoded(self, spec: StreamSpec, head: list[bytes], chunk: list[DocRow]) -> list[bytes]:
        return [*head, *self._encode(spec, chunk)]

    async def _send_batched(self, msgs: list[bytes]) -> None:
        batch: list[bytes] = []
        size = 0
        for m in msgs:
            batch.append(m)
            size += len(m)
            if size >= BATCH_BYTES:
                await self.sender.send(batch)
                batch, size = [], 0
        if batch:
            await self.sender.send(batch)


async def _finish(call: Awaitable[None]) -> None:
    """Complete a cleanup call even if the task is being cancelled meanwhile."""
    task = asyncio.ensure_future(call)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


def _chunks(items: list[DocRow], max_items: int, max_bytes: int) -> Iterator[list[DocRow]]:
    """`items` in runs of at most `max_items` and about `max_bytes` of keys and values
    (what one encoded batch holds; a larger item comes alone), each taken out of `items`
    as it is given: a capture keeps only the versions its stream has yet to send, not
    those the flusher has written and the writers replaced meanwhile (measured: a
    cluster node restoring 5 MiB documents peaked 100 MB higher)."""
    while items:
        n, size = 0, 0
        for doc in items:
            n += 1
            size += len(doc.key) + len(doc.value)
            if size >= max_bytes or n >= max_items:
                break
        run = items[:n]
        del items[:n]
        yield run


def _memory_snapshot(part: Partition, cursor: int) -> tuple[list[DocRow], int] | None:
    """The next memory snapshot after `cursor`: the queued items it holds and its end, or
    None if there is none to send now. The caller has checked `cursor` ≥ the persisted
    seq in the same synchronous step, so the queue holds the newest version of every key
    written above `cursor`, and taking ALL of them at once gives the state at the last.

    An active (or one set dead) sends everything queued. A replica's queue is what it
    received from its active, possibly part of a snapshot: its snapshots end only where
    the active's did, at the newest end `_whole_end` finds.
    """
    if part.state == ACTIVE or (part.state == DEAD and not part.markers):
        items = part.queue.items_after(cursor, len(part.queue))
        return (items, items[-1].seq) if items else None
    if part.state != REPLICA:
        return None  # a dead replica copy: the ends its queue broke are no longer tracked
    snap_end = _whole_end(part, cursor)
    if snap_end is None:
        return None
    items = part.queue.items_after(cursor, len(part.queue))
    return items[: bisect_right(items, snap_end, key=lambda d: d.seq)], snap_end


def _whole_end(part: Partition, cursor: int) -> int | None:
    """The newest end above `cursor` of a snapshot a replica received whole, not yet
    persisted past, at which its queue still holds the state: every item up to the end
    arrived (the high seq reached it); the stream from the active did not restart inside
    it (a later marker starting below the end: the resumed stream deduplicates against
    its own end, so what it sent may lack a version at or below this one); and no version
    at or below the end was replaced in the queue by one above it (`Partition.broken`;
    conservative: also when the replaced version lies at or below `cursor`)."""
    high, broken = part.high_seq, part.broken
    best: int | None = None
    later_start = high + 1  # the lowest start of the markers received after this one
    for start, e in reversed(part.markers):
        if cursor < e <= high and e <= later_start and e not in broken:
            best = e if best is None else max(best, e)
        later_start = min(later_start, start)
    return best
