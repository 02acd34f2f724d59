"""Where a partition's stream stands (docs/design.md "Positions"; docs/protocol.md §4.4).

A position is shared by every layer that resumes a stream: the DCP consumer, the
backup repository's resume points, the store and the Spark source all hold one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from upr_cli.errors import UsageError


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """The last seq received and the last snapshot's bounds, on branch `uuid`.

    A resume sends start = seq, uuid, snap_start, snap_end (docs/protocol.md §2.4, §4.4).
    """

    partition: int
    uuid: int = 0
    seq: int = 0
    snap_start: int = 0
    snap_end: int = 0

    @classmethod
    def beginning(cls, partition: int) -> StreamPosition:
        """No history: start 0, uuid 0."""
        return cls(partition)

    @property
    def complete(self) -> bool:
        """True when the last snapshot was received entirely (seq == snap_end): the state
        up to `seq` is then one the source really had, a snapshot boundary. Inside a
        snapshot it is not, since deduplication left out the versions that later ones
        in it replaced (docs/design.md, "Snapshot boundaries")."""
        return self.seq == self.snap_end

    def at(self, seq: int) -> StreamPosition:
        """Received the item with this seq."""
        return replace(self, seq=seq)

    def marker(self, start: int, end: int) -> StreamPosition:
        """Received a snapshot marker [start, end]."""
        return replace(self, snap_start=start, snap_end=end)

    def rolled_back(self, uuid: int, seq: int) -> StreamPosition:
        """After ROLLBACK(seq): restart from (seq, seq, seq) on `uuid` (docs/protocol.md §4.4)."""
        return StreamPosition(self.partition, uuid, seq, seq, seq)

    def to_json(self) -> dict[str, Any]:
        """64-bit values as decimal strings, as everywhere in upr's JSON."""
        return {"partition": self.partition, "uuid": str(self.uuid), "seq": str(self.seq),
                "snap_start": str(self.snap_start), "snap_end": str(self.snap_end)}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any) -> StreamPosition:
        """Parse `to_json` output; malformed input raises UsageError."""
        try:
            return cls(int(obj["partition"]), int(obj["uuid"]), int(obj["seq"]),
                       int(obj["snap_start"]), int(obj["snap_end"]))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"malformed stream position: {exc}") from None


def boundary_at(boundaries: Iterable[int], seq: int) -> int:
    """The newest snapshot boundary at or below `seq`; 0 (the empty state, which every
    client can return to) when there is none. `boundaries` need not be sorted."""
    ordered = sorted(set(boundaries))
    i = bisect.bisect_right(ordered, seq)
    return ordered[i - 1] if i else 0
