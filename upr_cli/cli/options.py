"""Shared option aliases, so every command spells the same option the same way (declared
once here, as sqlite-utils shares its options), the deprecated spellings still accepted,
and the parsing and error rules some commands share."""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import typer

from upr_cli.dcp.consumer import WIRE_COMPRESSION, WireCompression
from upr_cli.errors import ExitCode, UprError, UsageError, check_file_path, is_network_error
from upr_cli.memory import MIB, MIN_MEMORY_LIMIT, MemoryLimit, parse_size
from upr_cli.source import parse_source
from upr_cli.storage import UnknownScheme, parse_location

if TYPE_CHECKING:
    from upr_cli.net.tls import ClientTls
    from upr_cli.net.uri import SourceUri

T = TypeVar("T")

# -- options every command spells the same way -----------------------------------------

JsonOutput = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
Partitions = Annotated[
    str | None,
    typer.Option("--partitions", metavar="LIST", help="Only these partitions, e.g. 0-15,40."),
]


def repo_location(value: str | Path) -> Path:
    """`--repo`: a local directory or `s3://BUCKET/PREFIX`; any other `scheme://` is a
    usage error (`upr_cli.storage.parse_location`)."""
    if isinstance(value, Path):
        return value
    try:
        return parse_location(value)
    except UnknownScheme as exc:
        raise typer.BadParameter(str(exc)) from None


REPO_ENV = "UPR_REPO"
"""The environment variable `--repo` falls back to (restic's RESTIC_REPOSITORY)."""

Repo = Annotated[
    Path,
    typer.Option(
        "--repo",
        metavar="URL",
        parser=repo_location,
        envvar=REPO_ENV,
        show_envvar=True,
        help="The backup repository: a directory or s3://BUCKET/PREFIX.",
    ),
]
Bucket = Annotated[
    str | None,
    typer.Option("--bucket", metavar="NAME", help="The bucket in the repository (if several)."),
]
At = Annotated[
    str,
    typer.Option("--at", metavar="BACKUP", help="A backup id, latest or oldest."),
]
AtTime = Annotated[
    str | None,
    typer.Option("--at-time", metavar="TIME",
                 help="The state at a time: 2026-12-06T14:37:00Z, a local time "
                 "(2026-12-06 14:37) or relative (-15m, -2h, -1d)."),
]  # fmt: skip
AtSeq = Annotated[
    str | None,
    typer.Option("--at-seq", metavar="SEQS",
                 help="P:SEQ,…: only the partitions named, each at its seq (rounded down to a "
                 "snapshot boundary)."),
]  # fmt: skip
BeforeFailover = Annotated[
    int | None,
    typer.Option("--before-failover", metavar="N", min=1,
                 help="The state just before failover N (`upr info` numbers them), lost "
                 "writes included."),
]  # fmt: skip


def point_at(at: str, at_time: str | None = None, at_seq: str | None = None,
             before_failover: int | None = None) -> Any:  # fmt: skip
    """The one state `--at`, `--at-time`, `--at-seq` and `--before-failover` name
    (what `jobs.state.select` takes); more than one of them is a usage error, and a
    TIME or a P:SEQ list that does not parse is one now, before any work."""
    from upr_cli.repo.pitr import AtFailover, AtSeqs, parse_time

    named = (("--at", None if at == "latest" else at), ("--at-time", at_time),
             ("--at-seq", at_seq), ("--before-failover", before_failover))  # fmt: skip
    given = [name for name, v in named if v is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} each name the state to read: give one")
    if at_time is not None:
        parse_time(at_time)
        return at_time.strip()
    if at_seq is not None:
        return AtSeqs.parse(at_seq)
    if before_failover is not None:
        return AtFailover(before_failover)
    return at


Through = Annotated[
    str,
    typer.Option(
        "--through", metavar="BACKUP", help="The backup to merge through (an id, latest, oldest)."
    ),
]
NodeUri = Annotated[
    str,
    typer.Argument(metavar="URI", help="The node: upr://[user[:password]@]host[:port]/bucket."),
]
NoProgress = Annotated[bool, typer.Option("--no-progress", help="No progress bar.")]
AllRows = Annotated[
    bool, typer.Option("--all", help="List every row (by default: counts and the first few).")
]
Keys = Annotated[
    str | None, typer.Option("--keys", metavar="REGEX", help="Only keys matching this regex.")
]

SparkMaster = Annotated[
    str | None,
    typer.Option("--master", metavar="URL",
                 help="Divide the partitions among Spark tasks on this Spark master "
                 "(local[*], spark://…, yarn)."),
]  # fmt: skip
SparkTasks = Annotated[
    int,
    typer.Option("--spark-tasks", min=1, metavar="N", help="Spark tasks (partitions shares)."),
]
SparkConf = Annotated[
    list[str] | None,
    typer.Option("--conf", metavar="KEY=VALUE", help="A Spark setting (repeatable)."),
]


