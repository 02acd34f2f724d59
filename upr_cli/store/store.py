"""The SQLite store: the target of `upr restore … sqlite:PATH` and `upr replay --into`.

Theory of operation (formats/store.md is the normative spec)
------------------------------------------------------------
* **State = documents + positions.** `documents` holds the latest version of every key
  of every partition, tombstones included (`deleted = 1`), so a rollback can put a
  tombstone back and a reader can tell a deletion from absence. `partitions` holds each
  partition's `StreamPosition` and failover log.
* **A position is saved only with the changes it covers** (docs/design.md "Positions",
  "Rollback"). `apply` writes one snapshot's rows, their undo entries and the new
  position in ONE transaction; `batch()` widens that transaction over several calls
  (inner calls become savepoints, so a failed inner call undoes only itself). After a
  crash the store holds exactly the changes up to each saved position, and a resume
  restarts there.
* **The mutation log** (the UPR design specification, "Client and Mutation Log")
  records, for every applied change, the row it replaced (NULLs when the key did not
  exist), at most `undo_window` entries per partition, oldest dropped first.
  `rollback(p, r)` undoes the changes above r: for each key, the replaced row of its
  OLDEST change above r is the key's state at r (which is what undoing the changes one
  by one, newest first, ends with), so it is put back, or the document is deleted if
  that entry is all NULLs. `log_floor` is the highest seq whose change can no longer be
  undone (trimmed, never logged, or written by a restore): a rollback below it is "too
  far" and the caller resets the partition.
* **Hot path without per-row Python.** Records are bound exactly as the decoder yields
  them (`DcpRecord`, key and value as memoryviews) with `executemany`; SQL maps the
  opcode to `deleted` and stores JSON values as TEXT. Undo entries are captured in bulk,
  one INSERT … SELECT per up to 256 changes. Checks that need every row (seq order,
  partition, opcode) run over columns with C-level `map`/`set`. 64-bit values above
  2^63-1 are rare (a cas would have to be from after 2262), so rows whose seqs, rev
  seqs and cas all fit are bound as they are; otherwise they are first bound as they
  are inside a savepoint and, if SQLite refuses an integer, the statements are undone
  to it and the rows re-bound with u64 → i64 conversion.
* **Snapshot boundaries** (formats/store.md §3.6). Inside a deduplicated snapshot the
  store's state is not one the source ever had, so a rollback must land on a boundary:
  a saved position that ended (or had not begun) its snapshot. `apply` and
  `set_position` record such positions, a rollback keeps those at or below its target,
  and those below `log_floor`, out of the log's reach, are dropped as the floor rises.
* **Collections** (formats/store.md §3.8, §5.5). A document is (partition, collection
  id, key); names live apart, by id, since an id never changes its meaning. `apply`
  takes a partition's manifest changes with its rows and applies them in seq order: a
  drop logs each document of the collection as a change at the drop's seq, then
  deletes it, so the ordinary rollback (oldest entry above the target) puts it back.
* **Xattrs** (formats/store.md §3.9) are kept beside the value as the JSON text of an
  object, NULL for none, in `documents`, `lost_writes` and (`prev_xattrs`) the mutation
  log, so a rollback puts them back. A record's blob is turned into that text by an SQL
  function calling Python only for rows that have one; a batch with none binds no
  xattrs at all.
* **64-bit values** (seq, rev_seq, cas, uuid, snapshot bounds) are stored as their two's
  complement i64, as `upr_cli.node.storage` does; SQL comparisons are signed, exact for
  seqs below 2^63, the range a producer hands out.

One thread at a time may use a Store (it may be a worker thread: docs/design.md
"Performance").
"""

from __future__ import annotations

import contextlib
import functools
import json
import operator
import sqlite3
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from operator import itemgetter, lt
from pathlib import Path
from typing import Any, NamedTuple, Self, TypeVar, cast

import sqlite_utils

from upr_cli import sqlite
from upr_cli.collections import Manifest, ManifestChange
from upr_cli.errors import UsageError
from upr_cli.failover import FailoverLog
from upr_cli.position import StreamPosition
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import (
    OP_DELETION,
    OP_EXPIRATION,
    OP_MUTATION,
    ROW_FIELDS,
    DcpRecord,
)
from upr_cli.sqlite import I64_MAX as _I64_MAX
from upr_cli.sqlite import TWO64 as _TWO64
from upr_cli.sqlite import i64 as _i64
from upr_cli.sqlite import u64 as _u64
from upr_cli.store.content import ContentHasher, Document, xattrs_json
from upr_cli.store.schema import StoreError, init_schema, now_iso
from upr_cli.store.schema import set_meta as _set_meta

# What `apply` and `restore_rows` take: DcpRecords, or plain tuples in ROW_FIELDS order
# (converted once on entry, by `_records`); everything inside works on DcpRecords.
Row = tuple[Any, ...]
T = TypeVar("T")
#: What `apply_many` takes: `apply`'s arguments, (partition, rows, position,
#: failover_log), optionally followed by the manifest changes among the rows.
Work = (
    tuple[int, Iterable[Row], StreamPosition, FailoverLog | None]
    | tuple[int, Iterable[Row], StreamPosition, FailoverLog | None, Sequence[ManifestChange]]
)

DEFAULT_UNDO_WINDOW = 10_000
KEEP_BOUNDARIES = 256  # snapshot boundaries kept per partition (formats/store.md §3.6)
_DATA_OPS = frozenset({OP_MUTATION, OP_DELETION, OP_EXPIRATION})
_CHANGE_KINDS = frozenset({"collection-created", "collection-dropped", "scope-created",
                           "scope-dropped"})  # fmt: skip
_CACHE_KIB = 32 * 1024
_FETCH = 4096

# Column extractors run by `map` in C over a whole batch (see the module header). Rows
# are bound by position in ROW_FIELDS order (the SQL layer); each getter finds its
# field's position by name once, and reads a DcpRecord and a plain row in that order
# alike (a restore hands plain rows: no record object a row, its hot path).
_field = ROW_FIELDS.index
_get_op = itemgetter(_field("opcode"))
_get_partition = itemgetter(_field("vbucket"))
_get_seq = itemgetter(_field("by_seqno"))
_get_rev = itemgetter(_field("rev_seqno"))
_get_cas = itemgetter(_field("cas"))
# a document's identity inside its partition: (collection id, key)
_get_ckey = itemgetter(_field("collection"), _field("key"))
_get_xattrs = itemgetter(_field("xattrs"))

