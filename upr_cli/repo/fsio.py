"""Atomic publication, re-exported for older imports: the one implementation is
`upr_cli.fsio`."""

from upr_cli.fsio import FileOps, atomic_write

__all__ = ["FileOps", "atomic_write"]
