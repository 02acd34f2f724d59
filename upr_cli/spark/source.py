"""The `upr` data source: `DataSource`, batch reader and `InputPartition` (formats/spark.md).

Only this module imports pyspark. The reader plans on the driver from the manifests
(`plan.parse_options`, `plan.plan`) and each task reads its group with
`batch.read_group`, yielding `pyarrow.RecordBatch`es (the Arrow path: no per-row
conversion in Spark).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from upr_cli.spark.batch import ddl, read_group
from upr_cli.spark.plan import Group, parse_options, plan


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


class UprDataSource(DataSource):
    """`spark.read.format("upr").load(REPO)`: a backup repository as a DataFrame."""

    @classmethod
    def name(cls) -> str:
        return "upr"

    def schema(self) -> str:
        opts, _ = parse_options(dict(self.options))  # checks every option, at analysis
        return ddl(opts.view)

    def reader(self, schema: Any) -> UprBatchReader:
        return UprBatchReader(dict(self.options))
