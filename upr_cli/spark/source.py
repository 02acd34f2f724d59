"""The `upr` data source: `DataSource`, batch reader and `InputPartition` (formats/spark.md).

Only this module imports pyspark. The reader plans on the driver from the manifests
(`plan.parse_options`, `plan.plan`) and each task reads its group with
`batch.read_group`, yielding `pyarrow.RecordBatch`es (the Arrow path: no per-row
conversion in Spark).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)

from upr_cli.errors import UprError
from upr_cli.position import StreamPosition
from upr_cli.spark.batch import ddl, read_group
from upr_cli.spark.plan import Group, get_option, parse_options, plan
from upr_cli.spark.stream import (
    Range,
    check_collections,
    from_offset,
    parse_stream_options,
    plan_ranges,
    probe,
    read_ranges,
    stream_ddl,
    to_offset,
)

log = logging.getLogger(__name__)
STREAM_TASKS = 4  # micro-batch tasks at most, each reading a contiguous share of partitions


class UprInputPartition(InputPartition):
    """One task's group (small: paths, ids and seq cuts)."""

    def __init__(self, group: Group) -> None:
        super().__init__(group)
        self.group = group


class UprBatchReader(DataSourceReader):
    """Reads a repository: planning from the manifests, reading segments in tasks."""

    def __init__(self, options: dict[str, str]) -> None:
        self.opts, manifests = parse_options(options)
        self.groups = plan(self.opts, manifests)

    def partitions(self) -> list[UprInputPartition]:
        return [UprInputPartition(g) for g in self.groups]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, UprInputPartition)
        yield from read_group(partition.group)


class UprStreamPartition(InputPartition):
    """One micro-batch task's ranges."""

    def __init__(self, ranges: list[Range]) -> None:
        super().__init__(ranges)
        self.ranges = ranges


class UprStreamReader(DataSourceStreamReader):
    """A live source (formats/spark.md §5): offsets from a cheap probe on the driver,
    ranges planned with rollbacks decided there, rows read by the tasks."""

    def __init__(self, options: dict[str, str]) -> None:
        self.opts = parse_stream_options(options)
        self.last: dict[str, Any] | None = None
        if self.opts.collections:
            asyncio.run(check_collections(self.opts.uri, self.opts.collections))

    def _probe(self) -> dict[int, tuple[int, int]]:
        return asyncio.run(probe(self.opts.uri, self.opts.partitions))

    def initialOffset(self) -> dict[str, Any]:
        now = self._probe()
        if self.opts.starting == "latest":
            return to_offset({p: StreamPosition(p, u, h, h, h) for p, (u, h) in now.items()})
        return to_offset({p: StreamPosition(p) for p in now})

    def latestOffset(self, start: Any = None, limit: Any = None) -> dict[str, Any]:
        try:
            now = self._probe()
        except (UprError, OSError) as exc:
            if self.last is None:
                raise
            log.warning("upr source unreachable (%s); no new data this trigger", exc)
            return self.last
        self.last = to_offset({p: StreamPosition(p, u, h, h, h) for p, (u, h) in now.items()})
        return self.last

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        ranges = asyncio.run(plan_ranges(self.opts.uri, from_offset(start), from_offset(end)))
        if not ranges:
            return []
        k = min(STREAM_TASKS, len(ranges))
        size = -(-len(ranges) // k)
        return [UprStreamPartition(ranges[i : i + size]) for i in range(0, len(ranges), size)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, UprStreamPartition)
        yield from read_ranges(self.opts.source, partition.ranges, self.opts.collections)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to clean up: offsets live in Spark's checkpoint."""


class UprDataSource(DataSource):
    """`spark.read.format("upr").load(REPO)`: a backup repository as a DataFrame;
    `spark.readStream.format("upr").option("source", "upr://…")`: a live source."""

    @classmethod
    def name(cls) -> str:
        return "upr"

    def _streaming(self) -> bool:
        opts = dict(self.options)
        src = get_option(opts, "source") or get_option(opts, "path") or ""
        return src.startswith(("upr://", "couchbase://"))

    def schema(self) -> str:
        if self._streaming():
            parse_stream_options(dict(self.options))
            return stream_ddl()
        opts, _ = parse_options(dict(self.options))  # checks every option, at analysis
        return ddl(opts.view)

    def reader(self, schema: Any) -> UprBatchReader:
        return UprBatchReader(dict(self.options))

    def streamReader(self, schema: Any) -> UprStreamReader:
        return UprStreamReader(dict(self.options))
