"""Where output goes and how it looks (docs/output.md).

The command's answer (its table, its summary line, or with --json one JSON object) goes
to stdout; progress bars, warnings and "what to do next" hints go to stderr, so a pipe
or a script gets the answer alone. Tables fit 80 columns: key columns never wrap or
truncate, long ones fold, and what does not fit is in --json. A list that can run to
hundreds of rows shows its counts and the first few rows, then "… N more (--all)".
Every long command shows one kind of progress bar (`Progress`): items, items/s (and
bytes/s where the job counts bytes) and an ETA, on a terminal only.

The lines on stderr follow `--log-format` and `--log-level` (upr_cli/logs.py): in text
format they read as they always did; in json format each is one JSON object (`error`,
`warning`, `notice` or `hint` its event).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from upr_cli import logs
from upr_cli.errors import size_text

T = TypeVar("T")

# Piped output gets room: a table cut at 80 columns is no use to a script or a log.
stdout = Console(soft_wrap=True, highlight=False, width=None if sys.stdout.isatty() else 200)
# messages wrap at word boundaries on a terminal; piped, a message stays one line
stderr = Console(stderr=True, soft_wrap=not sys.stderr.isatty(), highlight=False)

#: rows a list shows before "… N more (--all)"
FIRST_ROWS = 10


#: the version of a command's `--json` document (its `schema` member, docs/output.md
#: "Schema versions"): every command starts at 1; a command whose document loses,
#: renames or retypes a member passes the next number to `print_json` (and says so in
#: CHANGELOG.md). A member added is not a new version.
SCHEMA = 1


def print_json(obj: dict[str, Any], schema: int = SCHEMA) -> None:
    """One JSON document on stdout: `obj`, led by its `schema` version."""
    sys.stdout.write(json.dumps({"schema": schema, **obj}, indent=2) + "\n")
    sys.stdout.flush()


def error_line(message: str, **fields: Any) -> None:
    """One line on stderr, prefixed so it is recognisable in scripts' logs (in json
    format an object of event `error`, with `fields`)."""
    first = " ".join(str(message).split())
    if logs.is_json():
        logs.emit("error", "error", first, **fields)
        return
    sys.stderr.write(f"upr: error: {logs.redact(first)}\n")  # a URI's password: ***
    sys.stderr.flush()


def notice(message: str) -> None:
    """A line on stderr about the run's own course (a link lost, and back)."""
    if logs.is_json():
        logs.emit("notice", "notice", message)
    elif logs.enabled("notice"):
        stderr.print(f"upr: {message}", markup=False, highlight=False)


def warning(message: str) -> None:
    """A `upr: warning: …` line on stderr."""
    if logs.is_json():
        logs.emit("warning", "warning", message)
    elif logs.enabled("warning"):
        stderr.print(f"upr: warning: {message}", markup=False, highlight=False)


def hint(message: str) -> None:
    """A "what to do next" line on stderr (never part of the answer a pipe reads); a
    hint written as a warning (`upr: warning: …`) is one."""
    level, event, text = logs.classify(message)
    if logs.is_json():
        logs.emit(level, "hint" if event == "message" else event, text)
    elif logs.enabled(level):
        stderr.print(message, markup=False, highlight=False)


def table(title: str | None = None) -> Table:
    """A table in the house style: a rule under the header and no vertical borders, so
    the columns, not the box, get the width of an 80-column terminal."""
    return Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                 collapse_padding=True, title_justify="left")  # fmt: skip


def keep_whole(t: Table, *headers: str) -> Table:
    """Give the columns `headers` (all when none is named) the width of their widest
    cell, so that Rich, short of room, folds or cuts the other columns, never these."""
    for col in t.columns:
        if not headers or col.header in headers:
            cells = [col.header, *col.cells]
            col.min_width = max(cell_len(c) if isinstance(c, str) else 1 for c in cells)
    return t


def first_rows(rows: Sequence[T], show_all: bool, n: int = FIRST_ROWS) -> tuple[Sequence[T], int]:
    """The rows to show and how many are left out: all of them with --all, else the
    first `n` (a flood of rows hides the counts that matter)."""
    if show_all or len(rows) <= n:
        return rows, 0
    return rows[:n], len(rows) - n


def more_line(left_out: int, what: str = "") -> None:
    """The line after a shortened list: "… N more (--all)"."""
    if left_out:
        noun = f" {what}" if what else ""
        stdout.print(f"… {left_out:,} more{noun} (--all lists them, --json has every one)",
                     markup=False, highlight=False)  # fmt: skip


def fits(console: Console, width: int) -> bool:
    """Whether the console has `width` columns (to add the columns that only then fit)."""
    return console.width >= width


