"""What a DCP consumer hands its caller besides data rows (`DcpRecord`-ordered tuples).

A collection or scope created or dropped on a partition reaches the caller as a
`ManifestChange` (upr_cli/collections.py), at its seq among the records.
"""

from __future__ import annotations

from dataclasses import dataclass

from upr_cli.collections import ManifestChange
from upr_cli.position import StreamPosition
from upr_cli.protocol.decoder import DcpRecord


@dataclass(frozen=True, slots=True)
class StreamOpened:
    """A stream was accepted; the server's failover log, newest first."""

    partition: int
    failover_log: tuple[tuple[int, int], ...]
    position: StreamPosition


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A snapshot marker: the items that follow up to `end` form a consistent cut."""

    partition: int
    start: int
    end: int
    flags: int


@dataclass(frozen=True, slots=True)
class Rollback:
    """The server answered ROLLBACK(`asked`): the caller must undo everything above
    `to_seq`, the newest snapshot boundary at or below `asked` that the consumer knows
    the caller reached (docs/design.md, "Snapshot boundaries"); the stream restarts
    there. `to_seq < asked` when `asked` fell inside a snapshot the caller received."""

    partition: int
    previous: StreamPosition
    to_seq: int
    uuid: int
    asked: int


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """The stream ended (status per docs/protocol.md §2.6; 0 = end seq reached, 7 =
    every collection of the stream's filter was dropped)."""

    partition: int
    status: int
    position: StreamPosition


@dataclass(frozen=True, slots=True)
class BarrierReached:
    """A barrier cookie came back (formats/barrier.md): `cut` is consistent across partitions."""

    cookie: bytes
    cut: dict[int, int]


Event = StreamOpened | Snapshot | Rollback | StreamEnded | BarrierReached | ManifestChange
#: what `DcpConsumer.batches()` yields: data rows (`DcpRecord` order) and events
Item = DcpRecord | Event

__all__ = ["BarrierReached", "Event", "Item", "ManifestChange", "Rollback", "Snapshot",
           "StreamEnded", "StreamOpened"]  # fmt: skip
