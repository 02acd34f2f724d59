"""Export a backup's state with Spark and read the Parquet back with Spark.

Runs after `make demo` (which installs the spark extra and Java 17): starts a local
`upr serve` with sample data, backs it up, runs `upr spark export` (Spark local mode),
then reads the exported Parquet back with Spark, queries it, and checks that it holds
exactly the node's live documents.

    .venv/bin/python examples/spark-export.py
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from demo import Node, console, node_content, upr  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="upr-spark-") as tmp:
        data, repo, out = Path(tmp) / "node", Path(tmp) / "repo", Path(tmp) / "state"
        node = Node(data)
        node.start("--flush-interval", "0.05")
        try:
            console.rule("[bold]1. a local upr serve with sample data, backed up")
            upr("load", node.uri, "--docs", "20000", "--update-ratio", "0.2", "--delete-ratio",
                "0.05")  # fmt: skip
            upr("backup", node.uri, "--repo", str(repo))
            live, _hash = node_content(node.uri)
        finally:
            node.signal(signal.SIGTERM)

        console.rule("[bold]2. upr spark export: the state as Parquet, by partition id")
        summary = json.loads(
            upr("spark", "export", "--repo", str(repo), "--output", str(out), "--json").stdout
        )
        console.print(
            f"exported {summary['items']:,} documents in {summary['partitions']} partitions "
            f"in {summary['seconds']:.1f}s"
        )

        console.rule("[bold]3. read the Parquet back with Spark")
        from upr_cli.spark.jobs import session

        spark = session("local[2]", app="upr spark-export example")
        try:
            df = spark.read.parquet(str(out))
            df.printSchema()
            count = df.count()
            console.print(f"{count:,} rows read back; the node holds {live:,} live documents")
            df.createOrReplaceTempView("state")
            top = spark.sql(
                "SELECT get_json_object(json, '$.name') AS name, count(*) AS n FROM state "
                "GROUP BY name ORDER BY n DESC, name LIMIT 5"
            )
            top.show(truncate=False)
            per_partition = df.groupBy("partition").count().orderBy("partition").collect()
            console.print(
                "documents per partition: "
                + ", ".join(f"{r['partition']}:{r['count']}" for r in per_partition)
            )
        finally:
            spark.stop()
    ok = count == live == summary["items"]
    console.print("[bold green]match[/]" if ok else "[bold red]MISMATCH[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
