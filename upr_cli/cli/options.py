"""Shared option aliases, so every command spells the same option the same way, and the
parsing and error rules some commands share."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Literal

import typer

from upr_cli.errors import ExitCode, UprError, UsageError, check_file_path, is_network_error

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


#: what `upr restore` accepts as its TARGET
RESTORE_TARGETS = "upr://[user@]host[:port]/bucket (a node) or sqlite:PATH (a SQLite store)"


def restore_target(text: str) -> tuple[Literal["node", "sqlite"], str]:
    """Parse `upr restore`'s TARGET: ("node", the URI) for upr://… or couchbase://…, or
    ("sqlite", PATH) for sqlite:PATH, whose directory must exist. Anything else is a
    UsageError naming what is wrong; a bare path gets the sqlite: form it probably meant."""
    if text.startswith(("upr://", "couchbase://")):
        return "node", text
    if text.startswith("sqlite:"):
        path = text[len("sqlite:") :]
        if not path:
            raise UsageError("TARGET sqlite: needs a path, e.g. sqlite:/tmp/bucket.db")
        check_file_path(path, f"TARGET {text}")
        return "sqlite", path
    if not text.strip():
        raise UsageError(f"TARGET is empty: give {RESTORE_TARGETS}")
    scheme, colon, _rest = text.partition(":")
    if colon and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]+", scheme):
        shown = f"{scheme}:…" if "@" in text else text  # user:password@ is never echoed
        raise UsageError(f"TARGET {shown!r}: unknown kind of target; give {RESTORE_TARGETS}")
    raise UsageError(f"TARGET {text!r} is a path: a SQLite store there is sqlite:{text}; "
                     "a node is upr://[user@]host[:port]/bucket")  # fmt: skip


class NoAnswer(UprError):
    """A command whose exit 1 is an answer (diff: the histories differ; salvage: lost writes
    remain) failed: it exits 2, never 1 (README "Errors and exit codes")."""

    exit_code = ExitCode.USAGE


@contextmanager
def one_is_an_answer() -> Iterator[None]:
    """Around the work of a command whose exit 1 is an answer: a failure that exits 1
    elsewhere (a source, the network, damaged data) becomes `NoAnswer` (exit 2); every
    other code (2, 3, 74, 130) stays as it is."""
    try:
        yield
    except UprError as exc:
        if exc.exit_code == ExitCode.FAILED:
            raise NoAnswer(str(exc)) from None
        raise
    except OSError as exc:  # the file system's errors keep theirs (2 or 74) in the funnel
        if exc.filename is None and is_network_error(exc):
            raise NoAnswer(f"network error: {exc.strerror or exc}") from None
        raise
