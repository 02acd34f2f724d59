"""Point-in-time restore: which state of each partition a time, a seq or a failover names.

Theory of operation (docs/design.md "Point-in-time restore" is the rule in prose):

Restore points. In a continuous commit (`Manifest.continuous` set) each partition
entry lists its `points`: the snapshot ends the follower received, each with the time
it received it. An entry without points, and every entry of an ordinary backup, is one
point: (its `end_seq`, the manifest's `finished`). A partition's points are taken in
chain order, then seq. In an ordinary chain the granularity is therefore the backup.

Exact moments and coarse stretches. A continuous commit watched the stretch of time
[`continuous` (since), `finished`]: whatever happened then is among its points. An
ordinary backup is exact only at its `finished`. The restorable range runs from the
oldest restore point to the last commit's `finished`; a time of that range that lies
in no watched stretch and is no ordinary backup's `finished` is in a coarse stretch
(a, b): a restore there gives the state at a, `T - a` before T.

Resolving. `resolve_time` takes, per partition, the newest point whose time is ≤ T:
(backup J, seq s), restored as the state at J with J's own records clipped to seq ≤ s
(`chain.plan_state(at=J, clip=s)`). A partition with no point ≤ T did not exist yet
and is not restored (the resolution names it). A time outside the restorable range is
a `PitrRangeError` (a usage error, exit 2) naming the range, raised before anything is
read. `resolve_seqs` takes a seq per named partition, rounded down to the newest
snapshot boundary at or below it (restore points, whole-snapshot ends,
`chain.snapshot_boundaries`), with a notice when it rounded. `failovers` numbers the
backups that recorded rollbacks (an entry with `rollback` or `cut_back`) from 1 in
chain order, and `resolve_failover` gives the state just before event N: the state at
the backup before it, plus, for a partition whose entry in the event has cut-back
records and no `rollback` record, the event's own records up to the first cut's `to`
and that cut's records (the old branch as the run received it).

`parse_time` is the one parser of a TIME argument for every command: RFC 3339 (`Z` or
an offset), a local time without offset (`2026-12-06 14:37`, `2026-12-06T14:37:00`),
or relative to now (`-15m`, `-2h`, `-30s`, `-1d`, `-1h30m`).

Everything but `parse_time`'s reading of the clock is pure: functions of manifests.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from upr_cli.errors import UsageError
from upr_cli.position import StreamPosition
from upr_cli.repo.chain import (
    NO_CUT,
    PlanStep,
    ResumePoint,
    SeqRange,
    _cuts,
    _holding,
    lost_ranges,
    ordered,
    plan_state,
    resume_point,
    snapshot_boundaries,
)
from upr_cli.repo.manifest import Manifest, Points, SegmentEntry
from upr_cli.repo.names import BackupId, format_cut_path, format_time


class PitrRangeError(UsageError):
    """A time, seq or failover outside what the chain can restore (exit 2)."""


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_RELATIVE = re.compile(r"-((?:\d+[smhd])+)")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")

TIME_FORMS = "RFC 3339 (2026-12-06T14:37:00Z), a local time (2026-12-06 14:37) or -15m, -2h, -1d"


def looks_like_time(text: str) -> bool:
    """True when `text` is written as a time (a date first, or a relative `-15m`), not
    as a backup id (`20261206T…`, latest, oldest)."""
    return bool(_DATE.match(text) or _RELATIVE.fullmatch(text))


def parse_time(text: str, *, now: datetime | None = None, option: str = "--at-time") -> datetime:
    """A TIME argument as an aware UTC datetime (the module's doc lists the forms); a
    local time without offset is in this machine's time zone. Anything else is a
    UsageError naming the forms."""
    t = text.strip()
    m = _RELATIVE.fullmatch(t)
    if m is not None:
        seconds = sum(int(n) * _UNITS[u] for n, u in re.findall(r"(\d+)([smhd])", m.group(1)))
        return (now or datetime.now(UTC)).astimezone(UTC) - timedelta(seconds=seconds)
    if _DATE.match(t):
        with contextlib.suppress(ValueError):  # not a date after all: the error below
            return datetime.fromisoformat(t).astimezone(UTC)  # naive: local time
    raise UsageError(f"{option} {text!r} is not a time: give {TIME_FORMS}")


def show_time(t: datetime) -> str:
    """A time as output shows it: RFC 3339 UTC, to the microsecond."""
    return format_time(t.astimezone(UTC))


def show_span(seconds: float) -> str:
    """A duration in words: `37 s`, `12 min 5 s`, `3 h 2 min`, `2 d 4 h`."""
    s = round(seconds)
    if s < 60:
        return f"{seconds:.3g} s" if seconds < 10 else f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


@dataclass(frozen=True, slots=True, order=True)
class Point:
    """A restore point of a partition: backup J's records up to `seq` (received at `time`)."""

    backup_id: BackupId
    seq: int
    time: datetime


def restore_points(manifests: Sequence[Manifest], partition: int) -> list[Point]:
    """The partition's restore points in chain order, then seq (the module's doc)."""
    out = []
    for m in ordered(manifests):
        e = m.partition(partition)
        if e is None:
            continue
        if m.continuous is not None and e.points:
            out += [Point(m.backup_id, s, t) for s, t in e.points]
        else:
            out.append(Point(m.backup_id, e.end_seq, m.finished))
    return out


@dataclass(frozen=True, slots=True)
class Stretch:
    """A coarse stretch (`start`, `end`): no snapshot end was watched in between."""

    start: datetime
    end: datetime

    @property
    def seconds(self) -> float:
        """Its length."""
        return (self.end - self.start).total_seconds()

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md: times RFC 3339, durations in seconds)."""
        return {"start_time": show_time(self.start), "end_time": show_time(self.end),
                "seconds": round(self.seconds, 6)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Timeline:
    """A chain's restorable range and its coarse stretches."""

    oldest: datetime
    last: datetime
    coarse: tuple[Stretch, ...]

    def stretch_of(self, t: datetime) -> Stretch | None:
        """The coarse stretch holding `t` (strictly inside it), or None (watched)."""
        return next((s for s in self.coarse if s.start < t < s.end), None)

    def to_json(self) -> dict[str, Any]:
        """JSON form: `oldest`, `last`, `coarse` (each start_time, end_time, seconds)."""
        return {"oldest": show_time(self.oldest), "last": show_time(self.last),
                "coarse": [s.to_json() for s in self.coarse]}  # fmt: skip

    def describe(self) -> str:
        """`2026-… to 2026-…` (the range in one phrase)."""
        return f"{show_time(self.oldest)} to {show_time(self.last)}"


