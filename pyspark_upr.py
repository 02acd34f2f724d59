"""Spark 4 discovers Python data sources in top-level modules named `pyspark_*` that
expose `DefaultSource`: with upr installed, `spark.read.format("upr")` works without
calling `upr_cli.spark.register` (formats/spark.md "Registration")."""

from upr_cli.spark.source import UprDataSource as DefaultSource

__all__ = ["DefaultSource"]
