"""Every name the repository puts on disk, as tested format/parse pairs.

Theory of operation: a path in the repository is never assembled by hand. Each kind of
name has one `format` and one strict `parse`, and `parse(format(x)) == x` is a property
test. Names are fixed-width, so a plain directory listing is already in order:

* backup ids are UTC timestamps `YYYYMMDDTHHMMSS.ffffffZ`: name order = time order;
* segment files are `pPPPP-sFFFFFFFFFFFFFFFF-eLLLLLLLLLLLLLLLL.seg` in lowercase hex:
  name order = (partition, seq) order;
* temp files are `.NAME.tmp-RRRRRRRR[-SUFFIX]` (`upr_cli.fsio`, which the segment
  writer also uses: formats/segment.md "Writing"), so one sweep removes every leftover.

formats/repository.md "Names" is the normative grammar.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from upr_cli import fsio
from upr_cli.fsio import parse_temp_name as parse_temp_name
from upr_cli.repo.errors import RepositoryError

U64_MAX = (1 << 64) - 1
PARTITION_MAX = 0xFFFF

_BACKUP_ID = re.compile(r"(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})(\d{2})\.(\d{6})Z", re.ASCII)
_REVISION = re.compile(r"-r([0-9]{8})")
REVISION_MAX = 99_999_999
"""The highest revision of a backup (formats/repository.md §2.2)."""
_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})\.(\d{6})Z", re.ASCII)
_SEGMENT = re.compile(r"p([0-9a-f]{4})-s([0-9a-f]{16})-e([0-9a-f]{16})\.seg")
_CUT = re.compile(r"cut-([1-9][0-9]{0,3})/([^/]+)")
CUT_MAX = 9999
# Couchbase bucket names: letters, digits, "_", "-", ".", "%"; at most 100; no leading ".".
_BUCKET = re.compile(r"[A-Za-z0-9_%-][A-Za-z0-9_.%-]{0,99}")
RESERVED_BUCKET_NAMES = frozenset({"repo.json"})
"""Valid Couchbase bucket names that would collide with a repository-level file."""


def _utc(fields: tuple[str, ...], text: str, what: str) -> datetime:
    y, mo, d, h, mi, s, us = (int(f) for f in fields)
    try:
        return datetime(y, mo, d, h, mi, s, us, tzinfo=UTC)
    except ValueError:
        raise RepositoryError(f"{what} {text!r} is not a valid date and time") from None


def _check_utc(t: datetime, what: str) -> None:
    if not isinstance(t, datetime) or t.tzinfo is None or t.utcoffset() != timedelta(0):
        raise RepositoryError(f"{what} must be an aware UTC datetime, got {t!r}")


def format_time(t: datetime) -> str:
    """RFC 3339 UTC with microseconds: `2026-11-21T06:15:00.123456Z` (fixed width)."""
    _check_utc(t, "time")
    return (
        f"{t.year:04d}-{t.month:02d}-{t.day:02d}T{t.hour:02d}:{t.minute:02d}:{t.second:02d}"
        f".{t.microsecond:06d}Z"
    )


def parse_time(text: str) -> datetime:
    """Inverse of `format_time`; anything else raises RepositoryError."""
    m = _TIME.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise RepositoryError(f"time {text!r} is not YYYY-MM-DDTHH:MM:SS.ffffffZ")
    return _utc(m.groups(), text, "time")


@dataclass(frozen=True, slots=True, order=True)
class BackupId:
    """A backup's id: the UTC time its directory was created, to the microsecond."""

    time: datetime

    def __post_init__(self) -> None:
        _check_utc(self.time, "a backup id")

    @classmethod
    def parse(cls, text: str) -> BackupId:
        """Parse `YYYYMMDDTHHMMSS.ffffffZ`; anything else raises RepositoryError."""
        m = _BACKUP_ID.fullmatch(text) if isinstance(text, str) else None
        if m is None:
            raise RepositoryError(f"backup id {text!r} is not YYYYMMDDTHHMMSS.ffffffZ")
        return cls(_utc(m.groups(), text, "backup id"))

    @classmethod
    def is_valid(cls, text: str) -> bool:
        """True when `text` parses as a backup id."""
        try:
            cls.parse(text)
        except RepositoryError:
            return False
        return True

    @classmethod
    def now(cls, after: BackupId | None = None) -> BackupId:
        """The current time, or one microsecond after `after` if the clock is not past it."""
        t = datetime.now(UTC)
        if after is not None and t <= after.time:
            return after.next()
        return cls(t)

    def next(self) -> BackupId:
        """The smallest id after this one."""
        return BackupId(self.time + timedelta(microseconds=1))

    def format(self) -> str:
        """The fixed-width text form (23 characters)."""
        t = self.time
        return (
            f"{t.year:04d}{t.month:02d}{t.day:02d}T{t.hour:02d}{t.minute:02d}{t.second:02d}"
            f".{t.microsecond:06d}Z"
        )

    def __str__(self) -> str:
        return self.format()


