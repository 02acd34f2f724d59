"""The main job on the embedded default: a local `upr serve` with sample data.

What `make demo` runs. Every step is a real `upr` command in its own process:

1. start a node (loopback, no auth) and load sample documents;
2. tail it to the end, keeping the positions in a state file;
3. restart it so that new writes stay unpersisted, write more, tail them too;
4. SIGKILL the node (the unpersisted writes are lost) and restart it: every partition
   gets a new failover entry at its last persisted seq;
5. resume the tail from its state file: the node answers ROLLBACK, the tail shows
   each partition rolling back to exactly the persisted seq, then carries on;
6. the seed's rollback-point examples, for reference.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
console = Console(width=None if sys.stdout.isatty() else 120, highlight=False)
PARTITIONS = 16


def upr(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `upr ARGS` and fail loudly if it fails."""
    proc = subprocess.run([sys.executable, "-m", "upr_cli", *args], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"demo: `upr {' '.join(args[:1])}` failed: {proc.stderr.strip()}")
    return proc


class Node:
    """`upr serve` on a free loopback port, restartable on the same port."""

    def __init__(self, data: Path) -> None:
        self.data, self.port, self.proc = data, 0, None  # type: ignore[var-annotated]

    def start(self, *extra: str) -> None:
        for _ in range(50):
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "upr_cli", "serve", "--data", str(self.data), "--port",
                 str(self.port), "--no-auth", "--partitions", str(PARTITIONS), *extra],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if line.startswith("listening "):
                self.port = int(line.rsplit(":", 1)[1].split("/")[0])
                return
            self.proc.wait()
            time.sleep(0.1)
        raise SystemExit("demo: upr serve did not start")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)

    @property
    def uri(self) -> str:
        return f"upr://127.0.0.1:{self.port}/default"


def tail(uri: str, state: Path, *extra: str) -> list[dict[str, object]]:
    out = upr("tail", uri, "--until-end", "--format", "json", "--state", str(state), *extra)
    return [json.loads(line) for line in out.stdout.splitlines()]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="upr-demo-") as tmp:
        data, state = Path(tmp) / "node", Path(tmp) / "tail-state.json"
        node = Node(data)
        node.start("--flush-interval", "0.05")
        console.rule(f"[bold]1. upr serve on {node.uri} ({PARTITIONS} partitions), upr load")
        summary = json.loads(upr("load", node.uri, "--docs", "20000", "--update-ratio", "0.2",
                                 "--delete-ratio", "0.05", "--json").stdout)  # fmt: skip
        console.print(f"loaded {summary['ops']:,} operations at {summary['ops_per_s']:,} ops/s "
                      f"({summary['sets']:,} new, {summary['updates']:,} updates, "
                      f"{summary['deletes']:,} deletes)")  # fmt: skip

        console.rule("[bold]2. upr tail --until-end (positions kept in a state file)")
        first = tail(node.uri, state)
        console.print(f"{len(first):,} changes (one per key: the node deduplicates); e.g.")
        console.print_json(json.dumps(first[0]))

        console.rule("[bold]3. restart with --flush-interval 3600: new writes stay in memory")
        node.signal(signal.SIGTERM)
        node.start("--flush-interval", "3600")
        upr("load", node.uri, "--docs", "3000", "--prefix", "unpersisted", "--seed", "2")
        second = tail(node.uri, state)
        console.print(
            f"the tail saw {len(second):,} more changes, all still unpersisted on the node"
        )

        console.rule("[bold]4. SIGKILL the node and restart it")
        node.signal(signal.SIGKILL)
        node.start("--flush-interval", "0.05")
        console.print("restarted after an unclean stop: each partition got a new failover entry "
                      "at its last persisted seq")  # fmt: skip

        console.rule("[bold]5. resume the tail: the node answers ROLLBACK")
        third = upr(
            "tail", node.uri, "--until-end", "--format", "json", "--state", str(state), "-v"
        )
        events = [json.loads(line) for line in third.stdout.splitlines()]
        rollbacks = [e for e in events if e.get("event") == "rollback"]
        table = Table(title="rollbacks seen by the resumed tail")
        for col in ("partition", "had seen seq", "rolled back to", "writes lost"):
            table.add_column(col, justify="right")
        for e in rollbacks:
            table.add_row(str(e["partition"]), str(e["from_seq"]), str(e["to_seq"]),
                          str(int(e["from_seq"]) - int(e["to_seq"])))  # fmt: skip
        console.print(table)
        lost = sum(int(e["from_seq"]) - int(e["to_seq"]) for e in rollbacks)
        leftover = sum(1 for e in events if str(e.get("key", "")).startswith("unpersisted"))
        console.print(f"{len(rollbacks)} partitions rolled back over {lost:,} lost seqs; "
                      f"unpersisted documents still on the node: {leftover}")  # fmt: skip
        node.signal(signal.SIGTERM)
        ok = len(rollbacks) == PARTITIONS and leftover == 0

    console.rule("[bold]6. upr rollback-point on the seed's worked examples")
    seed = subprocess.run([sys.executable, str(HERE / "rollback_examples.py")], check=False)
    return 0 if ok and seed.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
