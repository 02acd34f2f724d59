"""Schema of the SQLite store (formats/store.md): creation, identification, migration.

Theory of operation
-------------------
* A store is recognised by its `meta` table: `format` = "upr-store" and a decimal
  `schema_version`. A file with tables but no such row is not a store; a file whose
  version is above `SCHEMA_VERSION` is refused, never written to.
* Creation and migration run through `sqlite_utils.Database` inside ONE `BEGIN
  IMMEDIATE` transaction (sqlite-utils statements join an open transaction), so two
  processes opening a new file at once cannot both create it, and a crash mid-way leaves
  the previous version intact. `MIGRATIONS[v]` turns version v into v + 1; a store of an
  older version is brought up to date step by step when it is opened.
* Tables keyed by more than an integer are WITHOUT ROWID (sqlite-utils has no option for
  it, so its generated CREATE TABLE gets the clause appended): a row lives in its primary
  key b-tree, so a write touches one b-tree instead of two.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import sqlite_utils

from upr_cli import sqlite
from upr_cli.errors import UprError

SCHEMA_VERSION = 5
FORMAT = "upr-store"

_DOCUMENT_COLUMNS: dict[str, type] = {
    "partition": int,
    "key": bytes,
    "seq": int,
    "rev_seq": int,
    "cas": int,
    "flags": int,
    "expiry": int,
    "delete_time": int,
    "datatype": int,
    "deleted": int,
    "value": bytes,
}

_PREV = ("seq", "rev_seq", "cas", "flags", "expiry", "delete_time", "datatype", "deleted")
_LOG_COLUMNS: dict[str, type] = (
    {"partition": int, "seq": int, "key": bytes}
    | {f"prev_{name}": int for name in _PREV}
    | {"prev_value": bytes}
)

# A convenience view: live JSON documents only, with `doc` NULL unless it is valid JSON,
# so a json_extract over the whole view can never fail on one bad row. Version 1's
# columns; version 4 replaces it with `_JSON_VIEW` (the collection's names added).
_JSON_VIEW_V1 = """
SELECT partition, key, CAST(key AS TEXT) AS id, seq, rev_seq, cas, flags, expiry, datatype,
       CASE WHEN json_valid(value) THEN value END AS doc