def format_backup_dir(backup_id: BackupId, revision: int = 1) -> str:
    """A backup directory's name: the id, then `-rNNNNNNNN` from revision 2 on (a
    replacement written by `upr prune`, formats/repository.md §2.2)."""
    if not 1 <= revision <= REVISION_MAX:
        raise RepositoryError(f"revision {revision} is not in 1..{REVISION_MAX}")
    return backup_id.format() + ("" if revision == 1 else f"-r{revision:08d}")


def parse_backup_dir(text: str) -> tuple[BackupId, int]:
    """Inverse of `format_backup_dir`; anything else raises RepositoryError."""
    if not isinstance(text, str):
        raise RepositoryError(f"backup directory name {text!r} is not a string")
    head, tail = text[:23], text[23:]
    backup_id = BackupId.parse(head)
    if not tail:
        return backup_id, 1
    m = _REVISION.fullmatch(tail)
    if m is None or int(m.group(1)) < 2:
        raise RepositoryError(
            f"backup directory name {text!r} is not BACKUP-ID or BACKUP-ID-rNNNNNNNN (N ≥ 2)"
        )
    return backup_id, int(m.group(1))


@dataclass(frozen=True, slots=True, order=True)
class SegmentName:
    """A segment file's name: partition and the seqs of its first and last record."""

    partition: int
    first_seq: int
    last_seq: int

    def __post_init__(self) -> None:
        if not 0 <= self.partition <= PARTITION_MAX:
            raise RepositoryError(f"partition {self.partition} is outside 0..{PARTITION_MAX}")
        if not 0 <= self.first_seq <= self.last_seq <= U64_MAX:
            raise RepositoryError(
                f"segment seqs must satisfy 0 ≤ first ≤ last < 2^64, got "
                f"{self.first_seq}..{self.last_seq}"
            )

    @classmethod
    def parse(cls, text: str) -> SegmentName:
        """Parse `pPPPP-sFFFFFFFFFFFFFFFF-eLLLLLLLLLLLLLLLL.seg` (lowercase hex)."""
        m = _SEGMENT.fullmatch(text) if isinstance(text, str) else None
        if m is None:
            raise RepositoryError(
                f"segment file name {text!r} is not pPPPP-s<16 hex>-e<16 hex>.seg (lowercase hex)"
            )
        p, first, last = (int(g, 16) for g in m.groups())
        return cls(p, first, last)

    def format(self) -> str:
        """The fixed-width file name (45 characters)."""
        return f"p{self.partition:04x}-s{self.first_seq:016x}-e{self.last_seq:016x}.seg"

    def __str__(self) -> str:
        return self.format()


def format_segment_name(partition: int, first_seq: int, last_seq: int) -> str:
    """The file name of a segment (see `SegmentName`)."""
    return SegmentName(partition, first_seq, last_seq).format()


def parse_segment_name(text: str) -> SegmentName:
    """Inverse of `format_segment_name`."""
    return SegmentName.parse(text)


def format_cut_path(k: int, segment: str) -> str:
    """Where the K-th cut-back of a partition keeps a segment, relative to the backup
    directory: `cut-K/NAME` (formats/repository.md §2.3)."""
    if not 1 <= k <= CUT_MAX:
        raise RepositoryError(f"cut-back number {k} is outside 1..{CUT_MAX}")
    return f"cut-{k}/{SegmentName.parse(segment).format()}"


def parse_cut_path(text: str) -> tuple[int, SegmentName]:
    """Inverse of `format_cut_path`."""
    m = _CUT.fullmatch(text) if isinstance(text, str) else None
    if m is None or not 1 <= int(m[1]) <= CUT_MAX:
        raise RepositoryError(f"{text!r} is not cut-K/<segment file name> (K in 1..{CUT_MAX})")
    return int(m[1]), SegmentName.parse(m[2])


def temp_name(final: str, token: str | None = None) -> str:
    """`fsio.temp_name`, its errors as RepositoryError (the repository names everything)."""
    try:
        return fsio.temp_name(final, token)
    except ValueError as exc:
        raise RepositoryError(str(exc)) from None


def is_temp_name(name: str) -> bool:
    """True for a temp file's name (ours or the segment writer's `-body` variant)."""
    return parse_temp_name(name) is not None


def check_bucket(name: str) -> str:
    """`name` if it is a valid Couchbase bucket name usable as a directory, else an error."""
    if not isinstance(name, str) or not _BUCKET.fullmatch(name):
        raise RepositoryError(
            f"bucket name {name!r} is invalid: letters, digits, '_', '-', '.', '%' "
            "(at most 100, no leading '.')"
        )
    if name in RESERVED_BUCKET_NAMES:
        raise RepositoryError(f"bucket name {name!r} is reserved by the repository layout")
    return name
