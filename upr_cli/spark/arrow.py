"""Arrow plumbing shared by the batch and streaming readers (formats/spark.md §4-5)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from upr_cli.protocol.decoder import OP_DELETION, OP_EXPIRATION, OP_MUTATION
from upr_cli.store.content import xattrs_json

Columns = list[tuple[str, pa.DataType, bool]]  # (name, type, nullable)

_TWO64 = 1 << 64
_I64_MAX = (1 << 63) - 1
_DDL = {pa.int32(): "INT", pa.int64(): "BIGINT", pa.binary(): "BINARY", pa.string(): "STRING",
        pa.bool_(): "BOOLEAN"}  # fmt: skip
OPS = {OP_MUTATION: "mutation", OP_DELETION: "deletion", OP_EXPIRATION: "expiration"}
#: the last column of every read (formats/spark.md §4, version 3): the record's xattrs as
#: the JSON text of an object, NULL for none
XATTRS_COLUMN = ("xattrs", pa.string(), True)


def schema_of(columns: Columns) -> pa.Schema:
    """The Arrow schema of these columns."""
    return pa.schema([pa.field(n, t, nullable=null) for n, t, null in columns])


def ddl_of(columns: Columns) -> str:
    """The Spark DDL of these columns (NOT NULL where not nullable)."""
    return ", ".join(f"{n} {_DDL[t]}{'' if null else ' NOT NULL'}" for n, t, null in columns)


def i64(v: int) -> int:
    """A u64 as its two's complement i64 (store.md §2)."""
    return v - _TWO64 if v > _I64_MAX else v


def text(b: bytes) -> str | None:
    """UTF-8 text of `b`, or None."""
    try:
        return b.decode()
    except UnicodeDecodeError:
        return None


def json_of_xattrs(blobs: list[bytes], keys: list[bytes]) -> list[str | None]:
    """The `xattrs` column of a batch: each blob's JSON text, as the store keeps it
    (formats/store.md §3.9), None for none; a batch without any costs one C-level pass."""
    if not any(blobs):
        return [None] * len(blobs)
    return [xattrs_json(b, k) if b else None for b, k in zip(blobs, keys, strict=True)]


class Buffer:
    """Rows appended as lists, handed out as RecordBatches."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.cols: list[list[Any]] = [[] for _ in schema]

    def __len__(self) -> int:
        return len(self.cols[0])

    def add(self, row: list[Any]) -> None:
        """Append one row (in schema order)."""
        for col, v in zip(self.cols, row, strict=True):
            col.append(v)

    def take(self) -> pa.RecordBatch:
        """The rows so far as one RecordBatch; the buffer starts empty again."""
        batch = pa.RecordBatch.from_arrays(
            [pa.array(c, type=f.type) for c, f in zip(self.cols, self.schema, strict=True)],
            schema=self.schema,
        )
        self.cols = [[] for _ in self.schema]
        return batch
