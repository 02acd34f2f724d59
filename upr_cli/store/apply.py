"""The store's write path (formats/store.md §5.1 Apply, §5.2 Restore): rows bound as the
decoder yields them, undo entries captured in bulk, checks run over whole columns.

Theory of operation
-------------------
* **Hot path without per-row Python.** Records are bound exactly as the decoder yields
  them (`DcpRecord`, key and value as memoryviews) with `executemany`; SQL maps the
  opcode to `deleted` and stores JSON values as TEXT. Undo entries (the mutation log,
  `upr_cli.store.rollback`) are captured in bulk, one INSERT … SELECT per up to 256
  changes. Checks that need every row (seq order, partition, opcode) run over columns
  with C-level `map`/`set`. 64-bit values above 2^63-1 are rare (a cas would have to be
  from after 2262), so rows whose seqs, rev seqs and cas all fit are bound as they are;
  otherwise they are first bound as they are inside a savepoint and, if SQLite refuses
  an integer, the statements are undone to it and the rows re-bound with u64 → i64
  conversion (`i64_retry`).
* **Xattrs** (formats/store.md §3.9) are kept beside the value as the JSON text of an
  object, NULL for none. A record's blob is turned into that text by an SQL function
  (`XATTRS_SQL`, registered by the store) calling Python only for rows that have one; a
  batch with none binds no xattrs at all.
* **64-bit values** (seq, rev_seq, cas, uuid, snapshot bounds) are stored as their two's
  complement i64, as `upr_cli.node.storage` does; SQL comparisons are signed, exact for
  seqs below 2^63, the range a producer hands out.
"""

from __future__ import annotations

import functools
import operator
import sqlite3
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, islice
from operator import itemgetter, lt
from pathlib import Path
from typing import Any, TypeVar, cast

from upr_cli import sqlite
from upr_cli.collections import ManifestChange
from upr_cli.failover import FailoverLog
from upr_cli.position import StreamPosition
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

# What `apply` and `restore_rows` take: DcpRecords, or plain tuples in ROW_FIELDS order
# (converted once on entry, by `as_records`); everything inside works on DcpRecords.
Row = tuple[Any, ...]
T = TypeVar("T")
#: What `apply_many` takes: `apply`'s arguments, (partition, rows, position,
#: failover_log), optionally followed by the manifest changes among the rows.
Work = (
    tuple[int, Iterable[Row], StreamPosition, FailoverLog | None]
    | tuple[int, Iterable[Row], StreamPosition, FailoverLog | None, Sequence[ManifestChange]]
)

_DATA_OPS = frozenset({OP_MUTATION, OP_DELETION, OP_EXPIRATION})

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

DOC_COLUMNS = (
    "partition, key, seq, rev_seq, cas, flags, expiry, delete_time, datatype, deleted, value,"
    " collection_id, xattrs"
)
PREV_COLUMNS = (
    "prev_seq, prev_rev_seq, prev_cas, prev_flags, prev_expiry, prev_delete_time,"
    " prev_datatype, prev_deleted, prev_value"
)
#: the SQL function (registered on the store's connection) that turns an xattr blob into
#: the `xattrs` column's JSON text (formats/store.md §3.9)
XATTRS_SQL = "upr_xattrs_json"
_XATTRS_OF_ROW = f"CASE WHEN length(?14) THEN {XATTRS_SQL}(?14, ?10) END"

# The SQL layer: a record (a tuple) is bound positionally, as ?1..?14 in ROW_FIELDS order
# (opcode, vbucket, by_seqno, rev_seqno, cas, flags, expiration, delete_time, datatype,
# key, value, opaque, collection, xattrs), so no per-row Python runs to bind it. An
# unknown opcode gives deleted = NULL, which the NOT NULL constraint rejects. ?12 (opaque)
# is unused: the `0 * (?12 IS NULL)` term, always 0, only makes the statement take the
# parameters a row carries. (A VALUES list, not INSERT … SELECT: measured twice as fast.)
# A row without xattrs (b"", nearly every row) runs no Python; a blob goes through
# `XATTRS_SQL` to its JSON text.
_UPSERT_ROW = f"""
INSERT OR REPLACE INTO documents ({DOC_COLUMNS}) VALUES (
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


# The rows that `size` changes replace, read before the changes are written: a VALUES
# list of (partition, seq, collection, key) JOINed with documents. A change that creates its key has
# no entry: a rollback finds it as a document above the target seq (formats/store.md §3.4),
# so a first replay writes no log at all. One statement per up to 256 changes: a statement
# per change measured at half the rate, the per-statement cost dominating.
@functools.cache
def _log_sql(size: int) -> str:
    values = ",".join(["(?,?,?,?)"] * size)
    return f"""
INSERT INTO mutation_log (partition, seq, collection_id, key, {PREV_COLUMNS}, prev_xattrs)
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


