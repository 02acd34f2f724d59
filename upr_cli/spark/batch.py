"""Reading one planned group into `pyarrow.RecordBatch`es (formats/spark.md §3-4).

Runs in a Spark task (or anywhere: it needs pyarrow, not pyspark). Segments are read
with `SegmentReader`, which verifies every block's checksum. `state` keeps the latest
record per key of each vbucket (memory: one vbucket's keys at a time, as restore does)
and drops tombstones; `history` streams every record, flagging those above the cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from upr_cli.segments import Record, SegmentReader
from upr_cli.spark.arrow import OPS, Buffer, Columns, ddl_of, i64, schema_of, text
from upr_cli.spark.plan import Group, Piece

BATCH_ROWS = 65_536

_COMMON: Columns = [
    ("partition", pa.int32(), False),
    ("key", pa.binary(), False),
    ("id", pa.string(), True),
    ("seq", pa.int64(), False),
    ("rev_seq", pa.int64(), False),
    ("cas", pa.int64(), False),
    ("flags", pa.int64(), False),
    ("expiry", pa.int64(), False),
    ("datatype", pa.int32(), False),
    ("deleted", pa.bool_(), False),
    ("value", pa.binary(), False),
    ("json", pa.string(), True),
]
_HISTORY: Columns = [
    ("op", pa.string(), False),
    ("delete_time", pa.int64(), False),
    ("backup_id", pa.string(), False),
    ("lost", pa.bool_(), False),
]


def _columns(view: str) -> Columns:
    return _COMMON + (_HISTORY if view == "history" else [])


def arrow_schema(view: str) -> pa.Schema:
    """The Arrow schema of a view."""
    return schema_of(_columns(view))


def ddl(view: str) -> str:
    """The Spark DDL of a view (NOT NULL where formats/spark.md says so)."""
    return ddl_of(_columns(view))


class _Columns(Buffer):
    """A view's rows, from segment records."""

    def __init__(self, view: str) -> None:
        super().__init__(arrow_schema(view))
        self.view = view

    def add_record(self, p: int, rec: Record, backup_id: str = "", lost: bool = False) -> None:
        op, seq, rev, cas, flags, exp, dtime, dt, key, value = rec
        key, value = bytes(key), bytes(value)
        row: list[Any] = [p, key, text(key), seq, i64(rev), i64(cas), flags, exp, dt,
                          op != 0x57, value, text(value) if dt & 7 == 1 else None]  # fmt: skip
        if self.view == "history":
            row += [OPS.get(op, f"0x{op:02x}"), dtime, backup_id, lost]
        self.add(row)


def _by_partition(pieces: Iterable[Piece]) -> dict[int, list[Piece]]:
    out: dict[int, list[Piece]] = {}
    for piece in pieces:
        out.setdefault(piece.partition, []).append(piece)
    return out


def read_group(group: Group) -> Iterator[pa.RecordBatch]:
    """Every RecordBatch of one planned group."""
    cols = _Columns(group.view)
    if group.view == "state":
        for p, pieces in _by_partition(group.pieces).items():
            latest: dict[bytes, Record] = {}
            for piece in pieces:  # in chain order: later records win
                with SegmentReader(piece.path) as reader:
                    for rec in reader.records():
                        if rec[1] > piece.max_seq:
                            break
                        latest[bytes(rec[8])] = rec
            for rec in sorted(latest.values(), key=lambda r: r[1]):
                if rec[0] != 0x57:
                    continue  # the state drops tombstones
                cols.add_record(p, rec)
                if len(cols) >= BATCH_ROWS:
                    yield cols.take()
    else:
        for piece in group.pieces:
            with SegmentReader(piece.path) as reader:
                for rec in reader.records():
                    cols.add_record(piece.partition, rec, piece.backup_id, rec[1] > piece.cut)
                    if len(cols) >= BATCH_ROWS:
                        yield cols.take()
    if len(cols):
        yield cols.take()
