"""The issue's story, with the official SDK as the peer at both ends, all over TLS:

the SDK connects with couchbases:// and the test CA and writes documents with user and
system xattrs (`mutate_in`, the CAS macro) and large compressible bodies; some are
removed (their system xattrs stay in the tombstones). `upr backup` reads the node over
uprs://, `upr restore` writes into a second TLS node with another partition count, and
the SDK's `lookup_in` reads the same xattrs and bodies back from the target, from the
deleted documents too (`access_deleted`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.conftest import PASSWORD, USER, Node, upr
from tests.e2e.test_tls_e2e import Certs, start_tls, tls_uri

DOCS, REMOVED = 60, range(0, 60, 4)


def _sdk(port: int, cafile: Path) -> Any:
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.options import ClusterOptions

    auth = PasswordAuthenticator(USER, PASSWORD, cert_path=str(cafile))
    return Cluster(f"couchbases://127.0.0.1:{port}=kv", ClusterOptions(auth))


def _body(i: int) -> dict[str, Any]:
    # large and compressible: the SDK sends it Snappy-compressed
    return {"id": i, "text": f"document {i} " * 400, "tags": ["a", "b"]}


def _write(docs: Any) -> dict[str, int]:
    import couchbase.subdocument as SD
    from couchbase.subdocument import MutationMacro

    cas = {}
    for i in range(DOCS):
        key = f"story-{i:03d}"
        docs.upsert(key, _body(i))
        res = docs.mutate_in(key, [
            SD.upsert("_sync.rev", f"1-{i}", xattr=True, create_parents=True),
            SD.upsert("_sync.cas", MutationMacro.cas(), xattr=True, create_parents=True),
            SD.upsert("app", {"owner": f"user{i % 3}"}, xattr=True),
        ])  # fmt: skip
        cas[key] = res.cas
    for i in REMOVED:
        docs.remove(f"story-{i:03d}")
    return cas


def _read(docs: Any) -> dict[str, tuple[Any, ...]]:
    """Per key: the body (None when removed) and the xattrs lookup_in finds."""
    import couchbase.subdocument as SD
    from couchbase.options import LookupInOptions

    seen: dict[str, tuple[Any, ...]] = {}
    deleted = LookupInOptions(access_deleted=True)
    for i in range(DOCS):
        key = f"story-{i:03d}"
        got = docs.lookup_in(key, [SD.get("_sync", xattr=True), SD.exists("app", xattr=True),
                                   SD.get("app", xattr=True), SD.get_full()], deleted)  # fmt: skip
        app = got.content_as[dict](2) if got.exists(1) else None
        body = got.content_as[dict](3) if got.exists(3) else None
        seen[key] = (got.content_as[dict](0), app, body)
    return seen


def test_sdk_xattrs_back_up_and_restore_over_tls(node_factory: type[Node], tmp_path: Path) -> None:
    certs = Certs(tmp_path)
    src = node_factory("--flush-interval", "0.02", *certs.good, name="src")
    src_tls = start_tls(src)
    dst = node_factory("--flush-interval", "0.02", *certs.good, partitions=8, name="dst")
    dst_tls = start_tls(dst)

    cluster = _sdk(src_tls, certs.cafile)
    try:
        docs = cluster.bucket("default").default_collection()
        cas = _write(docs)
        before = _read(docs)
    finally:
        cluster.close()
    for i in range(DOCS):
        key = f"story-{i:03d}"
        sync, app, body = before[key]
        assert sync == {"rev": f"1-{i}", "cas": "0x" + cas[key].to_bytes(8, "little").hex()}
        if i in REMOVED:  # the tombstone keeps the system xattr only
            assert (app, body) == (None, None)
        else:
            assert (app, body) == ({"owner": f"user{i % 3}"}, _body(i))

    ca = ["--cacert", str(certs.cafile)]
    repo = tmp_path / "repo"
    upr("backup", tls_uri(src_tls), "--repo", str(repo), *ca)
    out = json.loads(upr("restore", "--repo", str(repo), tls_uri(dst_tls), "--json", *ca).stdout)
    assert out["target_partitions"] == 8 and out["errors"] == 0

    cluster = _sdk(dst_tls, certs.cafile)
    try:
        after = _read(cluster.bucket("default").default_collection())
    finally:
        cluster.close()
    assert after == before
