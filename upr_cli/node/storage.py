"""SQLite storage of one bucket of the UPR node: documents, tombstones, partition state.

Theory of operation
-------------------
* **Two trees in one table** (couchstore's by-id and by-seq b-trees, the UPR design
  specification, "How ep-engine streams a consistent snapshot for a partition"). `docs` is
  keyed by (vbucket, key) and holds only the latest version of each key, live or
  tombstone; the UNIQUE index `docs_by_seq(vbucket, seq)` is the by-seq tree. Writing a
  newer version of a key replaces its row, so the by-seq tree holds one entry per key: a
  stream from disk is deduplicated for free. A version must carry a higher seq than the
  stored one.
* **Group commit.** The node's flusher hands `write_batch` everything it drained from
  the write queue; documents and the partition records that describe them (high seq,
  last complete snapshot) commit in ONE transaction, with `executemany`. In WAL mode
  with `synchronous=NORMAL` a commit survives a process crash but may be lost with the
  machine; `sync_full=True` syncs every commit. State changes that must be durable
  before the node acts on them (`save_partitions`, `set_clean_shutdown`, `rollback`)
  always commit with `synchronous=FULL`, which also makes every earlier commit durable.
* **Snapshot reads.** The node has one writer connection (this class; the node runs
  one write at a time) and any number of `StorageReader` connections, one per worker
  thread. A `Backfill` reads one partition inside one read transaction: WAL mode gives
  it a fixed snapshot while the writer keeps committing, so the rows it returns and
  its `high_seq` agree with each other, as a DCP snapshot must (docs/protocol.md §4).
* **64-bit values.** SQLite integers are signed 64-bit. Every u64 column (seq, rev_seq,
  cas, and the partition seqnos) is stored as its two's complement i64, so values up to
  2^64-1 round-trip; failover logs are JSON with decimal strings (docs/design.md
  "Conventions"). Ordering and comparisons in SQL are signed, so the by-seq order,
  `after_seq`, `high_seq`, purge and rollback are exact only for seqs < 2^63, which is the
  range ep-engine ever hands out. The seq-regression check of `write_batch` compares as
  unsigned.
* **Qualified keys** (schema version 2, formats/collections.md §1). Every key is the
  document's collection id as LEB128, then the document key; system event rows use
  the system namespace (upr_cli/node/sysevents.py). A version 1 directory (plain keys,
  all in the default collection) is migrated on open, in one transaction: its keys get
  the prefix 0x00 in `docs`, `undo` and `lost_writes`.
* **The collections manifest** is a `meta` row (its JSON), written in the transaction
  of the flush that holds the system rows of its changes.
* **Expirations.** A tombstone's `expiry` is 0 for a deletion and its delete time
  (never 0) for an expiration (formats/wire.md "Collections on DCP", point 9): older
  databases hold deletions only, and read the same. The partial index `docs_expiry`
  (live rows with an expiry) lets the expiry pager find expired documents without a
  scan; like the undo tables it is created on open when missing, without a schema
  version of its own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import secrets
import sqlite3
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

from upr_cli import sqlite
from upr_cli.errors import UprError, UsageError
from upr_cli.node_files import DOC_COLUMNS as _DOC_COLUMNS
from upr_cli.node_files import SCHEMA_VERSION as SCHEMA_VERSION
from upr_cli.node_files import DocRow as DocRow
from upr_cli.node_files import lost_writes_of
from upr_cli.node_files import rows_to_docs as _rows_to_docs
from upr_cli.protocol import leb128
from upr_cli.sqlite import I64_MAX as _I64_MAX
from upr_cli.sqlite import TWO64 as _TWO64
from upr_cli.sqlite import U64_MAX
from upr_cli.sqlite import i64 as _i64
from upr_cli.sqlite import u64 as _u64

PARTITION_STATES = frozenset({"active", "replica", "pending", "dead"})
_BUCKET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.%-]{0,99}")
_DECIMAL = re.compile(r"[0-9]{1,20}")
# each connection's SQLite page cache unless the node gives it a share of --memory-limit
# (32 MiB for each of a bucket's two connections once held 80 MB of a cluster node's
# peak, for no measured speed: loads of 200,000 documents ran level at 8 MiB)
WRITER_CACHE_KIB = 8 * 1024

_SCHEMA = (
    """CREATE TABLE meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    )""",
    """CREATE TABLE docs (
        vbucket INTEGER NOT NULL,
        key BLOB NOT NULL,
        seq INTEGER NOT NULL,
        rev_seq INTEGER NOT NULL,
        cas INTEGER NOT NULL,
        flags INTEGER NOT NULL,
        expiry INTEGER NOT NULL,
        datatype INTEGER NOT NULL,
        deleted INTEGER NOT NULL,
        delete_time INTEGER NOT NULL,
        value BLOB NOT NULL,
        PRIMARY KEY (vbucket, key)
    ) WITHOUT ROWID""",
    "CREATE UNIQUE INDEX docs_by_seq ON docs (vbucket, seq)",
    # Only tombstones are indexed: purge finds old ones without scanning live documents.
    "CREATE INDEX docs_tombstones ON docs (delete_time) WHERE deleted = 1",
    """CREATE TABLE partitions (
        vbucket INTEGER PRIMARY KEY,
        state TEXT NOT NULL,
        failover_log TEXT NOT NULL,
        high_seq INTEGER NOT NULL,
        purge_seq INTEGER NOT NULL,
        snap_start INTEGER NOT NULL,
        snap_end INTEGER NOT NULL
    )""",
)

# Replica undo (formats/cluster.md §5): the version a replica's write replaced, keyed by
# the replacing seq, so a rollback to r restores every key to its version at r. Partitions
# record undo only while replica or pending; `undo_floor` is the lowest r it can serve.
# Added without a schema-version bump: CREATE IF NOT EXISTS on every open (the
# `boundaries` table of a directory written before it existed is seeded on that open).
_DOC_COLUMNS_DDL = (
    "vbucket INTEGER NOT NULL, key BLOB NOT NULL, seq INTEGER NOT NULL, rev_seq INTEGER NOT NULL,"
    " cas INTEGER NOT NULL, flags INTEGER NOT NULL, expiry INTEGER NOT NULL,"
    " datatype INTEGER NOT NULL, deleted INTEGER NOT NULL, delete_time INTEGER NOT NULL,"
    " value BLOB NOT NULL"
)
_UNDO_SCHEMA = (
    f"""CREATE TABLE IF NOT EXISTS undo (
        new_seq INTEGER NOT NULL, {_DOC_COLUMNS_DDL},
        PRIMARY KEY (vbucket, new_seq)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS undo_by_key ON undo (vbucket, key, new_seq)",
    "CREATE TABLE IF NOT EXISTS undo_floor (vbucket INTEGER PRIMARY KEY, seq INTEGER NOT NULL)",
    # Snapshot boundaries a replica rollback can go back to (formats/cluster.md §5): seqs
    # where the partition's persisted state was a whole snapshot's, at or above its floor.
    """CREATE TABLE IF NOT EXISTS boundaries (
        vbucket INTEGER NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (vbucket, seq)
    ) WITHOUT ROWID""",
    # Versions a replica's rollback discarded (what `upr salvage --node-data` offers back).
    f"""CREATE TABLE IF NOT EXISTS lost_writes (
        rolled_back_at REAL NOT NULL, rolled_back_to INTEGER NOT NULL, {_DOC_COLUMNS_DDL},
        PRIMARY KEY (vbucket, seq)
    ) WITHOUT ROWID""",
)
# Live rows with an expiry, for the expiry pager (`NodeStorage.expired`); created on
# every open when missing, after a migration that rebuilds `docs`.
_EXPIRY_INDEX = (
    "CREATE INDEX IF NOT EXISTS docs_expiry ON docs (expiry) WHERE deleted = 0 AND expiry != 0"
)
# A data directory written before `boundaries` existed: each replica partition's
# persisted state is a boundary if it ends a snapshot (the only one known to be whole).
_SEED_BOUNDARIES = """INSERT OR IGNORE INTO boundaries (vbucket, seq)
SELECT p.vbucket, p.high_seq FROM partitions p JOIN undo_floor f ON f.vbucket = p.vbucket
WHERE p.high_seq = p.snap_end AND p.high_seq >= f.seq"""
_SAVE_UNDO = f"""INSERT OR REPLACE INTO undo (new_seq, {_DOC_COLUMNS})
SELECT ?, {_DOC_COLUMNS} FROM docs WHERE vbucket = ? AND key = ?"""

