"""The official Couchbase Python SDK (`couchbase` 4.6.3) in named collections of
`upr serve`: `bucket.scope(S).collection(C)` for get, upsert, insert, replace, remove,
touch, get_and_touch, exists and get with expiry, with the exceptions a Couchbase
Server gives; a collection's max TTL; and a manifest that survives SIGKILL.

One node and one SDK cluster object serve the module's SDK tests (the SDK's connect
takes seconds); each test uses its own keys."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.collections_helpers import create, drop, get_manifest
from tests.e2e.conftest import PASSWORD, USER, Node
from tests.e2e.e2e_helpers import run, seqnos

SHORT = datetime.timedelta(seconds=1)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node with app.users, app.orders and app.short (max TTL 100 s)."""
    node = Node(tmp_path_factory.mktemp("sdk") / "node", "--flush-interval", "0.02")
    try:
        node.start()
        create(node.uri, "app.users", "app.orders")
        create(node.uri, "app.short", max_ttl=100)
        yield node
    finally:
        node.close()


@pytest.fixture(scope="module")
def bucket(served: Node) -> Iterator[Any]:
    """The SDK's view of the node's bucket."""
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.options import ClusterOptions

    cluster = Cluster(f"couchbase://127.0.0.1:{served.port}=kv",
                      ClusterOptions(PasswordAuthenticator(USER, PASSWORD)))  # fmt: skip
    try:
        yield cluster.bucket("default")
    finally:
        cluster.close()


@pytest.mark.parametrize("path", ["app.users", "_default._default"])
def test_the_sdk_reads_and_writes_a_collection(bucket: Any, path: str) -> None:
    from couchbase.exceptions import DocumentExistsException, DocumentNotFoundException
    from couchbase.options import GetOptions

    scope, name = path.split(".")
    docs = bucket.scope(scope).collection(name)
    docs.upsert("a", {"v": 1})
    docs.upsert("a", {"v": 2})
    docs.insert("b", {"v": 3})
    with pytest.raises(DocumentExistsException):
        docs.insert("b", {"v": 4})
    docs.replace("b", {"v": 5})
    with pytest.raises(DocumentNotFoundException):
        docs.replace("nope", {"v": 6})
    assert docs.get("a").content_as[dict] == {"v": 2}
    assert docs.exists("a").exists and not docs.exists("nope").exists
    docs.touch("a", datetime.timedelta(seconds=600))
    got = docs.get("a", GetOptions(with_expiry=True))
    left = got.expiry_time.timestamp() - time.time()
    assert 590 < left <= 601 and got.content_as[dict] == {"v": 2}
    assert docs.get_and_touch("b", datetime.timedelta(seconds=600)).content_as[dict] == {"v": 5}
    docs.remove("b")
    assert not docs.exists("b").exists
    with pytest.raises(DocumentNotFoundException):
        docs.get("b")
    with pytest.raises(DocumentNotFoundException):
        docs.remove("b")


def test_collections_do_not_share_keys(bucket: Any) -> None:
    users = bucket.scope("app").collection("users")
    orders = bucket.scope("app").collection("orders")
    default = bucket.default_collection()
    for i, coll in enumerate((users, orders, default)):
        coll.upsert("same", {"i": i})
    assert [c.get("same").content_as[dict]["i"] for c in (users, orders, default)] == [0, 1, 2]


def test_unknown_scopes_and_collections(bucket: Any) -> None:
    """As against a Couchbase Server: an unknown scope fails at once; an unknown
    collection is retried (the SDK expects its manifest to be outdated) until the
    operation times out."""
    from couchbase.exceptions import ScopeNotFoundException, UnAmbiguousTimeoutException
    from couchbase.options import GetOptions

    with pytest.raises(ScopeNotFoundException):
        bucket.scope("nope").collection("x").get("k", GetOptions(timeout=SHORT))
    with pytest.raises(UnAmbiguousTimeoutException) as err:
        bucket.scope("app").collection("nope").get("k", GetOptions(timeout=SHORT))
    assert "key_value_collection_outdated" in str(err.value)


def test_a_max_ttl_caps_the_expiry(bucket: Any) -> None:
    from couchbase.options import GetOptions, UpsertOptions

    short = bucket.scope("app").collection("short")
    short.upsert("none", {"v": 1})
    short.upsert("long", {"v": 1}, UpsertOptions(expiry=datetime.timedelta(days=2)))
    short.upsert("within", {"v": 1}, UpsertOptions(expiry=datetime.timedelta(seconds=30)))
    now = time.time()
    left = {k: short.get(k, GetOptions(with_expiry=True)).expiry_time.timestamp() - now
            for k in ("none", "long", "within")}  # fmt: skip
    assert 95 < left["none"] <= 101 and 95 < left["long"] <= 101, left
    assert 25 < left["within"] <= 31, left


def test_the_manifest_and_its_events_survive_sigkill(node_factory: type[Node]) -> None:
    node = node_factory("--flush-interval", "60").start()  # nothing flushed by the timer
    create(node.uri, "app.users", "app.orders")
    made = drop(node.uri, "app.orders")
    node.kill()
    node.start()
    assert get_manifest(node.uri) == made
    # scope app, users, orders created, orders dropped: 3 rows, the drop replaced the create
    highs = {vb: high for vb, (_uuid, high, _persisted) in run(seqnos(node.uri)).items()}
    assert set(highs.values()) == {4}, highs


def test_a_dropped_collection_is_gone_for_the_sdk(bucket: Any, served: Node) -> None:
    """A collection the SDK knew: the node answers UnknownCollection, the SDK asks for the
    id again (GET_COLLECTION_ID), and gives up at once when that is unknown too."""
    from couchbase.exceptions import CollectionNotFoundException
    from couchbase.options import GetOptions

    create(served.uri, "app.doomed")
    coll = bucket.scope("app").collection("doomed")
    coll.upsert("k", {"v": 1})
    assert coll.get("k").content_as[dict] == {"v": 1}
    drop(served.uri, "app.doomed")
    with pytest.raises(CollectionNotFoundException):
        coll.get("k", GetOptions(timeout=SHORT))
