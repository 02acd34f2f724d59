"""The official Couchbase Python SDK (`couchbase` 4.6.3) writes and reads xattrs and
sub-document paths on `upr serve` (formats/subdoc.md): `mutate_in` with system and
user xattrs and `MutationMacro.cas()`, counters, array appends, field inserts and
removals, whole-document replace; `lookup_in` get/exists/count/get_full; a removed
document keeps its system xattrs for `lookup_in(access_deleted=True)`; a CAS mismatch
and a missing path are the SDK's own exceptions. The SDK's verdict is the truth: an
error it raises where a Couchbase Server would not is a bug of the node.

One node and one SDK cluster object serve the module (the SDK's connect takes
seconds); each test uses its own keys."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import PASSWORD, USER, Node
from tests.e2e.e2e_helpers import drain, run, wait_persisted


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = Node(tmp_path_factory.mktemp("sdkx") / "node", "--flush-interval", "0.02")
    try:
        node.start()
        yield node
    finally:
        node.close()


@pytest.fixture(scope="module")
def docs(served: Node) -> Iterator[Any]:
    """The SDK's default collection of the node's bucket."""
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.options import ClusterOptions

    cluster = Cluster(f"couchbase://127.0.0.1:{served.port}=kv",
                      ClusterOptions(PasswordAuthenticator(USER, PASSWORD)))  # fmt: skip
    try:
        yield cluster.bucket("default").default_collection()
    finally:
        cluster.close()


def _cas_macro(cas: int) -> str:
    """What `${Mutation.CAS}` expands to: the CAS's 8 bytes in little-endian order."""
    return "0x" + cas.to_bytes(8, "little").hex()


def test_xattrs_macros_and_body_paths(docs: Any) -> None:
    import couchbase.subdocument as SD
    from couchbase.subdocument import MutationMacro

    docs.upsert("x1", {"name": "one", "n": 1, "tags": ["a"], "old": True})
    res = docs.mutate_in("x1", [
        SD.upsert("_sync.rev", "1-abc", xattr=True, create_parents=True),
        SD.upsert("_sync.cas", MutationMacro.cas(), xattr=True, create_parents=True),
        SD.upsert("meta.by", "alice", xattr=True, create_parents=True),
        SD.increment("n", 5),
        SD.array_append("tags", "b", "c"),
        SD.insert("added", {"k": [1, 2]}),
        SD.remove("old"),
    ])  # fmt: skip
    assert res.content_as[int](3) == 6  # the counter's new value
    got = docs.lookup_in("x1", [
        SD.get("_sync", xattr=True), SD.get("meta.by", xattr=True),
        SD.exists("meta.nope", xattr=True), SD.get("tags"), SD.count("tags"), SD.exists("old"),
        SD.get("added.k[-1]"),
    ])  # fmt: skip
    assert got.content_as[dict](0) == {"rev": "1-abc", "cas": _cas_macro(res.cas)}
    assert got.content_as[str](1) == "alice"
    assert not got.exists(2) and not got.exists(5)
    assert got.content_as[list](3) == ["a", "b", "c"] and got.content_as[int](4) == 3
    assert got.content_as[int](6) == 2
    assert got.cas == res.cas
    body = docs.get("x1").content_as[dict]  # a GET answers the body alone
    assert body == {"name": "one", "n": 6, "tags": ["a", "b", "c"], "added": {"k": [1, 2]}}
    full = docs.lookup_in("x1", [SD.get("$document.exptime", xattr=True), SD.get_full()])
    assert full.content_as[int](0) == 0 and full.content_as[dict](1) == body
    assert docs.mutate_in("x1", [SD.decrement("n", 2)]).content_as[int](0) == 4


def test_replace_and_upsert_keep_the_xattrs(docs: Any) -> None:
    import couchbase.subdocument as SD

    docs.upsert("x2", {"v": 1})
    docs.mutate_in("x2", [SD.upsert("_sync", {"rev": "1"}, xattr=True),
                          SD.upsert("app", {"note": "n"}, xattr=True)])  # fmt: skip
    docs.mutate_in("x2", [SD.replace("", {"whole": "new"})])  # SET_DOC in 0xd1
    docs.upsert("x2", {"v": 2})  # a full-document write keeps every xattr
    got = docs.lookup_in("x2", [SD.get("_sync", xattr=True), SD.get("app", xattr=True),
                                SD.get_full()])  # fmt: skip
    assert got.content_as[dict](0) == {"rev": "1"} and got.content_as[dict](1) == {"note": "n"}
    assert got.content_as[dict](2) == {"v": 2}