# The WHERE clause makes a stale version a no-op (0 changes), which write_batch detects.
# `excluded.seq > docs.seq` as unsigned 64-bit numbers stored as i64 (see header).
_UPSERT_DOC = f"""
INSERT INTO docs ({_DOC_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (vbucket, key) DO UPDATE SET
    seq = excluded.seq, rev_seq = excluded.rev_seq, cas = excluded.cas,
    flags = excluded.flags, expiry = excluded.expiry, datatype = excluded.datatype,
    deleted = excluded.deleted, delete_time = excluded.delete_time, value = excluded.value
WHERE CASE WHEN (excluded.seq < 0) = (docs.seq < 0) THEN excluded.seq > docs.seq
           ELSE excluded.seq < 0 END
"""

_UPSERT_PARTITION = """
INSERT INTO partitions (vbucket, state, failover_log, high_seq, purge_seq, snap_start, snap_end)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (vbucket) DO UPDATE SET
    state = excluded.state, failover_log = excluded.failover_log,
    high_seq = excluded.high_seq, purge_seq = excluded.purge_seq,
    snap_start = excluded.snap_start, snap_end = excluded.snap_end
"""


class _StaleVersion(Exception):
    """Internal: a doc of a batch did not advance its key's seq (the batch is rolled back)."""


class StorageError(UprError):
    """The node's database file is unusable: not SQLite, not ours, too new, or corrupt."""


