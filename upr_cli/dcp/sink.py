"""One loop from a `DcpConsumer` to whatever keeps what it streams.

Theory of operation. `DcpConsumer.batches()` yields data records and events in wire
order. Every tool that streams (tail, backup, replay, salvage, diff, the Spark stream,
the node's replication) is a `Sink`: `drive` hands it each maximal run of consecutive
data records as one list (the fast path: a sink batches a run into a segment block or
one `executemany`), each event between runs on its own and in order (a snapshot marker,
a rollback, a stream's end, a collection created or dropped), and then says the
consumer's batch is over. The sink
decides there what is durable (and so what `consumer.commit()` may record) and whether
to stop. Order is the only guarantee that matters: a record is never handed over after
an event that followed it on the wire.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

from upr_cli.protocol.decoder import DcpRecord

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from upr_cli.dcp.consumer import Item
    from upr_cli.dcp.events import Event


class Batches(Protocol):
    """What `drive` reads: a `DcpConsumer`, or anything that yields its batches (a
    read-ahead in front of one)."""

    def batches(self) -> AsyncIterator[list[Item]]:
        """Records and events in wire order, batch by batch."""
        ...


class Sink(Protocol):
    """What `drive` feeds: runs of records, events between them, and batch ends."""

    async def records(self, records: list[DcpRecord]) -> None:
        """A run of consecutive data records, in wire order (never empty)."""

    async def event(self, event: Event) -> None:
        """One event, after the records that preceded it on the wire."""

    async def batch_done(self) -> bool:
        """The consumer's batch is over: make durable what the sink holds and commit it if
        it wants; return True to stop streaming."""


class SinkBase:
    """A `Sink` that ignores what it is not written for: subclass it and override the
    methods a tool needs (records are dropped, events ignored, streaming goes on). An
    `event` override should let kinds it does not know pass: new ones appear (a
    `ManifestChange` reaches sinks written before collections)."""

    async def records(self, records: list[DcpRecord]) -> None:
        """A run of consecutive data records, in wire order (never empty)."""

    async def event(self, event: Event) -> None:
        """One event, after the records that preceded it on the wire."""

    async def batch_done(self) -> bool:
        """The consumer's batch is over; True stops streaming."""
        return False


async def drive(consumer: Batches, sink: Sink) -> None:
    """Feed every batch of `consumer` to `sink` until the streams end or the sink stops."""
    async for batch in consumer.batches():
        if len(set(map(type, batch))) == 1 and type(batch[0]) is DcpRecord:
            await sink.records(cast("list[DcpRecord]", batch))  # records alone: most batches
            if await sink.batch_done():
                return
            continue
        start = 0
        for i, item in enumerate(batch):
            if not isinstance(item, DcpRecord):
                if i > start:
                    await sink.records(cast("list[DcpRecord]", batch[start:i]))
                await sink.event(item)
                start = i + 1
        if start < len(batch):
            await sink.records(cast("list[DcpRecord]", batch[start:] if start else batch))
        if await sink.batch_done():
            return
