"""`upr examine`: every version of a key across the chain, lost writes marked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import typer
from rich.table import Table

from upr_cli.cli.options import AtTime, Bucket, JsonOutput, Partitions, Repo
from upr_cli.cli.output import hidden_columns, hint, keep_whole, print_json, stdout, table
from upr_cli.collections import Path as CollectionPath
from upr_cli.jobs.examine import Version
from upr_cli.jobs.examine import examine_key as examine  # and the collection and key it read
from upr_cli.repo.pitr import show_time
from upr_cli.source import selected

HELP = """Show every version of a key stored in a repository.

Each version with its backup, seq, rev seq and op, whether it is in the latest state,
and whether it is a lost write: a version a failover or an unclean restart rolled
back (above a later backup's rollback point), absent from the latest state but kept.
A wide terminal also shows each version's cas and the start of its value (and, wider
still, its time); a narrower one names the columns it leaves out, on stderr; --json
has them all. A version with extended attributes (xattrs: Sync Gateway's _sync,
transactions' _txn, an application's own) lists their names; --json has their values
(an "xattrs" object, {} for none). A deletion keeps its system xattrs.

--collection SCOPE.COLLECTION looks the key up in that collection (default
_default._default), by name: a collection dropped and created again under the same name
is one name with two ids, and versions of the dropped one say so. A KEY written
scope.collection:key, as `upr tail` prints one outside the default collection, is that
key in that collection when the backups have it (else the key as written, in
_default._default); --collection, given, always wins.

The key's partition comes from the bucket's partition count, which the repository's
backups record. --partitions selects partitions as in every command: one that leaves
out the key's partition is an error naming it.

Each version has its time: when the restore point that first holds it was received
(the end of its snapshot, in a continuous chain: `upr backup --follow`), else its
backup's commit; the CAS is beside it on a wide terminal, never used to place a
version (writes made with SET_WITH_META keep their source's CAS). --at-time TIME marks
the version a restore at TIME gives ("at time" in the state column, `at_time` in
--json): RFC 3339, a local time (2026-12-06 14:37) or relative (-15m, -2h, -1d).

Example:

  upr examine --repo /backups/cb user::1042

Example (which version a restore at 14:37 UTC would give):

  upr examine --repo /backups/cb --at-time 2026-12-06T14:37:00Z user::1042

Example (as JSON):

  upr examine --repo /backups/cb --json user::1042

Example (in collection users of scope app):

  upr examine --repo /backups/cb --collection app.users user::1042

Example (the same key, as `upr tail` prints it):

  upr examine --repo /backups/cb app.users:user::1042
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("examine", help=HELP, no_args_is_help=True)(examine_cmd)


def examine_cmd(
    key: Annotated[str, typer.Argument(metavar="KEY", help="The document key.")],
    repo: Repo,
    bucket: Bucket = None,
    partitions: Partitions = None,
    json_out: JsonOutput = False,
    collection: Annotated[
        str | None,
        typer.Option(
            "--collection", metavar="SCOPE.COLLECTION",
            help="The key's collection (default _default._default, or the one a KEY "
            "written scope.collection:key names).",
        ),
    ] = None,
    at_time: AtTime = None,
) -> None:  # fmt: skip
    """Show every version of a key."""
    given = None if collection is None else CollectionPath.parse(collection, need_collection=True)
    if at_time is not None:
        from upr_cli.repo.pitr import parse_time

        parse_time(at_time)  # a usage error now, before the repository is read
    path, raw, versions = examine(repo, key.encode(), bucket=bucket,
                                  partitions=selected(partitions), collection=given,
                                  at_time=at_time)  # fmt: skip
    key = raw.decode()
    if json_out:
        print_json({"key": key, "scope": path.scope, "collection": path.collection,
                    "versions": [v.to_json() for v in versions]})  # fmt: skip
        return
    if not versions:
        stdout.print(f"no version of {key!r} in {path} in the repository", markup=False)
        raise typer.Exit(1)
    stdout.print(versions_table(key, versions, width=stdout.width))
    hidden_columns(narrow_columns(stdout.width))
    if any(v.lost for v in versions):
        hint(f"lost writes may be recoverable: upr salvage --repo {repo} --into URI")


#: the columns only a terminal this wide has room for, in the table's order
WIDE_COLUMNS = {"time": 128, "cas": 100, "value": 112}


def narrow_columns(width: int) -> list[str]:
    """The columns a terminal `width` columns wide leaves out (--json has them)."""
    return [col for col, need in WIDE_COLUMNS.items() if width < need]


def versions_table(key: str, versions: Sequence[Version], *, width: int) -> Table:
    """One row a version. The columns that say which version counts (backup, seq, rev,
    op, state) never wrap; the names of the xattrs, when a version has some, fold into
    the room left; cas and a value preview come when `width` leaves room for them
    (--json always has them, and the xattrs' values)."""
    t = table(f"{key} (partition {versions[0].partition})")
    for col in ("backup", "seq", "rev", "op", "state"):
        t.add_column(col, no_wrap=True, justify="right" if col in ("seq", "rev") else "left")
    with_xattrs = any(v.xattrs for v in versions)
    if with_xattrs:
        t.add_column("xattrs", overflow="fold", min_width=6)
    hidden = narrow_columns(width)
    with_cas = "cas" not in hidden
    with_time = "time" not in hidden  # beside the cas: the version's time, the cas
    with_value = "value" not in hidden
    if with_time:
        t.add_column("time", no_wrap=True)
    if with_cas:
        t.add_column("cas", no_wrap=True, justify="right")
    if with_value:
        t.add_column("value", no_wrap=True, overflow="ellipsis", min_width=8, max_width=60)
    for v in versions:
        state = "lost write" if v.lost else ("latest" if v.in_latest else "superseded")
        if v.dropped:
            state = f"dropped ({state})" if v.lost else "dropped collection"
        if v.at_time:
            state += ", at time"
        row = [v.backup_id, str(v.seq), str(v.rev_seq), v.op, state]
        if with_xattrs:  # ", ": a long list wraps between names
            row.append(", ".join(v.xattr_names))
        if with_time:
            row.append("" if v.time is None else show_time(v.time))
        if with_cas:
            row.append(str(v.cas))
        if with_value:
            row.append(v.value.decode(errors="replace")[:60] if v.op == "mutation" else "")
        t.add_row(*row)
    return keep_whole(t, "backup", "seq", "rev", "op", "state", "cas", "time")