# Backfill rows (`Backfill.fetch_rows`) are the SQL rows themselves, in _DOC_COLUMNS
# (DocRow) order, `deleted` as 0/1: the hot path builds no object per row (a NamedTuple
# a row, read by attribute, measured 1.4 us a row against 0.6 us). The SQL layer reads
# them by column with these.
StoredRow = tuple[Any, ...]
_I64_TOP = _I64_MAX + 1
ROW_SEQ = itemgetter(2)
ROW_DELETED = itemgetter(8)
ROW_KEY = itemgetter(1)
ROW_VALUE = itemgetter(10)
#: a live row's `encode_mutation` arguments after (vbucket, opaque): cas, datatype,
#: seq, rev_seq, flags, expiry, key, value
ROW_MUTATION_ARGS = itemgetter(4, 7, 2, 3, 5, 6, 1, 10)


@dataclass(frozen=True, slots=True)
class PartitionRecord:
    """Persistent state of one partition."""

    vbucket: int
    state: str  # "active" | "replica" | "pending" | "dead"
    failover_log: tuple[tuple[int, int], ...]  # (uuid, seq) newest first
    high_seq: int  # highest seq persisted for this partition
    purge_seq: int
    snap_start: int  # last complete snapshot persisted
    snap_end: int


def _doc_params(docs: Sequence[DocRow]) -> list[tuple[Any, ...]]:
    """Bind parameters of `_UPSERT_DOC` for each doc. The flusher's hot loop: a row
    whose seq, rev seq and CAS are all below 2^63 (every one ep-engine hands out, and
    our own CAS clock until 2262) is taken as it is; any other goes through `i64`."""
    top = _I64_TOP
    return [
        (d.vbucket, d.key, d.seq, d.rev_seq, d.cas, d.flags, d.expiry, d.datatype,
         1 if d.deleted else 0, d.delete_time, d.value)
        if 0 <= d.seq < top and 0 <= d.rev_seq < top and 0 <= d.cas < top
        else (d.vbucket, d.key, _i64(d.seq), _i64(d.rev_seq), _i64(d.cas), d.flags, d.expiry,
              d.datatype, 1 if d.deleted else 0, d.delete_time, d.value)
        for d in docs
    ]  # fmt: skip


def _partition_params(rec: PartitionRecord) -> tuple[Any, ...]:
    """Bind parameters of `_UPSERT_PARTITION` for one record."""
    if rec.state not in PARTITION_STATES:
        raise ValueError(f"vb {rec.vbucket}: unknown partition state {rec.state!r}")
    log = _failover_json(rec.failover_log)
    return (
        rec.vbucket,
        rec.state,
        log,
        _i64(rec.high_seq),
        _i64(rec.purge_seq),
        _i64(rec.snap_start),
        _i64(rec.snap_end),
    )


@functools.lru_cache(maxsize=4096)
def _failover_json(pairs: tuple[tuple[int, int], ...]) -> str:
    """The failover_log column of a log (a flush writes every partition's record)."""
    return json.dumps([{"uuid": str(u), "seq": str(s)} for u, s in pairs])


