"""Snappy end to end (formats/wire.md "Snappy"): the official SDK negotiates Snappy with
`upr serve` and writes large compressible documents compressed; the node stores them so;
`upr tail`, `upr backup` + `upr restore` and `upr replay` all see the plain documents.

Needs `upr serve` to grant HELLO Snappy and to tell its DCP producer so
(`upr_cli/node/server.py`)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.e2e.conftest import PASSWORD, USER, Node, upr
from tests.e2e.e2e_helpers import store_rows, wait_persisted

BIG = {f"big{i}": {"i": i, "text": "snappy compresses this well " * 80} for i in range(20)}
SMALL = {f"small{i}": {"i": i} for i in range(5)}
SNAPPY = 0x02


@contextlib.contextmanager
def _collection(node: Node) -> Iterator[Any]:
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.options import ClusterOptions

    cluster = Cluster(f"couchbase://127.0.0.1:{node.port}=kv",
                      ClusterOptions(PasswordAuthenticator(USER, PASSWORD)))  # fmt: skip
    try:
        yield cluster.bucket("default").default_collection()
    finally:
        cluster.close()


def _stored_datatypes(node: Node) -> dict[bytes, int]:
    """key → datatype of the node's stored rows (its own SQLite file, read-only)."""
    path = node.data / "default.sqlite3"
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT key, datatype FROM docs WHERE deleted = 0").fetchall()
    return {bytes(k)[1:]: dt for k, dt in rows}  # without the default collection's 0x00


def test_sdk_values_stay_compressed_on_the_node_and_tools_see_them_plain(
    node_factory: type[Node], tmp_path: Path
) -> None:
    src = node_factory("--flush-interval", "0.02").start()
    with _collection(src) as docs:
        for key, value in (BIG | SMALL).items():
            docs.upsert(key, value)
        assert docs.get("big3").content_as[dict] == BIG["big3"]  # a GET answers inflated
    wait_persisted(src.uri)
    stored = _stored_datatypes(src)
    assert all(stored[k.encode()] & SNAPPY for k in BIG), stored  # kept as the SDK sent them
    want = BIG | SMALL

    lines = upr("tail", src.uri, "--until-end", "--format", "json").stdout.splitlines()
    assert {row["key"]: row["value"] for row in map(json.loads, lines)} == want

    repo = tmp_path / "repo"
    upr("backup", src.uri, "--repo", str(repo))
    dst = node_factory("--flush-interval", "0.02", partitions=8, name="dst").start()
    upr("restore", "--repo", str(repo), dst.uri)
    with _collection(dst) as docs:
        assert {k: docs.get(k).content_as[dict] for k in want} == want

    db = tmp_path / "replay.db"
    upr("replay", src.uri, "--into", str(db))
    values = {key: row[2] for (_p, key), row in store_rows(db).items()}
    assert {k.decode(): json.loads(v) for k, v in values.items()} == want
