"""`upr load`: write a reproducible workload of JSON documents."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated

import typer

from upr_cli.cli.options import (
    CaCert,
    ClientCert,
    ClientKey,
    JsonOutput,
    MemoryLimitOption,
    NodeUri,
    NoProgress,
    NoVerify,
    PasswordFile,
    tls_source,
)
from upr_cli.cli.output import Progress, plural, print_json, stdout
from upr_cli.collections import parse_paths
from upr_cli.jobs.load import LoadSummary, load
from upr_cli.jobs.writer import DEFAULT_LIMIT
from upr_cli.net.uri import SourceUri

HELP = """Write a reproducible workload of JSON documents through the KV front end.

Each of N operations creates a document, or updates or deletes an existing one by
the given ratios; the same --seed gives the same operations. Requests are pipelined.
Keys are PREFIX-000000000 upwards: a key an earlier run left is overwritten, and the
summary says how many were.

With --collections S.C,... (or a scope S: each of its collections) new documents go to
the collections round robin, updates and deletes to their document's collection; the
collections must exist (nothing is written otherwise) and the summary counts each one.
Without it, everything goes to the default collection.

Example (100,000 documents of about 180 bytes):

  upr load upr://admin@127.0.0.1:11210/default --docs 100000

Example (mixed workload at 2,000 ops/s, summary as JSON):

  upr load upr://admin@127.0.0.1/default --docs 20000 --update-ratio 0.3 \\
      --delete-ratio 0.1 --rate 2000 --json

With --xattrs every write carries extended attributes, as Sync Gateway and
transactions leave them: a system xattr `_sync` (the new CAS, expanded by the server,
and the operation number) and a user xattr `meta`. Writes go through the sub-document
command SUBDOC_MULTI_MUTATION; a delete keeps `_sync` in the tombstone.

Up to 512 requests are in flight, and at most a quarter of --memory-limit (default
192MB) in their keys and values: large documents (--size) keep the memory bounded. A
write the node refuses for a while (ETMPFAIL: its write queue is full) is sent again
after a short pause.

Example (spread over two collections of scope app):

  upr load upr://admin@127.0.0.1/default --docs 10000 --collections app.users,app.orders
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("load", help=HELP, no_args_is_help=True)(load_cmd)


# Declared here, not in the signature, to keep `load_cmd` short.
Spread = Annotated[
    str | None,
    typer.Option(
        "--collections",
        metavar="PATHS",
        help="Spread the workload over these collections: S.C or S, comma-separated.",
    ),
]


def load_cmd(
    uri: NodeUri,
    docs: Annotated[int, typer.Option("--docs", min=1, metavar="N", help="Number of operations.")],
    size: Annotated[
        int,
        typer.Option(
            "--size",
            min=60,
            max=20_000_000,
            metavar="BYTES",
            help="Approximate document size in bytes (60 to 20,000,000).",
        ),
    ] = 180,
    update_ratio: Annotated[
        float,
        typer.Option(
            "--update-ratio",
            min=0.0,
            max=1.0,
            metavar="SHARE",
            help="Share of operations updating an existing document.",
        ),
    ] = 0.0,
    delete_ratio: Annotated[
        float,
        typer.Option(
            "--delete-ratio",
            min=0.0,
            max=1.0,
            metavar="SHARE",
            help="Share of operations deleting one.",
        ),
    ] = 0.0,
    rate: Annotated[
        float | None,
        typer.Option("--rate", min=1.0, metavar="N", help="Operations per second at most."),
    ] = None,
    seed: Annotated[
        int, typer.Option("--seed", metavar="N", help="Random seed (same seed, same workload).")
    ] = 1,
    prefix: Annotated[str, typer.Option("--prefix", metavar="TEXT", help="Key prefix.")] = "doc",
    collections: Spread = None,
    with_xattrs: Annotated[
        bool, typer.Option("--xattrs", help="Write a system and a user xattr with each document.")
    ] = False,
    memory: MemoryLimitOption = DEFAULT_LIMIT,
    no_progress: NoProgress = False,
    json_out: JsonOutput = False,
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Write a workload."""
    source = tls_source(SourceUri.parse(uri), cacert, no_verify, cert, key)
    paths = parse_paths(collections)
    if collections is not None and not paths:
        from upr_cli.errors import UsageError

        raise UsageError("--collections: give SCOPE.COLLECTION or SCOPE, comma-separated")
    show = sys.stderr.isatty() and not no_progress
    with Progress("load", "ops", show=show, total=docs) as bar:
        bar.note(f"connecting to {source.redacted()}")

        def tick(s: LoadSummary) -> None:
            bar.update(s.ops, nbytes=s.bytes)

        summary = asyncio.run(
            load(
                source,
                docs=docs,
                size=size,
                update_ratio=update_ratio,
                delete_ratio=delete_ratio,
                rate=rate,
                seed=seed,
                prefix=prefix,
                collections=paths or None,
                with_xattrs=with_xattrs,
                on_progress=tick,
                memory=memory,
            )
        )
    if json_out:
        print_json(summary.to_json())
    else:
        _print_summary(summary, prefix)
    if summary.errors:
        raise typer.Exit(1)


def _print_summary(summary: LoadSummary, prefix: str) -> None:
    """The load's counts, per collection when it spread over several."""
    stdout.print(
        f"{summary.ops:,} items in {summary.seconds:.2f}s ({summary.rate:,.0f} items/s), "
        f"{plural(summary.errors, 'error')}\n{summary.sets:,} created, "
        f"{summary.updates:,} updated, {summary.deletes:,} deleted",
        markup=False,
    )
    if len(summary.collections) > 1 or summary.collections[0].id != 0:
        for c in summary.collections:
            stdout.print(f"  {c.path}: {c.created:,} created, {c.updates:,} updated, "
                         f"{c.deletes:,} deleted", markup=False)  # fmt: skip
    if summary.overwritten:
        stdout.print(f"overwrote {summary.overwritten:,} existing keys (left by an earlier "
                     f"run with --prefix {prefix})", markup=False)  # fmt: skip
