"""The `upr` Typer app and its single error funnel.

Every failure ends as one line on stderr and an exit code of `ExitCode` (README "Errors
and exit codes"): an `UprError` with its own code; click usage errors (and a command run
without its arguments) with 2; an `OSError` becomes the typed error `os_error` makes,
naming the path (74 for a failing or full file system, 2 for a path that is not what it
should be, 1 for the network); anything else is a bug, reported in one line with exit 70
(UPR_DEBUG=1 shows the traceback, which never shows locals). A command run without
arguments prints its help and exits 2, unless the environment gives its required
parameters (`UPR_REPO=… upr info`: `cli/help.py`). SIGINT and SIGTERM end every command by one rule
(upr_cli/interrupt.py): a bounded command says in one line what it kept and how to go
on, and exits 130 or 143; a follower says what it saved and exits 0. `KEPT` words the
line of the commands whose words do not depend on the run; the others say it
themselves.

The commands' modules are imported when one of them runs, not to list them
(`cli/help.py`), so `upr --help` starts fast.

Every command takes `--log-format text|json` and `--log-level` (upr_cli/logs.py, the
options added in `cli/help.py`): the error line is then a JSON object with the exit
status and the error's kind (and, with UPR_DEBUG=1, the traceback as a field). `main`
sets the log state from the environment before the command line is read, so a usage
error in it already follows UPR_LOG_FORMAT, and puts stderr back when the command ends.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import click
import typer
from typer.exceptions import Abort as TyperAbort
from typer.exceptions import TyperException

from upr_cli import __version__, interrupt, logs
from upr_cli.cli.help import LazyGroup
from upr_cli.cli.output import error_line, notice
from upr_cli.errors import ExitCode, UprError, free_bytes, is_network_error, os_error
from upr_cli.source import local_path

HELP = """Toolkit for Couchbase's replication protocol (UPR, shipped as DCP): a node to
serve, and backup, restore, tail, replay and failover-history tools for any node.

Each command's --help has examples; `man upr` and `man upr-COMMAND` have the details.
`upr --install-completion` completes commands and options in bash, zsh or fish.

Results go to stdout, everything else to stderr: every command takes --log-format
text|json (one JSON object a line, secrets redacted) and --log-level
debug|info|notice|warning|error (else UPR_LOG_FORMAT and UPR_LOG).

Example (a node, a workload, its changes, a backup and its restore):

  upr serve --data /tmp/node --port 11210 --user admin --password secret
  upr collections create upr://admin@127.0.0.1:11210/default app.users
  upr load upr://admin@127.0.0.1:11210/default --docs 10000
  upr tail upr://admin@127.0.0.1:11210/default --until-end
  upr backup upr://admin@127.0.0.1:11210/default --repo /backups/cb
  upr restore --repo /backups/cb sqlite:/tmp/bucket.db
  upr info --repo /backups/cb
"""

app = typer.Typer(
    name="upr",
    cls=LazyGroup,
    help=HELP,
    no_args_is_help=True,
    add_completion=True,  # --install-completion, --show-completion: bash, zsh, fish
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"upr {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Toolkit for Couchbase's replication protocol (UPR, shipped as DCP)."""


#: options whose value is a local path the command reads or writes: an error the file
#: system reports without a path (ENOSPC from write(2)) is told against them
PATH_OPTIONS = ("--repo", "--into", "--state", "--data", "--to", "--output", "--store",
                "--node-data")  # fmt: skip


#: what an interrupted run of a command kept and how to go on, for the commands whose
#: words do not depend on the run (backup, tail, replay and serve say theirs)
KEPT = {
    "restore": "the target keeps what was written (a restore writes the same versions "
    "again); run the same command to complete it",
    "verify": "verify changes nothing; run it again to check the whole repository",
    "info": "info changes nothing; run it again",
    "examine": "examine changes nothing; run it again",
    "ls": "ls changes nothing; run it again",
    "cat": "cat changes nothing; run it again",
    "diff": "diff changes nothing; run it again",
    "load": "the documents written so far stay; run the same command to write the whole "
    "workload (from its first document)",
    "salvage": "the lost writes written back so far stay; run the same command to see what is left",
}


