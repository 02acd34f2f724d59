"""A node's data directory as the node and the tools beside it read it: its document
rows, its key layout and the versions replica rollbacks kept (docs/design.md "Salvage").

The node writes `<data_dir>/<bucket>.sqlite3` (upr_cli/node/storage.py owns the schema
and every write). `upr salvage --node-data` reads the `lost_writes` table of a replica's
directory, possibly while the node runs; it needs no more than this module, so a
library job does not depend on the server's internals:

* a stored version is a `DocRow`, read from the `DOC_COLUMNS` of a row with
  `rows_to_docs` (u64 columns are stored as their two's complement i64);
* every key is qualified (formats/collections.md §1): LEB128 collection id, then the
  document key; a system event row's key starts with the system namespace, collection
  id 1 (upr_cli/node/sysevents.py lays those rows out), and is no document's write;
* a directory of schema version 1 (before collections) holds plain keys, all in the
  default collection: they read as qualified with the prefix 0x00, as the node
  migrates them when it opens the directory.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from upr_cli import sqlite
from upr_cli.errors import UprError
from upr_cli.sqlite import TWO64 as _TWO64
from upr_cli.sqlite import u64 as _u64

SCHEMA_VERSION = 2  # 2: qualified keys (formats/collections.md §1)
SYSTEM_NAMESPACE = 1  # the collection id of system event keys
_SYSTEM_PREFIX = bytes((SYSTEM_NAMESPACE,))
_DEFAULT_PREFIX = b"\x00"  # the default collection's id as LEB128
DOC_COLUMNS = (
    "vbucket, key, seq, rev_seq, cas, flags, expiry, datatype, deleted, delete_time, value"
)


class NodeFilesError(UprError):
    """A node's data directory that cannot be read (missing, not a node's, too new)."""


# Not frozen, though never changed once made (a new version is a new DocRow, built or
# `replace`d): the write path makes one per request, and a frozen dataclass's __init__
# costs 6x a plain one's (11 object.__setattr__ calls; profiled at a tenth of the node's
# time taking SETs). Hashable as a frozen one is.
@dataclass(slots=True, unsafe_hash=True)
class DocRow:
    """One document version as stored: a live document or a tombstone."""

    vbucket: int
    key: bytes
    seq: int
    rev_seq: int
    cas: int
    flags: int
    expiry: int
    datatype: int
    deleted: bool
    delete_time: int  # unix seconds when deleted (0 for live docs)
    value: bytes


def rows_to_docs(rows: list[Any]) -> list[DocRow]:
    """Turn `DOC_COLUMNS` rows into DocRows (inlined conversions: this is the hot loop)."""
    t = _TWO64
    return [
        DocRow(
            vb,
            k,
            s if s >= 0 else s + t,
            r if r >= 0 else r + t,
            c if c >= 0 else c + t,
            f,
            e,
            dt,
            d == 1,
            tm,
            v,
        )
        for vb, k, s, r, c, f, e, dt, d, tm, v in rows
    ]


def is_system_key(key: bytes) -> bool:
    """True for a system event row's key (its collection id is the system namespace)."""
    return key[:1] == _SYSTEM_PREFIX


def lost_writes_of(db: sqlite3.Connection) -> list[tuple[int, DocRow]]:
    """Versions discarded by replica rollbacks, as (the seq rolled back to, version), in
    the order they were discarded."""
    rows = db.execute(
        f"SELECT rolled_back_to, {DOC_COLUMNS} FROM lost_writes"
        " ORDER BY rolled_back_at, vbucket, seq"
    ).fetchall()
    docs = rows_to_docs([r[1:] for r in rows])
    return [(_u64(r[0]), d) for r, d in zip(rows, docs, strict=True)]


def read_lost_writes(data_dir: Path, bucket: str) -> list[tuple[int, DocRow]]:
    """The lost writes of `bucket` in a node's data directory (`lost_writes_of`), read
    without writing to it (the node may be running); keys qualified."""
    path = data_dir / f"{bucket}.sqlite3"
    try:
        db = sqlite.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise NodeFilesError(f"cannot open {path}: {exc}") from exc
    try:
        names = {name for (name,) in db.execute("SELECT name FROM sqlite_schema")}
        if not names:
            return []  # a database the node has not written yet
        if "meta" not in names or "lost_writes" not in names:
            raise NodeFilesError(f"{path}: not an upr node database")
        found = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        version = str(found[0]) if found else ""
        if not version.isdigit():
            raise NodeFilesError(f"{path}: bad schema version {version!r}")
        if int(version) > SCHEMA_VERSION:
            raise NodeFilesError(f"{path}: schema version {version} is newer than this upr "
                                 f"supports ({SCHEMA_VERSION})")  # fmt: skip
        lost = lost_writes_of(db)
    except sqlite3.Error as exc:
        raise NodeFilesError(f"cannot read {path}: {exc}") from exc
    finally:
        db.close()
    if int(version) < 2:
        return [(cut, replace(d, key=_DEFAULT_PREFIX + d.key)) for cut, d in lost]
    return lost
