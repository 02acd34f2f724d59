"""The `xattrs` column of the Spark reads (formats/spark.md §4, version 3), without a JVM:
state, history, the streamed rows' schema, and a merge keeping the xattrs of each
document's latest record, tombstones too."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from upr_cli.failover import FailoverLog
from upr_cli.jobs.compact import Piece as Cut
from upr_cli.jobs.merge import MergeRun, PartitionWork, write_partition
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import BackupId, Repository, format_segment_name
from upr_cli.segments import SegmentHeader, SegmentReader, SegmentWriter
from upr_cli.spark.arrow import json_of_xattrs
from upr_cli.spark.batch import arrow_schema, ddl, read_group
from upr_cli.spark.plan import Group, Piece
from upr_cli.spark.stream import stream_ddl, stream_schema

NAMES = ((0, "_default", "_default"),)
BOTH = xattrs.encode({"_sync": '{"rev":"2-b","seq":5}', "app": '"blue"'})
SYNC = xattrs.encode({"_sync": '{"rev":"1-a"}'})


def _segment(path: Path) -> Path:
    """Partition 3: a with xattrs then replaced without, b with both kinds then deleted
    keeping its system xattrs, c with a system xattr only."""

    def rec(seq: int, key: bytes, blob: bytes = b"", op: int = OP_MUTATION) -> DcpRecord:
        value = b'{"n":%d}' % seq if op == OP_MUTATION else b""
        return DcpRecord(op, 3, seq, 1, seq, 0, 0, 0, 1 if value else 0, key, value, 0, 0, blob)

    rows = [rec(1, b"a", BOTH), rec(2, b"b", BOTH), rec(3, b"a"), rec(4, b"c", SYNC),
            rec(5, b"b", xattrs.system_only(BOTH), OP_DELETION)]  # fmt: skip
    writer = SegmentWriter(path, SegmentHeader("default", 3, FailoverLog.of([(7, 0)]), 0, 5))
    writer.add(rows)
    writer.finish(path=path, sync=False)
    return path


def _read(group: Group) -> list[dict[str, object]]:
    table = pa.Table.from_batches(list(read_group(group)), schema=arrow_schema(group.view))
    return sorted(table.to_pylist(), key=lambda r: r["seq"])  # type: ignore[arg-type,return-value]


def test_every_read_ends_with_a_nullable_string_xattrs_column() -> None:
    for schema in (arrow_schema("state"), arrow_schema("history"), stream_schema()):
        last = schema.field(len(schema) - 1)
        assert (last.name, last.type, last.nullable) == ("xattrs", pa.string(), True)
    for text in (ddl("state"), ddl("history"), stream_ddl()):
        assert text.endswith(", xattrs STRING")
    # version 2's columns keep their places
    assert arrow_schema("history").names[:15] == arrow_schema("state").names[:15]


def test_state_and_history_give_the_xattrs_as_json_text(tmp_path: Path) -> None:
    path = str(_segment(tmp_path / "p3.seg"))
    state = _read(Group("state", (Piece(3, "b1", path, 5, 0, 1),), NAMES))
    got = {r["key"]: r["xattrs"] for r in state}
    assert got == {b"a": None, b"c": '{"_sync":{"rev":"1-a"}}'}  # b is deleted
    history = _read(Group("history", (Piece(3, "b1", path, 0, 5, 1),), NAMES))
    found = [(r["seq"], r["op"], json.loads(r["xattrs"]) if r["xattrs"] else None)  # type: ignore[arg-type]
             for r in history]  # fmt: skip
    assert found == [
        (1, "mutation", {"_sync": {"rev": "2-b", "seq": 5}, "app": "blue"}),
        (2, "mutation", {"_sync": {"rev": "2-b", "seq": 5}, "app": "blue"}),
        (3, "mutation", None),
        (4, "mutation", {"_sync": {"rev": "1-a"}}),
        (5, "deletion", {"_sync": {"rev": "2-b", "seq": 5}}),  # the tombstone kept _sync
    ]
    # the body alone is the value, still JSON text
    assert history[0]["value"] == b'{"n":1}' and history[0]["json"] == '{"n":1}'


def test_a_batch_without_xattrs_is_all_null() -> None:
    assert json_of_xattrs([b"", b""], [b"a", b"b"]) == [None, None]
    assert json_of_xattrs([b"", SYNC], [b"a", b"b"]) == [None, '{"_sync":{"rev":"1-a"}}']


def test_a_merge_keeps_the_xattrs_of_each_latest_record(tmp_path: Path) -> None:
    """The segment a merge task writes (`jobs.merge.write_partition`, both merges')."""
    repo, b = Repository(tmp_path / "repo"), BackupId.parse("20261121T061500.000000Z")
    name = format_segment_name(3, 1, 5)
    repo.backup_dir("default", b).mkdir(parents=True)
    _segment(repo.segment_path("default", b, name))
    out = tmp_path / "merged"
    out.mkdir()
    work = PartitionWork(3, FailoverLog.of([(7, 0)]).to_json(), 5, (5, 5), (Cut(b, name, 5),), 1)
    plan = MergeRun(repo.path, "default", b, b, None, out, "test", "2026-11-26T00:00:00.000000Z",
                    frozenset({0}), 1, (work,))  # fmt: skip
    (info,) = write_partition(repo, plan, work)
    with SegmentReader(out / info.entry.file) as reader:
        got = {(r.key, r.op): r.xattrs for r in reader.records()}
    assert got == {(b"a", OP_MUTATION): b"", (b"c", OP_MUTATION): SYNC,
                   (b"b", OP_DELETION): xattrs.system_only(BOTH)}  # fmt: skip
