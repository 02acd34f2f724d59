"""How this process reaches its repositories: the key and the object-store settings that
the command line and the environment gave.

Theory of operation: a command's options (`--key-file`, `--key-command`, `--s3-endpoint`,
`--transfers`, added to every command that opens a repository by `upr_cli.cli.help`)
are recorded once, at parse time, with `configure`; `Repository` reads them through
`current` when it opens a location, so no job passes keys or endpoints through its
signatures. A caller that needs other settings for one repository (the source of `upr
repo copy`, a Spark executor handed the data key) passes an `Access` explicitly, or
runs the job under it with `using` (a Spark task that calls a job which opens the
repository through `current`, as `restore_to_node` does).

The environment is read here too, in one place: `UPR_KEY_FILE` and `UPR_PASSPHRASE` for
the key (formats/repository.md §10), `AWS_ENDPOINT_URL` and the rest of the AWS
settings by the object-store client itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

__all__ = ["DEFAULT_TRANSFERS", "Access", "configure", "current", "reset", "using"]

DEFAULT_TRANSFERS = 8
"""Parallel object-store requests of one process (`--transfers`)."""


@dataclass(frozen=True, slots=True)
class Access:
    """The settings a repository is opened with. The key material never shows in a repr
    (a traceback, a log line or a Spark UI never prints it)."""

    key_file: Path | None = None
    """`--key-file` (else `UPR_KEY_FILE`): its bytes, one trailing newline removed."""
    key_command: str | None = None
    """`--key-command`: a shell command whose output is the key or passphrase."""
    s3_endpoint: str | None = None
    """`--s3-endpoint` (else `AWS_ENDPOINT_URL`, read by the client)."""
    transfers: int = DEFAULT_TRANSFERS
    """Parallel object-store requests (`--transfers`)."""
    data_keys: dict[str, bytes] = field(default_factory=dict, repr=False)
    """Unwrapped data keys by repository id: how a Spark executor opens an encrypted
    repository without the user's key (formats/repository.md §10)."""

    def passphrase(self) -> bytes | None:
        """`UPR_PASSPHRASE`, when set (as bytes; never logged)."""
        value = os.environb.get(b"UPR_PASSPHRASE")
        return value if value is not None else None

    def key_path(self) -> Path | None:
        """`--key-file`, else `UPR_KEY_FILE`."""
        if self.key_file is not None:
            return self.key_file
        env = os.environ.get("UPR_KEY_FILE")
        return Path(env) if env else None


_current = Access()


def current() -> Access:
    """The settings this process's command gave."""
    return _current


def configure(**changes: object) -> Access:
    """Record settings from the command line (fields of `Access`); returns the result."""
    global _current
    _current = replace(_current, **changes)  # type: ignore[arg-type]
    return _current


def reset() -> None:
    """Forget every setting (between commands run in one process, as tests do)."""
    global _current
    _current = Access()


@contextlib.contextmanager
def using(settings: Access) -> Iterator[Access]:
    """Run the block under `settings` (a Spark task under the access its driver shipped
    with the task, data key included); the previous settings come back after it, even
    when it raises."""
    global _current
    before, _current = _current, settings
    try:
        yield settings
    finally:
        _current = before
