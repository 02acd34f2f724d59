"""Document rows as read back from a store, the content hash (formats/store.md §6), and
the JSON text of xattrs (formats/store.md §3.9).

The content hash is a SHA-256 over the live documents sorted by key, each encoded as

    u32 key length, key, u64 cas, u64 rev_seq, u64 flags, u64 expiry, u32 value length, value

(big-endian). It leaves out everything a faithful copy may change: the partition, the
seq (a restore to a node assigns new seqs), the datatype (a node may re-detect JSON) and
tombstones. Any holder of documents (a node, a backup, a store) computes the same value
with `content_hash_of`, so tests compare a store with its source by one string.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from upr_cli.protocol import xattrs

_HEAD = struct.Struct(">I")
_META = struct.Struct(">QQQQI")

#: (key, value, cas, rev_seq, flags, expiry): what the content hash covers.
HashedDoc = tuple[bytes, bytes, int, int, int, int]


@dataclass(frozen=True, slots=True)
class Document:
    """One stored version of a key: a live document, or a tombstone (`deleted=True`)."""

    partition: int
    key: bytes
    seq: int
    rev_seq: int
    cas: int
    flags: int
    expiry: int
    delete_time: int
    datatype: int
    deleted: bool
    value: bytes
    collection: int = 0  # the collection id (0: `_default._default`)
    # the xattr blob (formats/wire.md "Xattrs"; b"" for none), rebuilt from the stored
    # JSON text (formats/store.md §3.9): `xattrs.to_json` gives the object back
    xattrs: bytes = b""


class ContentHasher:
    """Incremental content hash; feed documents in key order (ties in any order)."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._run: list[HashedDoc] = []  # documents sharing the current key
        self.count = 0

    def update(self, docs: Iterable[HashedDoc]) -> None:
        """Add documents, sorted by key; raises ValueError when a key goes backwards."""
        run = self._run
        for doc in docs:
            if run and doc[0] != run[0][0]:
                if doc[0] < run[0][0]:
                    raise ValueError("content hash: documents are not sorted by key")
                self._flush()
            run.append(doc)

    def _flush(self) -> None:
        # Equal keys (possible only across partitions) are ordered by the whole tuple.
        update = self._sha.update
        for key, value, cas, rev_seq, flags, expiry in sorted(self._run):
            update(_HEAD.pack(len(key)) + key + _META.pack(cas, rev_seq, flags, expiry, len(value)))
            update(value)
        self.count += len(self._run)
        self._run.clear()

    def hexdigest(self) -> str:
        """The hash of everything fed so far, as 64 lowercase hex digits."""
        self._flush()
        return self._sha.hexdigest()


def content_hash_of(docs: Iterable[HashedDoc]) -> str:
    """The content hash of live documents given in any order as HashedDoc tuples."""
    hasher = ContentHasher()
    hasher.update(sorted(docs))
    return hasher.hexdigest()


def xattrs_json(blob: bytes, key: bytes = b"") -> str:
    """The JSON text of an xattr blob, as the store's `xattrs` column and Spark's hold it
    (formats/store.md §3.9, formats/spark.md §4): the JSON object of its pairs,
    each value's JSON text as it came, once checked (measured at 2/3 of the cost of
    parsing the values and printing the object again). A value that is not JSON is kept
    as a string, as `xattrs.to_json` keeps it. A malformed blob raises
    CorruptXattrsError naming the key."""
    found = xattrs.pairs(blob, key)
    try:
        for _name, value in found:
            json.loads(value)
        return "{" + ",".join([json.dumps(n) + ":" + v.decode() for n, v in found]) + "}"
    except ValueError:  # not JSON (a UnicodeDecodeError included)
        return json.dumps(xattrs.to_json(blob), separators=(",", ":"))
