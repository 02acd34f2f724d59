"""`upr cat`: one document of the state at a backup (restic's `dump`)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from upr_cli.cli.options import At, AtTime, Bucket, JsonOutput, Repo, point_at
from upr_cli.cli.output import print_json
from upr_cli.collections import Path as CollectionPath
from upr_cli.jobs.cat import cat

HELP = """Print one document of a backup's state, as a restore would write it.

The document's body goes to stdout as its bytes, nothing added (no newline): a JSON
document as its JSON, a binary one as it is. Its extended attributes are not part of
the body; --json prints the whole record instead: seq, cas, rev_seq, flags, expiry,
datatype, its scope and collection, the value (as JSON when it is, else value_b64) and
the xattrs.

A key the state does not hold (never written, or deleted by that backup) is an error,
exit 1. --at takes a backup id, a unique prefix of one, latest (the default) or
oldest, as `upr restore --at` does. --collection SCOPE.COLLECTION looks in that
collection (default _default._default). Only the key's partition is read. --at-time
TIME gives the document as it was at a time, as `upr restore --at-time` restores it
(RFC 3339, a local time such as 2026-12-06 14:37, or relative: -15m, -2h, -1d). A
document whose expiry passed by then is given with its expiry, as it is restored.

Example:

  upr cat --repo /backups/cb user::1042

Example (as it was at an older backup, in collection users of scope app, as JSON):

  upr cat --repo /backups/cb --at 20261121T06 --collection app.users --json user::1042

Example (the document as it was at 14:37 UTC, before a bad deploy):

  upr cat --repo /backups/cb --at-time 2026-12-06T14:37:00Z user::1042
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("cat", help=HELP, no_args_is_help=True)(cat_cmd)


def cat_cmd(
    key: Annotated[str, typer.Argument(metavar="KEY", help="The document key.")],
    repo: Repo,
    bucket: Bucket = None,
    at: At = "latest",
    at_time: AtTime = None,
    collection: Annotated[
        str,
        typer.Option("--collection", metavar="SCOPE.COLLECTION", help="The key's collection."),
    ] = "_default._default",
    json_out: JsonOutput = False,
) -> None:
    """Print one document of the state at a backup (the key's bytes as the command line
    gave them: `os.fsencode` keeps bytes that are not UTF-8)."""
    path = CollectionPath.parse(collection, need_collection=True)
    doc = cat(repo, os.fsencode(key), bucket=bucket, at=point_at(at, at_time), collection=path)
    if json_out:
        print_json(doc.to_json())
        return
    sys.stdout.buffer.write(doc.body)
    sys.stdout.buffer.flush()