def _first_time(points: Sequence[tuple[int, datetime]]) -> datetime | None:
    """The oldest of a partition entry's points (times ascend), decoding only it."""
    if isinstance(points, Points):
        return points.first_time()
    return points[0][1] if points else None


def timeline(manifests: Sequence[Manifest]) -> Timeline | None:
    """The restorable range and coarse stretches of a chain; None when it holds no point."""
    chain = ordered(manifests)
    points = [m.finished for m in chain if m.partitions and m.continuous is None]
    points += [t for m in chain if m.continuous is not None for e in m.partitions
               if (t := _first_time(e.points)) is not None]  # fmt: skip
    points += [m.finished for m in chain if m.continuous is not None
               for e in m.partitions if not e.points]  # fmt: skip
    if not points or not chain:
        return None
    oldest, last = min(points), max(m.finished for m in chain)
    exact = sorted((m.continuous, m.finished) if m.continuous is not None
                   else (m.finished, m.finished) for m in chain)  # fmt: skip
    coarse = []
    reached = oldest
    for start, end in exact:
        if end < oldest:
            continue
        if start > reached:
            coarse.append(Stretch(reached, min(start, last)))
        reached = max(reached, end)
    return Timeline(oldest, max(last, oldest), tuple(s for s in coarse if s.end > s.start))


@dataclass(frozen=True, slots=True)
class Pick:
    """Where one partition is restored to: the state at `backup_id`, its own records up
    to `clip` (None: all), then `extra` steps (cut-back records, `resolve_failover`)."""

    backup_id: BackupId
    clip: int | None = None
    extra: tuple[PlanStep, ...] = ()

    def steps(self, manifests: Sequence[Manifest], partition: int) -> list[PlanStep]:
        """The plan of this partition's state (`chain.plan_state`, clipped, and extra)."""
        base = plan_state(manifests, at=self.backup_id, partition=partition, clip=self.clip)
        return base + list(self.extra)


