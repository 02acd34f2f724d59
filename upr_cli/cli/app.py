"""The `upr` Typer app and its single error funnel.

Every `UprError` becomes one line on stderr and its exit code (1, 2 for usage, 3 for an
impossible history); click usage errors become one line and exit 2; Ctrl-C exits 130;
an unexpected exception is reported in one line too (set UPR_DEBUG=1 for the traceback,
which never shows locals). STYLE 4 and 11.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

import click
import typer
from typer.exceptions import Abort as TyperAbort
from typer.exceptions import TyperException

from upr_cli import __version__
from upr_cli.cli import (
    backup,
    cluster,
    diff,
    examine,
    inspect,
    load,
    replay,
    restore,
    rollback_point,
    salvage,
    serve,
    spark,
    tail,
)
from upr_cli.cli.output import error_line
from upr_cli.errors import UprError

app = typer.Typer(
    name="upr",
    help=(
        "Toolkit for Couchbase's replication protocol (UPR, shipped as DCP).\n\n"
        'Example: upr rollback-point --server-log \'[["deadbeef",8],["cafebabe",0]]\' '
        '--client-log \'[["ba5eba11",7],["cafebabe",0]]\' --snapshot-seq 6 --seen-seq 9'
    ),
    no_args_is_help=True,
    add_completion=False,
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


rollback_point.register(app)
serve.register(app)
tail.register(app)
load.register(app)
backup.register(app)
inspect.register(app)
restore.register(app)
examine.register(app)
replay.register(app)
diff.register(app)
salvage.register(app)
spark.register(app)
cluster.register(app)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: run the app and map every failure to one line + exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    level = os.environ.get("UPR_LOG", "").upper()
    if level in ("DEBUG", "INFO", "WARNING"):  # diagnostics on stderr (moves, reconnects)
        import logging

        logging.basicConfig(level=level, stream=sys.stderr,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    command = typer.main.get_command(app)
    try:
        code = command.main(args=args, prog_name="upr", standalone_mode=False)
    except (TyperException, click.ClickException) as exc:
        # Usage errors (exit 2) from Typer's vendored click, or from click itself.
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        error_line(f"{exc.format_message()}{hint}")
        code = exc.exit_code
    except (TyperAbort, click.exceptions.Abort):
        error_line("interrupted")
        code = 130
    except UprError as exc:
        if os.environ.get("UPR_DEBUG"):
            traceback.print_exc()
        error_line(str(exc))
        code = exc.exit_code
    except KeyboardInterrupt:
        error_line("interrupted")
        code = 130
    except BrokenPipeError:
        code = 0
    except Exception as exc:
        if os.environ.get("UPR_DEBUG"):
            raise
        error_line(f"internal error: {type(exc).__name__}: {exc} (set UPR_DEBUG=1 for details)")
        code = 70
    sys.exit(code if isinstance(code, int) else 0)
