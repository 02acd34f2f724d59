"""`upr cat`: one document of the state at a backup, as a restore would write it.

Theory of operation. The state is the one `upr ls` lists (`jobs.ls.open_state`: `--at`
resolved as restore resolves it, the chain checked whole, the collections live at the
backup by name). Only the key's partition is read: the SDKs' CRC32 hash of the key
over the bucket's partition count, which the manifests record (`jobs.examine`'s
`key_partitions`: when the backups only bound the count from below, each partition
the key can hash to). The latest record of (collection, key) in that partition's
state is the document; a deletion or expiration, or no record at all, means the
restore writes no such document, and `cat` fails with `KeyNotFound` (exit 1, as
`examine` does for a key it does not find).

The body is the value's bytes as stored, inflated when its datatype says Snappy (a
backup stores what its consumer inflated, so that is for older or foreign segments);
the xattrs are not part of it. `Document.to_json` gives the whole record.
"""

from __future__ import annotations

import base64
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from upr_cli.collections import Path as CollectionPath
from upr_cli.errors import UprError, UsageError
from upr_cli.jobs.examine import key_partitions
from upr_cli.jobs.ls import StateAt, key_fields, key_text, known, open_state
from upr_cli.protocol import snappy, xattrs
from upr_cli.protocol.decoder import OP_MUTATION
from upr_cli.protocol.header import DATATYPE_JSON
from upr_cli.repo import BackupId
from upr_cli.segments import Record


class KeyNotFound(UprError):
    """The state at the backup holds no such document (absent, or deleted)."""


@dataclass(frozen=True, slots=True)
class Document:
    """A document of the state: its latest record, where it is, and its body."""

    backup_id: str  # the state's backup (`--at`)
    stored_in: str  # the backup whose segment holds the record
    partition: int
    scope: str
    collection: str
    record: Record

    @property
    def body(self) -> bytes:
        """The value as a restore writes it: inflated when stored Snappy-compressed."""
        r = self.record
        if r.datatype & snappy.SNAPPY and r.value:
            return snappy.inflate(r.value, r.key)
        return r.value

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md): seq, cas and rev seq as decimal strings; the value
        as JSON when its datatype says so, else `value_b64` (base64), as `upr tail`
        gives it; `xattrs` an object, {} for none."""
        r = self.record
        body = self.body
        out: dict[str, Any] = {
            "backup_id": self.backup_id,
            "stored_in": self.stored_in,
            "partition": self.partition,
            "scope": self.scope,
            "collection": self.collection,
            **key_fields(r.key),
            "seq": str(r.seq),
            "cas": str(r.cas),
            "rev_seq": str(r.rev_seq),
            "flags": r.flags,
            "expiry": r.expiry,
            "datatype": r.datatype & ~snappy.SNAPPY,
            "bytes": len(body),
        }
        try:
            if not r.datatype & DATATYPE_JSON:
                raise ValueError("not JSON")
            out["value"] = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            out["value"] = None
            out["value_b64"] = base64.b64encode(body).decode()
        out["xattrs"] = xattrs.to_json(r.xattrs)
        return out


def cat(
    repo_dir: Path,
    key: bytes,
    *,
    bucket: str | None = None,
    at: str = "latest",
    collection: CollectionPath | None = None,
) -> Document:
    """The document `key` of `collection` (default `_default._default`) in the state at
    `at`; `KeyNotFound` when the state has none, a UsageError for a collection no
    backup up to `at` named."""
    path = collection or CollectionPath("_default", "_default")
    if path.collection is None:
        raise UsageError(f"--collection {path}: give SCOPE.COLLECTION")
    with contextlib.ExitStack() as held:
        state = open_state(repo_dir, bucket, at, held=held, command="cat")
        return _document(state, path, key, repo_dir)


def _document(state: StateAt, path: CollectionPath, key: bytes, repo_dir: Path) -> Document:
    """The document `key` of `path` in `state` (see `cat`)."""
    assert path.collection is not None
    name = (path.scope, path.collection)
    ids = {cid for cid, n in state.names.items() if n == name}
    if not ids:
        raise UsageError(f"--collection {path}: no such collection in the backups up to "
                         f"{state.backup_id} (they have {known(state.names)})")  # fmt: skip
    shown = f"{key_text(key)!r} in {path}"
    if not ids & state.keep:
        raise KeyNotFound(f"{shown}: not in the state at {state.backup_id}: the collection "
                          "was dropped by then, or the backup's filter left it out")  # fmt: skip
    where = f"bucket {state.bucket!r} in {repo_dir}"
    parts = [p for p in key_partitions(key, state.manifests, None, where)
             if p in state.partitions]  # fmt: skip
    found = _latest(state, parts, key, ids)
    if found is None:
        raise KeyNotFound(f"{shown}: no such document in the state at {state.backup_id}")
    p, bid, rec = found
    if rec.op != OP_MUTATION:
        raise KeyNotFound(f"{shown}: deleted at seq {rec.seq} (backup {bid}), so not in the "
                          f"state at {state.backup_id}")  # fmt: skip
    return Document(str(state.backup_id), str(bid), p, path.scope, path.collection, rec)


def _latest(
    state: StateAt, partitions: list[int], key: bytes, ids: set[int]
) -> tuple[int, BackupId, Record] | None:
    """The state's latest record of `key` in the collections `ids` (with its partition
    and backup), or None."""
    found: tuple[int, BackupId, Record] | None = None
    for p in partitions:
        for bid, rec in state.records(p):
            if rec.key == key and rec.collection in ids:
                found = (p, bid, rec)
    return found