def _parse_failover_log(text: str) -> tuple[tuple[int, int], ...]:
    """Parse the failover_log column; raises ValueError on anything but our JSON shape."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("not a JSON list")
    out = []
    for entry in data:
        if not isinstance(entry, dict) or set(entry) != {"uuid", "seq"}:
            raise ValueError(f"bad entry {entry!r}")
        uuid, seq = entry["uuid"], entry["seq"]
        if not all(isinstance(x, str) and _DECIMAL.fullmatch(x) for x in (uuid, seq)):
            raise ValueError(f"bad entry {entry!r}")
        u, s = int(uuid), int(seq)
        if u > U64_MAX or s > U64_MAX:
            raise ValueError(f"entry out of range {entry!r}")
        out.append((u, s))
    return tuple(out)


_GET_MANY_SIZES = (8, 32, 128, 512)


@functools.cache
def _get_many_sql(size: int) -> str:
    cols = ", ".join(f"d.{c.strip()}" for c in _DOC_COLUMNS.split(","))
    values = ",".join("(?,?)" for _ in range(size))
    return (f"SELECT {cols} FROM (VALUES {values}) AS v CROSS JOIN docs AS d "
            "ON d.vbucket = v.column1 AND d.key = v.column2")  # fmt: skip


class NodeStorage(sqlite.Closing):
    """The database of one bucket, `<data_dir>/<bucket>.sqlite3`, and its writer connection.

    One thread at a time may use an instance (the node serialises writes); readers on
    other threads use `open_reader`.
    """

    def __init__(self, data_dir: Path, bucket: str, *, sync_full: bool = False,
                 cache_kib: int = WRITER_CACHE_KIB) -> None:  # fmt: skip
        if not _BUCKET_NAME.fullmatch(bucket):
            raise UsageError(f"invalid bucket name {bucket!r}")
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / f"{bucket}.sqlite3"
        self._sync = "FULL" if sync_full else "NORMAL"
        self._conn: sqlite3.Connection | None = None
        try:
            conn = sqlite.connect(self.path)
        except sqlite3.Error as exc:
            raise StorageError(f"cannot open {self.path}: {exc}") from exc
        try:
            sqlite.set_writer_pragmas(conn, self.path, synchronous=self._sync,
                                      cache_kib=cache_kib, error=StorageError)  # fmt: skip
            self._bucket_uuid = self._init_schema(conn)
        except sqlite3.Error as exc:
            conn.close()
            raise StorageError(f"cannot open {self.path}: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _init_schema(self, conn: sqlite3.Connection) -> str:
        """Create the schema on first use, else check it is ours and not too new."""
        with sqlite.transaction(conn):
            names = {name for (name,) in conn.execute("SELECT name FROM sqlite_schema")}
            if "meta" not in names:
                if names:
                    raise StorageError(f"{self.path}: not an upr node database (no meta table)")
                for stmt in _SCHEMA:
                    conn.execute(stmt)
                conn.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [
                        ("schema_version", str(SCHEMA_VERSION)),
                        ("bucket_uuid", secrets.token_hex(16)),
                        ("clean_shutdown", "0"),
                    ],
                )
            meta = {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta")}
            version = meta.get("schema_version", "")
            if not version.isdigit():
                raise StorageError(f"{self.path}: bad schema version {version!r}")
            if int(version) > SCHEMA_VERSION:
                raise StorageError(
                    f"{self.path}: schema version {version} is newer than this upr "
                    f"supports ({SCHEMA_VERSION})"
                )
            for stmt in _UNDO_SCHEMA:
                conn.execute(stmt)
            if "boundaries" not in names and "partitions" in names:
                conn.execute(_SEED_BOUNDARIES)  # migration: a directory of an older upr
            if int(version) < 2:
                _qualify_keys(conn)
            conn.execute(_EXPIRY_INDEX)
            uuid = meta.get("bucket_uuid", "")
            if not re.fullmatch(r"[0-9a-f]{32}", uuid):
                raise StorageError(f"{self.path}: bad bucket uuid {uuid!r}")
        return uuid

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise ValueError(f"{self.path}: storage is closed")
        return self._conn

    @contextlib.contextmanager
    def _transaction(self, *, durable: bool) -> Iterator[sqlite3.Connection]:
        """One write transaction; rolled back unless the block completes."""
        db = self._db
        raise_sync = durable and self._sync != "FULL"
        if raise_sync:
            db.execute("PRAGMA synchronous = FULL")
        try:
            with sqlite.transaction(db):
                yield db
        finally:
            if raise_sync:
                db.execute(f"PRAGMA synchronous = {self._sync}")

    def close(self) -> None:
        """Close the writer connection (idempotent); readers stay open until closed."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # --- meta

    def clean_shutdown(self) -> bool:
        """Whether the clean-shutdown marker is set (the last run ended cleanly)."""
        row = self._db.execute("SELECT value FROM meta WHERE key = 'clean_shutdown'").fetchone()
        return row is not None and row[0] == "1"

    def set_clean_shutdown(self, clean: bool) -> None:
        """Set or clear the clean-shutdown marker, durably."""
        with self._transaction(durable=True) as db:
            db.execute(
                "INSERT INTO meta (key, value) VALUES ('clean_shutdown', ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                ("1" if clean else "0",),
            )

    def meta(self, key: str) -> str | None:
        """A `meta` value (the collections manifest: `collections_manifest`), or None."""
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, values: Mapping[str, str]) -> None:
        """Write `meta` values, durably."""
        with self._transaction(durable=True) as db:
            _write_meta(db, values)

    def bucket_uuid(self) -> str:
        """The bucket's uuid (32 hex digits), created with the database and never changed."""
        return self._bucket_uuid

    # --- partitions

    def partition_count(self) -> int:
        """How many partitions the bucket has on disk (0 for a new database)."""
        (count,) = self._db.execute("SELECT count(*) FROM partitions").fetchone()
        return int(count)

    def load_partitions(self) -> dict[int, PartitionRecord]:
        """Every stored partition record, by vbucket."""
        out: dict[int, PartitionRecord] = {}
        rows = self._db.execute(
            "SELECT vbucket, state, failover_log, high_seq, purge_seq, snap_start, snap_end"
            " FROM partitions ORDER BY vbucket"
        )
        for vb, state, log, high, purge, s_start, s_end in rows:
            try:
                failover_log = _parse_failover_log(log)
            except (ValueError, TypeError) as exc:
                raise StorageError(f"{self.path}: vb {vb}: corrupt failover log: {exc}") from exc
            if state not in PARTITION_STATES:
                raise StorageError(f"{self.path}: vb {vb}: unknown partition state {state!r}")
            out[vb] = PartitionRecord(
                vb, state, failover_log, _u64(high), _u64(purge), _u64(s_start), _u64(s_end)
            )
        return out

    def save_partitions(self, records: Iterable[PartitionRecord]) -> None:
        """Upsert partition records in one transaction, durable before returning."""
        params = [_partition_params(r) for r in records]
        with self._transaction(durable=True) as db:
            db.executemany(_UPSERT_PARTITION, params)

    # --- write path

    def write_batch(
        self,
        docs: Sequence[DocRow],
        records: Iterable[PartitionRecord],
        undo: Collection[int] = (),
        boundaries: Mapping[int, Iterable[int]] | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> None:
        """Upsert docs (newest version per key) and partition records in ONE transaction.

        `meta` values (a new collections manifest) are written in the same transaction,
        which is then durable (synchronous=FULL).

        For docs of the partitions in `undo` (replicas), the version each one replaces is
        kept in the undo table first. `boundaries` are snapshot boundaries this batch
        makes reachable (per partition: seqs where its persisted state is a whole
        snapshot's). Raises ValueError, committing nothing, when a doc's seq is not above
        the stored seq of its key, or reuses the seq of another key of its partition.
        """
        doc_params = _doc_params(docs)
        rec_params = [_partition_params(r) for r in records]
        bound_params = [(vb, _i64(b)) for vb, bs in (boundaries or {}).items() for b in bs]
        if not doc_params and not rec_params and not bound_params and not meta:
            return
        undo_params = [(_i64(d.seq), d.vbucket, d.key) for d in docs if d.vbucket in undo]
        try:
            with self._transaction(durable=bool(meta)) as db:
                if meta:
                    _write_meta(db, meta)
                if undo_params:
                    db.executemany(_SAVE_UNDO, undo_params)
                changed = db.executemany(_UPSERT_DOC, doc_params).rowcount if doc_params else 0
                if changed != len(doc_params):
                    raise _StaleVersion  # some upsert was a no-op: see _UPSERT_DOC
                db.executemany(_UPSERT_PARTITION, rec_params)
                db.executemany(
                    "INSERT OR IGNORE INTO boundaries (vbucket, seq) VALUES (?, ?)", bound_params
                )
        except sqlite3.IntegrityError as exc:
            raise ValueError(f"write_batch: {exc} (a seq reused within a partition)") from exc
        except _StaleVersion:
            # Rolled back: explain against the stored state, walking the batch in order.
            raise ValueError(f"write_batch: {self._seq_regression(docs)}") from None

    def _seq_regression(self, docs: Sequence[DocRow]) -> str:
        """Describe the first doc of a rejected batch whose seq does not advance its key."""
        latest: dict[tuple[int, bytes], int] = {}
        for d in docs:
            ident = (d.vbucket, d.key)
            prev = latest.get(ident)
            if prev is None:
                row = self._db.execute(
                    "SELECT seq FROM docs WHERE vbucket = ? AND key = ?", ident
                ).fetchone()
                prev = None if row is None else _u64(row[0])
            if prev is not None and d.seq <= prev:
                return f"vb {d.vbucket} key {d.key!r}: seq {d.seq} is not above stored seq {prev}"
            latest[ident] = d.seq
        return "a doc's seq does not advance its key"  # pragma: no cover - rowcount mismatch

    # --- reads

    def get(self, vbucket: int, key: bytes) -> DocRow | None:
        """The stored version of a key, tombstones included (`deleted=True`), or None."""
        rows = self._db.execute(
            f"SELECT {_DOC_COLUMNS} FROM docs WHERE vbucket = ? AND key = ?", (vbucket, key)
        ).fetchall()
        return _rows_to_docs(rows)[0] if rows else None

    def get_many(self, keys: Sequence[tuple[int, bytes]]) -> dict[tuple[int, bytes], DocRow]:
        """Stored versions of many (vbucket, key) pairs (absent: no entry).

        A CROSS JOIN driven by a VALUES list: one primary-key search per pair in one query
        (about 0.9 µs a key against 4 µs for single queries; a row-value IN list would scan).
        Lists are padded to a few fixed sizes so SQLite's statement cache hits.
        """
        out: dict[tuple[int, bytes], DocRow] = {}
        db = self._db
        for i in range(0, len(keys), _GET_MANY_SIZES[-1]):
            chunk = list(keys[i : i + _GET_MANY_SIZES[-1]])
            size = next(s for s in _GET_MANY_SIZES if s >= len(chunk))
            chunk += [(-1, b"")] * (size - len(chunk))  # vbucket -1 matches nothing
            rows = db.execute(_get_many_sql(size), [x for pair in chunk for x in pair]).fetchall()
            for doc in _rows_to_docs(rows):
                out[(doc.vbucket, doc.key)] = doc
        return out

    def open_reader(self) -> StorageReader:
        """A separate read-only connection, for one worker thread at a time.

        Safe to call from any thread: it does not touch the writer connection.
        """
        try:
            conn = sqlite.connect(self.path)
            conn.execute("PRAGMA query_only = ON")
        except sqlite3.Error as exc:
            raise StorageError(f"cannot open {self.path}: {exc}") from exc
        return StorageReader(conn, self.path)

    def doc_count(self, vbucket: int | None = None, *, include_deleted: bool = False) -> int:
        """Number of stored keys, of one partition or all; tombstones only if asked."""
        where = []
        params: list[int] = []
        if vbucket is not None:
            where.append("vbucket = ?")
            params.append(vbucket)
        if not include_deleted:
            where.append("deleted = 0")
        sql = "SELECT count(*) FROM docs" + (" WHERE " + " AND ".join(where) if where else "")
        return int(self._db.execute(sql, params).fetchone()[0])

    # --- maintenance

    def expired(self, vbuckets: Collection[int], now: int, limit: int) -> list[DocRow]:
        """Up to `limit` live documents of `vbuckets` whose expiry is at or before `now`,
        soonest first (the expiry pager's candidates; system rows, whose `expiry` is an
        event version, are not documents)."""
        rows = self._db.execute(
            f"SELECT {_DOC_COLUMNS} FROM docs INDEXED BY docs_expiry"
            " WHERE deleted = 0 AND expiry != 0 AND expiry <= ? AND substr(key, 1, 1) != x'01'"
            " AND vbucket IN (SELECT value FROM json_each(?)) ORDER BY expiry LIMIT ?",
            (now, json.dumps(sorted(vbuckets)), limit),
        ).fetchall()
        return _rows_to_docs(rows)

    def purge_tombstones(self, older_than: float, now: float | None = None) -> dict[int, int]:
        """Delete tombstones deleted before `now - older_than` and raise purge_seq.

        Returns {vbucket: new purge_seq} for each partition that lost tombstones; the
        purge_seq of a stored partition record is updated in the same transaction.
        """
        cutoff = (time.time() if now is None else now) - older_than
        out: dict[int, int] = {}
        with self._transaction(durable=False) as db:
            purged = db.execute(
                "SELECT vbucket, max(seq) FROM docs INDEXED BY docs_tombstones"
                " WHERE deleted = 1 AND delete_time < ?"
                " GROUP BY vbucket",
                (cutoff,),
            ).fetchall()
            if purged:
                db.execute("DELETE FROM docs WHERE deleted = 1 AND delete_time < ?", (cutoff,))
                stored = dict(db.execute("SELECT vbucket, purge_seq FROM partitions").fetchall())
                for vb, top in purged:
                    out[vb] = max(_u64(top), _u64(stored.get(vb, 0)))
                db.executemany(
                    "UPDATE partitions SET purge_seq = ? WHERE vbucket = ?",
                    [(_i64(seq), vb) for vb, seq in out.items()],
                )
        return out

    def purge_collection(self, vbucket: int, cid: int, limit: int = 10_000) -> int:
        """Delete up to `limit` rows of a dropped collection in one partition, without
        tombstones (formats/collections.md §3); returns how many (below `limit`: done)."""
        low, high = _key_range(cid)
        with self._transaction(durable=False) as db:
            return int(db.execute(
                "DELETE FROM docs WHERE vbucket = :vb AND key IN (SELECT key FROM docs"
                " WHERE vbucket = :vb AND key >= :low AND key < :high LIMIT :n)",
                {"vb": vbucket, "low": low, "high": high, "n": limit},
            ).rowcount)  # fmt: skip

    def rollback(self, vbucket: int, to_seq: int) -> int:
        """Delete the partition's rows with seq > to_seq, durably; returns how many.

        Only the latest version of a key is kept, so a key whose latest version is above
        `to_seq` disappears entirely. The stored record's high_seq and snapshot are
        clamped to `to_seq` in the same transaction.
        """
        seq = _i64(to_seq)
        with self._transaction(durable=True) as db:
            count = db.execute(
                "DELETE FROM docs WHERE vbucket = ? AND seq > ?", (vbucket, seq)
            ).rowcount
            db.execute(
                "UPDATE partitions SET high_seq = min(high_seq, :s),"
                " snap_start = min(snap_start, :s), snap_end = min(snap_end, :s)"
                " WHERE vbucket = :vb",
                {"s": seq, "vb": vbucket},
            )
        return int(count)

    # --- replica undo (formats/cluster.md §5)

    def undo_floors(self) -> dict[int, int]:
        """Per partition, the lowest seq a replica rollback can restore (absent: none)."""
        rows = self._db.execute("SELECT vbucket, seq FROM undo_floor")
        return {int(vb): _u64(seq) for vb, seq in rows}

    def boundaries(self) -> dict[int, list[int]]:
        """Per partition, the snapshot boundaries a replica rollback can go back to
        (ascending; formats/cluster.md §5)."""
        out: dict[int, list[int]] = {}
        for vb, seq in self._db.execute("SELECT vbucket, seq FROM boundaries ORDER BY 1, 2"):
            out.setdefault(int(vb), []).append(_u64(seq))
        return out

    def start_undo(self, vbucket: int, floor: int, *, boundary: bool = False) -> None:
        """Start keeping undo for a partition that became replica at `floor`, durably;
        `boundary`: its state at `floor` is a whole snapshot's (it was active)."""
        with self._transaction(durable=True) as db:
            db.execute("DELETE FROM undo WHERE vbucket = ?", (vbucket,))
            db.execute("DELETE FROM boundaries WHERE vbucket = ?", (vbucket,))
            db.execute(
                "INSERT OR REPLACE INTO undo_floor (vbucket, seq) VALUES (?, ?)",
                (vbucket, _i64(floor)),
            )
            if boundary:
                db.execute(
                    "INSERT INTO boundaries (vbucket, seq) VALUES (?, ?)", (vbucket, _i64(floor))
                )

    def prune_undo(self, vbucket: int, floor: int) -> None:
        """Forget undo below `floor` (rollbacks below it then reset the partition), and
        the boundaries below it, which the undo no longer reaches."""
        with self._transaction(durable=False) as db:
            db.execute(
                "DELETE FROM undo WHERE vbucket = ? AND new_seq <= ?", (vbucket, _i64(floor))
            )
            db.execute(
                "DELETE FROM boundaries WHERE vbucket = ? AND seq < ?", (vbucket, _i64(floor))
            )
            db.execute(
                "UPDATE undo_floor SET seq = max(seq, ?) WHERE vbucket = ?",
                (_i64(floor), vbucket),
            )

    def rollback_replica(self, vbucket: int, to_seq: int, record: PartitionRecord, *,
                         lost_above: int | None = None) -> int:  # fmt: skip
        """Take a replica partition back to its state at `to_seq`, durably; returns how
        many versions were discarded.

        Every key changed above `to_seq` gets back the version its first change above
        `to_seq` replaced (the undo table), or disappears if it was created above it. The
        caller checked `to_seq` ≥ the partition's undo floor. The discarded versions
        above `lost_above` (the seq the source asked to roll back to, when the rollback
        went further back to a snapshot boundary; default `to_seq`) go to `lost_writes`,
        with `lost_above` as the seq rolled back to: those at or below it are the source's
        too, and come back on the stream. The caller checked `to_seq` is a snapshot
        boundary; the ones above it are forgotten. `record` is saved in the same
        transaction.
        """
        seq = _i64(to_seq)
        args = {"vb": vbucket, "s": seq}
        with self._transaction(durable=True) as db:
            _record_lost(db, vbucket, max(to_seq, lost_above or 0))
            count = db.execute("DELETE FROM docs WHERE vbucket = :vb AND seq > :s", args).rowcount
            # The version a key had at r is the one its first change above r replaced:
            # the undo row above r holding a version at or below r. A key created above r
            # has no such row (a creation replaces nothing), so it stays removed.
            db.execute(
                f"INSERT INTO docs ({_DOC_COLUMNS}) SELECT {_DOC_COLUMNS} FROM undo u"
                " WHERE u.vbucket = :vb AND u.new_seq > :s AND u.seq <= :s AND u.new_seq = ("
                "  SELECT min(new_seq) FROM undo v"
                "  WHERE v.vbucket = :vb AND v.key = u.key AND v.new_seq > :s)",
                args,
            )
            db.execute("DELETE FROM undo WHERE vbucket = :vb AND new_seq > :s", args)
            db.execute("DELETE FROM boundaries WHERE vbucket = :vb AND seq > :s", args)
            db.execute("INSERT OR IGNORE INTO boundaries (vbucket, seq) VALUES (:vb, :s)", args)
            db.execute(_UPSERT_PARTITION, _partition_params(record))
        return int(count)

    def reset_partition(self, record: PartitionRecord, *, lost_above: int | None = None) -> int:
        """Empty a partition (a rollback no reachable boundary serves: it streams again
        from 0); returns how many versions were discarded. With `lost_above` (the seq the
        source asked to roll back to), those above it go to `lost_writes` first."""
        vb = record.vbucket
        with self._transaction(durable=True) as db:
            if lost_above is not None:
                _record_lost(db, vb, lost_above)
            count = db.execute("DELETE FROM docs WHERE vbucket = ?", (vb,)).rowcount
            db.execute("DELETE FROM undo WHERE vbucket = ?", (vb,))
            db.execute("DELETE FROM boundaries WHERE vbucket = ?", (vb,))
            db.execute("INSERT OR REPLACE INTO undo_floor (vbucket, seq) VALUES (?, 0)", (vb,))
            db.execute(_UPSERT_PARTITION, _partition_params(record))
        return int(count)

    def lost_writes(self) -> list[tuple[int, DocRow]]:
        """Versions discarded by replica rollbacks, as (the seq rolled back to, version)."""
        return lost_writes_of(self._db)


def _write_meta(db: sqlite3.Connection, values: Mapping[str, str]) -> None:
    db.executemany(
        "INSERT INTO meta (key, value) VALUES (?, ?)"
        " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        list(values.items()),
    )


def _record_lost(db: sqlite3.Connection, vbucket: int, above: int) -> None:
    """Copy a partition's versions with seq > `above` to `lost_writes` (rolled back to
    `above`), inside the caller's transaction."""
    db.execute(
        f"INSERT OR REPLACE INTO lost_writes (rolled_back_at, rolled_back_to, {_DOC_COLUMNS})"
        f" SELECT :now, :s, {_DOC_COLUMNS} FROM docs WHERE vbucket = :vb AND seq > :s",
        {"vb": vbucket, "s": _i64(above), "now": time.time()},
    )


def _qualify_keys(conn: sqlite3.Connection) -> None:
    """Schema 1 → 2, inside the caller's transaction: every key of a version 1
    directory is a document of the default collection, so it gets the prefix 0x00
    (formats/collections.md §1). `docs` is rebuilt, not updated in place: its primary
    key holds the key, and an in-place UPDATE could meet a key that is some other
    key's prefixed form before that one moved ("a" and "\\x00a")."""
    # `||` makes TEXT of two BLOBs; CAST back gives the same bytes (UTF-8 database)
    qualified = "CAST(X'00' || key AS BLOB)"
    cols = _DOC_COLUMNS.replace("key", qualified, 1)
    conn.execute("DROP INDEX docs_by_seq")
    conn.execute("DROP INDEX docs_tombstones")
    conn.execute("ALTER TABLE docs RENAME TO docs_v1")
    for stmt in _SCHEMA[1:4]:  # docs and its two indexes
        conn.execute(stmt)
    conn.execute(f"INSERT INTO docs ({_DOC_COLUMNS}) SELECT {cols} FROM docs_v1")
    conn.execute("DROP TABLE docs_v1")
    conn.execute(f"UPDATE undo SET key = {qualified}")
    conn.execute(f"UPDATE lost_writes SET key = {qualified}")
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))


