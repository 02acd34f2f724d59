"""Where output goes: data to stdout (pipeable), messages and errors to stderr."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

# Piped output gets room: a table cut at 80 columns is no use to a script or a log.
stdout = Console(soft_wrap=True, highlight=False, width=None if sys.stdout.isatty() else 200)
stderr = Console(stderr=True, soft_wrap=True, highlight=False)


def print_json(obj: Any) -> None:
    """One JSON document on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    sys.stdout.flush()


def error_line(message: str) -> None:
    """One line on stderr, prefixed so it is recognisable in scripts' logs."""
    first = " ".join(str(message).split())
    sys.stderr.write(f"upr: error: {first}\n")
    sys.stderr.flush()


class PartitionProgress:
    """A transient progress bar on stderr for jobs over partitions: "done/total <what>",
    an item count and a rate. Hidden unless stderr is a terminal (nothing when piped)."""

    def __init__(self, label: str, what: str, *, show: bool) -> None:
        import time

        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._time = time.monotonic
        self._what = what
        self.bar = Progress(
            TextColumn(label),
            BarColumn(),
            TextColumn("{task.fields[parts]}"),
            TextColumn("{task.fields[items]}"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=stderr,
            disable=not show,
            transient=True,
        )
        self.task = self.bar.add_task(label, total=None, parts="", items="", rate="")

    def __enter__(self) -> PartitionProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)

    def update(self, done: int, total: int, items: int, noun: str, started: float) -> None:
        """Show `done` of `total` partitions and `items` (a rate since `started`)."""
        secs = max(self._time() - started, 1e-6)
        self.bar.update(self.task, total=total or None, completed=done,
                        parts=f"{done}/{total} {self._what}", items=f"{items:,} {noun}",
                        rate=f"{items / secs:,.0f}/s")  # fmt: skip