FROM documents
WHERE deleted = 0 AND typeof(value) = 'text'
"""

# Names join in (LEFT: a collection whose creation the store never saw keeps its
# documents, with NULL names) from `collections` and `scopes` (formats/store.md §3.7).
_NAMED = """
FROM documents AS d
LEFT JOIN collections AS c ON c.id = d.collection_id
LEFT JOIN scopes AS s ON s.id = c.scope_id
"""
_NAMED_VIEW = f"""
SELECT d.partition, d.key, d.seq, d.rev_seq, d.cas, d.flags, d.expiry, d.delete_time,
       d.datatype, d.deleted, d.value, d.collection_id, s.name AS scope, c.name AS collection
{_NAMED}
"""
_JSON_VIEW = f"""
SELECT d.partition, d.key, CAST(d.key AS TEXT) AS id, d.seq, d.rev_seq, d.cas, d.flags,
       d.expiry, d.datatype, CASE WHEN json_valid(d.value) THEN d.value END AS doc,
       d.collection_id, s.name AS scope, c.name AS collection
{_NAMED}
WHERE d.deleted = 0 AND typeof(d.value) = 'text'
"""


def _add_lost_writes(db: sqlite_utils.Database) -> None:
    """v1 → v2: the `lost_writes` table (formats/store.md §3.5)."""
    columns: dict[str, type] = {"id": int} | _DOCUMENT_COLUMNS
    columns |= {"uuid": int, "rolled_back_to": int, "recorded": str, "salvaged": str}
    not_null = [c for c in columns if c not in ("id", "salvaged")]
    db.execute(db.create_table_sql("lost_writes", columns, pk="id", not_null=not_null))


def _add_boundaries(db: sqlite_utils.Database) -> None:
    """v2 → v3: the `boundaries` table (formats/store.md §3.6). A v2 store recorded no
    boundaries; its saved positions that end their snapshot (seq = snap_end) are the
    only states it is known to have held whole."""
    db.execute(_BOUNDARIES_SQL)
    db.execute(
        "INSERT OR IGNORE INTO boundaries (partition, seq) SELECT partition, seq"
        " FROM partitions WHERE seq = snap_end"
    )


_BOUNDARIES_SQL = (
    "CREATE TABLE boundaries (partition INTEGER NOT NULL, seq INTEGER NOT NULL,"
    " PRIMARY KEY (partition, seq)) WITHOUT ROWID"
)

# Version 4 (formats/store.md §8): a key is (partition, collection id, key). The id is
# the LAST column of `documents` and `mutation_log`, so a reader's positional
# `SELECT *` of version 3 still finds every column where it was.
_COLLECTIONS_SQL = (
    "CREATE TABLE collections (id INTEGER PRIMARY KEY, scope_id INTEGER NOT NULL,"
    " name TEXT NOT NULL, max_ttl INTEGER, dropped INTEGER NOT NULL DEFAULT 0)",
    "CREATE TABLE scopes (id INTEGER PRIMARY KEY, name TEXT NOT NULL,"
    " dropped INTEGER NOT NULL DEFAULT 0)",
    "INSERT INTO scopes (id, name) VALUES (0, '_default')",
    "INSERT INTO collections (id, scope_id, name) VALUES (0, 0, '_default')",
)


def _rebuild(db: sqlite_utils.Database, table: str, columns: dict[str, type],
             not_null: list[str], pk: tuple[str, ...]) -> None:  # fmt: skip
    """Give `table` a `collection_id` column (0 for every row: before version 4 every
    document was in the default collection) and a new primary key: SQLite changes a
    primary key only by copying the table."""
    names = ", ".join(columns)
    sql = db.create_table_sql(
        f"{table}_v4", columns | {"collection_id": int}, pk=pk,
        not_null=[*not_null, "collection_id"], defaults={"collection_id": 0},
    )  # fmt: skip
    db.execute(_without_rowid(sql))
    db.execute(f"INSERT INTO [{table}_v4] ({names}) SELECT {names} FROM [{table}]")
    db.execute(f"DROP TABLE [{table}]")
    db.execute(f"ALTER TABLE [{table}_v4] RENAME TO [{table}]")


def _add_collections(db: sqlite_utils.Database) -> None:
    """v3 → v4: collections (formats/store.md §3.2, §3.8): the `collection_id` column in
    `documents`, `mutation_log` and `lost_writes`, the `collections` and `scopes`
    tables, and the views with names. Every existing row is in `_default._default`."""
    db.execute("DROP VIEW json_documents")  # it reads `documents`, which is rebuilt
    _rebuild(db, "documents", _DOCUMENT_COLUMNS, list(_DOCUMENT_COLUMNS),
             ("partition", "collection_id", "key"))  # fmt: skip
    _rebuild(db, "mutation_log", _LOG_COLUMNS, ["partition", "seq", "key"],
             ("partition", "seq", "collection_id", "key"))  # fmt: skip
    db.execute("ALTER TABLE lost_writes ADD COLUMN collection_id INTEGER NOT NULL DEFAULT 0")
    for sql in _COLLECTIONS_SQL:
        db.execute(sql)
    db.execute(f"CREATE VIEW json_documents AS {_JSON_VIEW}")
    db.execute(f"CREATE VIEW named_documents AS {_NAMED_VIEW}")


# Version 5 (formats/store.md §3.9): xattrs, as the JSON text of an object (NULL for
# none), in `documents`, `lost_writes` and, as `prev_xattrs`, `mutation_log`, so a rollback
# puts them back. Each is added last, as `collection_id` was; the views gain the column.
_NAMED_VIEW_V5 = f"""
SELECT d.partition, d.key, d.seq, d.rev_seq, d.cas, d.flags, d.expiry, d.delete_time,
       d.datatype, d.deleted, d.value, d.collection_id, s.name AS scope, c.name AS collection,
       d.xattrs
{_NAMED}
"""
_JSON_VIEW_V5 = f"""
SELECT d.partition, d.key, CAST(d.key AS TEXT) AS id, d.seq, d.rev_seq, d.cas, d.flags,
       d.expiry, d.datatype, CASE WHEN json_valid(d.value) THEN d.value END AS doc,
       d.collection_id, s.name AS scope, c.name AS collection, d.xattrs
{_NAMED}
WHERE d.deleted = 0 AND typeof(d.value) = 'text'
"""


def _add_xattrs(db: sqlite_utils.Database) -> None:
    """v4 → v5: the `xattrs` columns (formats/store.md §3.9) and the views showing them.
    Every existing row has none (NULL): before version 5 no replay asked for xattrs."""
    db.execute("DROP VIEW json_documents")
    db.execute("DROP VIEW named_documents")
    db.execute("ALTER TABLE documents ADD COLUMN xattrs TEXT")
    db.execute("ALTER TABLE mutation_log ADD COLUMN prev_xattrs TEXT")
    db.execute("ALTER TABLE lost_writes ADD COLUMN xattrs TEXT")
    db.execute(f"CREATE VIEW json_documents AS {_JSON_VIEW_V5}")
    db.execute(f"CREATE VIEW named_documents AS {_NAMED_VIEW_V5}")


#: version v → the function that turns a version-v store into version v + 1, inside the
#: open transaction (run DDL with `db.execute`; never commit). A new store is created at
#: version 1 and brought up by these, so every step runs on every new store.
MIGRATIONS: dict[int, Callable[[sqlite_utils.Database], None]] = {
    1: _add_lost_writes,
    2: _add_boundaries,
    3: _add_collections,
    4: _add_xattrs,
}


class StoreError(UprError):
    """The store file is unusable: not SQLite, not a store, too new, locked or corrupt."""


def now_iso() -> str:
    """The current UTC time as ISO 8601 with milliseconds and a Z suffix."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _without_rowid(create_sql: str) -> str:
    """A sqlite-utils CREATE TABLE statement made WITHOUT ROWID."""
    return create_sql.strip().removesuffix(";") + " WITHOUT ROWID"