def resume_at(manifests: Sequence[Manifest], partition: int, pick: Pick) -> ResumePoint | None:
    """The stream position of a partition restored to `pick` (what a replay records):
    the resume point at its backup, moved down to its clip (a snapshot boundary) on
    the branch the failover log says held that seq, the log pruned above it."""
    rp = resume_point([m for m in manifests if m.backup_id <= pick.backup_id], partition)
    if rp is None or pick.clip is None or pick.clip >= rp.position.seq:
        return rp
    log = rp.failover_log.prune_above(pick.clip)
    branch = log.entry_at(pick.clip)
    uuid = rp.position.uuid if branch is None else branch.uuid
    s = pick.clip
    kept = log if len(log) else rp.failover_log
    return ResumePoint(StreamPosition(partition, uuid, s, s, s), kept)


@dataclass
class Resolution:
    """What a time, seqs or a failover resolved to, per partition, and what to say."""

    how: str  # "time", "seq" or "failover"
    asked: str  # the argument as resolved (a time in UTC, the seqs, the failover)
    picks: dict[int, Pick] = field(default_factory=dict)
    not_restored: list[int] = field(default_factory=list)  # no point at or before T yet
    lag: dict[int, float] = field(default_factory=dict)  # seconds before T, per partition
    notices: list[str] = field(default_factory=list)
    stretch: Stretch | None = None  # the coarse stretch T is in

    @property
    def newest(self) -> BackupId:
        """The newest backup any partition reads (the chain's end for collections)."""
        return max(p.backup_id for p in self.picks.values())

    @property
    def max_lag(self) -> float:
        """The most any partition's state is before T."""
        return max(self.lag.values(), default=0.0)

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md): per partition its backup and seq, and the lags."""
        return {
            "by": self.how,
            "asked": self.asked,
            "partitions": [  # one object a partition, with its `partition`
                {
                    "partition": p,
                    "backup_id": str(k.backup_id),
                    "seq": None if k.clip is None else str(k.clip),
                }
                for p, k in sorted(self.picks.items())
            ],
            "not_restored": self.not_restored,
            "lag_seconds": {str(p): round(s, 6) for p, s in sorted(self.lag.items())},
            "max_lag_seconds": round(self.max_lag, 6),
            "coarse": None if self.stretch is None else self.stretch.to_json(),
            "notices": self.notices,
        }

    def describe(self) -> list[str]:
        """Lines of text: what was asked, the lag in a coarse stretch, what is left out."""
        lines = [
            {
                "time": f"the state at {self.asked}",
                "seq": f"the state at seqs {self.asked}",
                "failover": f"the state before failover {self.asked}",
            }[self.how]
        ]
        if self.stretch is not None:
            lines.append(f"  coarse stretch {show_time(self.stretch.start)} to "
                         f"{show_time(self.stretch.end)}:")  # fmt: skip
            lines.append(f"  the state given is {show_span(self.max_lag)} before it (at most: "
                         "--json has each partition's)")  # fmt: skip
        if self.not_restored:
            lines.append("  not restored (no restore point by then: they did not exist "
                         f"yet): {_runs(self.not_restored)}")  # fmt: skip
        lines += [f"  {n}" for n in self.notices]
        return lines


def _runs(parts: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for p in sorted(parts):
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _partitions(manifests: Sequence[Manifest], wanted: Sequence[int] | None) -> list[int]:
    held = sorted({e.partition for m in manifests for e in m.partitions})
    return held if wanted is None else [p for p in held if p in set(wanted)]


def resolve_time(
    manifests: Sequence[Manifest], when: datetime, partitions: Sequence[int] | None = None,
    *, bucket: str = "", option: str = "--at-time",
) -> Resolution:  # fmt: skip
    """Per partition, the newest restore point at or before `when` (the module's doc)."""
    tl = timeline(manifests)
    name = f"bucket {bucket}" if bucket else "the bucket"
    if tl is None:
        raise PitrRangeError(f"{option}: {name} has no restore point")
    if not tl.oldest <= when <= tl.last:
        raise PitrRangeError(f"{option} {show_time(when)} is outside the restorable range of "
                             f"{name}: {tl.describe()}")  # fmt: skip
    out = Resolution("time", show_time(when))
    out.stretch = tl.stretch_of(when)
    lag = 0.0 if out.stretch is None else (when - out.stretch.start).total_seconds()
    # one pass over the chain: a later backup's point, or a later point, replaces the
    # one found before (chain order, then seq), so this is `restore_points` per partition
    # without walking the chain once per partition
    wanted = None if partitions is None else set(partitions)
    best: dict[int, tuple[BackupId, int]] = {}
    for m in ordered(manifests):
        for e in m.partitions:
            if wanted is not None and e.partition not in wanted:
                continue
            if m.continuous is not None and e.points:
                seqs = [q for q, t in e.points if t <= when]
                if seqs:
                    best[e.partition] = (m.backup_id, seqs[-1])
            elif m.finished <= when:
                best[e.partition] = (m.backup_id, e.end_seq)
    for p in _partitions(manifests, partitions):
        if p not in best:
            out.not_restored.append(p)
            continue
        out.picks[p] = Pick(*best[p])
        out.lag[p] = lag
    return out


@dataclass(frozen=True, slots=True)
class AtSeqs:
    """`--at-seq P:SEQ,…`: a seq per partition (`parse_seqs`)."""

    seqs: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, text: str) -> AtSeqs:
        """From the option's text; a UsageError when it is not P:SEQ,…"""
        return cls(tuple(sorted(parse_seqs(text).items())))