def test_a_removed_document_keeps_its_system_xattrs(docs: Any) -> None:
    import couchbase.subdocument as SD
    from couchbase.exceptions import DocumentNotFoundException
    from couchbase.options import LookupInOptions, MutateInOptions

    docs.upsert("x3", {"v": 1})
    docs.mutate_in("x3", [SD.upsert("_txn.id", "t-1", xattr=True, create_parents=True),
                          SD.upsert("user", "u", xattr=True)])  # fmt: skip
    docs.remove("x3")  # a plain DELETE
    assert not docs.exists("x3").exists
    with pytest.raises(DocumentNotFoundException):
        docs.lookup_in("x3", [SD.get("_txn", xattr=True)])
    deleted = LookupInOptions(access_deleted=True)
    got = docs.lookup_in("x3", [SD.get("_txn", xattr=True), SD.exists("user", xattr=True)], deleted)
    assert got.content_as[dict](0) == {"id": "t-1"} and not got.exists(1)
    # an xattr of the tombstone changes, and the document stays deleted
    docs.mutate_in("x3", [SD.upsert("_txn.state", "done", xattr=True)],
                   MutateInOptions(access_deleted=True))  # fmt: skip
    got = docs.lookup_in("x3", [SD.get("_txn", xattr=True)], deleted)
    assert got.content_as[dict](0) == {"id": "t-1", "state": "done"}
    assert not docs.exists("x3").exists


def test_the_sdks_exceptions(docs: Any) -> None:
    import couchbase.subdocument as SD
    from couchbase.exceptions import (
        CasMismatchException,
        DocumentExistsException,
        DocumentNotFoundException,
        PathExistsException,
        PathNotFoundException,
    )
    from couchbase.options import MutateInOptions
    from couchbase.subdocument import StoreSemantics

    first = docs.upsert("x4", {"a": 1})
    with pytest.raises(CasMismatchException):
        docs.mutate_in("x4", [SD.upsert("a", 2)], MutateInOptions(cas=first.cas + 1))
    with pytest.raises(PathNotFoundException):
        docs.lookup_in("x4", [SD.get("nope")]).content_as[int](0)
    with pytest.raises(PathNotFoundException):
        docs.mutate_in("x4", [SD.replace("nope", 1)])
    with pytest.raises(PathExistsException):
        docs.mutate_in("x4", [SD.insert("a", 3)])
    with pytest.raises(DocumentNotFoundException):
        docs.mutate_in("x4-missing", [SD.upsert("a", 1)])
    with pytest.raises(DocumentExistsException):
        docs.mutate_in(
            "x4", [SD.upsert("a", 1)], MutateInOptions(store_semantics=StoreSemantics.INSERT)
        )
    assert docs.get("x4").content_as[dict] == {"a": 1}  # nothing changed on a failure


def test_create_with_store_semantics_and_expiry(docs: Any) -> None:
    import couchbase.subdocument as SD
    from couchbase.options import GetOptions, MutateInOptions
    from couchbase.subdocument import StoreSemantics

    docs.mutate_in("x5", [SD.upsert("_s", 1, xattr=True), SD.upsert("a.b", 2)],
                   MutateInOptions(store_semantics=StoreSemantics.UPSERT,
                                   expiry=datetime.timedelta(seconds=600)))  # fmt: skip
    got = docs.get("x5", GetOptions(with_expiry=True))
    assert got.content_as[dict] == {"a": {"b": 2}} and got.expiry_time is not None
    docs.mutate_in("x5", [SD.upsert("c", 3)], MutateInOptions(preserve_expiry=True))
    assert docs.get("x5", GetOptions(with_expiry=True)).expiry_time == got.expiry_time
    docs.mutate_in("x5", [SD.upsert("c", 4)])  # no expiry given: kv_engine resets it
    assert docs.get("x5", GetOptions(with_expiry=True)).expiry_time is None


def test_dcp_sees_what_the_sdk_wrote(served: Node, docs: Any) -> None:
    import couchbase.subdocument as SD

    docs.upsert("x6", {"v": 1})
    docs.mutate_in("x6", [SD.upsert("_sync.rev", "9", xattr=True, create_parents=True)])
    docs.upsert("x7", {"v": 2})
    docs.mutate_in("x7", [SD.upsert("_keep", 1, xattr=True), SD.upsert("drop", 1, xattr=True)])
    docs.remove("x7")
    wait_persisted(served.uri)
    rows, _events, _c = run(drain(served.uri))
    by_key = {bytes(r.key): r for r in rows}
    from upr_cli.protocol import xattrs

    x6, x7 = by_key[b"x6"], by_key[b"x7"]
    assert json.loads(x6.value) == {"v": 1} and xattrs.to_json(x6.xattrs) == {"_sync": {"rev": "9"}}
    assert x7.value == b"" and xattrs.to_json(x7.xattrs) == {"_keep": 1}  # the tombstone's