def wait_seconds(value: str | float) -> float:
    """`--wait`: seconds (0: no waiting) or `forever` (math.inf)."""
    if isinstance(value, int | float):  # the default, already a number
        return float(value)
    text = value.strip().lower()
    if text in ("forever", "inf", "infinity"):
        return math.inf
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < math.inf:
        raise typer.BadParameter(f"{value!r}: takes seconds (0: no waiting) or forever")
    return seconds


_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def duration_seconds(value: str | float) -> float:
    """A positive duration: `250ms`, `1s`, `30s`, `5m`, `1h`, or plain seconds."""
    if isinstance(value, int | float):  # the default, already a number
        return float(value)
    m = _DURATION.fullmatch(value.lower())
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)] if m else 0.0
    if not 0 < seconds < math.inf:
        raise typer.BadParameter(f"{value!r}: takes a duration such as 1s, 30s or 5m")
    return seconds


def size_bytes(value: str | int) -> int:
    """A positive size: 64MB, 1GiB, 65536."""
    if isinstance(value, int):
        return value
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if n < 1:
        raise typer.BadParameter(f"{value!r}: takes a size above 0, such as 64MB")
    return n


# One reconnect policy for every command that streams (docs/protocol.md §4.5).
Wait = Annotated[
    float,
    typer.Option("--wait", metavar="SECONDS", parser=wait_seconds, show_default=False,
                 help="How long a node that is down is waited for (it may restart or fail "
                 "over) before the command fails: seconds (default 120), 0 for no waiting, "
                 "or forever."),
]  # fmt: skip


def wire_compression(value: str) -> WireCompression:
    """`--wire-compression`: auto, force or off (formats/wire.md "Snappy")."""
    text = value.strip().lower()
    for mode in WIRE_COMPRESSION:
        if text == mode:
            return mode
    raise typer.BadParameter(f"{value!r}: takes auto, force or off")


# Snappy on every DCP link a command opens (formats/wire.md "Snappy").
Compression = Annotated[
    WireCompression,
    typer.Option("--wire-compression", metavar="auto|force|off", parser=wire_compression,
                 show_default=False,
                 help="Snappy on the DCP links: auto (default: negotiated, values travel "
                 "as the node stores them), force (the node compresses every value: for a "
                 "slow link) or off (never negotiated: values travel plain)."),
]  # fmt: skip