@dataclass(frozen=True, slots=True)
class AtFailover:
    """`--before-failover N`: the state just before failover N (numbered from 1)."""

    number: int


def parse_seqs(text: str, option: str = "--at-seq") -> dict[int, int]:
    """`P:SEQ,…` → {partition: seq}; anything else is a UsageError."""
    out: dict[int, int] = {}
    for part in (t.strip() for t in text.split(",")):
        m = re.fullmatch(r"(\d+):(\d+)", part)
        if m is None:
            raise UsageError(f"{option}: {part!r} is not PARTITION:SEQ (e.g. 0:1500,3:20)")
        p, s = int(m.group(1)), int(m.group(2))
        if p in out and out[p] != s:
            raise UsageError(f"{option}: partition {p} is given twice")
        out[p] = s
    return out


Snapshots = Callable[[BackupId, SegmentEntry], Sequence[tuple[int, int]]]


def boundaries(
    manifests: Sequence[Manifest], partition: int, snapshots_of: Snapshots | None = None
) -> list[int]:
    """The snapshot boundaries of p's state at the newest backup, ascending: restore
    points and whole-snapshot ends within each backup's kept range, and
    `chain.snapshot_boundaries` (with `snapshots_of`, the newest backup's markers)."""
    held = _holding(manifests, partition, None)
    out = set(snapshot_boundaries(manifests, partition, snapshots_of))
    for (_bid, e), c in zip(held, _cuts(held), strict=True):
        out.update(s for s, _t in e.points if s <= c)
    return sorted(out)


def resolve_seqs(
    manifests: Sequence[Manifest], seqs: Mapping[int, int],
    snapshots_of: Snapshots | None = None, *, option: str = "--at-seq",
) -> Resolution:  # fmt: skip
    """Each named partition at its seq, rounded down to a snapshot boundary (with a
    notice); only the named partitions are restored."""
    out = Resolution("seq", ",".join(f"{p}:{s}" for p, s in sorted(seqs.items())))
    for p, seq in sorted(seqs.items()):
        held = _holding(manifests, p, None)
        if not held:
            raise PitrRangeError(f"{option}: no backup holds partition {p}")
        cuts = _cuts(held)
        end = min(held[-1].entry.end_seq, cuts[-1])
        if seq > end:
            raise PitrRangeError(f"{option}: partition {p} ends at seq {end} in the newest "
                                 f"backup; {seq} is beyond it")  # fmt: skip
        b = max(x for x in boundaries(manifests, p, snapshots_of) if x <= seq)
        if b < seq:
            out.notices.append(f"partition {p}: seq {seq} is inside a snapshot: restored to "
                               f"the snapshot boundary below it, {b}")  # fmt: skip
        # the backup whose kept records (start, min(end, cut)] hold b (the first, for 0)
        where = next(
            (h.backup_id for h, c in zip(held, cuts, strict=True)
             if h.entry.start_seq < b <= min(h.entry.end_seq, c)), held[0].backup_id)  # fmt: skip
        out.picks[p] = Pick(where, b)
    return out


