"""Shared option aliases, so every command spells the same option the same way."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOutput = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
Seq = Annotated[int, typer.Option(min=0, metavar="SEQ")]

SparkMaster = Annotated[
    str | None,
    typer.Option("--spark", metavar="MASTER",
                 help="Divide the partitions among Spark tasks (local[*], spark://…, yarn)."),
]  # fmt: skip
SparkTasks = Annotated[
    int, typer.Option("--spark-tasks", min=1, help="Spark tasks (partitions shares).")
]
SparkConf = Annotated[
    list[str] | None,
    typer.Option("--conf", metavar="KEY=VALUE", help="A Spark setting (repeatable)."),
]