def memory_limit(value: str | int | MemoryLimit) -> MemoryLimit:
    """`--memory-limit`: a size (192MB, 1GiB, 65536), at least MIN_MEMORY_LIMIT."""
    if isinstance(value, MemoryLimit):  # the default, already parsed
        return value
    try:
        n = value if isinstance(value, int) else parse_size(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if n < MIN_MEMORY_LIMIT:
        raise typer.BadParameter(f"{value!r}: at least {MIN_MEMORY_LIMIT // MIB}MB")
    return MemoryLimit(n)


# The budget for a command's buffers (docs/design.md "Performance").
MemoryLimitOption = Annotated[
    MemoryLimit,
    typer.Option("--memory-limit", metavar="SIZE", parser=memory_limit, show_default=False,
                 help="The budget for the command's buffers (windows, queues, batches), "
                 "e.g. 512MB or 1GiB (default 192MB; MB = MiB). A document larger than "
                 "it still goes through, alone."),
]  # fmt: skip


def key_pattern(keys: str | None) -> re.Pattern[bytes] | None:
    """`--keys` compiled; a regex that does not compile is a usage error."""
    try:
        return re.compile(keys.encode()) if keys is not None else None
    except re.error as exc:
        raise UsageError(f"--keys: not a valid regex: {exc}") from None


# -- the password of a URI that names a user without one (upr_cli/net/uri.py) ----------


def _password_file(value: Path | None) -> Path | None:
    """Read `--password-file` as it is parsed, before the URIs: its password becomes
    UPR_PASSWORD for this process and the ones it starts (never in their argv)."""
    if value is not None:
        from upr_cli.net.uri import PASSWORD_ENV, read_password_file

        os.environ[PASSWORD_ENV] = read_password_file(value)
    return value


PasswordFile = Annotated[
    Path | None,
    typer.Option("--password-file", metavar="FILE", callback=_password_file,
                 expose_value=False, show_default=False,
                 help="The password of a URI that names a user without one: the file's "
                 "text, one trailing newline removed (else UPR_PASSWORD; else, on a "
                 "terminal, it is asked for)."),
]  # fmt: skip


# -- TLS for uprs:// and couchbases:// sources (docs/protocol.md §13) --------------------

CaCert = Annotated[
    Path | None,
    typer.Option("--cacert", metavar="FILE", envvar="UPR_CACERT", show_envvar=False,
                 help="PEM CA file that signs the server certificate (or set UPR_CACERT; "
                 "default: the system trust store)."),
]  # fmt: skip
NoVerify = Annotated[
    bool,
    typer.Option("--no-verify",
                 help="Do not check the server certificate (warns on every run)."),
]  # fmt: skip
ClientCert = Annotated[
    Path | None,
    typer.Option("--cert", metavar="FILE", envvar="UPR_CERT", show_envvar=False,
                 help="PEM client certificate, for nodes that ask for one (with --key)."),
]  # fmt: skip
ClientKey = Annotated[
    Path | None,
    typer.Option("--key", metavar="FILE", envvar="UPR_KEY", show_envvar=False,
                 help="PEM private key of --cert."),
]  # fmt: skip


def tls_source(
    uri: SourceUri,
    cacert: Path | None,
    no_verify: bool,
    cert: Path | None = None,
    key: Path | None = None,
) -> SourceUri:
    """`uri` with the TLS options given; --no-verify prints its warning (every run, as
    long as it is given, whatever the scheme: it is a choice worth repeating)."""
    return uri.with_tls(client_tls(cacert, no_verify, cert, key, secure=uri.secure))


def client_tls(
    cacert: Path | None,
    no_verify: bool,
    cert: Path | None = None,
    key: Path | None = None,
    *,
    secure: bool = True,
) -> ClientTls:
    """The TLS options as settings (for a command with several sources, such as diff,
    given once): --no-verify prints its warning; with `secure` (some source is uprs://
    or couchbases://) a CA or key file that cannot be used is a usage error now."""
    from upr_cli.net.tls import NO_VERIFY_WARNING, ClientTls  # not for --help (lazy CLI)

    if no_verify:
        sys.stderr.write(f"upr: warning: {NO_VERIFY_WARNING}\n")
        sys.stderr.flush()
    if (cert is None) != (key is None):
        raise UsageError("--cert and --key go together")
    tls = ClientTls(
        cafile=None if cacert is None else str(cacert),
        certfile=None if cert is None else str(cert),
        keyfile=None if key is None else str(key),
        verify=not no_verify,
    )
    if secure:
        tls.context()
    return tls


# -- deprecated spellings ---------------------------------------------------------------


def deprecated_alias(old: str, new: str, **kwargs: Any) -> Any:
    """A hidden option `old` still accepted for `new`: when given, it prints one warning
    line on stderr. Declare it next to `new` with a default of None and merge the two
    with `either`; `kwargs` (min, max, …) are `new`'s checks.

        partitions: Annotated[int | None, deprecated_alias("--partitions", "--num-partitions")]
    """

    def warn(value: object) -> object:
        if value is not None and value != []:
            from upr_cli.cli.output import warning  # follows --log-format

            warning(f"{old} is deprecated; use {new}")
        return value

    return typer.Option(old, hidden=True, callback=warn, show_default=False, **kwargs)


def either(new: T | None, old: T | None, default: T, names: tuple[str, str]) -> T:
    """The value of an option given under its new name or its deprecated alias (`names`:
    new, old); both at once is a usage error."""
    if new is not None and old is not None:
        raise UsageError(f"{names[1]} is the old spelling of {names[0]}: give one of them")
    if new is not None:
        return new
    return old if old is not None else default


#: `--spark MASTER`, the old spelling of `--master` on backup and restore
OldSparkMaster = Annotated[str | None, deprecated_alias("--spark", "--master")]


# -- a new bucket (serve, cluster init) ----------------------------------------------------

BucketName = Annotated[str, typer.Option("--bucket", metavar="NAME", help="Bucket name.")]
OldNumPartitions = Annotated[
    int | None, deprecated_alias("--partitions", "--num-partitions", min=1, max=1024)
]


def num_partitions_option(default: int | str) -> Any:
    """`--num-partitions N` (1 to 1024), naming the command's default in its help (a count,
    or words for a default that depends on something else); declare
    `OldNumPartitions` next to it and merge the two with `partition_count`."""
    help_ = f"How many partitions (vbuckets) the bucket has (default {default})."
    return typer.Option("--num-partitions", min=1, max=1024, metavar="N", help=help_)


def partition_count(new: int | None, old: int | None, default: int) -> int:
    """The partition count given as --num-partitions or the deprecated --partitions."""
    return either(new, old, default, ("--num-partitions", "--partitions"))


# -- sources and targets ------------------------------------------------------------------


def restore_target(text: str) -> tuple[Literal["node", "sqlite"], str]:
    """Parse `upr restore`'s TARGET: ("node", the URI) for upr://… or couchbase://…, or
    ("sqlite", PATH) for sqlite:PATH, whose directory must exist. Anything else is a
    UsageError naming what is wrong; a bare path gets the sqlite: form it probably meant."""
    target = parse_source(text, ("node", "sqlite"), what="TARGET")
    if target.kind == "node":
        return "node", target.uri
    path = text[len("sqlite:") :]
    check_file_path(path, f"TARGET {text}")
    return "sqlite", path


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