_DOC_COLUMNS = (
    "partition, key, seq, rev_seq, cas, flags, expiry, delete_time, datatype, deleted, value,"
    " collection_id, xattrs"
)
_DOC_SELECT = (
    "partition, key, seq, rev_seq, cas, flags, expiry, delete_time, datatype, deleted,"
    " CAST(value AS BLOB), collection_id, xattrs"
)
#: the SQL function (registered on the store's connection) that turns an xattr blob into
#: the `xattrs` column's JSON text (formats/store.md §3.9)
_XATTRS_SQL = "upr_xattrs_json"
_XATTRS_OF_ROW = f"CASE WHEN length(?14) THEN {_XATTRS_SQL}(?14, ?10) END"

# The SQL layer: a record (a tuple) is bound positionally, as ?1..?14 in ROW_FIELDS order
# (opcode, vbucket, by_seqno, rev_seqno, cas, flags, expiration, delete_time, datatype,
# key, value, opaque, collection, xattrs), so no per-row Python runs to bind it. An
# unknown opcode gives deleted = NULL, which the NOT NULL constraint rejects. ?12 (opaque)
# is unused: the `0 * (?12 IS NULL)` term, always 0, only makes the statement take the
# parameters a row carries. (A VALUES list, not INSERT … SELECT: measured twice as fast.)
# A row without xattrs (b"", nearly every row) runs no Python; a blob goes through
# `_XATTRS_SQL` to its JSON text.
_UPSERT_ROW = f"""
INSERT OR REPLACE INTO documents ({_DOC_COLUMNS}) VALUES (
    ?2, ?10, ?3, ?4, ?5, ?6, ?7, ?8, ?9,
    CASE ?1 WHEN {OP_MUTATION} THEN 0 WHEN {OP_DELETION} THEN 1 WHEN {OP_EXPIRATION} THEN 1 END
        + 0 * (?12 IS NULL),
    CASE WHEN ?9 & 7 = 1 THEN CAST(?11 AS TEXT) ELSE ?11 END,
    ?13,
    {_XATTRS_OF_ROW}
)
"""
# Rows bound without their xattrs (13 fields: a batch in which no row has any, or plain
# rows written before records carried them) get NULL, and rows of 12 (before
# collections) are in the default collection: the same statement with those parameters
# constants, picked by the number of fields bound. Leaving the empty xattrs unbound
# keeps the common batch at the cost it had before xattrs (measured: binding and testing
# ?14 on every row cost about 5% of the rate).
_UPSERT_BY_WIDTH = {
    len(ROW_FIELDS): _UPSERT_ROW,
    len(ROW_FIELDS) - 1: _UPSERT_ROW.replace(_XATTRS_OF_ROW, "NULL", 1),
    len(ROW_FIELDS) - 2: _UPSERT_ROW.replace(_XATTRS_OF_ROW, "NULL", 1).replace("?13", "0", 1),
}
# the same statements inserting only keys that have no document yet
_INSERT_BY_WIDTH = {
    n: sql.replace("INSERT OR REPLACE", "INSERT OR IGNORE", 1)
    for n, sql in _UPSERT_BY_WIDTH.items()
}


_PREV_COLUMNS = (
    "prev_seq, prev_rev_seq, prev_cas, prev_flags, prev_expiry, prev_delete_time,"
    " prev_datatype, prev_deleted, prev_value"
)


# The rows that `size` changes replace, read before the changes are written: a VALUES
# list of (partition, seq, collection, key) JOINed with documents. A change that creates its key has
# no entry: a rollback finds it as a document above the target seq (formats/store.md §3.4),
# so a first replay writes no log at all. One statement per up to 256 changes: a statement
# per change measured at half the rate, the per-statement cost dominating.
@functools.cache
def _log_sql(size: int) -> str:
    values = ",".join(["(?,?,?,?)"] * size)
    return f"""
INSERT INTO mutation_log (partition, seq, collection_id, key, {_PREV_COLUMNS}, prev_xattrs)
SELECT v.column1, v.column2, v.column3, v.column4, d.seq, d.rev_seq, d.cas, d.flags,
       d.expiry, d.delete_time, d.datatype, d.deleted, d.value, d.xattrs
FROM (VALUES {values}) AS v
JOIN documents AS d
  ON d.partition = v.column1 AND d.collection_id = v.column3 AND d.key = v.column4
"""


_LOG_SIZES = (256, 64, 16, 4, 1)  # a few statement shapes, so the statement cache hits
_log_key = itemgetter(_field("vbucket"), _field("by_seqno"), _field("collection"), _field("key"))


def _log_previous(db: sqlite3.Connection, rows: Sequence[DcpRecord]) -> int:
    """Insert the undo entries of rows whose keys are distinct (see `_unique_key_runs`);
    returns how many were inserted (one per row whose key already had a document)."""
    i, n, logged = 0, len(rows), 0
    for size in _LOG_SIZES:
        sql = _log_sql(size)
        while n - i >= size:
            cur = db.execute(sql, list(chain.from_iterable(map(_log_key, rows[i : i + size]))))
            logged += cur.rowcount
            i += size
    return logged


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
INSERT OR REPLACE INTO documents ({_DOC_COLUMNS})
SELECT m.partition, m.key, {_PREV_COLUMNS.replace("prev_", "m.prev_")}, m.collection_id,
       m.prev_xattrs
