"""Xattrs in the views of a real `upr serve`'s data (formats/wire.md "Xattrs"): documents
written with SET_WITH_META and a blob over a connection that negotiated XATTR, updated
by a plain SET (which keeps them) and by SET_WITH_META (which replaces them), deleted by
DELETE (the tombstone keeps the system xattrs) and by DEL_WITH_META (which keeps the blob
it carries). `upr tail` prints them, `upr replay` keeps them in the store (tombstones
too, and a rollback puts them back), `upr examine` and a replay from a backup show what
the live replay shows, and a Spark streaming read gives them as its `xattrs` column."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import run, wait_persisted, write_xattr_ops
from upr_cli.net.bootstrap import partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition
from upr_cli.protocol import xattrs
from upr_cli.spark.stream import Range, probe, read_ranges
from upr_cli.store import Store

JSON = 0x01
SYNC1 = {"_sync": {"rev": "1-a", "sequence": 1}, "meta": {"by": "app"}}
SYNC2 = {"_sync": {"rev": "2-b", "sequence": 2}, "tags": ["x", "y"]}
SYSTEM1 = {"_sync": SYNC1["_sync"]}

# a: written with SYNC1, then a plain SET (keeps them); b: SYNC1, then DELETE (keeps _sync);
# c: SYNC1, then DEL_WITH_META carrying SYNC1 (keeps both); d: a plain document; e: SYNC1,
# then SET_WITH_META with SYNC2 (replaces them)
FIRST: list[tuple[str, bytes, Any]] = [
    ("meta", b"a", (SYNC1, b'{"n":1}', 1)), ("meta", b"b", (SYNC1, b'{"n":2}', 1)),
    ("meta", b"c", (SYNC1, b'{"n":3}', 1)), ("set", b"d", b'{"n":4}'),
    ("meta", b"e", (SYNC1, b'{"n":5}', 1)),
    ("set", b"a", b'{"n":10}'), ("delete", b"b", None), ("delmeta", b"c", (SYNC1, 5)),
    ("meta", b"e", (SYNC2, b'{"n":50}', 2)),
]  # fmt: skip
EXPECTED = {  # key → (deleted, xattrs) once FIRST is written
    "a": (False, SYNC1), "b": (True, SYSTEM1), "c": (True, SYNC1), "d": (False, {}),
    "e": (False, SYNC2),
}  # fmt: skip


def _store_xattrs(path: Path) -> dict[str, tuple[bool, dict[str, Any]]]:
    """key → (deleted, xattrs) of every document of a store, tombstones included."""
    with Store(path, create=False) as s:
        return {d.key.decode(): (d.deleted, xattrs.to_json(d.xattrs)) for d in s.documents()}


def test_tail_prints_the_xattrs_tombstones_too(node: Node) -> None:
    run(write_xattr_ops(node.uri, FIRST))
    out = upr("tail", node.uri, "--until-end", "--format", "json").stdout
    last = {}
    for line in out.splitlines():
        obj = json.loads(line)
        last[obj["key"]] = obj
    got = {k: (o["op"] != "mutation", o.get("xattrs", {})) for k, o in last.items()}
    assert got == EXPECTED
    assert "xattrs" not in last["d"]  # none: the field is left out
    assert last["a"]["value"] == {"n": 10} and last["e"]["value"] == {"n": 50}  # the body alone
    text = upr("tail", node.uri, "--until-end").stdout.splitlines()
    line_b = next(t for t in text if " key=b " in t and " deletion " in t)
    assert line_b.endswith(" xattrs=_sync")
    line_e = [t for t in text if " key=e " in t][-1]
    assert " xattrs=_sync,tags value=" in line_e


def test_replay_keeps_xattrs_and_a_rollback_puts_them_back(node: Node, tmp_path: Path) -> None:
    run(write_xattr_ops(node.uri, FIRST))
    db = tmp_path / "live.db"
    upr("replay", node.uri, "--into", str(db))
    assert _store_xattrs(db) == EXPECTED
    with Store(db, create=False) as s:
        (rev,) = s.db.execute(
            "SELECT json_extract(xattrs, '$._sync.rev') FROM documents"
            " WHERE key = CAST('b' AS BLOB) AND deleted = 1"
        ).fetchone()
        assert rev == "1-a"  # the tombstone kept the system xattr
        p_a = s.get(partition_of(b"a", node.partitions), b"a")
        assert p_a is not None
        before = s.boundaries(p_a.partition)[p_a.partition][-1]
    # a second run resumes: a's xattrs replaced, d gets some, e deleted
    more = [("meta", b"a", (SYNC2, b'{"n":11}', 3)), ("meta", b"d", (SYNC1, b'{"n":40}', 2)),
            ("delete", b"e", None)]  # fmt: skip
    run(write_xattr_ops(node.uri, more))
    upr("replay", node.uri, "--into", str(db))
    now = _store_xattrs(db)
    assert now["a"] == (False, SYNC2) and now["d"] == (False, SYNC1)
    assert now["e"] == (True, {"_sync": SYNC2["_sync"]})
    with Store(db, create=False) as s:
        (prev,) = s.db.execute(
            "SELECT prev_xattrs FROM mutation_log WHERE key = CAST('a' AS BLOB)"
        ).fetchone()
        assert json.loads(prev) == SYNC1
        res = s.rollback(p_a.partition, before)  # as a source's ROLLBACK would
        assert not res.too_far
        doc = s.get(p_a.partition, b"a")
        assert doc is not None and xattrs.to_json(doc.xattrs) == SYNC1
        assert doc.value == b'{"n":10}'


def test_backup_examine_repo_replay_and_spark_rows_agree(node: Node, tmp_path: Path) -> None:
    run(write_xattr_ops(node.uri, FIRST))
    wait_persisted(node.uri)
    repo = tmp_path / "repo"
    upr("backup", node.uri, "--repo", str(repo))
    found = json.loads(upr("examine", "--repo", str(repo), "--json", "b").stdout)
    (tomb,) = [v for v in found["versions"] if v["in_latest"]]
    assert (tomb["op"], tomb["xattrs"]) == ("deletion", SYSTEM1)
    e = json.loads(upr("examine", "--repo", str(repo), "--json", "e").stdout)["versions"]
    assert [v["xattrs"] for v in e if v["in_latest"]] == [SYNC2]
    table = upr("examine", "--repo", str(repo), "c").stdout
    assert "_sync, meta" in table and "deletion" in table
    live, replayed = tmp_path / "live.db", tmp_path / "repo.db"
    upr("replay", node.uri, "--into", str(live))
    upr("replay", f"repo:{repo}", "--into", str(replayed))
    assert _store_xattrs(replayed) == _store_xattrs(live) == EXPECTED
    # a Spark streaming read's task, without a JVM: the rows of every partition
    uri = SourceUri.parse(node.uri)
    highs = asyncio.run(probe(uri, None))
    ranges = [Range(p, StreamPosition(p), h) for p, (_u, h) in highs.items() if h]
    rows = [r for b in read_ranges(node.uri, ranges) for r in b.to_pylist()]
    last = {r["id"]: r for r in sorted(rows, key=lambda r: r["seq"])}
    got = {k: (r["deleted"], json.loads(r["xattrs"]) if r["xattrs"] else {})
           for k, r in last.items()}  # fmt: skip
    assert got == EXPECTED