@dataclass(frozen=True, slots=True)
class Failover:
    """A backup that recorded rollbacks: its number (from 1), time, partitions and the
    lost writes the rollbacks made (seq ranges per backup)."""

    number: int
    backup_id: BackupId
    time: datetime
    partitions: tuple[int, ...]
    lost: tuple[tuple[int, SeqRange], ...]  # (partition, range)

    @property
    def lost_seqs(self) -> int:
        """How many seqs the lost ranges span (at most that many lost writes)."""
        return sum(r.to_seq - r.from_seq for _p, r in self.lost)

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md: seqs as decimal strings)."""
        return {
            "number": self.number,
            "backup_id": str(self.backup_id),
            "time": show_time(self.time),
            "partitions": list(self.partitions),
            "lost_seq_count": self.lost_seqs,  # diff's `lost_seqs` is a list
            "lost_ranges": [  # `lost` is a version's flag (examine)
                {
                    "partition": p,
                    "backup_id": str(r.backup_id),
                    "from_seq": str(r.from_seq),
                    "to_seq": str(r.to_seq),
                }
                for p, r in self.lost
            ],
        }


def failovers(manifests: Sequence[Manifest]) -> list[Failover]:
    """The chain's failover events, numbered from 1 in chain order (the module's doc).

    An event's lost writes are, per partition it names, the ranges that became lost at
    it (`chain.lost_ranges` at the event minus at the backup before it) and its own
    cut-back records."""
    chain = ordered(manifests)
    out: list[Failover] = []
    for i, m in enumerate(chain):
        parts = tuple(e.partition for e in m.partitions if e.rollback is not None or e.cut_backs)
        if not parts:
            continue
        lost: list[tuple[int, SeqRange]] = []
        before = chain[i - 1].backup_id if i else None
        for p in parts:
            prior = {} if before is None else _by_backup(lost_ranges(chain, p, at=before))
            if any(h.backup_id <= m.backup_id for h in _holding(chain[:i], p, None)):
                for r in lost_ranges(chain[: i + 1], p, at=m.backup_id):
                    if r.backup_id == m.backup_id:
                        continue
                    was = prior.get(r.backup_id)
                    top = r.to_seq if was is None else was.from_seq
                    if top > r.from_seq:
                        lost.append((p, SeqRange(r.backup_id, r.from_seq, top)))
            e = m.partition(p)
            assert e is not None
            lost += [(p, SeqRange(m.backup_id, c.to_seq, c.from_seq)) for c in e.cut_backs]
        out.append(Failover(len(out) + 1, m.backup_id, m.finished, parts, tuple(lost)))
    return out


def _by_backup(ranges: Sequence[SeqRange]) -> dict[BackupId, SeqRange]:
    return {r.backup_id: r for r in ranges}


def resolve_failover(
    manifests: Sequence[Manifest], number: int, partitions: Sequence[int] | None = None,
    *, option: str = "--before-failover",
) -> Resolution:  # fmt: skip
    """Each partition as it was on its old branch just before failover `number`."""
    chain = ordered(manifests)
    events = failovers(chain)
    if not events:
        raise PitrRangeError(f"{option}: the chain recorded no failover (no rollback)")
    if not 1 <= number <= len(events):
        raise PitrRangeError(f"{option} {number}: the chain recorded failovers 1 to "
                             f"{len(events)} (`upr info` lists them)")  # fmt: skip
    ev = events[number - 1]
    i = next(i for i, m in enumerate(chain) if m.backup_id == ev.backup_id)
    if i == 0:
        raise PitrRangeError(f"{option} {number}: failover {number} is in the chain's first "
                             "backup: no state before it")  # fmt: skip
    before = chain[i - 1].backup_id
    out = Resolution("failover", f"{number} ({show_time(ev.time)})")
    event = chain[i]
    # a partition the event cut back, with no `rollback` record: the run went on from
    # where the chain stood (start = the previous end), so its old branch is the event's
    # records up to the first cut, then what that cut took back
    clean = {e.partition: e.cut_backs[0] for e in event.partitions
             if e.cut_backs and e.rollback is None}  # fmt: skip
    if partitions is not None:
        clean = {p: c for p, c in clean.items() if p in set(partitions)}
    for p in sorted(set(_partitions(chain[:i], partitions)) | set(clean)):
        cb = clean.get(p)
        if cb is None:
            out.picks[p] = Pick(before)
            continue
        extra = tuple(PlanStep(event.backup_id, s, NO_CUT, format_cut_path(1, s.file))
                      for s in cb.segments)  # fmt: skip
        out.picks[p] = Pick(event.backup_id, cb.to_seq, extra)
        out.notices.append(f"partition {p}: with the records the run received before its "
                           f"rollback to seq {cb.to_seq} (lost writes)")  # fmt: skip
    return out
