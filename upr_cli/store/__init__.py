"""SQLite store (formats/store.md): the target of `upr restore … sqlite:PATH` and `upr replay`.

`Store` holds documents (tombstones included), per-partition positions and failover
logs, and a bounded mutation log that undoes changes on a rollback; documents are keyed
by collection id, and the `collections` and `scopes` tables name the ids. `content_hash_of`
computes, from any holder's documents, the hash `Store.content_hash` returns.

Modules, by job: `store` (`Store`: the connection, its transactions, the public calls),
`schema` (creation and migrations), `apply` (the write path), `partitions` (positions
and snapshot boundaries), `manifests` (collections), `rollback` (undo, reset, lost
writes), `queries` (reads) and `content` (documents, the content hash, xattrs as JSON).
"""

from upr_cli.store.apply import Row
from upr_cli.store.content import ContentHasher, Document, HashedDoc, content_hash_of, xattrs_json
from upr_cli.store.manifests import StoredCollection
from upr_cli.store.partitions import PartitionState
from upr_cli.store.queries import LostWrite
from upr_cli.store.rollback import RollbackResult
from upr_cli.store.schema import FORMAT, SCHEMA_VERSION, StoreError
from upr_cli.store.store import DEFAULT_UNDO_WINDOW, Store

__all__ = [
    "DEFAULT_UNDO_WINDOW",
    "FORMAT",
    "SCHEMA_VERSION",
    "ContentHasher",
    "Document",
    "HashedDoc",
    "LostWrite",
    "PartitionState",
    "RollbackResult",
    "Row",
    "Store",
    "StoreError",
    "StoredCollection",
    "content_hash_of",
    "xattrs_json",
]
