"""`upr repo copy`: copy a repository's backups into another one (upr_cli/jobs/repo_copy.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from upr_cli import interrupt
from upr_cli.cli.options import Bucket, JsonOutput, NoProgress, repo_location
from upr_cli.cli.output import Progress, hint, human_bytes, plural, print_json, stdout
from upr_cli.metrics import MetricsFile, one_shot

HELP = """Copy a repository's backups into another repository, verified as it goes.

Every committed backup of every bucket (or of --bucket) is copied in chain order,
under the same id: its segments, its rollback and cut-back records (lost writes), its
failover logs and collections, the current revision of a pruned backup. The copy
restores, verifies and shows in `upr info` exactly as the source does. Each file is
checked against its manifest's size and BLAKE2b digest as it is streamed, before it is
published; the manifest is written last, so the destination only ever holds whole
backups. A corrupt source file stops the copy and is named.

Run it again at any time: backups already in the destination are skipped, a copy that
was killed goes on where it stopped, and the revisions a prune of the source wrote
replace the destination's (what they absorbed is removed there too). A destination
holding a different backup under one of the source's ids is refused. The destination
is a new or empty directory or s3://BUCKET/PREFIX, or a copy made before; --encrypt
creates it encrypted (with --key-file, --key-command or UPR_PASSPHRASE): how plaintext
backups become encrypted. An encrypted source is copied into a new plaintext
repository only with --decrypt, never by omission. The source's key is
--from-key-file, --from-key-command, UPR_FROM_KEY_FILE or UPR_FROM_PASSPHRASE. Files
are copied --transfers at a time.

Exit status: 0 copied (or nothing to copy), 1 failed (a corrupt source file, a
destination that is not a copy of the source, a held lock), 2 usage error.

Example (what would be copied, changing nothing):

  upr repo copy --from /backups/cb --to s3://offsite/cb --dry-run

Example (encrypt years of plaintext backups into a new repository):

  upr repo copy --from /backups/cb --to /backups/cb-enc --encrypt \\
      --key-file ~/.upr/cb.key

--metrics-file PATH writes Prometheus metrics at the end, success or failure (result,
duration, per bucket the backups and bytes copied: docs/metrics.md), for
node_exporter's textfile collector; the label command is repo_copy.
"""


def register(app: typer.Typer) -> None:
    """Add `copy` to the `upr repo` group."""
    app.command("copy", help=HELP, no_args_is_help=True)(copy_cmd)


From = Annotated[
    Path,
    typer.Option("--from", metavar="URL", parser=repo_location,
                 help="The repository to copy: a directory or s3://BUCKET/PREFIX."),
]  # fmt: skip
To = Annotated[
    Path,
    typer.Option("--to", metavar="URL", parser=repo_location,
                 help="Where to copy it: a new or empty location, or an earlier copy."),
]  # fmt: skip
FromKeyFile = Annotated[
    Path | None,
    typer.Option("--from-key-file", metavar="FILE", dir_okay=False,
                 help="The source's key or passphrase file (else UPR_FROM_KEY_FILE, "
                      "UPR_FROM_PASSPHRASE)."),
]  # fmt: skip
FromKeyCommand = Annotated[
    str | None,
    typer.Option("--from-key-command", metavar="CMD",
                 help="A shell command whose output is the source's key or passphrase."),
]  # fmt: skip
Encrypt = Annotated[
    bool, typer.Option("--encrypt", help="Create the destination encrypted (a new one).")
]
DryRun = Annotated[
    bool, typer.Option("--dry-run", help="List what would be copied; change nothing.")
]


def copy_cmd(
    source: From,
    destination: To,
    bucket: Bucket = None,
    from_key_file: FromKeyFile = None,
    from_key_command: FromKeyCommand = None,
    encrypt: Encrypt = False,
    decrypt: Annotated[
        bool,
        typer.Option(
            "--decrypt", help="Copy an encrypted repository into a new plaintext one, on purpose."
        ),
    ] = False,
    dry_run: DryRun = False,
    no_progress: NoProgress = False,
    json_out: JsonOutput = False,
    metrics_file: MetricsFile = None,
) -> None:
    """Copy a repository."""
    from upr_cli.jobs.repo_copy import copy_repository, source_access

    access = source_access(from_key_file, from_key_command)
    interrupt.keeps(lambda: "the destination keeps every backup copied whole; run the same "
                    "command to copy the rest (finished files are reused)")  # fmt: skip
    show = sys.stderr.isatty() and not no_progress and not dry_run
    with (
        one_shot(metrics_file, "repo_copy", bucket) as run,
        Progress("copy", "backups", show=show) as bar,
    ):

        def tick(nbytes: int, total_bytes: int, backups: int, total: int) -> None:
            bar.update(backups, total=total, nbytes=nbytes)
            bar.note(f"{backups:,}/{total:,} backups, {human_bytes(nbytes)} of "
                     f"{human_bytes(total_bytes)}")  # fmt: skip

        result = copy_repository(source, destination, bucket=bucket, encrypt=encrypt,
                                 decrypt=decrypt, dry_run=dry_run, access=access,
                                 on_progress=tick)  # fmt: skip
        for b in result.buckets:
            run.done(b.bucket, len(b.copied), b.bytes)
    if json_out:
        print_json(result.to_json())
        return
    say = stdout.print
    if dry_run:
        for b in result.buckets:
            say(f"{b.bucket}: would copy {plural(len(b.copied), 'backup')} "
                f"({human_bytes(b.bytes)}), {len(b.skipped)} already there",
                markup=False, highlight=False)  # fmt: skip
            for bid in b.copied:
                say(f"  {bid}", markup=False, highlight=False)
        hint("dry run: nothing changed; run again without --dry-run to copy")
        return
    say(f"copied {plural(result.copied, 'backup')} ({human_bytes(result.bytes)}) of "
        f"{plural(len(result.buckets), 'bucket')} from {result.source} to "
        f"{result.destination}; {result.skipped} already there, in {result.seconds:.1f}s",
        markup=False, highlight=False)  # fmt: skip
