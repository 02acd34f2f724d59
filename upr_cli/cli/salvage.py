"""`upr salvage`: list, and with --apply write back, the writes a failover took back."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from upr_cli.cli.options import (
    REPO_ENV,
    AllRows,
    Bucket,
    CaCert,
    ClientCert,
    ClientKey,
    Compression,
    JsonOutput,
    NoVerify,
    Partitions,
    PasswordFile,
    Wait,
    deprecated_alias,
    either,
    one_is_an_answer,
    repo_location,
    tls_source,
)
from upr_cli.cli.output import (
    first_rows,
    hint,
    keep_whole,
    more_line,
    notice,
    print_json,
    stdout,
    table,
)
from upr_cli.errors import UsageError
from upr_cli.jobs.salvage import (
    LostItem,
    SalvageReport,
    Version,
    check_target,
    salvage_node_data,
    salvage_repo,
    salvage_store,
)
from upr_cli.protocol import xattrs
from upr_cli.source import selected

HELP = """Find the lost writes of a failover and write back those still safe to.

A lost write is the newest version of a key above a rollback cut: a former master
acknowledged it, the current history does not have it. --repo finds them in a backup
repository (records above the cuts its chain recorded, its cut-back segments: records a
failover in the middle of a backup took back, and above the rollback point its newest
backup would get from the master now); --store finds them in a replay store
(the versions its rollbacks took back, and its documents above the rollback point);
--node-data finds them in a replica node's data directory (the versions its
replication rollbacks took back, kept in its lost_writes table: a replica that rolled
back repairs the new master).

A lost write is safe to write back when the key has not changed on the master since
the cut (the master's DCP stream from the cut does not name it); otherwise it is a
conflict, shown with both versions and never written. The dry run (default) only
lists; --apply writes the safe ones with a CAS guard (value, flags and expiry come
back; the master assigns a new cas and seq).

Xattrs: each version shows its xattr names (--json: "xattrs", name -> value). A
master version that differs from a lost one only in its xattrs is a conflict. A SET
cannot carry xattrs, so a lost version with xattrs is written in two steps: the body
(CAS-guarded), then its xattrs with SUBDOC_MULTI_MUTATION guarded by the new cas; if
the master refuses them, the body stays written and the reason names the xattrs left
out.

Collections: a lost write keeps its collection (a key outside the default collection
shows as scope.collection:key) and goes back to that collection on the master, by id;
one whose collection the master dropped since is a conflict.

The master may be reached over TLS: --into uprs://… or couchbases://… (default port
11207), with --cacert FILE (or UPR_CACERT) for the CA that signs its certificate and
--cert/--key for a client certificate. A master that goes away while its changes are
read (a restart, a crash) is reconnected for up to --wait seconds (120; forever, or 0
for no waiting), with a line on stderr when the link is lost and when it is back.

--into was called --to before; --to still works, with a warning.

Exit status: 0 nothing lost or everything written, 1 conflicts or writes that failed
remain, 2 error.

Example (what could come back, without writing):

  upr salvage --repo /backups/cb --into upr://admin@127.0.0.1:11210/default

