"""Reads of a store's documents and lost writes (formats/store.md §3.2, §3.5, §7) and its
content hash (formats/store.md §6), as `Document` values: 64-bit values back to
unsigned, xattrs back to their blob.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from upr_cli.protocol import xattrs
from upr_cli.sqlite import TWO64 as _TWO64
from upr_cli.sqlite import i64 as _i64
from upr_cli.sqlite import u64 as _u64
from upr_cli.store.content import ContentHasher, Document

_FETCH = 4096
_DOC_SELECT = (
    "partition, key, seq, rev_seq, cas, flags, expiry, delete_time, datatype, deleted,"
    " CAST(value AS BLOB), collection_id, xattrs"
)


@dataclass(frozen=True, slots=True)
class LostWrite:
    """A version a rollback took back: the newest version of its key above the cut."""

    id: int
    document: Document
    uuid: int  # the branch the store followed when it held this version
    rolled_back_to: int  # the rollback seq that took it back
    recorded: str  # when (ISO 8601 UTC)
    salvaged: str | None  # when `upr salvage --apply` wrote it back, if it did


def get(db: sqlite3.Connection, partition: int, key: bytes | str, collection: int
        ) -> Document | None:  # fmt: skip
    """The stored version of a key of a collection (by id), tombstones included."""
    k = key.encode() if isinstance(key, str) else bytes(key)
    row = db.execute(
        f"SELECT {_DOC_SELECT} FROM documents"
        " WHERE partition = ? AND collection_id = ? AND key = ?",
        (partition, collection, k),
    ).fetchone()
    return None if row is None else _document(row)


def documents(
    db: sqlite3.Connection, partitions: Iterable[int] | None, include_deleted: bool
) -> Iterator[Document]:
    """Stored documents ordered by (partition, collection id, key)."""
    where, params = _where(partitions, include_deleted)
    cursor = db.execute(
        f"SELECT {_DOC_SELECT} FROM documents{where} ORDER BY partition, collection_id, key",
        params,
    )
    while chunk := cursor.fetchmany(_FETCH):
        yield from map(_document, chunk)


def lost_writes(
    db: sqlite3.Connection, partitions: Iterable[int] | None, include_salvaged: bool
) -> list[LostWrite]:
    """The rows of `lost_writes`, oldest first."""
    where, params = _where(partitions, True)
    if not include_salvaged:
        where += (" AND" if where else " WHERE") + " salvaged IS NULL"
    rows = db.execute(
        f"SELECT id, {_DOC_SELECT}, uuid, rolled_back_to, recorded, salvaged"
        f" FROM lost_writes{where} ORDER BY id",
        params,
    ).fetchall()
    return [
        LostWrite(r[0], _document(r[1:14]), _u64(r[14]), _u64(r[15]), r[16], r[17]) for r in rows
    ]


def documents_above(db: sqlite3.Connection, partition: int, seq: int) -> list[Document]:
    """The documents of a partition whose seq is above `seq`, tombstones included."""
    rows = db.execute(
        f"SELECT {_DOC_SELECT} FROM documents WHERE partition = ? AND seq > ? ORDER BY seq",
        (partition, _i64(seq)),
    ).fetchall()
    return [_document(r) for r in rows]


def count(db: sqlite3.Connection, include_deleted: bool, partition: int | None) -> int:
    """Number of stored keys, of one partition or all."""
    where, params = _where(None if partition is None else [partition], include_deleted)
    return int(db.execute(f"SELECT count(*) FROM documents{where}", params).fetchone()[0])


def content_hash(db: sqlite3.Connection, partitions: Iterable[int] | None) -> str:
    """The content hash of the live documents (formats/store.md §6, `content_hash_of`)."""
    where, params = _where(partitions, False)
    cursor = db.execute(
        "SELECT key, CAST(value AS BLOB), cas, rev_seq, flags, expiry"
        f" FROM documents{where} ORDER BY key",
        params,
    )
    hasher = ContentHasher()
    t = _TWO64
    while chunk := cursor.fetchmany(_FETCH):
        hasher.update(
            (k, v, c + t if c < 0 else c, r + t if r < 0 else r, f, e) for k, v, c, r, f, e in chunk
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
