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
* **One connection, the pieces by job.** `Store` owns the connection and its
  transactions and checks each call's arguments; the work is done inside the open
  transaction by the store package's modules: `apply` (rows, undo entries, the hot
  path), `partitions` (positions and snapshot boundaries), `manifests` (collections),
  `rollback` (the mutation log undone, lost writes) and `queries` (reads).

One thread at a time may use a Store (it may be a worker thread: docs/design.md
"Performance").
"""

from __future__ import annotations

import contextlib
import sqlite3
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Self

import sqlite_utils

from upr_cli import sqlite
from upr_cli.collections import CollectionsManifest, ManifestChange
from upr_cli.errors import UsageError
from upr_cli.failover import FailoverLog
from upr_cli.position import StreamPosition
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.store import manifests, partitions, queries
from upr_cli.store.apply import (
    XATTRS_SQL,
    Row,
    Work,
    as_records,
    bad_row,
    by_partition,
    check_partition,
    check_rows,
    i64_retry,
    trim_log,
    write_logged,
    write_rows,
)
from upr_cli.store.content import Document, xattrs_json
from upr_cli.store.manifests import StoredCollection, apply_change, check_changes
from upr_cli.store.partitions import (
    PartitionState,
    SavedState,
    log_text,
    newest_logged,
    parse_log,
    read_state,
    save_boundary,
    save_state,
)
from upr_cli.store.queries import LostWrite
from upr_cli.store.rollback import RollbackResult, reset, roll_back
from upr_cli.store.schema import StoreError, init_schema, now_iso

DEFAULT_UNDO_WINDOW = 10_000
_CACHE_KIB = 32 * 1024


class _Aborted(Exception):
    """Raised into an open transaction to roll it back (`Store.abort`)."""


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
        self._bad_xattrs: xattrs.CorruptXattrsError | None = None  # raised in `XATTRS_SQL`
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
        conn.create_function(XATTRS_SQL, 2, self._xattrs_json, deterministic=True)
        self._conn = conn

    def _xattrs_json(self, blob: bytes, key: bytes) -> str:
        """`XATTRS_SQL`: SQLite reports an exception raised in a function only as "user-
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

    # --- writes

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
        check_partition(partition)
        if position.partition != partition:
            raise ValueError(
                f"partition {partition}: position is of partition {position.partition}"
            )
        records = as_records(rows)
        with self._write() as db:
            state = read_state(db, partition)
            held = state.position.seq if state else 0
            if position.seq < held:
                raise ValueError(
                    f"partition {partition}: position seq {position.seq} is below the stored"
                    f" {held} (use rollback to go back)"
                )
            seqs: list[int] = []
            if records or changes:
                above = max(held, newest_logged(db, partition))
                seqs = check_rows(partition, records, above) if records else []
                top = check_changes(partition, changes, seqs, above) if changes else seqs[-1]
                if top > position.seq:
                    raise ValueError(
                        f"partition {partition}: position seq {position.seq} does not cover"
                        f" seq {top}"
                    )
            count, floor = (state.log_count, state.log_floor) if state else (0, 0)
            path, window = self.path, self.undo_window
            done = 0
            for change in changes:  # the rows below each change first
                n = bisect_right(seqs, change.seq, lo=done)
                count, floor = write_logged(
                    db, path, window, partition, records[done:n], seqs[done:n], count, floor
                )
                count, floor = apply_change(db, window, change, count, floor)
                done = n
            rest = records[done:] if done else records
            count, floor = write_logged(
                db, path, window, partition, rest, seqs[done:], count, floor
            )
            count, floor = trim_log(db, window, partition, count, floor)
            text = log_text(failover_log, state)
            save_state(db, SavedState(position, text, count, floor, now_iso()))
            save_boundary(db, position, floor, state.log_floor if state else 0, self._bounds_added)

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
            manifests.claim_filter(db, self.path, collections)

    def record_manifest(self, manifest: CollectionsManifest) -> None:
        """Record the names of a source's scopes and collections (by id), for the `scope`
        and `collection` columns of the views. Idempotent; a manifest older (lower uid)
        than one recorded only adds names of ids the store does not know."""
        with self._write() as db:
            manifests.record_manifest(db, manifest)

    def set_position(
        self, position: StreamPosition, failover_log: FailoverLog | None = None
    ) -> None:
        """Save a partition's position (and failover log) as given, e.g. after a restore.

        Unlike `apply` it may move the position anywhere; the documents are not touched.
        """
        check_partition(position.partition)
        with self._write() as db:
            state = read_state(db, position.partition)
            text = log_text(failover_log, state)
            count, floor = (state.log_count, state.log_floor) if state else (0, 0)
            save_state(db, SavedState(position, text, count, floor, now_iso()))
            save_boundary(db, position, floor, floor, self._bounds_added)

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
            return self._restore_logged(as_records(given))
        # the fast path takes plain rows in ROW_FIELDS order as they are (see `write_rows`)
        records, tops = by_partition(given)
        for p in tops:
            check_partition(p)
        with self._write() as db:
            try:
                i64_retry(db, lambda r: write_rows(db, r), records)
            except sqlite3.IntegrityError as exc:
                raise ValueError(f"{self.path}: restore: {bad_row(records, exc)}") from exc
            db.executemany("DELETE FROM mutation_log WHERE partition = ?", [(p,) for p in tops])
            updated = now_iso()
            for p, top in tops.items():
                state = read_state(db, p)
                floor = max(top, state.log_floor) if state else top
                position = state.position if state else StreamPosition(p)
                text = state.failover_log if state else None
                save_state(db, SavedState(position, text, 0, floor, updated))
                save_boundary(db, position, floor, state.log_floor if state else 0,
                              self._bounds_added)  # fmt: skip
        return len(records)

    def _restore_logged(self, rows: Sequence[DcpRecord]) -> int:
        groups: dict[int, list[DcpRecord]] = {}
        for r in rows:
            groups.setdefault(r.vbucket, []).append(r)
        path, window = self.path, self.undo_window
        with self._write() as db:
            updated = now_iso()
            for p, part_rows in groups.items():
                check_partition(p)
                state = read_state(db, p)
                held = state.position.seq if state else 0
                seqs = check_rows(p, part_rows, max(held, newest_logged(db, p)))
                count, floor = (state.log_count, state.log_floor) if state else (0, 0)
                count, floor = write_logged(db, path, window, p, part_rows, seqs, count, floor)
                count, floor = trim_log(db, window, p, count, floor)
                position = state.position if state else StreamPosition(p)
                text = state.failover_log if state else None
                save_state(db, SavedState(position, text, count, floor, updated))
                save_boundary(db, position, floor, state.log_floor if state else 0,
                              self._bounds_added)  # fmt: skip
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
        check_partition(partition)
        with self._write() as db:
            return roll_back(db, self.path, partition, to_seq, uuid, lost_above,
                             self._bounds_added)  # fmt: skip

    def reset_partition(self, partition: int, *, lost_above: int | None = None) -> int:
        """Delete a partition's documents, mutation log and position; returns the documents.

        With `lost_above` = r (a rollback to r found too far), the documents above r are
        first kept in `lost_writes`, as a rollback keeps them.
        """
        check_partition(partition)
        with self._write() as db:
            return reset(db, partition, lost_above)

    def mark_salvaged(self, ids: Iterable[int]) -> None:
        """Record that these lost writes were written back (`upr salvage --apply`)."""
        with self._write() as db:
            db.executemany(
                "UPDATE lost_writes SET salvaged = ? WHERE id = ?", [(now_iso(), i) for i in ids]
            )

    # --- reads

    def partition_state(self, partition: int) -> PartitionState | None:
        """Position, failover log and undo extent of a partition, or None if unknown."""
        state = read_state(self._db, partition)
        if state is None:
            return None
        log = parse_log(self.path, partition, state.failover_log)
        return PartitionState(state.position, log, state.log_count, state.log_floor, state.updated)

    def boundaries(self, partition: int | None = None) -> dict[int, list[int]]:
        """The snapshot boundaries a rollback can land on, per partition (ascending):
        recorded ones at or above the partition's log floor (formats/store.md §3.6)."""
        return partitions.boundaries(self._db, partition)

    def position(self, partition: int) -> StreamPosition | None:
        """The saved position of a partition, or None."""
        state = read_state(self._db, partition)
        return state.position if state else None

    def positions(self) -> dict[int, StreamPosition]:
        """Every saved position, by partition."""
        return partitions.positions(self._db)

    def failover_log(self, partition: int) -> FailoverLog | None:
        """The saved failover log of a partition, or None."""
        state = read_state(self._db, partition)
        return parse_log(self.path, partition, state.failover_log) if state else None

    def collections(self) -> dict[int, StoredCollection]:
        """Every collection the store knows a name of, by id (formats/store.md §3.8)."""
        return manifests.collections(self._db)

    def meta(self) -> dict[str, str]:
        """The `meta` table: format, schema_version, created, source."""
        return {str(k): str(v) for k, v in self._db.execute("SELECT key, value FROM meta")}

    def get(self, partition: int, key: bytes | str, collection: int = 0) -> Document | None:
        """The stored version of a key of a collection (by id), tombstones included
        (`deleted=True`), or None."""
        return queries.get(self._db, partition, key, collection)

    def documents(
        self, partitions: Iterable[int] | None = None, *, include_deleted: bool = True
    ) -> Iterator[Document]:
        """Stored documents ordered by (partition, collection id, key); tombstones unless
        excluded."""
        yield from queries.documents(self._db, partitions, include_deleted)

    def lost_writes(
        self, partitions: Iterable[int] | None = None, *, include_salvaged: bool = False
    ) -> list[LostWrite]:
        """Versions rollbacks took back (`lost_writes`, formats/store.md §3.5), oldest first."""
        return queries.lost_writes(self._db, partitions, include_salvaged)

    def documents_above(self, partition: int, seq: int) -> list[Document]:
        """The documents of a partition whose seq is above `seq`, tombstones included."""
        return queries.documents_above(self._db, partition, seq)

    def count(self, include_deleted: bool = False, *, partition: int | None = None) -> int:
        """Number of stored keys, of one partition or all; tombstones only if asked."""
        return queries.count(self._db, include_deleted, partition)

    def content_hash(self, partitions: Iterable[int] | None = None) -> str:
        """The content hash of the live documents (formats/store.md §6, `content_hash_of`)."""
        return queries.content_hash(self._db, partitions)