def hidden_columns(hidden: Sequence[str]) -> None:
    """The line on stderr after a table that left columns out for the terminal's width
    (docs/output.md "Tables"), so a reader knows they exist and where to find them."""
    if hidden:
        hint(f"columns hidden at {stdout.width} columns: {', '.join(hidden)} "
             "(--json has them)")  # fmt: skip


def human_bytes(n: int) -> str:
    """812 B, 4.5 MB, 1.9 GB: a size in at most 8 columns."""
    return size_text(n, step=1000, units=("B", "kB", "MB", "GB", "TB"))


def human_duration(seconds: float) -> str:
    """12s, 3m05s, 1h02m: an ETA or an elapsed time at a glance."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def compact(n: float) -> str:
    """950, 12.3k, 4.5M: a rate that keeps its width as it grows."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return f"{n:.0f}"


def eta(done: float, total: float | None, elapsed: float) -> str:
    """The time left at the rate so far, or "" while it cannot be told."""
    if not total or done <= 0 or elapsed < 0.5 or done >= total:
        return ""
    return "ETA " + human_duration(elapsed * (total - done) / done)


class Progress:
    """The one progress bar of every long command, on stderr: what it is doing, how far
    (partitions or items of a known total), items and items/s, and an ETA once the rate
    tells it. Shown only when stderr is a terminal and not --no-progress, so nothing
    reaches a pipe or a log. It starts with "starting…", never blank.

        with Progress("backup", "items", show=show) as bar:
            bar.update(items, parts=(done, total))
    """

    def __init__(self, label: str, noun: str, *, show: bool, total: int | None = None) -> None:
        from rich.progress import BarColumn, TextColumn
        from rich.progress import Progress as RichProgress

        self.noun = noun
        self.total = total
        self.started = time.monotonic()
        self.bar = RichProgress(
            TextColumn(label),
            BarColumn(bar_width=10),
            TextColumn("{task.fields[where]}"),
            TextColumn("{task.fields[rate]}"),
            _eta_column(),
            console=stderr,
            disable=not show,
            transient=True,
            refresh_per_second=4,
        )
        self.task = self.bar.add_task(label, total=None, where="starting…", rate="", eta="")

    def __enter__(self) -> Progress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)

    def note(self, text: str) -> None:
        """Say what the command is waiting for (before any item comes)."""
        self.bar.update(self.task, where=text)

    def update(
        self,
        items: int,
        *,
        total: int | None = None,
        done: int | None = None,
        parts: tuple[int, int] | None = None,
        unit: str = "partitions",
        started: float | None = None,
        nbytes: int | None = None,
    ) -> None:
        """`items` done (of `total` items, when the job knows it), `parts` = (`unit`s
        done, `unit`s in all: partitions, segments), the rate since `started` (default:
        when the bar began), in bytes/s too when the job counts the `nbytes` (keys and
        values) it has moved. The ETA comes from the items when their total is known,
        else from the parts. With `done`, the bar follows `done` of `total` (seqs passed,
        of which the items are a part) and the text shows the items alone."""
        elapsed = max(time.monotonic() - (self.started if started is None else started), 1e-6)
        total = total if total is not None else self.total
        shown_total = total if done is None else None
        where = (
            f"{items:,}/{shown_total:,} {self.noun}" if shown_total else f"{items:,} {self.noun}"
        )
        if parts is not None and parts[1]:
            where += f", {parts[0]:,}/{parts[1]:,} {unit}"
        of: int | None
        if total:
            passed, of = (items if done is None else min(done, total)), total
        else:
            passed, of = parts if parts is not None else (0, None)
        self.bar.update(
            self.task,
            total=of or None,
            completed=passed,
            where=where,
            rate=_rate(items, nbytes, elapsed),
            eta=eta(passed, of, elapsed),
        )


def _rate(items: int, nbytes: int | None, elapsed: float) -> str:
    """`12.3k/s` or `12.3k/s 4.5 MB/s`: items, and bytes when they are counted."""
    if not items:
        return ""
    text = f"{compact(items / elapsed)}/s"
    return text if nbytes is None else f"{text} {human_bytes(int(nbytes / elapsed))}/s"


def _eta_column() -> Any:
    """A Rich column (defined here so that rich.progress loads only with a bar)."""
    from rich.progress import ProgressColumn, Task
    from rich.text import Text

    class EtaColumn(ProgressColumn):
        """The ETA once there is one, else the time elapsed (so a wait still ticks)."""

        def render(self, task: Task) -> Text:
            text = task.fields.get("eta") or human_duration(task.elapsed or 0)
            return Text(str(text), style="progress.remaining")

    return EtaColumn()


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """`1 node`, `3 nodes`, `1,024 partitions` (`nouns` for an irregular plural)."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"