def _i64_rows(rows: Sequence[Row]) -> list[DcpRecord]:
    """Rows with seq, rev seq and cas converted to i64 where they exceed 2^63-1."""
    m, conv = _I64_MAX, _i64
    return [
        r if r.by_seqno <= m and r.rev_seqno <= m and r.cas <= m
        else r._replace(by_seqno=conv(r.by_seqno), rev_seqno=conv(r.rev_seqno), cas=conv(r.cas))
        for r in as_records(rows)
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
    m = _I64_MAX  # rows may come already converted to i64 (`i64_retry`)
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


def write_rows(db: sqlite3.Connection, rows: Sequence[Row], *, new_only: bool = False) -> None:
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


def as_records(rows: Iterable[Row]) -> Sequence[DcpRecord]:
    """The records as a sequence; plain tuples in ROW_FIELDS order become DcpRecords."""
    given: Sequence[Row] = rows if isinstance(rows, list | tuple) else list(rows)
    if given and set(map(type, given)) == {DcpRecord}:
        return cast("Sequence[DcpRecord]", given)
    try:
        return [r if type(r) is DcpRecord else DcpRecord(*r) for r in given]
    except TypeError:
        bad = next(r for r in given if not len(ROW_FIELDS) - 2 <= len(r) <= len(ROW_FIELDS))
        raise ValueError(f"a row has {len(bad)} fields, expected {len(ROW_FIELDS)}") from None


def check_partition(partition: int) -> None:
    """ValueError unless `partition` is a vbucket id."""
    if not isinstance(partition, int) or not 0 <= partition <= 0xFFFF:
        raise ValueError(f"partition {partition!r} is not a vbucket id (0..65535)")


def check_rows(partition: int, rows: Sequence[DcpRecord], above: int) -> list[int]:
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


def by_partition(rows: Sequence[Row]) -> tuple[Sequence[Row], dict[int, int]]:
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


def bad_row(rows: Sequence[Row], exc: Exception) -> str:
    """Explain why SQLite rejected a batch (called only after a failure)."""
    for r in as_records(rows):
        if r.opcode not in _DATA_OPS:
            return (f"row with seq {r.by_seqno}: opcode {r.opcode!r} is not mutation, deletion"
                    " or expiration")  # fmt: skip
        if r.key is None or r.value is None:
            return f"row with seq {r.by_seqno}: key and value must be bytes, not None"
    return str(exc)


def i64_retry(db: sqlite3.Connection, work: Callable[[Sequence[Row]], T],
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


def write_logged(
    db: sqlite3.Connection, path: Path, undo_window: int, partition: int,
    rows: Sequence[DcpRecord], seqs: list[int], count: int, floor: int,
) -> tuple[int, int]:  # fmt: skip
    """Write one partition's checked rows with their undo entries.

    Rows beyond the window's reach (all but the last `undo_window`) are written
    without entries, since trimming would drop those at once. Returns the new
    (log_count, log_floor), before trimming (`trim_log`). `path` names the store in
    errors.
    """
    if not rows:
        return count, floor
    unlogged = max(0, len(rows) - undo_window)

    def work(given: Sequence[Row]) -> int:
        rows = cast("Sequence[DcpRecord]", given)  # records in, records retried
        if unlogged:
            write_rows(db, rows[:unlogged])
        rest = rows[unlogged:]
        if not rest:
            return 0
        # Keys new to the store need no entry: insert those first, in C. If every
        # row was inserted, that is all (a first replay, a backfill of new keys).
        before = db.total_changes
        write_rows(db, rest, new_only=True)
        if db.total_changes - before == len(rest):
            return 0
        # The others replace a row: log it, then write (in order, so a key changed
        # twice in the batch logs its first change's row for the second).
        replacing = _not_inserted(db, partition, rest)
        logged = 0
        for run in _unique_key_runs(replacing):
            logged += _log_previous(db, run)
            write_rows(db, run)
        return logged

    try:
        count += i64_retry(db, work, rows)
    except sqlite3.IntegrityError as exc:
        raise ValueError(f"{path}: partition {partition}: {bad_row(rows, exc)}") from exc
    if unlogged:
        floor = max(floor, seqs[unlogged - 1])
    return count, floor


def trim_log(db: sqlite3.Connection, undo_window: int, partition: int, count: int, floor: int
             ) -> tuple[int, int]:  # fmt: skip
    """Drop the oldest undo entries beyond the window; the new (log_count, log_floor)."""
    if count <= undo_window:
        return count, floor
    # Oldest entries first (the UPR design specification, "Client and Mutation Log":
    # "the oldest entries are removed"). A collection drop logs many entries at one
    # seq, and they go together: a rollback reaches above that seq or not at all.
    (cut,) = db.execute(
        "SELECT seq FROM mutation_log WHERE partition = ? ORDER BY seq LIMIT 1 OFFSET ?",
        (partition, count - undo_window - 1),
    ).fetchone()
    gone = db.execute(
        "DELETE FROM mutation_log WHERE partition = ? AND seq <= ?", (partition, cut)
    ).rowcount
    return count - gone, max(floor, _u64(cut))
