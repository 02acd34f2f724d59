"""The sub-document commands against a bucket (formats/subdoc.md): which version a
request sees, the CAS and document-flag rules, and the version a mutation stores. The
JSON work is `upr_cli/node/subdoc.py`'s.

* A lookup reads the key's latest version. A tombstone is seen only with the document
  flag ACCESS_DELETED (else KEY_ENOENT, as for a key never written); the header status
  then says so (SubdocSuccessDeleted, SubdocMultiPathFailureDeleted).
* A mutation follows kv_engine's `SubdocCommandContext`: without MKDOC or ADD the
  document must exist (KEY_ENOENT); ADD fails on one that does (KEY_EEXISTS); a CAS given
  must match (KEY_EEXISTS) and needs a document (KEY_ENOENT). A tombstone is a document
  only with ACCESS_DELETED: its xattrs may change and it stays deleted (a body is
  SubdocDeletedDocumentCantHaveValue); without the flag a mutation that may create
  starts a new document, without the tombstone's xattrs.
* The new version gets a CAS from the bucket before the specs run, so the macros
  `${Mutation.CAS}` and `${Mutation.seqno}` name the version stored. Its expiry is the
  request's (none without expiry extras, as kv_engine resets it) unless PreserveTTL;
  its flags are the old version's. DELETE_DOC keeps the system xattrs in the tombstone;
  with none left, a tombstone being deleted again is KEY_ENOENT.
"""

from __future__ import annotations

from upr_cli.node import subdoc
from upr_cli.node.bucket import Bucket, unpacked
from upr_cli.node.storage import DocRow
from upr_cli.protocol import xattrs
from upr_cli.protocol.header import DATATYPE_JSON as JSON
from upr_cli.protocol.status import KeyExists, KeyNotFound
from upr_cli.protocol.subdoc import ADD, MKDOC


def document(bucket: Bucket, doc: DocRow) -> subdoc.Document:
    """A stored version as the engine reads it (inflated, the blob apart)."""
    datatype, blob, body = unpacked(doc)
    return subdoc.Document(
        body=body, json=bool(datatype & JSON), blob=blob, deleted=doc.deleted, cas=doc.cas,
        seqno=doc.seq, rev_seq=doc.rev_seq, expiry=doc.expiry, flags=doc.flags,
        datatype=doc.datatype, vbucket_uuid=bucket.partitions[doc.vbucket].uuid,
    )  # fmt: skip


def lookup_in(bucket: Bucket, vb: int, key: bytes, req: subdoc.Request,
              cas: int = 0) -> tuple[int, int, bytes]:  # fmt: skip
    """(header status, CAS, body) of a SUBDOC_MULTI_LOOKUP."""
    doc = bucket.version(vb, key)
    if doc is None or (doc.deleted and not req.access_deleted):
        raise KeyNotFound(f"no such key in partition {vb}")
    if cas and doc.cas != cas:
        raise KeyExists("CAS mismatch")
    results = subdoc.lookup(req, document(bucket, doc))
    return subdoc.lookup_status(results, doc.deleted), doc.cas, subdoc.lookup_body(results)


def mutate_in(bucket: Bucket, vb: int, key: bytes, req: subdoc.Request, *, cas: int = 0,
              preserve_ttl: bool = False) -> tuple[int, DocRow, bytes]:  # fmt: skip
    """(header status, the version stored, body) of a SUBDOC_MULTI_MUTATION; a failed
    spec raises `subdoc.SpecFailed`, a request refused a status error."""
    old = bucket.version(vb, key)
    seen = old if old is not None and (not old.deleted or req.access_deleted) else None
    if seen is None:
        if cas:
            raise KeyNotFound("no such key (CAS given)")
        if not req.doc_flags & (MKDOC | ADD):
            raise KeyNotFound(f"no such key in partition {vb}")
        base = subdoc.new_document(req)
    else:
        if req.doc_flags & ADD:
            raise KeyExists("key exists")
        if cas and seen.cas != cas:
            raise KeyExists("CAS mismatch")
        base = document(bucket, seen)
    new_cas = bucket.next_cas()
    outcome = subdoc.mutate(req, base, cas=new_cas, seqno=bucket.partitions[vb].high_seq + 1)
    if outcome.delete_doc and not outcome.blob and seen is not None and seen.deleted:
        raise KeyNotFound("the document is deleted and keeps no system xattrs")
    datatype, value = xattrs.join(outcome.blob, outcome.body, JSON if outcome.json else 0)
    if outcome.deleted:
        datatype &= xattrs.XATTR  # a tombstone's value is its blob alone
    expiry = req.expiry or 0
    if preserve_ttl and seen is not None and not seen.deleted:
        expiry = seen.expiry
    doc = bucket.write_version(vb, key, old, value=value, datatype=datatype,
                               deleted=outcome.deleted, flags=seen.flags if seen else 0,
                               expiry=expiry, cas=new_cas)  # fmt: skip
    deleted_before = seen is not None and seen.deleted
    status = subdoc.Code.SUCCESS_DELETED if deleted_before else subdoc.Code.SUCCESS
    return status, doc, subdoc.mutation_body(outcome.results)