Example (write them back, from a replay store's mutation log):

  upr salvage --store /tmp/bucket.db --into upr://admin@127.0.0.1/default --apply

Example (a replica that rolled back repairs the new master):

  upr salvage --node-data /tmp/cl/n2 \\
      --into upr://admin@127.0.0.1:12001/default --apply

Example (the master over TLS):

  upr salvage --repo /backups/cb --into uprs://admin@db.example.com/default \\
      --cacert ca.pem
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("salvage", help=HELP, no_args_is_help=True)(salvage_cmd)


def salvage_cmd(
    into: Annotated[
        str | None,
        typer.Option(
            "--into", metavar="URI", help="The current master: upr://…/bucket (uprs://… over TLS)."
        ),
    ] = None,
    old_to: Annotated[str | None, deprecated_alias("--to", "--into")] = None,
    repo: Annotated[
        Path | None,
        typer.Option(
            "--repo",
            metavar="URL",
            parser=repo_location,
            help="A backup repository: a directory or s3://BUCKET/PREFIX (else UPR_REPO, "
            "when neither --store nor --node-data is given).",
        ),
    ] = None,
    store: Annotated[
        Path | None, typer.Option("--store", metavar="PATH", help="A replay store.")
    ] = None,
    node_data: Annotated[
        Path | None,
        typer.Option("--node-data", metavar="DIR", help="A replica node's data directory."),
    ] = None,
    bucket: Bucket = None,
    apply: Annotated[
        bool, typer.Option("--apply/--dry-run", help="Write the safe ones (default: list only).")
    ] = False,
    partitions: Partitions = None,
    show_all: AllRows = False,
    json_out: JsonOutput = False,
    wait: Wait = 120.0,
    compression: Compression = "auto",
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Salvage lost writes."""
    if [repo, store, node_data].count(None) == 3 and os.environ.get(REPO_ENV):
        repo = repo_location(os.environ[REPO_ENV])  # --repo's fallback, as everywhere
    if [repo, store, node_data].count(None) != 2:
        raise UsageError("give exactly one of --repo URL, --store PATH.db and --node-data DIR")
    master = either(into, old_to, None, ("--into", "--to"))
    target = tls_source(check_target(master), cacert, no_verify, cert, key)
    parts = selected(partitions)
    with one_is_an_answer():  # 1 means "lost writes remain": a failure exits 2
        if repo is not None:
            report = salvage_repo(repo, target, bucket=bucket, apply=apply, partitions=parts,
                                  wait=wait, on_notice=notice, compression=compression)  # fmt: skip
        elif node_data is not None:
            report = salvage_node_data(node_data, target, bucket=bucket or "default",
                                       apply=apply, partitions=parts, wait=wait,
                                       on_notice=notice, compression=compression)  # fmt: skip
        else:
            assert store is not None
            report = salvage_store(store, target, apply=apply, partitions=parts, wait=wait,
                                   on_notice=notice, compression=compression)  # fmt: skip
    counts = report.counts
    bad = counts.get("conflict", 0) + counts.get("error", 0)
    code = 1 if bad or (not apply and counts.get("would-write", 0)) else 0
    if json_out:
        print_json(report.to_json())
        raise typer.Exit(code)
    shown, left_out = first_rows(report.items, show_all)
    if shown:
        stdout.print(lost_table(report, shown))
        more_line(left_out, "lost writes")
    summary = ", ".join(f"{n:,} {k}" for k, n in sorted(counts.items())) or "no lost writes"
    stdout.print(f"{len(report.items):,} lost writes: {summary}", markup=False, highlight=False)
    if not apply and counts.get("would-write", 0):
        hint("run again with --apply to write back the safe ones")
    raise typer.Exit(code)


def lost_table(report: SalvageReport, items: Sequence[LostItem]) -> Table:
    """One row a lost write: partition, cut and outcome never wrap; key and versions fold."""
    t = table(f"lost writes in {report.source} ({'dry run' if report.dry_run else 'applied'})")
    for col in ("partition", "key", "cut", "lost version", "outcome", "master version / why"):
        wrap = col in ("key", "lost version", "master version / why")
        t.add_column(col, no_wrap=not wrap, overflow="fold",
                     justify="right" if col in ("partition", "cut") else "left")  # fmt: skip
    for it in items:
        t.add_row(*_row(it))
    return keep_whole(t, "partition", "cut", "outcome")


def _short(v: bytes, n: int = 40) -> str:
    text = v.decode(errors="replace")
    return text if len(text) <= n else text[: n - 1] + "…"


def _shown(v: Version) -> str:
    """A version in a cell: its value (or "deleted") and its xattr names (--json has
    their values)."""
    text = "deleted" if v.deleted else _short(v.value)
    if v.xattrs:
        text += f" xattrs={','.join(xattrs.to_json(v.xattrs))}"
    return text


def _row(it: LostItem) -> list[str]:
    lost = f"seq {it.lost.seq}: {_shown(it.lost)}"
    master = ""
    if it.master is not None:
        mv = _shown(it.master)
        master = f"seq {it.master.seq}: {mv}" if it.master.seq else mv
    why = master or it.reason
    return [str(it.partition), _short(it.shown_key), str(it.cut), lost, it.outcome, why]
