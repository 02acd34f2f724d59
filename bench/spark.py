"""`upr spark export` at 1M, 2M and 4M records beside the local state materialisation.

Loads documents into a local `upr serve` (1024 partitions) and takes three backups so
the chain holds 1M, 2M and 4M records; then, for each backup, exports the state with
Spark (`local[2]`, one session, its start-up timed separately) and materialises the same
state locally without Spark (`upr_cli.jobs.state`, the code `upr restore` reads with),
and prints both times, their ratio, and how each grows with records. One warm-up
export runs first (Python workers, JIT) and is not measured.

Usage: python bench/spark.py [--millions 1,2,4]
Last line: spark_startup_s=… export_1m_s=… local_1m_s=… … growth_spark=… growth_local=…
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _node import BenchNode


def upr(*args: str) -> str:
    """Run `upr ARGS`, return stdout."""
    return subprocess.run([sys.executable, "-m", "upr_cli", *args], check=True,
                          capture_output=True, text=True).stdout  # fmt: skip


def local_state(repo: Path, at: str) -> tuple[int, float]:
    """Live documents of the state at `at`, materialised partition by partition."""
    from upr_cli.jobs.restore import partition_state
    from upr_cli.jobs.state import select
    from upr_cli.protocol.decoder import OP_MUTATION
    from upr_cli.repo import Repository

    t = time.perf_counter()
    r = Repository(repo)
    manifests = r.manifests("default")
    sel = select(manifests, at)
    live = 0
    for p in sel.partitions:
        state = partition_state(r, "default", manifests, sel.backup_id, p)
        live += sum(1 for rec in state.values() if rec.op == OP_MUTATION)
    return live, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--millions", default="1,2,4")
    args = ap.parse_args()
    sizes = [int(x) for x in args.millions.split(",")]
    with tempfile.TemporaryDirectory(prefix="upr-bench-spark-") as tmp:
        t = Path(tmp)
        repo = t / "repo"
        node = BenchNode(t / "node")
        ids: list[tuple[int, str]] = []
        try:
            loaded = 0
            for m in sizes:
                n = m * 1_000_000 - loaded
                upr("load", node.uri, "--docs", str(n), "--prefix", f"d{m}", "--json")
                loaded += n
                node.wait_persisted()
                out = json.loads(upr("backup", node.uri, "--repo", str(repo), "--json"))
                ids.append((m, out["backup_id"]))
        finally:
            node.stop()
        from upr_cli.spark.jobs import export, session

        t0 = time.perf_counter()
        spark = session("local[2]", app="upr bench")
        startup = time.perf_counter() - t0
        rows = []
        try:
            # warm-up: the first job pays for Python workers and JIT; not measured
            export(spark, repo, t / "warmup", at=ids[0][1])
            for m, bid in ids:
                s = export(spark, repo, t / f"out{m}", at=bid)
                live, local_s = local_state(repo, bid)
                assert live == s.rows, (live, s.rows)
                rows.append((m, s.rows, s.seconds, local_s))
        finally:
            spark.stop()
    print(f"Spark local[2] start-up: {startup:.1f}s (not included below)")
    for m, n, spark_s, local_s in rows:
        print(f"  {m}M records: {n:,} documents; spark export {spark_s:.1f}s "
              f"({n / spark_s:,.0f} docs/s), local state {local_s:.1f}s "
              f"({n / local_s:,.0f} docs/s), spark/local {spark_s / local_s:.2f}x")  # fmt: skip
    first, last = rows[0], rows[-1]
    scale = last[0] / first[0]
    gs, gl = last[2] / first[2], last[3] / first[3]
    print(f"  from {first[0]}M to {last[0]}M records ({scale:.0f}x): spark time x{gs:.2f}, "
          f"local time x{gl:.2f}")  # fmt: skip
    print(
        f"spark_startup_s={startup:.1f} "
        + " ".join(f"export_{m}m_s={s:.1f} local_{m}m_s={lo:.1f}" for m, _n, s, lo in rows)
        + f" growth_spark={gs:.2f} growth_local={gl:.2f} records_scale={scale:.0f}"
    )


if __name__ == "__main__":
    main()
