"""Keep rules: which backups `upr prune` keeps (restic's `forget` policy, same meaning).

Theory of operation: a backup's time is when it committed (its manifest's `finished`),
seen in the local time zone, as restic counts periods. Each rule looks at the backups
from the newest back and keeps some:

* `last N`: the N newest;
* `within D`: every backup committed at most D before the newest one (not before now:
  a repository nobody backed up for a month still keeps its last D of backups);
* `hourly N`, `daily N`, `weekly N` (ISO weeks), `monthly N`: the newest backup of each
  of the N most recent hours (days, weeks, months) that have a backup; periods without
  a backup do not count.

A backup any rule keeps is kept, and each kept backup says which rules keep it (the plan
shows them). The rules are pure functions of the backups' times: no I/O here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from upr_cli.errors import UsageError
from upr_cli.repo import BackupId

_DURATION = re.compile(r"(?:(\d+)y)?(?:(\d+)m)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?", re.ASCII)


@dataclass(frozen=True, slots=True)
class Duration:
    """A calendar duration: years and months move the date, weeks, days and hours the
    clock (`36h`, `14d`, `1y6m`; restic's `--keep-within` form, with weeks)."""

    text: str
    years: int = 0
    months: int = 0
    days: int = 0
    hours: int = 0

    @classmethod
    def parse(cls, text: str) -> Duration:
        m = _DURATION.fullmatch(text.strip().lower()) if text else None
        if m is None or not any(m.groups()):
            raise UsageError(
                f"--keep-within: {text!r} is not a duration such as 36h, 14d, 2w, 6m or 1y6m"
            )
        y, mo, w, d, h = (int(g or 0) for g in m.groups())
        return cls(text, y, mo, 7 * w + d, h)

    def before(self, t: datetime) -> datetime:
        """`t` moved back by this duration (the day clamped to the month's last)."""
        month = t.year * 12 + (t.month - 1) - self.years * 12 - self.months
        year, mon = divmod(month, 12)
        day = t.day
        while True:
            try:
                moved = t.replace(year=year, month=mon + 1, day=day)
                break
            except ValueError:
                day -= 1
        return moved - timedelta(days=self.days, hours=self.hours)


@dataclass(frozen=True, slots=True)
class KeepRules:
    """The keep rules of one `upr prune`; a rule at 0 (or None) is not given."""

    last: int = 0
    within: Duration | None = None
    hourly: int = 0
    daily: int = 0
    weekly: int = 0
    monthly: int = 0

    def __post_init__(self) -> None:
        for name in ("last", "hourly", "daily", "weekly", "monthly"):
            if getattr(self, name) < 0:
                raise UsageError(f"--keep-{name}: give a count of 0 or more")

    @property
    def given(self) -> bool:
        """True when at least one rule can keep something."""
        return self.within is not None or any(
            (self.last, self.hourly, self.daily, self.weekly, self.monthly)
        )

    def describe(self) -> str:
        """The rules as the command line gives them (`--keep-daily 7 …`)."""
        parts = [f"--keep-{n} {v}" for n in ("last", "hourly", "daily", "weekly", "monthly")
                 if (v := getattr(self, n))]  # fmt: skip
        if self.within is not None:
            parts.append(f"--keep-within {self.within.text}")
        return " ".join(parts) or "(none)"


@dataclass(slots=True)
class Decision:
    """One backup and the rules that keep it (none: it goes)."""

    backup_id: BackupId
    time: datetime  # local, aware
    reasons: list[str] = field(default_factory=list)

    @property
    def keep(self) -> bool:
        return bool(self.reasons)


_PERIODS: tuple[tuple[str, Callable[[datetime], tuple[int, ...]]], ...] = (
    ("hourly", lambda t: (t.year, t.month, t.day, t.hour)),
    ("daily", lambda t: (t.year, t.month, t.day)),
    ("weekly", lambda t: tuple(t.isocalendar()[:2])),
    ("monthly", lambda t: (t.year, t.month)),
)


def decide(backups: Sequence[tuple[BackupId, datetime]], rules: KeepRules) -> list[Decision]:
    """The decision for each backup (id, commit time), oldest first as given; times are
    turned to local time here."""
    out = [Decision(b, t.astimezone()) for b, t in backups]
    newest_first = sorted(out, key=lambda d: (d.time, d.backup_id), reverse=True)
    for i, d in enumerate(newest_first[: rules.last]):
        d.reasons.append(f"last {i + 1}")
    if rules.within is not None and newest_first:
        since = rules.within.before(newest_first[0].time)
        for d in newest_first:
            if d.time >= since:
                d.reasons.append(f"within {rules.within.text}")
    for name, period in _PERIODS:
        count = getattr(rules, name)
        seen: tuple[int, ...] | None = None
        kept = 0
        for d in newest_first:
            if kept >= count:
                break
            p = period(d.time)
            if p != seen:
                seen = p
                kept += 1
                d.reasons.append(f"{name} {kept}")
    return out


def local_zone() -> str:
    """The local time zone, as the plan names it: `CET (UTC+01:00)`."""
    now = datetime.now().astimezone()
    off = now.strftime("%z")
    return f"{now.tzname()} (UTC{off[:3]}:{off[3:]})"
