"""Each partition's saved state in the store (formats/store.md §3.3 `partitions`) and its
snapshot boundaries (formats/store.md §3.6 `boundaries`).

Theory of operation
-------------------
* **A position is saved only with the changes it covers** (docs/design.md "Positions"):
  the store's writes save a partition's `SavedState` (position, failover log, undo log
  extent) in the transaction that wrote its rows.
* **Snapshot boundaries** (docs/design.md "Snapshot boundaries"). Inside a deduplicated
  snapshot the store's state is not one the source ever had, so a rollback must land on
  a boundary: a saved position that ended (or had not begun) its snapshot. Every save
  of such a position records it (`save_boundary`), a rollback keeps those at or below
  its target, and those below `log_floor`, out of the log's reach, are dropped as the
  floor rises; the newest `KEEP_BOUNDARIES` of a partition are kept.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from upr_cli.errors import UsageError
from upr_cli.failover import FailoverLog
from upr_cli.position import StreamPosition
from upr_cli.sqlite import i64 as _i64
from upr_cli.sqlite import u64 as _u64
from upr_cli.store.schema import StoreError

KEEP_BOUNDARIES = 256  # snapshot boundaries kept per partition (formats/store.md §3.6)

_PARTITION_COLUMNS = (
    "partition, uuid, seq, snap_start, snap_end, failover_log, log_count, log_floor, updated"
)


class SavedState(NamedTuple):
    """A `partitions` row as stored (64-bit values decoded, failover log as JSON text)."""

    position: StreamPosition
    failover_log: str | None
    log_count: int
    log_floor: int
    updated: str


@dataclass(frozen=True, slots=True)
class PartitionState:
    """What the store knows of one partition: position, failover log, undo log extent."""

    position: StreamPosition
    failover_log: FailoverLog | None  # None until one is saved
    log_count: int  # mutation log entries held
    log_floor: int  # a rollback can reach any seq ≥ log_floor
    updated: str  # ISO 8601 UTC time of the last change


def read_state(db: sqlite3.Connection, partition: int) -> SavedState | None:
    """A partition's `partitions` row, or None if the store has none."""
    row = db.execute(
        "SELECT uuid, seq, snap_start, snap_end, failover_log, log_count, log_floor, updated"
        " FROM partitions WHERE partition = ?",
        (partition,),
    ).fetchone()
    if row is None:
        return None
    uuid, seq, s_start, s_end, log, count, floor, updated = row
    position = StreamPosition(partition, _u64(uuid), _u64(seq), _u64(s_start), _u64(s_end))
    return SavedState(position, log, count, _u64(floor), updated)


def save_state(db: sqlite3.Connection, state: SavedState) -> None:
    """Write a partition's `partitions` row (inside the caller's transaction)."""
    p = state.position
    db.execute(
        f"INSERT OR REPLACE INTO partitions ({_PARTITION_COLUMNS})"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (p.partition, _i64(p.uuid), _i64(p.seq), _i64(p.snap_start), _i64(p.snap_end),
         state.failover_log, state.log_count, _i64(state.log_floor), state.updated),
    )  # fmt: skip


def save_boundary(
    db: sqlite3.Connection, position: StreamPosition, floor: int, old_floor: int,
    added: dict[int, int],
) -> None:  # fmt: skip
    """Record a saved position that is a snapshot boundary; drop the boundaries a
    risen log floor put out of a rollback's reach (formats/store.md §3.6). `added`
    counts, per partition, the boundaries recorded since the last trim."""
    if floor > old_floor:
        db.execute(
            "DELETE FROM boundaries WHERE partition = ? AND seq < ?",
            (position.partition, _i64(floor)),
        )
    if position.complete and position.seq >= floor:
        db.execute(
            "INSERT OR IGNORE INTO boundaries (partition, seq) VALUES (?, ?)",
            (position.partition, _i64(position.seq)),
        )
        # the newest KEEP_BOUNDARIES only: a rollback further back lands on the
        # oldest kept (more streamed again), never wrong; trimmed now and then
        n = added.get(position.partition, 0) + 1
        added[position.partition] = n % KEEP_BOUNDARIES
        if n == KEEP_BOUNDARIES:
            db.execute(
                "DELETE FROM boundaries WHERE partition = :p AND seq < (SELECT seq FROM"
                " boundaries WHERE partition = :p ORDER BY seq DESC LIMIT 1 OFFSET :k)",
                {"p": position.partition, "k": KEEP_BOUNDARIES - 1},
            )


def newest_logged(db: sqlite3.Connection, partition: int) -> int:
    """The highest seq in a partition's mutation log (0 for none)."""
    top = db.execute(
        "SELECT max(seq) FROM mutation_log WHERE partition = ?", (partition,)
    ).fetchone()[0]
    return 0 if top is None else _u64(top)


def parse_log(path: Path, partition: int, text: str | None) -> FailoverLog | None:
    """A stored failover log (StoreError naming the store `path` when corrupt)."""
    if text is None:
        return None
    try:
        return FailoverLog.from_json(json.loads(text))
    except (ValueError, UsageError) as exc:
        raise StoreError(f"{path}: partition {partition}: corrupt failover log: {exc}") from None


def log_text(failover_log: FailoverLog | None, state: SavedState | None) -> str | None:
    """The failover log to store: the one given (as compact JSON), else the one kept."""
    if failover_log is not None:
        return json.dumps(failover_log.to_json(), separators=(",", ":"))
    return state.failover_log if state else None


def boundaries(db: sqlite3.Connection, partition: int | None) -> dict[int, list[int]]:
    """The recorded boundaries at or above each partition's log floor (ascending), of one
    partition or all."""
    where, args = ("WHERE b.partition = ?", [partition]) if partition is not None else ("", [])
    rows = db.execute(
        "SELECT b.partition, b.seq FROM boundaries AS b JOIN partitions AS p"
        f" ON p.partition = b.partition AND b.seq >= p.log_floor {where}"
        " ORDER BY b.partition, b.seq",
        args,
    )
    out: dict[int, list[int]] = {}
    for p, seq in rows:
        out.setdefault(p, []).append(_u64(seq))
    return out


def positions(db: sqlite3.Connection) -> dict[int, StreamPosition]:
    """Every saved position, by partition."""
    rows = db.execute(
        "SELECT partition, uuid, seq, snap_start, snap_end FROM partitions ORDER BY partition"
    ).fetchall()
    return {p: StreamPosition(p, _u64(u), _u64(s), _u64(a), _u64(b)) for p, u, s, a, b in rows}