FROM {_FIRST_ABOVE} WHERE m.prev_seq IS NOT NULL AND m.prev_seq <= :r
"""
_UNDO_DELETE = "DELETE FROM documents WHERE partition = :p AND seq > :r"
# The newest version of every key changed above :r: what a rollback to :r takes away
# (lost writes: formats/store.md §3.5), kept in `lost_writes` for `upr salvage --store`.
_KEEP_LOST = f"""
INSERT INTO lost_writes ({_DOC_COLUMNS}, uuid, rolled_back_to, recorded)
SELECT {_DOC_COLUMNS}, :uuid, :r, :now FROM documents WHERE partition = :p AND seq > :r
ORDER BY seq
"""

_PARTITION_COLUMNS = (
    "partition, uuid, seq, snap_start, snap_end, failover_log, log_count, log_floor, updated"
)


def _i64_rows(rows: Sequence[Row]) -> list[DcpRecord]:
    """Rows with seq, rev seq and cas converted to i64 where they exceed 2^63-1."""
    m, conv = _I64_MAX, _i64
    return [
        r if r.by_seqno <= m and r.rev_seqno <= m and r.cas <= m
        else r._replace(by_seqno=conv(r.by_seqno), rev_seqno=conv(r.rev_seqno), cas=conv(r.cas))
        for r in _records(rows)
    ]  # fmt: skip


def _not_inserted(
    db: sqlite3.Connection, partition: int, rows: Sequence[DcpRecord]
) -> list[DcpRecord]:
    """The rows the inserting statement ignored: their key's stored seq is not theirs (a
    stored row is always below every row being applied, so an inserted row is one whose
    seq is)."""
    stored: dict[tuple[int, bytes], int] = {}
    keys = [(r.collection, bytes(r.key)) for r in rows]
    for i in range(0, len(keys), 500):
        chunk = sorted({k for _c, k in keys[i : i + 500]})
        stored.update(
            ((c, k), seq)
            for c, k, seq in db.execute(
                "SELECT collection_id, key, seq FROM documents WHERE partition = ? AND key IN"
                f" ({','.join('?' * len(chunk))})",
                [partition, *chunk],
            )
        )
    m = _I64_MAX  # rows may come already converted to i64 (`_i64_retry`)
    return [
        r
        for r, k in zip(rows, keys, strict=True)
        if stored.get(k) != (r.by_seqno - _TWO64 if r.by_seqno > m else r.by_seqno)
    ]


def _unique_key_runs(rows: Sequence[DcpRecord]) -> list[Sequence[DcpRecord]]:
    """Split rows into consecutive runs in which no (collection, key) repeats (usually
    one run).

    A run's undo entries are read before its rows are written, so a key changed twice
    in one call must have its second change in a later run.
    """
    keys: list[Any] = list(map(_get_ckey, rows))
    try:
        distinct = len(set(keys))
    except (TypeError, ValueError):  # memoryviews of writable buffers are not hashable
        keys = [(c, bytes(k)) for c, k in keys]
        distinct = len(set(keys))
    if distinct == len(keys):
        return [rows]
    runs: list[Sequence[DcpRecord]] = []
    seen: set[Any] = set()
    start = 0
    for i, key in enumerate(keys):
        if key in seen:
            runs.append(rows[start:i])
            seen, start = set(), i
        seen.add(key)
    runs.append(rows[start:])
    return runs


def _write_rows(db: sqlite3.Connection, rows: Sequence[Row], *, new_only: bool = False) -> None:
    """Write `rows` with one `executemany`: replacing, or inserting only keys that have
    no document yet (`new_only`; the others are then logged and written by the replacing
    statement).

    Records are bound as plain tuples: sqlite3 binds an exact tuple straight from its
    items but a tuple subclass (a NamedTuple) one `__getitem__` call per column, about
    0.6 µs a row more (measured: 1.6 against 2.2 µs a row). Rows are bound without their
    xattrs when none has any (one C-level pass tells). The rows of one batch come from
    one producer: all records or all plain rows of one width (the first row's)."""
    if not rows:
        return
    width = len(rows[0])
    params: Iterable[Row] = rows
    if width == len(ROW_FIELDS) and not any(map(_get_xattrs, rows)):
        width -= 1
        params = map(_STORED_BARE, rows)
    elif type(rows[0]) is not tuple:
        params = map(_STORED, rows)
    sql = (_INSERT_BY_WIDTH if new_only else _UPSERT_BY_WIDTH).get(width, _UPSERT_ROW)
    db.executemany(sql, params)


_STORED = operator.itemgetter(*range(len(ROW_FIELDS)))  # a record's fields, as a tuple
_STORED_BARE = operator.itemgetter(*range(len(ROW_FIELDS) - 1))  # ... all but its xattrs


def _records(rows: Iterable[Row]) -> Sequence[DcpRecord]:
    """The records as a sequence; plain tuples in ROW_FIELDS order become DcpRecords."""
    given: Sequence[Row] = rows if isinstance(rows, list | tuple) else list(rows)
    if given and set(map(type, given)) == {DcpRecord}:
        return cast("Sequence[DcpRecord]", given)
    try:
        return [r if type(r) is DcpRecord else DcpRecord(*r) for r in given]
    except TypeError:
        bad = next(r for r in given if not len(ROW_FIELDS) - 2 <= len(r) <= len(ROW_FIELDS))
        raise ValueError(f"a row has {len(bad)} fields, expected {len(ROW_FIELDS)}") from None


def _check_changes(
    partition: int, changes: Sequence[ManifestChange], seqs: list[int], above: int
) -> int:
    """The highest seq of a partition's rows and changes, once checked (ValueError
    otherwise): changes of `partition`, of a kind the store knows, and every seq
    distinct, above `above`, and the changes in increasing order."""
    for c in changes:
        if c.partition != partition:
            raise ValueError(f"partition {partition}: a change of partition {c.partition} given")
        if c.kind not in _CHANGE_KINDS or (c.kind.startswith("collection") and c.collection_id
                                           is None):  # fmt: skip
            raise ValueError(f"partition {partition}: seq {c.seq}: not a manifest change")
    cs = [c.seq for c in changes]
    every = sorted([*seqs, *cs])
    if every[0] <= above:
        raise ValueError(
            f"partition {partition}: seq {every[0]} is not above {above}, the seq the store"
            " already holds (a stream must resume from the store's position)"
        )
    if cs != sorted(cs) or len(set(every)) != len(every):
        raise ValueError(f"partition {partition}: changes out of order or at a row's seq")
    return every[-1]


def _marks(values: Sequence[object]) -> str:
    return ", ".join("?" * len(values))


def _check_partition(partition: int) -> None:
    if not isinstance(partition, int) or not 0 <= partition <= 0xFFFF:
        raise ValueError(f"partition {partition!r} is not a vbucket id (0..65535)")


def _check_rows(partition: int, rows: Sequence[DcpRecord], above: int) -> list[int]:
    """The seqs of one partition's rows, checked (ValueError otherwise).

    They must be data rows of `partition` with strictly increasing seqs above `above`.
    """
    others = set(map(_get_partition, rows)) - {partition}
    if others:
        raise ValueError(f"partition {partition}: rows of partition(s) {sorted(others)} given")
    ops = set(map(_get_op, rows)) - _DATA_OPS
    if ops:
        raise ValueError(
            f"partition {partition}: opcode(s) {', '.join(f'0x{o:02x}' for o in sorted(ops))}"
            " are not mutation, deletion or expiration"
        )
    seqs: list[int] = list(map(_get_seq, rows))
    if seqs[0] <= above:
        raise ValueError(
            f"partition {partition}: seq {seqs[0]} is not above {above}, the seq the store"
            " already holds (a stream must resume from the store's position)"
        )
    if not all(map(lt, seqs, islice(seqs, 1, None))):
        i = next(i for i in range(1, len(seqs)) if seqs[i] <= seqs[i - 1])
        raise ValueError(
            f"partition {partition}: seqs do not increase: {seqs[i]} follows {seqs[i - 1]}"
        )
    return seqs


def _by_partition(rows: Sequence[Row]) -> tuple[Sequence[Row], dict[int, int]]:
    """The rows grouped by partition, stably, and each partition's highest seq.

    Rows already grouped (a restore reads one partition at a time) cost two C-level
    passes; mixed rows are sorted, which also turns random b-tree inserts into nearly
    sequential ones (measured: faster than inserting them unsorted).
    """
    parts: list[int] = list(map(_get_partition, rows))
    ordered = sorted(parts)
    if parts != ordered:
        rows = sorted(rows, key=_get_partition)
    tops: dict[int, int] = {}
    lo = 0
    for p in sorted(set(ordered)):
        hi = bisect_right(ordered, p, lo)
        tops[p] = max(map(_get_seq, rows[lo:hi]))
        lo = hi
    return rows, tops


def _bad_row(rows: Sequence[Row], exc: Exception) -> str:
    """Explain why SQLite rejected a batch (called only after a failure)."""
    for r in _records(rows):
        if r.opcode not in _DATA_OPS:
            return (f"row with seq {r.by_seqno}: opcode {r.opcode!r} is not mutation, deletion"
                    " or expiration")  # fmt: skip
        if r.key is None or r.value is None:
            return f"row with seq {r.by_seqno}: key and value must be bytes, not None"
    return str(exc)


class _Aborted(Exception):
    """Raised into an open transaction to roll it back (`Store.abort`)."""


class _State(NamedTuple):
    """A `partitions` row as stored (64-bit values decoded, failover log as JSON text)."""

    position: StreamPosition
    failover_log: str | None
    log_count: int
    log_floor: int
    updated: str


def _log_text(failover_log: FailoverLog | None, state: _State | None) -> str | None:
    """The failover log to store: the one given (as compact JSON), else the one kept."""
    if failover_log is not None:
        return json.dumps(failover_log.to_json(), separators=(",", ":"))
    return state.failover_log if state else None


@dataclass(frozen=True, slots=True)
class PartitionState:
    """What the store knows of one partition: position, failover log, undo log extent."""

    position: StreamPosition
    failover_log: FailoverLog | None  # None until one is saved
    log_count: int  # mutation log entries held
    log_floor: int  # a rollback can reach any seq ≥ log_floor
    updated: str  # ISO 8601 UTC time of the last change


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


@dataclass(frozen=True, slots=True)
class StoredCollection:
    """A collection's names as the store recorded them (`collections`, `scopes`)."""

    id: int
    scope: str | None  # None: the store never saw its scope's name
    name: str
    max_ttl: int | None
    dropped: bool

    def __str__(self) -> str:
        return f"{self.scope}.{self.name}"


@dataclass(frozen=True, slots=True)
class LostWrite:
    """A version a rollback took back: the newest version of its key above the cut."""

    id: int
    document: Document
    uuid: int  # the branch the store followed when it held this version
    rolled_back_to: int  # the rollback seq that took it back
    recorded: str  # when (ISO 8601 UTC)
    salvaged: str | None  # when `upr salvage --apply` wrote it back, if it did


class Store(sqlite.Closing):
    """A store file (formats/store.md), opened or created; one writer connection."""

    def __init__(
        self,
        path: Path | str,
        *,
        undo_window: int = DEFAULT_UNDO_WINDOW,
        create: bool = True,
        source: str | None = None,
    ) -> None:
        if not isinstance(undo_window, int) or undo_window < 0:
            raise UsageError(f"undo window must be a non-negative integer, got {undo_window!r}")
        self.path = Path(path)
        self.undo_window = undo_window
        self._conn: sqlite3.Connection | None = None
        self._depth = 0  # open write transactions: 1 = BEGIN, more = savepoints
        self._flat = False  # inner writes join the open transaction without a savepoint
        self._utils: sqlite_utils.Database | None = None
        self._open: contextlib.ExitStack | None = None  # a transaction `begin` opened
        self._bounds_added: dict[int, int] = {}  # boundaries recorded since the last trim
        self._bad_xattrs: xattrs.CorruptXattrsError | None = None  # raised in `_XATTRS_SQL`
        if not create and not self.path.is_file():
            raise StoreError(f"{self.path}: no such store")
        try:
            target = f"{self.path.resolve().as_uri()}?mode={'rwc' if create else 'rw'}"
            conn = sqlite.connect(target, uri=True)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open: {exc}") from None
        try:
            sqlite.set_writer_pragmas(conn, self.path, synchronous="NORMAL",
                                      cache_kib=_CACHE_KIB, error=StoreError)  # fmt: skip
            init_schema(conn, self.path, create=create, source=source)
        except sqlite3.DatabaseError as exc:
            conn.close()
            if "not a database" in str(exc):
                raise StoreError(
                    f"{self.path}: not an upr store (not an SQLite database)"
                ) from None
            raise StoreError(f"{self.path}: cannot open: {exc}") from None
        except BaseException:
            conn.close()
            raise
        conn.create_function(_XATTRS_SQL, 2, self._xattrs_json, deterministic=True)
        self._conn = conn

    def _xattrs_json(self, blob: bytes, key: bytes) -> str:
        """`_XATTRS_SQL`: SQLite reports an exception raised in a function only as "user-
        defined function raised exception", so a malformed blob is kept for `_write`."""
        try:
            return xattrs_json(blob, key)
        except xattrs.CorruptXattrsError as exc:
            self._bad_xattrs = exc
            raise

    # --- lifecycle

    def close(self) -> None:
        """Close the connection (idempotent); an open batch is rolled back."""
        self._open = None
        if self._conn is not None:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            self._conn.close()
            self._conn = None
            self._utils = None

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise ValueError(f"{self.path}: store is closed")
        return self._conn

    @property
    def db(self) -> sqlite_utils.Database:
        """A sqlite-utils view of the connection, for queries (writes bypass the invariants)."""
        if self._utils is None:
            self._utils = sqlite_utils.Database(self._db, execute_plugins=False)
        return self._utils

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, or a savepoint inside an open one; undone unless completed."""
        db = self._db
        depth = self._depth
        inner: contextlib.AbstractContextManager[sqlite3.Connection] = (
            sqlite.transaction(db) if not depth
            else contextlib.nullcontext(db) if self._flat
            else sqlite.savepoint(db, f"upr_{depth}")
        )  # fmt: skip
        try:
            with inner:
                self._depth += 1
                try:
                    yield db
                finally:
                    self._depth -= 1
        except (sqlite3.IntegrityError, sqlite3.InterfaceError, OverflowError) as exc:
            raise ValueError(f"{self.path}: rows rejected: {exc}") from exc
        except sqlite3.ProgrammingError as exc:
            raise ValueError(f"{self.path}: {exc}") from exc
        except sqlite3.Error as exc:
            bad, self._bad_xattrs = self._bad_xattrs, None
            if bad is not None:  # a row's xattrs were malformed: say which key
                raise bad from None
            raise StoreError(f"{self.path}: {exc}") from exc

    def _i64_retry(self, db: sqlite3.Connection, work: Callable[[Sequence[Row]], T],
                   rows: Sequence[Row]) -> T:  # fmt: skip
        """Run `work(rows)`; if SQLite refuses an integer, undo it and re-run it on i64 rows.

        See the module header: values above 2^63-1 are converted only when present. Rows
        whose seq, rev seq and cas all fit (three C-level passes tell) take no savepoint:
        a value that fails then fails the caller's transaction, as it would after the
        retry.
        """
        m = _I64_MAX
        if (
            max(map(_get_seq, rows), default=0) <= m
            and max(map(_get_rev, rows), default=0) <= m
            and max(map(_get_cas, rows), default=0) <= m
        ):
            return work(rows)
        try:
            with sqlite.savepoint(db, "upr_i64"):
                return work(rows)
        except OverflowError:
            return work(_i64_rows(rows))

    @contextlib.contextmanager
    def batch(self) -> Iterator[Self]:
        """Group several applies, restores, rollbacks and resets into ONE transaction."""
        with self._write():
            yield self

    def begin(self) -> None:
        """Open a transaction that stays open across calls until `commit` or `abort`.

        For a caller whose transaction spans waits (replay's consistent catch-up): every
        write until then joins it as a savepoint. Readers see none of it before `commit`.
        """
        if self._open is not None:
            raise ValueError(f"{self.path}: a transaction is already open")
        stack = contextlib.ExitStack()
        stack.enter_context(self._write())
        self._open = stack

    @property
    def in_transaction(self) -> bool:
        """True between `begin` and `commit`/`abort`."""
        return self._open is not None

    def commit(self) -> None:
        """Commit the transaction `begin` opened."""
        stack, self._open = self._open, None
        if stack is None:
            raise ValueError(f"{self.path}: no transaction is open")
        stack.close()

    def abort(self) -> None:
        """Undo everything since `begin` (nothing if no transaction is open)."""
        stack, self._open = self._open, None
        if stack is not None:
            stack.__exit__(_Aborted, _Aborted(), None)

    # --- partition state

    def _state(self, db: sqlite3.Connection, partition: int) -> _State | None:
        row = db.execute(
            "SELECT uuid, seq, snap_start, snap_end, failover_log, log_count, log_floor, updated"
            " FROM partitions WHERE partition = ?",
            (partition,),
        ).fetchone()
        if row is None:
            return None
        uuid, seq, s_start, s_end, log, count, floor, updated = row
        position = StreamPosition(partition, _u64(uuid), _u64(seq), _u64(s_start), _u64(s_end))
        return _State(position, log, count, _u64(floor), updated)

    def _save_state(self, db: sqlite3.Connection, state: _State) -> None:
        p = state.position
        db.execute(
            f"INSERT OR REPLACE INTO partitions ({_PARTITION_COLUMNS})"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (p.partition, _i64(p.uuid), _i64(p.seq), _i64(p.snap_start), _i64(p.snap_end),
             state.failover_log, state.log_count, _i64(state.log_floor), state.updated),
        )  # fmt: skip

    def _save_boundary(
        self, db: sqlite3.Connection, position: StreamPosition, floor: int, old_floor: int
    ) -> None:
        """Record a saved position that is a snapshot boundary; drop the boundaries a
        risen log floor put out of a rollback's reach (formats/store.md §3.6)."""
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
            n = self._bounds_added.get(position.partition, 0) + 1
            self._bounds_added[position.partition] = n % KEEP_BOUNDARIES
            if n == KEEP_BOUNDARIES:
                db.execute(
                    "DELETE FROM boundaries WHERE partition = :p AND seq < (SELECT seq FROM"
                    " boundaries WHERE partition = :p ORDER BY seq DESC LIMIT 1 OFFSET :k)",
                    {"p": position.partition, "k": KEEP_BOUNDARIES - 1},
                )

    def _newest_logged(self, db: sqlite3.Connection, partition: int) -> int:
        top = db.execute(
            "SELECT max(seq) FROM mutation_log WHERE partition = ?", (partition,)
        ).fetchone()[0]
        return 0 if top is None else _u64(top)

    def _parse_log(self, partition: int, text: str | None) -> FailoverLog | None:
        if text is None:
            return None
        try:
            return FailoverLog.from_json(json.loads(text))
        except (ValueError, UsageError) as exc:
            raise StoreError(
                f"{self.path}: partition {partition}: corrupt failover log: {exc}"
            ) from None

    # --- writes

    def _write_logged(
        self, db: sqlite3.Connection, partition: int, rows: Sequence[DcpRecord], seqs: list[int],
        count: int, floor: int,
    ) -> tuple[int, int]:  # fmt: skip
        """Write one partition's checked rows with their undo entries.

        Rows beyond the window's reach (all but the last `undo_window`) are written
        without entries, since trimming would drop those at once. Returns the new
        (log_count, log_floor), before trimming (`_trim`).
        """
        if not rows:
            return count, floor
        unlogged = max(0, len(rows) - self.undo_window)

        def work(given: Sequence[Row]) -> int:
            rows = cast("Sequence[DcpRecord]", given)  # records in, records retried
            if unlogged:
                _write_rows(db, rows[:unlogged])
            rest = rows[unlogged:]
            if not rest:
                return 0
            # Keys new to the store need no entry: insert those first, in C. If every
            # row was inserted, that is all (a first replay, a backfill of new keys).
            before = db.total_changes
            _write_rows(db, rest, new_only=True)
            if db.total_changes - before == len(rest):
                return 0
            # The others replace a row: log it, then write (in order, so a key changed
            # twice in the batch logs its first change's row for the second).
            replacing = _not_inserted(db, partition, rest)
            logged = 0
            for run in _unique_key_runs(replacing):
                logged += _log_previous(db, run)
                _write_rows(db, run)
            return logged

        try:
            count += self._i64_retry(db, work, rows)
        except sqlite3.IntegrityError as exc:
            raise ValueError(f"{self.path}: partition {partition}: {_bad_row(rows, exc)}") from exc
        if unlogged:
            floor = max(floor, seqs[unlogged - 1])
        return count, floor

    def _trim(self, db: sqlite3.Connection, partition: int, count: int, floor: int
              ) -> tuple[int, int]:  # fmt: skip
        """Drop the oldest undo entries beyond the window; the new (log_count, log_floor)."""
        window = self.undo_window
        if count <= window:
            return count, floor
        # Oldest entries first (the UPR design specification, "Client and Mutation Log":
        # "the oldest entries are removed"). A collection drop logs many entries at one
        # seq, and they go together: a rollback reaches above that seq or not at all.
        (cut,) = db.execute(
            "SELECT seq FROM mutation_log WHERE partition = ? ORDER BY seq LIMIT 1 OFFSET ?",
            (partition, count - window - 1),
        ).fetchone()
        gone = db.execute(
            "DELETE FROM mutation_log WHERE partition = ? AND seq <= ?", (partition, cut)
        ).rowcount
        return count - gone, max(floor, _u64(cut))

    def _apply_change(
        self, db: sqlite3.Connection, change: ManifestChange, count: int, floor: int
    ) -> tuple[int, int]:
        """Record a change's names; a drop removes the documents of the collection (or of
        the scope's collections) in the change's partition, each logged as a change at
        the drop's seq, so a rollback below it puts them back (formats/store.md §5.5)."""
        p, seq = change.partition, _i64(change.seq)
        if change.kind == "collection-created":
            self._name_collection(db, change.collection_id, change.scope_id, change.name,
                                  change.max_ttl)  # fmt: skip
            return count, floor
        if change.kind == "scope-created":
            db.execute(
                "INSERT INTO scopes (id, name) VALUES (?, ?) ON CONFLICT (id)"
                " DO UPDATE SET name = excluded.name, dropped = 0",
                (change.scope_id, change.name or ""),
            )
            return count, floor
        if change.kind == "collection-dropped":
            where, args = "collection_id = ?", [change.collection_id]
            db.execute("UPDATE collections SET dropped = 1 WHERE id = ?", args)
        else:  # a scope's collections go with it (each has its own drop event as well)
            where = "collection_id IN (SELECT id FROM collections WHERE scope_id = ?)"
            args = [change.scope_id]
            db.execute("UPDATE scopes SET dropped = 1 WHERE id = ?", args)
            db.execute("UPDATE collections SET dropped = 1 WHERE scope_id = ?", args)
        if self.undo_window:
            count += db.execute(
                f"INSERT INTO mutation_log (partition, seq, collection_id, key, {_PREV_COLUMNS},"
                " prev_xattrs) SELECT partition, ?, collection_id, key, seq, rev_seq, cas, flags,"
                " expiry, delete_time, datatype, deleted, value, xattrs FROM documents"
                " WHERE partition = ?"
                f" AND {where}",
                [seq, p, *args],
            ).rowcount
        else:
            floor = max(floor, change.seq)  # nothing is logged: the drop cannot be undone
        db.execute(f"DELETE FROM documents WHERE partition = ? AND {where}", [p, *args])
        return count, floor

    def _name_collection(self, db: sqlite3.Connection, cid: int | None, scope_id: int,
                         name: str | None, max_ttl: int | None) -> None:  # fmt: skip
        db.execute(
            "INSERT INTO collections (id, scope_id, name, max_ttl) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET scope_id = excluded.scope_id,"
            " name = excluded.name, max_ttl = excluded.max_ttl, dropped = 0",
            (cid, scope_id, name or "", max_ttl),
        )

    def apply(
        self,
        partition: int,
        rows: Iterable[Row],
        position: StreamPosition,
        failover_log: FailoverLog | None = None,
        changes: Sequence[ManifestChange] = (),
    ) -> None:
        """Apply a partition's rows, log what they replace, save the position: ONE transaction.

        `rows` are data records of `partition` with strictly increasing seqs above
        the stored position; `position` must cover them. `changes` (collections created
        and dropped, `apply_change`) are applied between the rows, in seq order.
        ValueError, committing nothing, when they are not.
        """
        _check_partition(partition)
        if position.partition != partition:
            raise ValueError(
                f"partition {partition}: position is of partition {position.partition}"
            )
        records = _records(rows)
        with self._write() as db:
            state = self._state(db, partition)
            held = state.position.seq if state else 0
            if position.seq < held:
                raise ValueError(
                    f"partition {partition}: position seq {position.seq} is below the stored"
                    f" {held} (use rollback to go back)"
                )
            seqs: list[int] = []
            if records or changes:
                above = max(held, self._newest_logged(db, partition))
                seqs = _check_rows(partition, records, above) if records else []
                top = _check_changes(partition, changes, seqs, above) if changes else seqs[-1]
                if top > position.seq:
                    raise ValueError(
                        f"partition {partition}: position seq {position.seq} does not cover"
                        f" seq {top}"
                    )
            count, floor = (state.log_count, state.log_floor) if state else (0, 0)
            done = 0
            for change in changes:  # the rows below each change first
                n = bisect_right(seqs, change.seq, lo=done)
                count, floor = self._write_logged(
                    db, partition, records[done:n], seqs[done:n], count, floor
                )
                count, floor = self._apply_change(db, change, count, floor)
                done = n
            rest = records[done:] if done else records
            count, floor = self._write_logged(db, partition, rest, seqs[done:], count, floor)
            count, floor = self._trim(db, partition, count, floor)
            log_text = _log_text(failover_log, state)
            self._save_state(db, _State(position, log_text, count, floor, now_iso()))
            self._save_boundary(db, position, floor, state.log_floor if state else 0)

    def apply_change(
        self, partition: int, change: ManifestChange, position: StreamPosition
    ) -> None:
        """Apply one collection or scope change at its seq and save `position` (covering
        it): a drop removes the collection's documents in `partition` through the
        mutation log, so a rollback below the drop brings them back."""
        self.apply(partition, (), position, changes=(change,))

    def apply_many(self, batches: Iterable[Work]) -> None:
        """`apply` each (partition, rows, position, failover_log[, changes]) in ONE
        transaction. A failure undoes all of them (it leaves the batch), so the applies
        take no savepoint each: two statements fewer an apply, which count where a batch
        holds a few rows of each of many partitions."""
        with self.batch():
            flat, self._flat = self._flat, True
            try:
                for work in batches:
                    if len(work) == 5:
                        self.apply(*work)
                    else:
                        self.apply(*work[:4])
            finally:
                self._flat = flat

    def claim_filter(self, collections: str) -> None:
        """Follow only `collections` (comma-separated paths; "" for all): recorded on a
        store without positions; refused (UsageError) by a store that holds positions
        under another filter, since a resume would miss what one left out and the other
        takes in (formats/store.md §3.1)."""
        with self._write() as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'collections'").fetchone()
            held = db.execute("SELECT count(*) FROM partitions").fetchone()[0]
            had = row[0] if row is not None else ""
            if held and had != collections:
                raise UsageError(
                    f"{self.path}: the store follows "
                    f"{'--collections ' + had if had else 'every collection'}, not "
                    f"{'--collections ' + collections if collections else 'every collection'};"
                    " give the same or use another store"
                )
            if row is None or had != collections:
                _set_meta(db, "collections", collections)

    def record_manifest(self, manifest: Manifest) -> None:
        """Record the names of a source's scopes and collections (by id), for the `scope`
        and `collection` columns of the views. Idempotent; a manifest older (lower uid)
        than one recorded only adds names of ids the store does not know."""
        with self._write() as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'manifest_uid'").fetchone()
            newer = row is None or manifest.uid >= int(row[0])
            verb = "OR REPLACE" if newer else "OR IGNORE"
            db.executemany(
                f"INSERT {verb} INTO scopes (id, name, dropped) VALUES (?, ?, 0)",
                [(sc.id, sc.name) for sc in manifest.scopes],
            )
            db.executemany(
                f"INSERT {verb} INTO collections (id, scope_id, name, max_ttl, dropped)"
                " VALUES (?, ?, ?, ?, 0)",
                [(c.id, sc.id, c.name, c.max_ttl) for sc, c in manifest.collections()],
            )
            if newer:
                # ids are never used again: one the newest manifest lacks was dropped
                sids = [sc.id for sc in manifest.scopes]
                cids = [c.id for _sc, c in manifest.collections()]
                db.execute(f"UPDATE scopes SET dropped = 1 WHERE id NOT IN ({_marks(sids)})", sids)
                db.execute(
                    f"UPDATE collections SET dropped = 1 WHERE id NOT IN ({_marks(cids)})", cids
                )
                _set_meta(db, "manifest_uid", str(manifest.uid))

    def set_position(
        self, position: StreamPosition, failover_log: FailoverLog | None = None
    ) -> None:
        """Save a partition's position (and failover log) as given, e.g. after a restore.

        Unlike `apply` it may move the position anywhere; the documents are not touched.
        """
        _check_partition(position.partition)
        with self._write() as db:
            state = self._state(db, position.partition)
            log_text = _log_text(failover_log, state)
            count, floor = (state.log_count, state.log_floor) if state else (0, 0)
            self._save_state(db, _State(position, log_text, count, floor, now_iso()))
            self._save_boundary(db, position, floor, floor)

    def restore_rows(self, rows: Iterable[Row], *, keep_log: bool = False) -> int:
        """Write rows of any partitions (their `vbucket` field) as they are: a restore.

        The fast path (default) records no undo entries: it drops the mutation log of
        every partition it writes and raises its log floor to the highest seq written, so
        a rollback below that is too far. Later rows of a key replace earlier ones.
        `keep_log=True` records undo entries as `apply` does (and checks the rows as it
        does, per partition) without moving positions. Returns the number of rows.
        """
        given: Sequence[Row] = rows if isinstance(rows, list | tuple) else list(rows)
        if not given:
            return 0
        if keep_log:
            return self._restore_logged(_records(given))
        # the fast path takes plain rows in ROW_FIELDS order as they are (see `_write_rows`)
        records, tops = _by_partition(given)
        for p in tops:
            _check_partition(p)
        with self._write() as db:
            try:
                self._i64_retry(db, lambda r: _write_rows(db, r), records)
            except sqlite3.IntegrityError as exc:
                raise ValueError(f"{self.path}: restore: {_bad_row(records, exc)}") from exc
            db.executemany("DELETE FROM mutation_log WHERE partition = ?", [(p,) for p in tops])
            updated = now_iso()
            for p, top in tops.items():
                state = self._state(db, p)
                floor = max(top, state.log_floor) if state else top
                position = state.position if state else StreamPosition(p)
                log_text = state.failover_log if state else None
                self._save_state(db, _State(position, log_text, 0, floor, updated))
                self._save_boundary(db, position, floor, state.log_floor if state else 0)
        return len(records)

    def _restore_logged(self, rows: Sequence[DcpRecord]) -> int:
        groups: dict[int, list[DcpRecord]] = {}
        for r in rows:
            groups.setdefault(r.vbucket, []).append(r)
        with self._write() as db:
            updated = now_iso()
            for p, part_rows in groups.items():
                _check_partition(p)
                state = self._state(db, p)
                held = state.position.seq if state else 0
                seqs = _check_rows(p, part_rows, max(held, self._newest_logged(db, p)))
                count, floor = (state.log_count, state.log_floor) if state else (0, 0)
                count, floor = self._write_logged(db, p, part_rows, seqs, count, floor)
                count, floor = self._trim(db, p, count, floor)
                position = state.position if state else StreamPosition(p)
                log_text = state.failover_log if state else None
                self._save_state(db, _State(position, log_text, count, floor, updated))
                self._save_boundary(db, position, floor, state.log_floor if state else 0)
        return len(rows)

    def rollback(
        self, partition: int, to_seq: int, *, uuid: int | None = None, lost_above: int | None = None
    ) -> RollbackResult:
        """Undo every change above `to_seq` from the mutation log, in ONE transaction.

        `to_seq` must be a snapshot boundary (`boundary_at(self.boundaries(p), r)` for a
        source's ROLLBACK(r), or what the consumer's `Rollback` event names): inside a
        snapshot the undone state is not one the source had (formats/store.md §5.3).
        The position becomes (uuid, to_seq, to_seq, to_seq), `uuid` being given or else
        that of the newest stored failover entry with seq ≤ to_seq (0 if none), and the
        failover log is pruned above to_seq. The versions above `lost_above` (the seq the
        source asked for; default `to_seq`) are kept as lost writes: those between the
        two the source still has and sends again. When the log does not reach back to
        `to_seq` nothing changes and the result says `too_far`.
        """
        _check_partition(partition)
        with self._write() as db:
            state = self._state(db, partition)
            held = state.position.seq if state else 0
            if to_seq < 0 or to_seq > held:
                raise ValueError(
                    f"partition {partition}: cannot roll back to seq {to_seq}: the store holds"
                    f" seq {held}"
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
            undone = db.execute(
                "DELETE FROM mutation_log WHERE partition = :p AND seq > :r", args
            ).rowcount
            log = self._parse_log(partition, state.failover_log)
            log_text = state.failover_log
            if log is not None:
                log = log.prune_above(to_seq)
                log_text = json.dumps(log.to_json(), separators=(",", ":"))
            if uuid is None:
                entry = log.entry_at(to_seq) if log is not None else None
                uuid = entry.uuid if entry is not None else 0
            position = state.position.rolled_back(uuid, to_seq)
            self._save_state(
                db,
                _State(position, log_text, state.log_count - undone, state.log_floor, now_iso()),
            )
            db.execute("DELETE FROM boundaries WHERE partition = :p AND seq > :r", args)
            self._save_boundary(db, position, state.log_floor, state.log_floor)
        return RollbackResult(
            partition, held, to_seq, False, state.log_floor, undone, restored, deleted, position,
            lost,
        )  # fmt: skip

    def reset_partition(self, partition: int, *, lost_above: int | None = None) -> int:
        """Delete a partition's documents, mutation log and position; returns the documents.

        With `lost_above` = r (a rollback to r found too far), the documents above r are
        first kept in `lost_writes`, as a rollback keeps them.
        """
        _check_partition(partition)
        with self._write() as db:
            if lost_above is not None:
                state = self._state(db, partition)
                uuid = state.position.uuid if state else 0
                db.execute(_KEEP_LOST, {"p": partition, "r": _i64(lost_above),
                                        "uuid": _i64(uuid), "now": now_iso()})  # fmt: skip
            n = db.execute("DELETE FROM documents WHERE partition = ?", (partition,)).rowcount
            db.execute("DELETE FROM mutation_log WHERE partition = ?", (partition,))
            db.execute("DELETE FROM partitions WHERE partition = ?", (partition,))
            db.execute("DELETE FROM boundaries WHERE partition = ?", (partition,))
        return int(n)

    # --- reads

    def partition_state(self, partition: int) -> PartitionState | None:
        """Position, failover log and undo extent of a partition, or None if unknown."""
        state = self._state(self._db, partition)
        if state is None:
            return None
        log = self._parse_log(partition, state.failover_log)
        return PartitionState(state.position, log, state.log_count, state.log_floor, state.updated)

    def boundaries(self, partition: int | None = None) -> dict[int, list[int]]:
        """The snapshot boundaries a rollback can land on, per partition (ascending):
        recorded ones at or above the partition's log floor (formats/store.md §3.6)."""
        where, args = ("WHERE b.partition = ?", [partition]) if partition is not None else ("", [])
        rows = self._db.execute(
            "SELECT b.partition, b.seq FROM boundaries AS b JOIN partitions AS p"
            f" ON p.partition = b.partition AND b.seq >= p.log_floor {where}"
            " ORDER BY b.partition, b.seq",
            args,
        )
        out: dict[int, list[int]] = {}
        for p, seq in rows:
            out.setdefault(p, []).append(_u64(seq))
        return out

    def position(self, partition: int) -> StreamPosition | None:
        """The saved position of a partition, or None."""
        state = self._state(self._db, partition)
        return state.position if state else None

    def positions(self) -> dict[int, StreamPosition]:
        """Every saved position, by partition."""
        rows = self._db.execute(
            "SELECT partition, uuid, seq, snap_start, snap_end FROM partitions ORDER BY partition"
        ).fetchall()
        return {p: StreamPosition(p, _u64(u), _u64(s), _u64(a), _u64(b)) for p, u, s, a, b in rows}

    def failover_log(self, partition: int) -> FailoverLog | None:
        """The saved failover log of a partition, or None."""
        state = self._state(self._db, partition)
        return self._parse_log(partition, state.failover_log) if state else None

    def collections(self) -> dict[int, StoredCollection]:
        """Every collection the store knows a name of, by id (formats/store.md §3.8)."""
        rows = self._db.execute(
            "SELECT c.id, s.name, c.name, c.max_ttl, c.dropped FROM collections AS c"
            " LEFT JOIN scopes AS s ON s.id = c.scope_id ORDER BY c.id"
        )
        return {cid: StoredCollection(cid, scope, name, ttl, dropped == 1)
                for cid, scope, name, ttl, dropped in rows}  # fmt: skip

    def meta(self) -> dict[str, str]:
        """The `meta` table: format, schema_version, created, source."""
        return {str(k): str(v) for k, v in self._db.execute("SELECT key, value FROM meta")}

    def get(self, partition: int, key: bytes | str, collection: int = 0) -> Document | None:
        """The stored version of a key of a collection (by id), tombstones included
        (`deleted=True`), or None."""
        k = key.encode() if isinstance(key, str) else bytes(key)
        row = self._db.execute(
            f"SELECT {_DOC_SELECT} FROM documents"
            " WHERE partition = ? AND collection_id = ? AND key = ?",
            (partition, collection, k),
        ).fetchone()
        return None if row is None else _document(row)

    def documents(
        self, partitions: Iterable[int] | None = None, *, include_deleted: bool = True
    ) -> Iterator[Document]:
        """Stored documents ordered by (partition, collection id, key); tombstones unless
        excluded."""
        where, params = _where(partitions, include_deleted)
        cursor = self._db.execute(
            f"SELECT {_DOC_SELECT} FROM documents{where} ORDER BY partition, collection_id, key",
            params,
        )
        while chunk := cursor.fetchmany(_FETCH):
            yield from map(_document, chunk)

    def lost_writes(
        self, partitions: Iterable[int] | None = None, *, include_salvaged: bool = False
    ) -> list[LostWrite]:
        """Versions rollbacks took back (`lost_writes`, formats/store.md §3.5), oldest first."""
        where, params = _where(partitions, True)
        if not include_salvaged:
            where += (" AND" if where else " WHERE") + " salvaged IS NULL"
        rows = self._db.execute(
            f"SELECT id, {_DOC_SELECT}, uuid, rolled_back_to, recorded, salvaged"
            f" FROM lost_writes{where} ORDER BY id",
            params,
        ).fetchall()
        return [
            LostWrite(r[0], _document(r[1:14]), _u64(r[14]), _u64(r[15]), r[16], r[17])
            for r in rows
        ]

    def mark_salvaged(self, ids: Iterable[int]) -> None:
        """Record that these lost writes were written back (`upr salvage --apply`)."""
        with self._write() as db:
            db.executemany(
                "UPDATE lost_writes SET salvaged = ? WHERE id = ?", [(now_iso(), i) for i in ids]
            )

    def documents_above(self, partition: int, seq: int) -> list[Document]:
        """The documents of a partition whose seq is above `seq`, tombstones included."""
        rows = self._db.execute(
            f"SELECT {_DOC_SELECT} FROM documents WHERE partition = ? AND seq > ? ORDER BY seq",
            (partition, _i64(seq)),
        ).fetchall()
        return [_document(r) for r in rows]

    def count(self, include_deleted: bool = False, *, partition: int | None = None) -> int:
        """Number of stored keys, of one partition or all; tombstones only if asked."""
        where, params = _where(None if partition is None else [partition], include_deleted)
        return int(self._db.execute(f"SELECT count(*) FROM documents{where}", params).fetchone()[0])

    def content_hash(self, partitions: Iterable[int] | None = None) -> str:
        """The content hash of the live documents (formats/store.md §6, `content_hash_of`)."""
        where, params = _where(partitions, False)
        cursor = self._db.execute(
            "SELECT key, CAST(value AS BLOB), cas, rev_seq, flags, expiry"
            f" FROM documents{where} ORDER BY key",
            params,
        )
        hasher = ContentHasher()
        t = _TWO64
        while chunk := cursor.fetchmany(_FETCH):
            hasher.update(
                (k, v, c + t if c < 0 else c, r + t if r < 0 else r, f, e)
                for k, v, c, r, f, e in chunk
            )
        return hasher.hexdigest()


def _where(partitions: Iterable[int] | None, include_deleted: bool) -> tuple[str, list[int]]:
    terms: list[str] = []
    params: list[int] = []
    if partitions is not None:
        params = sorted(set(partitions))
        terms.append(f"partition IN ({', '.join('?' * len(params))})")
    if not include_deleted:
        terms.append("deleted = 0")
    return (" WHERE " + " AND ".join(terms) if terms else ""), params


def _document(row: Sequence[Any]) -> Document:
    p, k, s, r, c, f, e, dt_, dtype, deleted, v, cid, xa = row
    blob = b"" if xa is None else xattrs.from_json(json.loads(xa))
    return Document(p, k, _u64(s), _u64(r), _u64(c), f, e, dt_, dtype, deleted == 1, v, cid, blob)
