"""Reading a planned group (no JVM): scope and collection columns, the collections a
group keeps, (collection, key) as a document's identity, system events left out
(formats/spark.md §4)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from upr_cli.collections import ManifestChange
from upr_cli.failover import FailoverLog
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.segments import SegmentHeader, SegmentReader, SegmentWriter
from upr_cli.segments.format import event_record
from upr_cli.spark.batch import arrow_schema, read_group
from upr_cli.spark.plan import Group, Piece

NAMES = ((0, "_default", "_default"), (8, "app", "users"), (9, "app", "orders"))


def _segment(path: Path) -> Path:
    """Partition 3: the same key in three collections, a delete in one, a collection
    created (a system event) and an id no manifest names."""

    def rec(seq: int, cid: int, key: bytes, op: int = OP_MUTATION) -> DcpRecord:
        value = b'{"n":%d}' % seq if op == OP_MUTATION else b""
        return DcpRecord(op, 3, seq, 1, seq, 0, 0, 0, 1 if value else 0, key, value, 0, cid)

    created = ManifestChange(3, 1, "collection-created", 9, 8, 9, "orders")
    rows = [event_record(created), rec(2, 0, b"k"), rec(3, 8, b"k"), rec(4, 9, b"k"),
            rec(5, 8, b"k"), rec(6, 9, b"k", OP_DELETION), rec(7, 42, b"z")]  # fmt: skip
    header = SegmentHeader("default", 3, FailoverLog.of([(7, 0)]), 0, 7)
    writer = SegmentWriter(path, header)
    writer.add(rows)
    writer.finish(path=path, sync=False)
    return path


def _read(group: Group) -> list[dict[str, object]]:
    table = pa.Table.from_batches(list(read_group(group)), schema=arrow_schema(group.view))
    return sorted(table.to_pylist(), key=lambda r: r["seq"])


def test_state_names_collections_and_keeps_each_collections_key_apart(tmp_path: Path) -> None:
    path = str(_segment(tmp_path / "p3.seg"))
    piece = Piece(3, "b1", path, 7, 0, 1)
    rows = _read(Group("state", (piece,), NAMES))
    got = [(r["scope"], r["collection"], r["collection_id"], r["key"], r["seq"]) for r in rows]
    # the key in the default collection and in app.users are two documents; app.orders'
    # was deleted; id 42 has no name; the system event is no document
    assert got == [("_default", "_default", 0, b"k", 2), ("app", "users", 8, b"k", 5),
                   (None, None, 42, b"z", 7)]  # fmt: skip
    kept = _read(Group("state", (piece,), NAMES, frozenset({8, 9})))
    assert [(r["collection_id"], r["seq"]) for r in kept] == [(8, 5)]


def test_history_keeps_every_record_of_the_kept_collections(tmp_path: Path) -> None:
    path = str(_segment(tmp_path / "p3.seg"))
    piece = Piece(3, "b1", path, 0, 5, 1)  # records above seq 5 lie above the cut
    rows = _read(Group("history", (piece,), NAMES, frozenset({9})))
    assert [(r["collection"], r["op"], r["seq"], r["lost"]) for r in rows] == [
        ("orders", "mutation", 4, False),
        ("orders", "deletion", 6, True),
    ]
    assert len(_read(Group("history", (piece,), NAMES))) == 6  # the event left out


def test_a_merge_keeps_each_collections_latest_record_tombstones_too(tmp_path: Path) -> None:
    """The segment a merge task writes (`jobs.compact.write_latest`, both merges')."""
    from upr_cli.jobs.compact import Piece as Cut
    from upr_cli.jobs.compact import write_latest
    from upr_cli.repo import BackupId, Repository, format_segment_name

    repo, b = Repository(tmp_path / "repo"), BackupId.parse("20261121T061500.000000Z")
    name = format_segment_name(3, 1, 7)
    repo.backup_dir("default", b).mkdir(parents=True)
    _segment(repo.segment_path("default", b, name))
    header = SegmentHeader("default", 3, FailoverLog.of([(7, 0)]), 0, 7)
    w = write_latest(repo, "default", 3, [Cut(b, name, 7)], keep=frozenset({0, 8, 9}).__contains__,
                     header=header, directory=tmp_path)  # fmt: skip
    assert w is not None
    with SegmentReader(tmp_path / w.entry.file) as reader:
        got = [(r.collection, r.key, r.seq, r.op) for r in reader.records(events=True)]
    assert got == [(0, b"k", 2, OP_MUTATION), (8, b"k", 5, OP_MUTATION),
                   (9, b"k", 6, OP_DELETION)]  # fmt: skip