def given_paths(args: Sequence[str]) -> list[Path]:
    """The local paths named on the command line: PATH_OPTIONS' values and the
    `sqlite:PATH`, `repo:URL[@BACKUP]` and `json:PATH` sources or targets."""
    out: list[Path] = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in PATH_OPTIONS:
            text = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        else:
            path = local_path(arg)
            text = str(path) if path is not None else ""
        if text and "://" not in text:
            out.append(Path(text))
    return out


def _os_failure(exc: OSError, args: Sequence[str]) -> UprError:
    """The typed error of an OSError that escaped a command. Without a path from the system
    (a write(2) on a full disk), the path is the command's own: of those it names, the one
    on the fullest file system."""
    paths = given_paths(args) if exc.filename is None and not is_network_error(exc) else []
    return os_error(exc, min(paths, key=_free_or_inf) if paths else None)


def _free_or_inf(path: Path) -> float:
    free = free_bytes(path)
    return float("inf") if free is None else free


def _no_arguments(exc: Exception) -> bool:
    """The error click raises for a command that shows its help when run without
    arguments: the help is printed (on stdout) and the exit status is 2, as Typer and
    click have it, with no error line after it."""
    return type(exc).__name__ == "NoArgsIsHelpError"


def _stopped() -> int:
    """A signal stopped the command: its one line, and its exit status."""
    end = interrupt.ending()
    if end.follower:
        notice(end.line)
        sys.stderr.flush()
    else:
        error_line(end.line, exit_code=int(end.code), kind="interrupted")
    return end.code


def _failed(message: str, code: int, kind: str) -> int:
    """The error line of a failure (in json format with its exit status and kind, and
    with UPR_DEBUG=1 the traceback), and its exit status."""
    fields: dict[str, object] = {"exit_code": int(code), "kind": kind}
    if os.environ.get("UPR_DEBUG") and sys.exc_info()[0] is not None:
        if logs.is_json():
            fields["traceback"] = traceback.format_exc()
        else:
            traceback.print_exc()
    error_line(message, **fields)
    return code


def _environment_logs() -> None:
    """The log state of UPR_LOG_FORMAT and UPR_LOG (a bad value is left for the
    options' callbacks to report)."""
    for setter in (logs.set_format, logs.set_level):
        with contextlib.suppress(ValueError):
            setter(None)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: run the app and map every failure to one line + exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    logs.reset()
    _environment_logs()
    try:
        code = _run(args)
    finally:
        logs.reset()
    sys.exit(int(code) if isinstance(code, int) else ExitCode.OK)


def _run(args: list[str]) -> object:
    """Run the command line `args`: its exit status."""
    command = typer.main.get_command(app)
    name = next((a for a in args if not a.startswith("-")), "")
    try:
        with interrupt.handling():
            if name in KEPT:
                interrupt.keeps(lambda: KEPT[name])
            code = command.main(args=args, prog_name="upr", standalone_mode=False)
        if code == ExitCode.INTERRUPTED:  # Typer's answer to a KeyboardInterrupt in a command
            code = _stopped()
    except (TyperException, click.ClickException) as exc:
        # Usage errors (exit 2) from Typer's vendored click, or from click itself.
        ctx = getattr(exc, "ctx", None)
        path = ctx.command_path if ctx is not None else "upr"
        if _no_arguments(exc):  # the help is printed already, as the answer: nothing to add
            code = ExitCode.USAGE
        else:
            error_line(f"{exc.format_message()} (see '{path} --help')",
                       exit_code=exc.exit_code, kind="usage")  # fmt: skip
            code = exc.exit_code
    except (TyperAbort, click.exceptions.Abort):
        error_line("interrupted", exit_code=int(ExitCode.INTERRUPTED), kind="interrupted")
        code = ExitCode.INTERRUPTED
    except UprError as exc:
        code = _failed(str(exc), exc.exit_code, type(exc).__name__.rstrip("_"))
    except KeyboardInterrupt:
        code = _stopped()
    except BrokenPipeError:
        code = ExitCode.OK
    except OSError as exc:  # from the file system (or a socket) with no typed error around it
        err = _os_failure(exc, args)
        code = _failed(str(err), err.exit_code, type(err).__name__.rstrip("_"))
    except Exception as exc:
        if os.environ.get("UPR_DEBUG"):
            raise
        code = _failed(f"internal error (a bug in upr: please report it with the output of the "
                       f"same command run with UPR_DEBUG=1): {type(exc).__name__}: {exc}",
                       ExitCode.INTERNAL, "internal")  # fmt: skip
    return code