def set_meta(conn: sqlite3.Connection, key: str, value: str) -> None:
    """Write one `meta` row (inside the caller's transaction)."""
    conn.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?)"
        " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )


def _create(db: sqlite_utils.Database, conn: sqlite3.Connection, source: str) -> None:
    """Create the tables and view of version 1 (the caller holds the lock); `MIGRATIONS`
    then bring the new store up to the current version.

    sqlite-utils writes the DDL; it is run with `execute`, which joins the open
    transaction (some sqlite-utils versions commit inside `Table.create`).
    """
    partition_columns: dict[str, type] = {
        "partition": int, "uuid": int, "seq": int, "snap_start": int, "snap_end": int,
        "failover_log": str, "log_count": int, "log_floor": int, "updated": str,
    }  # fmt: skip
    tables: list[tuple[str, dict[str, type], str | tuple[str, ...], list[str], bool]] = [
        ("meta", {"key": str, "value": str}, "key", ["value"], False),
        ("documents", _DOCUMENT_COLUMNS, ("partition", "key"), list(_DOCUMENT_COLUMNS), True),
        ("mutation_log", _LOG_COLUMNS, ("partition", "seq"), ["partition", "seq", "key"], True),
        ("partitions", partition_columns, "partition",
         [c for c in partition_columns if c not in ("partition", "failover_log")], False),
    ]  # fmt: skip
    for name, columns, pk, not_null, without_rowid in tables:
        sql = db.create_table_sql(name, columns, pk=pk, not_null=not_null)
        db.execute(_without_rowid(sql) if without_rowid else sql)
    db.execute(f"CREATE VIEW json_documents AS {_JSON_VIEW_V1}")
    for key, value in (
        ("format", FORMAT),
        ("schema_version", "1"),
        ("created", now_iso()),
        ("source", source),
    ):
        set_meta(conn, key, value)


def _current(conn: sqlite3.Connection, source: str | None) -> bool:
    """True when the file is already a store of this version with this source: opening it
    then needs no write, so it works while another process holds a long write
    transaction (a replay's catch-up). Anything else goes through the locked path."""
    try:
        meta = {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta")}
    except sqlite3.DatabaseError:
        return False
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    return (
        meta.get("format") == FORMAT
        and meta.get("schema_version") == str(SCHEMA_VERSION)
        and (source is None or meta.get("source") == source)
    )


def init_schema(conn: sqlite3.Connection, path: Path, *, create: bool, source: str | None) -> None:
    """Create the schema in an empty file, or check and migrate an existing store."""
    if _current(conn, source):
        return
    db = sqlite_utils.Database(conn, execute_plugins=False)
    with sqlite.transaction(conn):
        names = {name for (name,) in conn.execute("SELECT name FROM sqlite_schema")}
        if not names:
            if not create:
                raise StoreError(f"{path}: not an upr store (the database is empty)")
            _create(db, conn, source or "")
        elif "meta" not in names:
            raise StoreError(f"{path}: not an upr store (no meta table)")
        meta = {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta")}
        if meta.get("format") != FORMAT:
            raise StoreError(f"{path}: not an upr store (meta format is {meta.get('format')!r})")
        version = meta.get("schema_version", "")
        if not version.isdigit() or int(version) < 1:
            raise StoreError(f"{path}: bad schema version {version!r}")
        if int(version) > SCHEMA_VERSION:
            raise StoreError(
                f"{path}: schema version {version} is newer than this upr supports "
                f"({SCHEMA_VERSION}); upgrade upr"
            )
        for v in range(int(version), SCHEMA_VERSION):
            step = MIGRATIONS.get(v)
            if step is None:
                raise StoreError(f"{path}: no migration from schema version {v}")
            step(db)
        if int(version) != SCHEMA_VERSION:
            if not conn.in_transaction:
                raise StoreError(f"{path}: a schema migration committed on its own")
            set_meta(conn, "schema_version", str(SCHEMA_VERSION))
        if source is not None and meta.get("source") != source:
            set_meta(conn, "source", source)
