"""`drive`, the one dispatch loop: runs of records, events between them in wire order,
a batch end after each batch, and a sink that stops the stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

from upr_cli.dcp.consumer import DcpConsumer, Item
from upr_cli.dcp.events import Event, Snapshot, StreamEnded
from upr_cli.dcp.sink import SinkBase, drive
from upr_cli.position import StreamPosition
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord


def rec(seq: int, op: int = OP_MUTATION) -> DcpRecord:
    return DcpRecord(opcode=op, vbucket=0, by_seqno=seq, rev_seqno=1, cas=seq, flags=0,
                     expiration=0, delete_time=0, datatype=0, key=b"k%d" % seq, value=b"",
                     opaque=1)  # fmt: skip


def snap(start: int, end: int) -> Snapshot:
    return Snapshot(0, start, end, 1)


class FakeConsumer:
    """Only what `drive` uses: `batches()`; counts how many batches were taken."""

    def __init__(self, batches: list[list[Item]]) -> None:
        self._batches = batches
        self.taken = 0

    async def batches(self) -> AsyncIterator[list[Item]]:
        for batch in self._batches:
            self.taken += 1
            yield batch


class Recorder(SinkBase):
    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.stop_after = stop_after
        self.done = 0

    async def records(self, records: list[DcpRecord]) -> None:
        assert records
        self.calls.append(("records", [r.by_seqno for r in records]))

    async def event(self, event: Event) -> None:
        self.calls.append(("event", event))

    async def batch_done(self) -> bool:
        self.done += 1
        self.calls.append(("done", self.done))
        return self.stop_after is not None and self.done >= self.stop_after


def run(batches: list[list[Item]], sink: SinkBase) -> FakeConsumer:
    consumer = FakeConsumer(batches)
    asyncio.run(drive(cast(DcpConsumer, consumer), sink))
    return consumer


def test_runs_of_records_and_events_keep_wire_order() -> None:
    end = StreamEnded(0, 0, StreamPosition(0, 1, 5, 5, 5))
    batches: list[list[Item]] = [
        [snap(1, 3), rec(1), rec(2), rec(3, OP_DELETION), snap(4, 5), rec(4), rec(5), end],
        [rec(6), rec(7)],
        [snap(8, 8)],
    ]
    sink = Recorder()
    run(batches, sink)
    assert sink.calls == [
        ("event", snap(1, 3)), ("records", [1, 2, 3]), ("event", snap(4, 5)),
        ("records", [4, 5]), ("event", end), ("done", 1),
        ("records", [6, 7]), ("done", 2),
        ("event", snap(8, 8)), ("done", 3),
    ]  # fmt: skip


def test_back_to_back_events_and_an_empty_batch() -> None:
    sink = Recorder()
    run([[snap(1, 1), snap(2, 2)], []], sink)
    assert sink.calls == [("event", snap(1, 1)), ("event", snap(2, 2)), ("done", 1), ("done", 2)]


def test_a_sink_stops_the_stream_at_a_batch_end() -> None:
    sink = Recorder(stop_after=1)
    consumer = run([[rec(1)], [rec(2)], [rec(3)]], sink)
    assert sink.calls == [("records", [1]), ("done", 1)] and consumer.taken == 1


def test_the_base_sink_ignores_everything_and_streams_on() -> None:
    consumer = run([[rec(1), snap(2, 2)], [rec(2)]], SinkBase())
    assert consumer.taken == 2
