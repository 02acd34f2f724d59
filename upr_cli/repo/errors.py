"""Errors of the backup repository (formats/repository.md).

Every message is one line that names the file or directory at fault, so the CLI can print
it as it is.
"""

from __future__ import annotations

from upr_cli.errors import UprError


class RepositoryError(UprError):
    """The repository, a manifest or a lock is missing, malformed or inconsistent."""


class RepositoryLocked(RepositoryError):
    """Another live process holds the bucket's repository lock."""

    def __init__(self, message: str, *, pid: int | None, hostname: str | None) -> None:
        super().__init__(message)
        self.pid = pid
        self.hostname = hostname


class BrokenChain(RepositoryError):
    """The chain a reader or a backup needs cannot be read whole: a backup's manifest is
    damaged, a parent backup is gone, or seqs of a partition are in no backup
    (formats/repository.md §8.8). The message names the missing piece."""
