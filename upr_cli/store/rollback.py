"""Rollback and reset of a store's partition (formats/store.md §5.3, §5.4), from the
mutation log (formats/store.md §3.4), keeping what they take back as lost writes
(formats/store.md §3.5).

Theory of operation
-------------------
* **The mutation log** (the UPR design specification, "Client and Mutation Log")
  records, for every applied change, the row it replaced (NULLs when the key did not
  exist), at most `undo_window` entries per partition, oldest dropped first (written by
  `upr_cli.store.apply`). `roll_back(p, r)` undoes the changes above r: for each key,
  the replaced row of its OLDEST change above r is the key's state at r (which is what
  undoing the changes one by one, newest first, ends with), so it is put back, or the
  document is deleted if that entry is all NULLs. `log_floor` is the highest seq whose
  change can no longer be undone (trimmed, never logged, or written by a restore): a
  rollback below it is "too far" and the caller resets the partition.
* **Lost writes.** The versions a rollback or a reset takes away are first copied to
  `lost_writes`, for `upr salvage --store`.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from upr_cli.position import StreamPosition
from upr_cli.sqlite import i64 as _i64
from upr_cli.store.apply import DOC_COLUMNS, PREV_COLUMNS
from upr_cli.store.partitions import SavedState, parse_log, read_state, save_boundary, save_state
from upr_cli.store.schema import now_iso

# For each key changed above :r, its oldest logged change above :r: when the row it
# replaced is at or below :r, that row is the key's state at :r and is put back. Every
# document still above :r afterwards was created above :r (its first change above :r
# replaced nothing, or replaced a version itself above :r), so it is deleted. (No WITH
# clause: sqlite3 reports no rowcount for a statement that does not start with INSERT,
# UPDATE, DELETE or REPLACE.)
_FIRST_ABOVE = """
(SELECT collection_id, key, min(seq) AS seq FROM mutation_log WHERE partition = :p AND seq > :r
 GROUP BY collection_id, key) AS first
JOIN mutation_log AS m ON m.partition = :p AND m.seq = first.seq
 AND m.collection_id = first.collection_id AND m.key = first.key
"""
_UNDO_RESTORE = f"""
INSERT OR REPLACE INTO documents ({DOC_COLUMNS})
SELECT m.partition, m.key, {PREV_COLUMNS.replace("prev_", "m.prev_")}, m.collection_id,
       m.prev_xattrs
FROM {_FIRST_ABOVE} WHERE m.prev_seq IS NOT NULL AND m.prev_seq <= :r
"""
_UNDO_DELETE = "DELETE FROM documents WHERE partition = :p AND seq > :r"
# The newest version of every key changed above :r: what a rollback to :r takes away
# (lost writes: formats/store.md §3.5), kept in `lost_writes` for `upr salvage --store`.
_KEEP_LOST = f"""
INSERT INTO lost_writes ({DOC_COLUMNS}, uuid, rolled_back_to, recorded)
SELECT {DOC_COLUMNS}, :uuid, :r, :now FROM documents WHERE partition = :p AND seq > :r
ORDER BY seq
"""


@dataclass(frozen=True, slots=True)
class RollbackResult:
    """What `rollback` did, or that it could not (`too_far`: reset and restream from 0)."""

    partition: int
    from_seq: int
    to_seq: int
    too_far: bool
    log_floor: int
    undone: int = 0  # mutation log entries above to_seq removed
    restored: int = 0  # documents put back to their version at to_seq
    deleted: int = 0  # documents removed: they did not exist at to_seq
    position: StreamPosition | None = None  # the new position; None when too far
    lost: int = 0  # versions above to_seq kept in `lost_writes` (for `upr salvage --store`)

    def __str__(self) -> str:
        p = self.partition
        if self.too_far:
            return (
                f"partition {p}: cannot roll back from seq {self.from_seq} to {self.to_seq}: "
                f"the mutation log reaches back only to seq {self.log_floor}"
            )
        return (
            f"partition {p}: rolled back from seq {self.from_seq} to {self.to_seq}: "
            f"{self.lost} newer versions taken back (kept for salvage), "
            f"{self.restored} documents restored, {self.deleted} removed"
        )


def roll_back(
    db: sqlite3.Connection, path: Path, partition: int, to_seq: int, uuid: int | None,
    lost_above: int | None, added: dict[int, int],
) -> RollbackResult:  # fmt: skip
    """`Store.rollback` inside its transaction: undo a partition's changes above `to_seq`
    (`path` names the store in errors; `added` is `save_boundary`'s count)."""
    state = read_state(db, partition)
    held = state.position.seq if state else 0
    if to_seq < 0 or to_seq > held:
        raise ValueError(
            f"partition {partition}: cannot roll back to seq {to_seq}: the store holds seq {held}"
        )
    if state is None:  # nothing stored, to_seq is 0
        return RollbackResult(partition, 0, 0, False, 0, position=None)
    if to_seq < state.log_floor:
        return RollbackResult(partition, held, to_seq, True, state.log_floor)
    args = {"p": partition, "r": _i64(to_seq)}
    cut = to_seq if lost_above is None else max(to_seq, lost_above)
    lost = db.execute(
        _KEEP_LOST,
        args | {"r": _i64(cut), "uuid": _i64(state.position.uuid), "now": now_iso()},
    ).rowcount
    restored = db.execute(_UNDO_RESTORE, args).rowcount
    deleted = db.execute(_UNDO_DELETE, args).rowcount
    undone = db.execute("DELETE FROM mutation_log WHERE partition = :p AND seq > :r", args).rowcount
    log = parse_log(path, partition, state.failover_log)
    log_text = state.failover_log
    if log is not None:
        log = log.prune_above(to_seq)
        log_text = json.dumps(log.to_json(), separators=(",", ":"))
    if uuid is None:
        entry = log.entry_at(to_seq) if log is not None else None
        uuid = entry.uuid if entry is not None else 0
    position = state.position.rolled_back(uuid, to_seq)
    save_state(
        db, SavedState(position, log_text, state.log_count - undone, state.log_floor, now_iso())
    )
    db.execute("DELETE FROM boundaries WHERE partition = :p AND seq > :r", args)
    save_boundary(db, position, state.log_floor, state.log_floor, added)
    return RollbackResult(
        partition, held, to_seq, False, state.log_floor, undone, restored, deleted, position,
        lost,
    )  # fmt: skip


def reset(db: sqlite3.Connection, partition: int, lost_above: int | None) -> int:
    """`Store.reset_partition` inside its transaction: delete a partition's documents,
    mutation log, position and boundaries, first keeping those above `lost_above` (if
    given) as lost writes; returns the number of documents deleted."""
    if lost_above is not None:
        state = read_state(db, partition)
        uuid = state.position.uuid if state else 0
        db.execute(_KEEP_LOST, {"p": partition, "r": _i64(lost_above),
                                "uuid": _i64(uuid), "now": now_iso()})  # fmt: skip
    n = db.execute("DELETE FROM documents WHERE partition = ?", (partition,)).rowcount
    db.execute("DELETE FROM mutation_log WHERE partition = ?", (partition,))
    db.execute("DELETE FROM partitions WHERE partition = ?", (partition,))
    db.execute("DELETE FROM boundaries WHERE partition = ?", (partition,))
    return int(n)
