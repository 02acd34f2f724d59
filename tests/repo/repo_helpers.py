"""What the repository tests share: one bucket, one clock and one failover log."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from upr_cli.failover import FailoverLog
from upr_cli.repo import BackupId

BUCKET = "default"
T0 = datetime(2026, 11, 21, 6, 15, tzinfo=UTC)
LOG = FailoverLog.of([(0xBEEF, 0)])


def bid(hours: float) -> BackupId:
    """The backup id `hours` after T0."""
    return BackupId(T0 + timedelta(hours=hours))