def _key_range(cid: int) -> tuple[bytes, bytes]:
    """[low, high) of the qualified keys of collection `cid`: its LEB128 id ends with a
    byte below 0x80, so that byte plus one bounds every key that starts with it."""
    low = leb128.encode(cid)
    return low, low[:-1] + bytes((low[-1] + 1,))


class StorageReader(sqlite.Closing):
    """A read connection; `backfill` gives a consistent snapshot of one partition."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn: sqlite3.Connection | None = conn
        self.path = path
        self._active: Backfill | None = None

    def backfill(self, vbucket: int, after_seq: int, *, batch: int = 1000,
                 max_bytes: int | None = None) -> Backfill:  # fmt: skip
        """Start reading the partition's rows with seq > after_seq (one at a time per
        reader), `batch` rows and about `max_bytes` of keys and values a fetch at most."""
        if self._conn is None:
            raise ValueError(f"{self.path}: reader is closed")
        if batch < 1:
            raise ValueError(f"batch must be positive, got {batch}")
        if self._active is not None and not self._active.done:
            raise RuntimeError("this reader already has an open backfill; close it first")
        self._active = Backfill(self._conn, vbucket, after_seq, batch, max_bytes)
        return self._active

    def close(self) -> None:
        """End any open backfill and close the connection (idempotent)."""
        if self._active is not None:
            self._active.close()
            self._active = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class Backfill(sqlite.Closing):
    """Rows of one partition with seq > after_seq in seq order, from ONE read transaction."""

    high_seq: int  # max seq of the partition in this snapshot (0 if empty)

    def __init__(self, conn: sqlite3.Connection, vbucket: int, after_seq: int, batch: int,
                 max_bytes: int | None = None) -> None:  # fmt: skip
        self._conn = conn
        self._batch = batch
        self._max_bytes = max_bytes
        self.done = False  # True once the read transaction has ended
        conn.execute("BEGIN")
        try:
            # The first SELECT fixes the WAL snapshot: high_seq and the rows agree.
            top = conn.execute(
                "SELECT max(seq) FROM docs WHERE vbucket = ?", (vbucket,)
            ).fetchone()[0]
            self.high_seq = 0 if top is None else _u64(top)
            self._cursor: sqlite3.Cursor = conn.execute(
                f"SELECT {_DOC_COLUMNS} FROM docs WHERE vbucket = ? AND seq > ? ORDER BY seq",
                (vbucket, _i64(after_seq)),
            )
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def fetch(self) -> list[DocRow]:
        """The next batch (at most `batch` rows); [] when done, and the transaction ends."""
        return _rows_to_docs(self._fetch_raw())

    def _fetch_raw(self) -> list[Any]:
        if self.done:
            return []
        limit = self._max_bytes
        if limit is None:
            rows = self._cursor.fetchmany(self._batch)
            if len(rows) < self._batch:
                self.close()
            return rows
        # bounded in bytes too: row by row, since one large value after many small ones
        # must not bring a whole chunk of large ones (a row larger than the bound comes
        # alone)
        rows, size, batch = [], 0, self._batch
        for row in self._cursor:
            rows.append(row)
            size += len(ROW_KEY(row)) + len(ROW_VALUE(row))
            if size >= limit or len(rows) >= batch:
                return rows
        self.close()
        return rows

    def fetch_rows(self) -> list[StoredRow]:
        """Like `fetch`, as plain rows in DocRow field order (`ROW_*` read them), `deleted`
        as 0/1, 64-bit values decoded: the hot path, no object per row."""
        rows = self._fetch_raw()
        t = _TWO64
        # most rows need no u64 decoding and are taken as SQLite made them
        return [
            r if r[2] >= 0 and r[3] >= 0 and r[4] >= 0 and r[8] in (0, False)
            else (r[0], r[1], r[2] + t if r[2] < 0 else r[2], r[3] + t if r[3] < 0 else r[3],
                  r[4] + t if r[4] < 0 else r[4], r[5], r[6], r[7], r[8] == 1, r[9], r[10])
            for r in rows
        ]  # fmt: skip

    def close(self) -> None:
        """End the read transaction early (idempotent)."""
        if not self.done:
            self.done = True
            self._cursor.close()
            self._conn.execute("COMMIT")
