"""`upr replay` into SQLite: items/s beside a bare executemany of the same rows.

Loads --docs JSON documents (1024 partitions) into a local `upr serve`, waits until
they are persisted, then replays the node into a new store (`upr replay upr://…`) and a
backup of it (`upr replay repo:…`), each in its own process, and inserts the same rows
(read back from the store) into the same schema with one bare `executemany` in one
transaction, in this process, in the order a replay applies them (partition, then seq;
the target) and in primary-key order (printed beside it), each the best of two runs.
Target:
replay ≥ 65% of the bare rate.

Usage: python bench/replay.py [--docs 1000000]
Last line: replay_items_per_s=… bare_insert_items_per_s=… share=… target=… …
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _node import BenchNode, run_measured
from _ref import bare_executemany

SHARE_TARGET = 0.65  # issue 27: replay from a node >= 65% of the bare rate


def upr(*args: str) -> list[str]:
    """A `upr` command line in this interpreter."""
    return [sys.executable, "-m", "upr_cli", *args]


def bare_rates(store: Path, scratch: Path) -> tuple[float, float, int]:
    """rows/s of one bare executemany of the store's rows into a new store's schema, in
    one transaction: in the order a replay applies them (partition, then seq), and in
    primary-key order."""
    from upr_cli.store import Store

    with Store(store, create=False) as s:
        rows = s.db.conn.execute(
            "SELECT partition, key, seq, rev_seq, cas, flags, expiry, delete_time, datatype,"
            " deleted, value, collection_id FROM documents ORDER BY partition, seq"
        ).fetchall()
    # best of two runs each: disk speed on this machine varies by 2x between runs, and
    # the faster reference is the stricter one
    in_order = max(bare_executemany(rows, scratch / f"bare-seq{i}.db") for i in range(2))
    rows.sort(key=lambda r: (r[0], r[11], r[1]))
    by_key = max(bare_executemany(rows, scratch / f"bare-key{i}.db") for i in range(2))
    return in_order, by_key, len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="upr-bench-replay-") as tmp:
        t = Path(tmp)
        node = BenchNode(t / "node")
        try:
            subprocess.run(upr("load", node.uri, "--docs", str(args.docs), "--json"),
                           check=True, capture_output=True)  # fmt: skip
            node.wait_persisted()
            _s, node_rss, out = run_measured(upr("replay", node.uri, "--into", str(t / "n.db"),
                                                 "--json"))  # fmt: skip
            live = json.loads(out)
            subprocess.run(upr("backup", node.uri, "--repo", str(t / "repo"), "--json"),
                           check=True, capture_output=True)  # fmt: skip
        finally:
            node.stop()
        _s, repo_rss, out = run_measured(upr("replay", f"repo:{t / 'repo'}", "--into",
                                             str(t / "r.db"), "--json"))  # fmt: skip
        from_repo = json.loads(out)
        bare, bare_sorted, rows = bare_rates(t / "n.db", t)
    live_rate = live["applied"] / live["seconds"]
    repo_rate = from_repo["applied"] / from_repo["seconds"]
    share, repo_share = live_rate / bare, repo_rate / bare
    print(f"node with {args.docs:,} operations (1024 partitions), {rows:,} documents, persisted")
    print(
        f"  bare executemany, one transaction: {bare:,.0f} rows/s in replay order (partition,"
        f" seq); {bare_sorted:,.0f} rows/s in key order"
    )
    print(
        f"  replay from the node:       {live['applied']:,} items in {live['seconds']:.2f}s = "
        f"{live_rate:,.0f} items/s = {share:.0%} of bare  target >= {SHARE_TARGET:.0%} "
        f"{'MET' if share >= SHARE_TARGET else 'MISSED'}  (peak RSS {node_rss:.0f} MB)"
    )
    print(
        f"  replay from a repository:   {from_repo['applied']:,} items in "
        f"{from_repo['seconds']:.2f}s = {repo_rate:,.0f} items/s = {repo_share:.0%} of bare  "
        f"target >= {SHARE_TARGET:.0%} {'MET' if repo_share >= SHARE_TARGET else 'MISSED'}  "
        f"(peak RSS {repo_rss:.0f} MB)"
    )
    print(
        f"replay_items_per_s={live_rate:.0f} repo_replay_items_per_s={repo_rate:.0f} "
        f"bare_insert_items_per_s={bare:.0f} bare_sorted_items_per_s={bare_sorted:.0f} "
        f"share={share:.2f} repo_share={repo_share:.2f} "
        f"target={SHARE_TARGET} replay_rss_mb={node_rss:.0f} repo_replay_rss_mb={repo_rss:.0f}"
    )


if __name__ == "__main__":
    main()
