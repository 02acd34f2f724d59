"""PySpark `upr` data source (formats/spark.md) and the Spark jobs behind `upr spark …`.

`register(spark)` adds the data source to a session; the top-level module `pyspark_upr`
lets Spark find it without that call. Importing this package does not import pyspark:
the planning (`plan`) and reading (`batch`) code runs without it.
"""

from __future__ import annotations

from typing import Any


def register(spark: Any) -> None:
    """Register the `upr` data source on a SparkSession."""
    from upr_cli.spark.source import UprDataSource

    spark.dataSource.register(UprDataSource)


__all__ = ["register"]
