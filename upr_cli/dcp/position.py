"""Stream positions, re-exported: they live in `upr_cli.position`, below every layer that
resumes a stream (the consumer here, the repository, the store)."""

from upr_cli.position import StreamPosition, boundary_at

__all__ = ["StreamPosition", "boundary_at"]
