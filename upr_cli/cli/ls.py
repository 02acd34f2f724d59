"""`upr ls`: the keys the state at a backup holds (restic's `ls`)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterable
from typing import Annotated

import typer

from upr_cli.cli.options import At, AtTime, Bucket, JsonOutput, Repo, point_at
from upr_cli.cli.output import SCHEMA
from upr_cli.collections import parse_paths
from upr_cli.jobs.ls import Key, StateAt, key_fields, key_text, list_keys, open_state

HELP = """List the keys a restore of a backup's state would write.

One line per key, SCOPE.COLLECTION KEY, in partition order and, within a partition,
in seq order (the order the backup's streams sent them). A key that is not printable
UTF-8 shows invalid bytes and control characters as backslash escapes. A key whose
latest record is a deletion is not restored and not listed; --deleted lists those
too, each line then starting with "live" or "deleted".

--at takes a backup id, a unique prefix of one, latest (the default) or oldest, as
`upr restore --at` does. --collection keeps the collections it names (SCOPE or
SCOPE.COLLECTION, comma-separated); a collection dropped by that backup is not part
of its state. --prefix keeps the keys that start with it. --at-time TIME lists the
state at a time instead, as `upr restore --at-time` restores it (RFC 3339, a local
time such as 2026-12-06 14:37, or relative: -15m, -2h, -1d); partitions with no
restore point by then are not listed.

The keys are read one partition at a time and no value is held, so a bucket of any
size lists in the memory of its largest partition's keys. --json prints one JSON
document: backup_id, bucket, point (what --at-time resolved to, else null), keys
(scope, collection, key, and key_b64 when the key is not UTF-8, partition, seq,
deleted, bytes: the body's length) and items (the keys listed).

Example:

  upr ls --repo /backups/cb --at latest

Example (the keys as they were 15 minutes ago):

  upr ls --repo /backups/cb --at-time -15m

Example (one collection's keys starting with user::, tombstones too, as JSON):

  upr ls --repo /backups/cb --at 20261121T06 --collection app.users --prefix user:: --deleted --json
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("ls", help=HELP, no_args_is_help=True)(ls_cmd)


def ls_cmd(
    repo: Repo,
    bucket: Bucket = None,
    at: At = "latest",
    at_time: AtTime = None,
    collection: Annotated[
        str | None,
        typer.Option(
            "--collection",
            metavar="PATHS",
            help="Only these collections: SCOPE or SCOPE.COLLECTION, comma-separated.",
        ),
    ] = None,
    prefix: Annotated[
        str | None, typer.Option("--prefix", metavar="TEXT", help="Only keys starting so.")
    ] = None,
    deleted: Annotated[
        bool, typer.Option("--deleted", help="List deleted keys too, marked.")
    ] = False,
    json_out: JsonOutput = False,
) -> None:
    """List the keys of the state at a backup."""
    with contextlib.ExitStack() as held:  # the shared lock, while the segments are read
        paths = parse_paths(collection) if collection else ()
        state = open_state(repo, bucket, point_at(at, at_time), paths, held=held)
        _list(state, prefix, deleted, json_out)


def _list(state: StateAt, prefix: str | None, deleted: bool, json_out: bool) -> None:
    start = prefix.encode() if prefix else b""
    keys = (k for k in list_keys(state, deleted=deleted) if k.key.startswith(start))
    if json_out:
        write_json(state, keys)
        return
    out = sys.stdout
    for k in keys:
        scope, coll = state.names[k.collection]
        mark = ("deleted " if k.deleted else "live    ") if deleted else ""
        out.write(f"{mark}{scope}.{coll} {key_text(k.key)}\n")
    out.flush()


def write_json(state: StateAt, keys: Iterable[Key]) -> None:
    """One JSON document, written as the keys come (never held whole): the form
    `print_json` gives an object, with `items` after the keys."""
    out = sys.stdout
    point = state.selection.point
    head = json.dumps(
        {
            "schema": SCHEMA,
            "backup_id": str(state.backup_id),
            "bucket": state.bucket,
            "point": None if point is None else point.to_json(),
        },
        indent=2,
    )
    out.write(head[:-2] + ',\n  "keys": [')
    n = 0
    for k in keys:
        scope, coll = state.names[k.collection]
        obj = {"scope": scope, "collection": coll, **key_fields(k.key),
               "partition": k.partition, "seq": str(k.seq), "deleted": k.deleted,
               "bytes": k.bytes}  # fmt: skip
        text = json.dumps(obj, indent=2).replace("\n", "\n    ")
        out.write(("," if n else "") + "\n    " + text)
        n += 1
    out.write(("\n  " if n else "") + f'],\n  "items": {n}\n}}\n')
    out.flush()
