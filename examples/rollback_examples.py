"""Run `upr rollback-point` on the UPR design specification's worked examples; print a table.

Usage: python examples/rollback_examples.py   (what `make demo` runs for now)
Each row runs the real command line in a subprocess and compares with the design's answer
(its "Examples" section, "Finding RollbackSeq/StartSeq from the failover logs").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent


def fmt(log: list[list[object]]) -> str:
    return ", ".join(f"{u}@{s}" for u, s in log) or "(none)"


def main() -> int:
    examples = json.loads((HERE / "seed-rollback-examples.json").read_text())["examples"]
    table = Table(title="upr rollback-point on the UPR design's examples (seed rule)")
    table.add_column("example", max_width=46)
    for col in ("server log", "client log", "snap", "seen", "design says", "upr says", "step"):
        table.add_column(col, no_wrap=True)
    failures = 0
    for ex in examples:
        cmd = [
            sys.executable,
            "-m",
            "upr_cli",
            "rollback-point",
            "--json",
            "--server-log",
            json.dumps(ex["server_log"]),
            "--client-log",
            json.dumps(ex["client_log"]),
            "--snapshot-seq",
            str(ex["snapshot_seq"]),
            "--seen-seq",
            str(ex["seen_seq"]),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if ex.get("impossible"):
            expected = "not possible"
            got = "not possible (exit 3)" if proc.returncode == 3 else f"exit {proc.returncode}"
            step, ok = "impossible-history", proc.returncode == 3
        else:
            expected = str(ex["rollback_seq"])
            if proc.returncode == 0:
                out = json.loads(proc.stdout)
                got, step = str(out["rollback_seq"]), out["step"]
            else:
                got, step = f"exit {proc.returncode}", proc.stderr.strip()
            ok = got == expected
        failures += not ok
        table.add_row(
            ex["title"],
            fmt(ex["server_log"]),
            fmt(ex["client_log"]),
            str(ex["snapshot_seq"]),
            str(ex["seen_seq"]),
            expected,
            f"[green]{got}[/]" if ok else f"[red]{got}[/]",
            step,
        )
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    console.print(f"{len(examples) - failures}/{len(examples)} examples agree with the design")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
