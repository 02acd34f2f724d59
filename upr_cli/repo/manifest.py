"""Backup manifests: what one committed backup holds (formats/repository.md "manifest.json").

Theory of operation: a manifest is the commit point of a backup (docs/design.md
"Reliability"). It lists, per partition, where the backup's stream began and ended, on
which branch (uuid and failover log), the last snapshot (the resume point of the next
backup, docs/protocol.md §4.4), any rollback the source forced, and the segment files
that hold the records. The dataclasses validate themselves, so an inconsistent manifest
cannot be built, written or read: every check of formats/repository.md is in
`__post_init__` or in `from_json`, and each failure is a `RepositoryError` with a
one-line message naming the field. 64-bit values travel as decimal strings
(docs/design.md "Conventions"). `dumps` adds a BLAKE2b-128 checksum of the canonical
JSON, which `loads` verifies, so a bit flip that still parses as JSON is caught
(pg_verifybackup's embedded manifest checksum).

Collections (version 2): a manifest also records the source's collections manifest at
the backup's start, the manifest changes (DCP system events) its streams met, which
collections a filtered backup left out, and the records per collection id. Version 1
manifests (written before collections) read as backups of the default collection only.
`chain_manifest` gives the collections as they stand at the end of a chain, and
`collection_history` every collection id a chain ever saw, with its name and whether it
was dropped.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, overload

from upr_cli.collections import (
    CollectionsError,
    CollectionsManifest,
    ManifestChange,
    Path,
    apply_change,
)
from upr_cli.errors import UprError
from upr_cli.failover import FailoverLog, InvalidFailoverLog
from upr_cli.repo.errors import RepositoryError
from upr_cli.repo.names import (
    PARTITION_MAX,
    REVISION_MAX,
    U64_MAX,
    BackupId,
    SegmentName,
    check_bucket,
    format_cut_path,
    format_time,
    parse_time,
)

MANIFEST_FORMAT = "upr-backup-manifest"
"""The `format` value of every manifest."""
MANIFEST_VERSION = 2
"""The manifest version this code writes; it reads every version of `MANIFEST_VERSIONS`."""
MANIFEST_VERSIONS = (1, 2, 3, 4)
"""1: before collections (every record in the default collection); 2: collections;
3: a revision written by `upr prune` (`revision`, `absorbed`), formats/repository.md §5.10;
4: a commit of `upr backup --follow` (`continuous`, `points`, packed segments),
formats/repository.md §5.11. A manifest is written in the lowest version that describes
it: 3 only for a revision, 4 only for a continuous commit (or a revision of one)."""
REVISION_VERSION = 3
"""The manifest version of a revision (`revision` > 1 or `absorbed` not empty)."""
CONTINUOUS_VERSION = 4
"""The manifest version of a continuous commit (`continuous` set); it has every version 3
key as well."""
CHANGE_KINDS = ("collection-created", "collection-dropped", "scope-created", "scope-dropped")
MAX_MANIFEST_BYTES = 64 << 20
"""Readers refuse larger manifests instead of allocating for them."""

_DEC = re.compile(r"0|[1-9][0-9]*")
_HEX128 = re.compile(r"[0-9a-f]{32}")
_USERINFO = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)@")


def _fail(msg: str) -> RepositoryError:
    return RepositoryError(msg)


def checksum_hex(data: bytes) -> str:
    """BLAKE2b-128 of `data`, lowercase hex: the checksum used throughout the repository."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _u64(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64_MAX:
        raise _fail(f"{what} {value!r} is not an integer in 0..2^64-1")


@dataclass(frozen=True, slots=True)
class SegmentEntry:
    """One segment file of a partition: its name, record range, counts and checksum."""

    file: str
    first_seq: int
    last_seq: int
    records: int
    bytes: int
    checksum: str

    def __post_init__(self) -> None:
        for name in ("first_seq", "last_seq", "records", "bytes"):
            _u64(getattr(self, name), f"segment {self.file!r}: {name}")
        if not 1 <= self.first_seq <= self.last_seq:
            raise _fail(
                f"segment {self.file!r}: first_seq {self.first_seq} and last_seq "
                f"{self.last_seq} must satisfy 1 ≤ first ≤ last"
            )
        if not 1 <= self.records <= self.last_seq - self.first_seq + 1:
            raise _fail(
                f"segment {self.file!r}: {self.records} records cannot have seqs "
                f"{self.first_seq}..{self.last_seq} (a listed segment holds at least one record)"
            )
        if self.bytes < 1:
            raise _fail(f"segment {self.file!r}: size 0 is not a segment file")
        if not isinstance(self.checksum, str) or not _HEX128.fullmatch(self.checksum):
            raise _fail(
                f"segment {self.file!r}: checksum {self.checksum!r} is not 32 lowercase hex "
                "digits (BLAKE2b-128)"
            )
        parsed = SegmentName.parse(self.file)
        if (parsed.first_seq, parsed.last_seq) != (self.first_seq, self.last_seq):
            raise _fail(
                f"segment {self.file!r}: its name does not match first_seq {self.first_seq} "
                f"and last_seq {self.last_seq}"
            )

    @property
    def partition(self) -> int:
        """The partition named in the file name."""
        return SegmentName.parse(self.file).partition

    def to_json(self) -> dict[str, Any]:
        """JSON object with 64-bit values as decimal strings."""
        return {
            "file": self.file,
            "first_seq": str(self.first_seq),
            "last_seq": str(self.last_seq),
            "records": str(self.records),
            "bytes": str(self.bytes),
            "checksum": self.checksum,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "segment") -> SegmentEntry:
        """Parse `to_json` output; anything else raises RepositoryError."""
        o = _Obj(data, where, ("file", "first_seq", "last_seq", "records", "bytes", "checksum"))
        return cls(
            o.string("file"),
            o.u64("first_seq"),
            o.u64("last_seq"),
            o.u64("records"),
            o.u64("bytes"),
            o.string("checksum"),
        )


@dataclass(frozen=True, slots=True)
class RollbackRecord:
    """A rollback the source forced: asked to start at `from_seq`, started at `to_seq`."""

    from_seq: int
    to_seq: int
    seed_rule_seq: int | None
    producer_seq: int

    def __post_init__(self) -> None:
        _u64(self.from_seq, "rollback from")
        _u64(self.to_seq, "rollback to")
        _u64(self.producer_seq, "rollback producer_seq")
        if self.seed_rule_seq is not None:
            _u64(self.seed_rule_seq, "rollback seed_rule_seq")
        if self.to_seq > self.from_seq:
            raise _fail(f"rollback to {self.to_seq} is above rollback from {self.from_seq}")
        # where both rules were computed the lower seq wins (docs/design.md "The two
        # rollback rules")
        if self.to_seq > self.producer_seq:
            raise _fail(
                f"rollback to {self.to_seq} is above the producer's rollback seq "
                f"{self.producer_seq} (the lower seq wins)"
            )
        if self.seed_rule_seq is not None and self.to_seq > self.seed_rule_seq:
            raise _fail(
                f"rollback to {self.to_seq} is above the seed rule's seq {self.seed_rule_seq} "
                "(the lower seq wins)"
            )

    @property
    def branch_seq(self) -> int:
        """Where the source's history and the backup's surely agree: the lower rule's
        answer. `to_seq` may be lower still, the newest snapshot boundary at or below it
        (formats/repository.md §5.5); the records in (to_seq, branch_seq] are streamed
        again, never lost."""
        if self.seed_rule_seq is None:
            return self.producer_seq
        return min(self.producer_seq, self.seed_rule_seq)

    def to_json(self) -> dict[str, Any]:
        """JSON object with decimal strings; `seed_rule_seq` may be null."""
        return {
            "from": str(self.from_seq),
            "to": str(self.to_seq),
            "seed_rule_seq": None if self.seed_rule_seq is None else str(self.seed_rule_seq),
            "producer_seq": str(self.producer_seq),
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "rollback") -> RollbackRecord:
        """Parse `to_json` output; anything else raises RepositoryError."""
        o = _Obj(data, where, ("from", "to", "seed_rule_seq", "producer_seq"))
        return cls(o.u64("from"), o.u64("to"), o.opt_u64("seed_rule_seq"), o.u64("producer_seq"))


@dataclass(frozen=True, slots=True)
class CutBack:
    """Records a run streamed that a ROLLBACK in mid-run then took back (the partition's
    active failed over while it streamed; formats/repository.md §5.6): kept as lost writes
    (formats/repository.md §8.3), never part of a state. Its segment files live in
    `cut-K/`, K its 1-based place in the partition's list."""

    from_seq: int  # where the stream stood when the rollback came
    to_seq: int  # the rollback seq
    segments: tuple[SegmentEntry, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        _u64(self.from_seq, "cut_back from")
        _u64(self.to_seq, "cut_back to")
        if not self.to_seq < self.from_seq:
            raise _fail(f"cut_back to {self.to_seq} is not below its from {self.from_seq}")
        if not self.segments:
            raise _fail(f"cut_back ({self.to_seq}, {self.from_seq}] lists no segment")
        _check_segments(self.segments, f"cut_back ({self.to_seq}, {self.from_seq}]",
                        self.to_seq, self.from_seq)  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """JSON object (formats/repository.md §5.6)."""
        return {
            "from": str(self.from_seq),
            "to": str(self.to_seq),
            "segments": [s.to_json() for s in self.segments],
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "cut_back") -> CutBack:
        """Parse `to_json` output; anything else raises RepositoryError."""
        o = _Obj(data, where, ("from", "to", "segments"))
        segments = tuple(
            SegmentEntry.from_json(s, f"{where}: segments[{i}]")
            for i, s in enumerate(o.array("segments"))
        )
        return cls(o.u64("from"), o.u64("to"), segments)


def _cut_backs(o: _Obj, where: str) -> tuple[CutBack, ...]:
    items = o.array("cut_back")
    if not items:
        raise _fail(
            f"{where}: cut_back is present only when not empty (formats/repository.md §5.6)"
        )
    return tuple(CutBack.from_json(c, f"{where}: cut_back[{i}]") for i, c in enumerate(items))


def _check_segments(
    segments: tuple[SegmentEntry, ...], w: str, start: int, end: int, partition: int | None = None
) -> None:
    """Rules 5 and 6 of formats/repository.md §5.3: in `(start, end]`, in order, disjoint."""
    previous: SegmentEntry | None = None
    for s in segments:
        if not isinstance(s, SegmentEntry):
            raise _fail(f"{w}: segments must be SegmentEntry values")
        if partition is not None and s.partition != partition:
            raise _fail(f"{w}: segment {s.file} belongs to partition {s.partition}")
        if s.first_seq <= start or s.last_seq > end:
            raise _fail(
                f"{w}: segment {s.file} holds seqs {s.first_seq}..{s.last_seq} outside "
                f"({start}, {end}]"
            )
        if previous is not None and s.first_seq <= previous.last_seq:
            raise _fail(
                f"{w}: segment {s.file} does not start after segment {previous.file} "
                "(segments are listed in seq order and never overlap)"
            )
        previous = s


def _check_points(
    points: Sequence[tuple[int, datetime]], w: str, start_seq: int, end_seq: int,
    *, decoded: bool = False,
) -> None:  # fmt: skip
    """Restore points: seqs strictly ascending in (start_seq, end_seq], times in order
    (and each an aware UTC time, unless `decoded` from the compact form made them so)."""
    last: tuple[int, datetime] | None = None
    for point in points:
        if not decoded and (not isinstance(point, tuple) or len(point) != 2):
            raise _fail(f"{w}: a point is a (seq, time) pair")
        seq, when = point
        if not decoded:
            _u64(seq, f"{w}: point seq")
            format_time(when)
        if not start_seq < seq <= end_seq:
            raise _fail(f"{w}: point seq {seq} lies outside ({start_seq}, {end_seq}]")
        if last is not None and (seq <= last[0] or when < last[1]):
            raise _fail(f"{w}: points must ascend by seq, their times in order")
        last = point


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _varints(data: bytes, where: str) -> Iterator[int]:
    value = shift = 0
    for b in data:
        value |= (b & 0x7F) << shift
        if b & 0x80:
            shift += 7
            if shift > 63:
                raise _fail(f"{where}: points: a number longer than 64 bits")
            continue
        yield value
        value = shift = 0
    if shift:
        raise _fail(f"{where}: points: cut in the middle of a number")


def _pair_end(data: bytes) -> int:
    """Where the second varint of `data` ends (its first pair's length)."""
    ends = 0
    for i, b in enumerate(data):
        if not b & 0x80:
            ends += 1
            if ends == 2:
                return i + 1
    return len(data)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


class Points(Sequence[tuple[int, datetime]]):
    """A partition entry's restore points (formats/repository.md §5.11): (seq, time)
    pairs, kept in their compact text form until read. A manifest with thousands of
    points per entry (a rolled-up stretch of commits) then parses as fast as one
    without; they are checked when first read (and by `upr verify`, which reads them
    all): `RepositoryError` naming the partition."""

    __slots__ = ("_check", "_items", "_text")

    def __init__(
        self,
        items: Iterable[tuple[int, datetime]] = (),
        *,
        text: str | None = None,
        check: tuple[str, int, int] | None = None,
    ) -> None:
        self._items: tuple[tuple[int, datetime], ...] | None = None if text else tuple(items)
        self._text = text or None
        self._check = check

    def _decoded(self) -> tuple[tuple[int, datetime], ...]:
        if self._items is None:
            where, start, end = self._check or ("points", 0, U64_MAX)
            try:
                raw = base64.b64decode(self._text or "", validate=True)
            except ValueError:
                raise _fail(f"{where}: points are not base64") from None
            nums = list(_varints(raw, where))
            if len(nums) % 2:
                raise _fail(f"{where}: points hold an odd count of numbers")
            out, seq, us = [], start, 0
            for i in range(0, len(nums), 2):
                seq, us = seq + nums[i], us + nums[i + 1]
                try:
                    when = _EPOCH + timedelta(microseconds=us)
                except OverflowError:
                    raise _fail(f"{where}: a point's time is out of range") from None
                out.append((seq, when))
            _check_points(out, where, start, end, decoded=True)
            self._items = tuple(out)
        return self._items

    def first_time(self) -> datetime | None:
        """The oldest point's time (the first: times ascend) without decoding the rest;
        None when there is no point."""
        if self._items is not None:
            return self._items[0][1] if self._items else None
        where = (self._check or ("points",))[0]
        try:
            raw = base64.b64decode(self._text or "", validate=True)
        except ValueError:
            raise _fail(f"{where}: points are not base64") from None
        nums = _varints(raw, where)
        if next(nums, None) is None or (us := next(nums, None)) is None:
            return None if not raw else self._decoded()[0][1]  # its error, named
        try:
            return _EPOCH + timedelta(microseconds=us)
        except OverflowError:
            raise _fail(f"{where}: a point's time is out of range") from None

    def text(self, start_seq: int) -> str:
        """The compact form: base64 of varint pairs, each the seq's step up from the one
        before (the first from `start_seq`) and the time's in microseconds (the first
        from the Unix epoch)."""
        if self._text is not None and self._check is not None and self._check[1] == start_seq:
            return self._text
        out, seq, us = bytearray(), start_seq, 0
        for q, t in self._decoded():
            now = (t - _EPOCH) // timedelta(microseconds=1)
            out += _varint(q - seq) + _varint(now - us)
            seq, us = q, now
        text = base64.b64encode(bytes(out)).decode("ascii")
        if self._text is None:  # kept in this form from now on: a tenth of the memory
            self._text, self._check, self._items = text, ("points", start_seq, U64_MAX), None
        return text

    @classmethod
    def checked(cls, items: Sequence[tuple[int, datetime]], where: str, start_seq: int,
                end_seq: int) -> Points:  # fmt: skip
        """Points made by this process (a follower's commit): their seqs ascend within
        (start_seq, end_seq] and their times are in order, checked without formatting
        each time as a point read from elsewhere is."""
        _check_points(items, where, start_seq, end_seq, decoded=True)
        return cls(items)

    @staticmethod
    def joined(parts: Sequence[tuple[Sequence[tuple[int, datetime]], int]], start_seq: int,
               end_seq: int, where: str = "points") -> Points:  # fmt: skip
        """The points of consecutive entries as one, in compact form, without making a
        time of any: `parts` are each entry's points and its start seq, oldest first.
        Each part's numbers are copied but its first pair, which steps from the last
        point of the part before (a rollup of thousands of commits, jobs/rollup.py)."""
        out, seq, us = bytearray(), start_seq, 0
        for points, start in parts:
            if not points:
                continue
            raw = base64.b64decode(_points_text(points, start))
            nums = list(_varints(raw, where))
            if len(nums) % 2:
                raise _fail(f"{where}: points hold an odd count of numbers")
            first, when = start + nums[0], nums[1]
            if first <= seq or when < us:
                raise _fail(f"{where}: points must ascend by seq, their times in order")
            out += _varint(first - seq) + _varint(when - us)
            out += raw[_pair_end(raw) :]
            seq, us = start + sum(nums[0::2]), sum(nums[1::2])
        if not out:
            return Points()
        if seq > end_seq:
            raise _fail(f"{where}: point seq {seq} lies outside ({start_seq}, {end_seq}]")
        text = base64.b64encode(bytes(out)).decode("ascii")
        return Points(text=text, check=(where, start_seq, end_seq))

    def __len__(self) -> int:
        return len(self._decoded())

    @overload
    def __getitem__(self, i: int) -> tuple[int, datetime]: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[tuple[int, datetime], ...]: ...
    def __getitem__(self, i: int | slice) -> Any:
        return self._decoded()[i]

    def __iter__(self) -> Iterator[tuple[int, datetime]]:
        return iter(self._decoded())

    def __bool__(self) -> bool:
        return bool(self._text) if self._items is None else bool(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Points):
            return self._decoded() == other._decoded()
        if isinstance(other, tuple):
            return self._decoded() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._decoded())

    def __repr__(self) -> str:
        return f"Points({list(self._decoded())!r})"


def _points_text(points: Sequence[tuple[int, datetime]], start_seq: int) -> str:
    return (points if isinstance(points, Points) else Points(points)).text(start_seq)


@dataclass(frozen=True, slots=True)
class PartitionEntry:
    """What one backup holds for one partition: branch, seq range, snapshot, segments."""

    partition: int
    uuid: int
    failover_log: FailoverLog
    start_seq: int
    end_seq: int
    snap_start: int
    snap_end: int
    segments: tuple[SegmentEntry, ...] = ()
    rollback: RollbackRecord | None = None
    cut_backs: tuple[CutBack, ...] = ()
    # version 3 (formats/repository.md §5.10): at most how far this entry's history
    # agrees with every earlier backup's (formats/repository.md §8.3), when it took
    # over removed backups
    lost_bound: int | None = None
    # version 4 (formats/repository.md §5.11): the snapshot ends a follower received in
    # this commit, (seq, when received by its clock), ascending: its restore points
    points: Sequence[tuple[int, datetime]] = ()

    def __post_init__(self) -> None:
        p = self.partition
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= PARTITION_MAX:
            raise _fail(f"partition {p!r} is outside 0..{PARTITION_MAX}")
        w = f"partition {p}"
        object.__setattr__(self, "segments", tuple(self.segments))
        for name in ("uuid", "start_seq", "end_seq", "snap_start", "snap_end"):
            _u64(getattr(self, name), f"{w}: {name}")
        if not isinstance(self.failover_log, FailoverLog):
            raise _fail(f"{w}: failover_log must be a FailoverLog")
        if not self.failover_log.entries:
            if self.uuid != 0 or self.end_seq != 0:
                raise _fail(f"{w}: an empty failover log needs uuid 0 and end_seq 0")
        elif self.failover_log.find(self.uuid) is None:
            raise _fail(f"{w}: uuid {self.uuid} is not in the partition's failover log")
        if self.start_seq > self.end_seq:
            raise _fail(f"{w}: start_seq {self.start_seq} is above end_seq {self.end_seq}")
        if not self.snap_start <= self.end_seq <= self.snap_end:  # docs/protocol.md §4.4
            raise _fail(
                f"{w}: last snapshot [{self.snap_start}, {self.snap_end}] must contain "
                f"end_seq {self.end_seq}"
            )
        _check_segments(self.segments, w, self.start_seq, self.end_seq, p)
        if self.points and not isinstance(self.points, Points):  # given decoded: checked now
            _check_points(self.points, w, self.start_seq, self.end_seq)
            object.__setattr__(self, "points", Points(self.points))
        if self.lost_bound is not None:
            _u64(self.lost_bound, f"{w}: lost_bound")
        object.__setattr__(self, "cut_backs", tuple(self.cut_backs))
        for c in self.cut_backs:
            if not isinstance(c, CutBack):
                raise _fail(f"{w}: cut_back must hold CutBack values")
            if any(s.partition != p for s in c.segments):
                raise _fail(f"{w}: a cut_back segment belongs to another partition")
        if self.rollback is not None:
            if not isinstance(self.rollback, RollbackRecord):
                raise _fail(f"{w}: rollback must be a RollbackRecord or None")
            if self.rollback.to_seq != self.start_seq:
                raise _fail(
                    f"{w}: rollback to {self.rollback.to_seq} differs from start_seq "
                    f"{self.start_seq} (a rolled-back stream starts at the rollback seq)"
                )

    @property
    def records(self) -> int:
        """Records in all segments."""
        return sum(s.records for s in self.segments)

    @property
    def bytes(self) -> int:
        """Bytes of all segment files."""
        return sum(s.bytes for s in self.segments)

    @property
    def cut_bytes(self) -> int:
        """Bytes of the segments of records cut back in mid-run (formats/repository.md §5.6)."""
        return sum(s.bytes for c in self.cut_backs for s in c.segments)

    def cut_files(self) -> list[tuple[str, SegmentEntry]]:
        """(path relative to the backup directory, entry) of every cut-back segment."""
        return [(format_cut_path(k, s.file), s) for k, c in enumerate(self.cut_backs, 1)
                for s in c.segments]  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """JSON object (formats/repository.md "Partition entry")."""
        return {
            "partition": self.partition,
            "uuid": str(self.uuid),
            "failover_log": self.failover_log.to_json(),
            "start_seq": str(self.start_seq),
            "end_seq": str(self.end_seq),
            "last_snapshot": {"start": str(self.snap_start), "end": str(self.snap_end)},
            "segments": [s.to_json() for s in self.segments],
            "rollback": None if self.rollback is None else self.rollback.to_json(),
        } | ({"cut_back": [c.to_json() for c in self.cut_backs]} if self.cut_backs else {}) | (
            {} if self.lost_bound is None else {"lost_bound": str(self.lost_bound)}) | (
            {"points": _points_text(self.points, self.start_seq)}
            if self.points else {})  # fmt: skip

    @classmethod
    def from_json(cls, data: Any, where: str = "partition") -> PartitionEntry:
        """Parse `to_json` output; anything else raises RepositoryError."""
        keys: tuple[str, ...] = ("partition", "uuid", "failover_log", "start_seq", "end_seq",
                                 "last_snapshot", "segments", "rollback")  # fmt: skip
        if isinstance(data, dict) and "cut_back" in data:  # optional: only when not empty
            keys += ("cut_back",)
        if isinstance(data, dict) and "lost_bound" in data:  # optional: revisions only
            keys += ("lost_bound",)
        if isinstance(data, dict) and "points" in data:  # optional: continuous commits
            keys += ("points",)
        o = _Obj(data, where, keys)
        partition = o.small_int("partition", PARTITION_MAX)
        where = o.where = f"partition {partition}"
        snap = _Obj(o.get("last_snapshot"), f"{where}: last_snapshot", ("start", "end"))
        segments = tuple(
            SegmentEntry.from_json(s, f"{where}: segments[{i}]")
            for i, s in enumerate(o.array("segments"))
        )
        raw_rollback = o.get("rollback")
        rollback = (
            None
            if raw_rollback is None
            else RollbackRecord.from_json(raw_rollback, f"{where}: rollback")
        )
        return cls(
            partition,
            o.u64("uuid"),
            _failover_log(o.get("failover_log"), f"{where}: failover_log"),
            o.u64("start_seq"),
            o.u64("end_seq"),
            snap.u64("start"),
            snap.u64("end"),
            segments,
            rollback,
            _cut_backs(o, where) if "cut_back" in keys else (),
            o.u64("lost_bound") if "lost_bound" in keys else None,
            Points(text=o.string("points"), check=(where, o.u64("start_seq"), o.u64("end_seq")))
            if "points" in keys
            else (),
        )


# The fields of Totals, each a u64, under the same names in manifest.json.
_TOTALS = ("items", "bytes_read", "bytes_written", "rollbacks")


@dataclass(frozen=True, slots=True)
class Totals:
    """Backup-wide totals; all but `bytes_read` are derived from the partitions."""

    items: int
    bytes_read: int
    bytes_written: int
    rollbacks: int

    def __post_init__(self) -> None:
        for name in _TOTALS:
            _u64(getattr(self, name), f"totals: {name}")

    @classmethod
    def derive(cls, partitions: Iterable[PartitionEntry], bytes_read: int) -> Totals:
        """Totals of these partitions: records, segment bytes (cut-back ones too),
        partitions rolled back (a `rollback` record or a cut-back)."""
        ps = list(partitions)
        return cls(
            sum(p.records for p in ps),
            bytes_read,
            sum(p.bytes + p.cut_bytes for p in ps),
            sum(p.rollback is not None or bool(p.cut_backs) for p in ps),
        )

    def to_json(self) -> dict[str, str]:
        """JSON object with decimal strings."""
        return {name: str(getattr(self, name)) for name in _TOTALS}

    @classmethod
    def from_json(cls, data: Any, where: str = "totals") -> Totals:
        """Parse `to_json` output; anything else raises RepositoryError."""
        o = _Obj(data, where, _TOTALS)
        return cls(*(o.u64(name) for name in _TOTALS))


@dataclass(frozen=True, slots=True)
class CollectionFilter:
    """Which collections a filtered backup streamed (formats/repository.md §5.9):
    `include` the paths given (scopes or collections), or every collection but the
    `exclude` ones."""

    mode: str  # "include" | "exclude"
    paths: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.mode not in ("include", "exclude"):
            raise _fail(f"collection_filter: {self.mode!r} is not include or exclude")
        object.__setattr__(self, "paths", tuple(self.paths))
        if not self.paths:
            raise _fail(f"collection_filter: {self.mode} lists no path")
        for text in self.paths:
            try:
                Path.parse(text)
            except UprError as exc:
                raise _fail(f"collection_filter: {exc}") from None

    def covers(self, scope: str, collection: str) -> bool:
        """True if the backup streamed that collection."""
        named = any(Path.parse(t).covers(scope, collection) for t in self.paths)
        return named if self.mode == "include" else not named

    def to_json(self) -> dict[str, list[str]]:
        """`{"include": [...]}` or `{"exclude": [...]}`."""
        return {self.mode: list(self.paths)}

    @classmethod
    def from_json(cls, data: Any) -> CollectionFilter | None:
        """Parse `to_json` output or null."""
        if data is None:
            return None
        if not isinstance(data, dict) or len(data) != 1:
            raise _fail("collection_filter: expected null or one of include, exclude")
        ((mode, paths),) = data.items()
        if not isinstance(paths, list) or not all(isinstance(t, str) for t in paths):
            raise _fail(f"collection_filter: {mode} must be an array of strings")
        return cls(mode, tuple(paths))


@dataclass(frozen=True, slots=True)
class CollectionCount:
    """The data records one backup holds for one collection id: mutations (`items`) and
    deletions with expirations (`deleted`)."""

    id: int
    items: int
    deleted: int

    def __post_init__(self) -> None:
        if isinstance(self.id, bool) or not isinstance(self.id, int) or not 0 <= self.id < 1 << 32:
            raise _fail(f"collection_items: id {self.id!r} is not a u32")
        _u64(self.items, f"collection_items {self.id}: items")
        _u64(self.deleted, f"collection_items {self.id}: deleted")

    def to_json(self) -> dict[str, Any]:
        """JSON object: the id as an integer (a u32), the counts as decimal strings."""
        return {"id": self.id, "items": str(self.items), "deleted": str(self.deleted)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> CollectionCount:
        """Parse `to_json` output."""
        o = _Obj(data, where, ("id", "items", "deleted"))
        return cls(o.small_int("id", (1 << 32) - 1), o.u64("items"), o.u64("deleted"))


def change_to_json(c: ManifestChange) -> dict[str, Any]:
    """A manifest change as JSON (formats/repository.md §5.9): seqs and the manifest uid
    as decimal strings, ids (u32) and the max TTL as integers, names or null."""
    return {
        "partition": c.partition, "seq": str(c.seq), "kind": c.kind,
        "manifest_uid": str(c.manifest_uid), "scope_id": c.scope_id,
        "collection_id": c.collection_id, "name": c.name, "max_ttl": c.max_ttl,
    }  # fmt: skip


def change_from_json(data: Any, where: str) -> ManifestChange:
    """Parse `change_to_json` output; anything else raises RepositoryError."""
    o = _Obj(data, where, ("partition", "seq", "kind", "manifest_uid", "scope_id",
                           "collection_id", "name", "max_ttl"))  # fmt: skip
    kind = o.get("kind")
    if kind not in CHANGE_KINDS:
        raise _fail(f"{where}: kind {kind!r} is not one of {', '.join(CHANGE_KINDS)}")
    u32 = (1 << 32) - 1
    cid = None if o.get("collection_id") is None else o.small_int("collection_id", u32)
    if (cid is None) != kind.startswith("scope"):
        raise _fail(f"{where}: a collection event has a collection_id, a scope event none")
    name = o.get("name")
    if name is not None and not isinstance(name, str):
        raise _fail(f"{where}: name {name!r} is not a string or null")
    ttl = None if o.get("max_ttl") is None else o.small_int("max_ttl", u32)
    return ManifestChange(o.small_int("partition", PARTITION_MAX), o.u64("seq"), kind,
                          o.u64("manifest_uid"), o.small_int("scope_id", u32), cid, name,
                          ttl)  # fmt: skip


def _collections(data: Any) -> CollectionsManifest | None:
    if data is None:
        return None
    try:
        return CollectionsManifest.from_json(data)
    except CollectionsError as exc:
        raise _fail(f"collections: {exc}") from None


@dataclass(frozen=True, slots=True)
class Manifest:
    """One committed backup of one bucket (formats/repository.md "manifest.json")."""

    backup_id: BackupId
    bucket: str
    source: str
    started: datetime
    finished: datetime
    full: bool
    parent: BackupId | None
    partitions: tuple[PartitionEntry, ...]
    totals: Totals
    # a merge standing in for that backup (formats/repository.md §8.9)
    merged_through: BackupId | None = None
    # the source's collections at the start (None: written before collections, or a
    # source without them: everything is in the default collection), formats/repository.md §5.9
    collections: CollectionsManifest | None = None
    manifest_changes: tuple[ManifestChange, ...] = ()  # the system events met
    collection_filter: CollectionFilter | None = None  # None: every collection
    collection_items: tuple[CollectionCount, ...] = ()  # data records per collection id
    # version 3 (formats/repository.md §5.10): which revision of the backup this is, and
    # the removed backups whose records it took over (every one, over all its revisions)
    revision: int = 1
    absorbed: tuple[BackupId, ...] = ()
    # version 4 (formats/repository.md §5.11): a commit of `upr backup --follow`, and
    # when the stretch of time it watched began (the follower's previous commit, or
    # when it caught up after starting); None: an ordinary backup
    continuous: datetime | None = None
    _index: dict[int, PartitionEntry] = field(
        init=False, repr=False, compare=False, hash=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if not isinstance(self.backup_id, BackupId):
            raise _fail("backup_id must be a BackupId")
        check_bucket(self.bucket)
        if not isinstance(self.source, str) or not self.source:
            raise _fail("source must be a non-empty string")
        userinfo = _USERINFO.match(self.source)
        if userinfo and ":" in userinfo.group(1) and not userinfo.group(1).endswith(":***"):
            raise _fail("source shows a password: store the redacted URI (password as ***)")
        format_time(self.started)
        format_time(self.finished)
        if self.finished < self.started:
            raise _fail(
                f"finished {format_time(self.finished)} is before started "
                f"{format_time(self.started)}"
            )
        if not isinstance(self.full, bool):
            raise _fail("full must be true or false")
        if self.parent is not None and not isinstance(self.parent, BackupId):
            raise _fail("parent must be a BackupId or None")
        if self.full != (self.parent is None):
            raise _fail(
                "a full backup has no parent and an incremental backup has one "
                f"(full={self.full}, parent={self.parent})"
            )
        if self.parent is not None and not self.parent < self.backup_id:
            raise _fail(f"parent {self.parent} is not older than backup {self.backup_id}")
        if self.merged_through is not None:
            if not isinstance(self.merged_through, BackupId):
                raise _fail("merged_through must be a BackupId or None")
            if not self.full:
                raise _fail("a merge (merged_through) is a full backup")
            if not self.merged_through < self.backup_id:
                raise _fail(
                    f"merged_through {self.merged_through} is not older than backup "
                    f"{self.backup_id}"
                )
        object.__setattr__(self, "partitions", tuple(self.partitions))
        last = -1
        for e in self.partitions:
            if not isinstance(e, PartitionEntry):
                raise _fail("partitions must be PartitionEntry values")
            if e.partition <= last:
                raise _fail(
                    f"partition {e.partition} is out of order or repeated "
                    "(partitions are listed once each, ascending)"
                )
            last = e.partition
            if self.full and e.start_seq != 0:
                raise _fail(
                    f"partition {e.partition}: a full backup starts at seq 0, not {e.start_seq}"
                )
            self._index[e.partition] = e
        self._check_collections()
        self._check_revision()
        if self.continuous is not None:
            format_time(self.continuous)
            if not self.continuous <= self.finished:
                raise _fail("continuous: since must not be after finished")
        elif any(e.points for e in self.partitions):
            raise _fail("points appear only in a continuous commit (formats/repository.md §5.11)")
        bounded = any(e.lost_bound is not None for e in self.partitions)
        if bounded and self.version < REVISION_VERSION:
            raise _fail("lost_bound appears only in a revision (formats/repository.md §5.10)")
        if not isinstance(self.totals, Totals):
            raise _fail("totals must be a Totals")
        derived = Totals.derive(self.partitions, self.totals.bytes_read)
        if self.totals != derived:
            raise _fail(
                f"totals {self.totals.to_json()} disagree with the partitions {derived.to_json()}"
            )

    def _check_revision(self) -> None:
        if (
            isinstance(self.revision, bool)
            or not isinstance(self.revision, int)
            or not (1 <= self.revision <= REVISION_MAX)
        ):
            raise _fail(f"revision {self.revision!r} is not an integer in 1..{REVISION_MAX}")
        object.__setattr__(self, "absorbed", tuple(self.absorbed))
        last: BackupId | None = None
        for b in self.absorbed:
            if not isinstance(b, BackupId):
                raise _fail("absorbed must hold backup ids")
            if (last is not None and b <= last) or not b < self.backup_id:
                raise _fail(
                    f"absorbed: {b} is out of order, repeated or not older than backup "
                    f"{self.backup_id}"
                )
            last = b

    @property
    def version(self) -> int:
        """The manifest version this manifest is written in (the lowest describing it)."""
        if self.continuous is not None:
            return CONTINUOUS_VERSION
        return REVISION_VERSION if self.revision > 1 or self.absorbed else MANIFEST_VERSION

    def _check_collections(self) -> None:
        if self.collections is not None and not isinstance(self.collections, CollectionsManifest):
            raise _fail("collections must be a collections Manifest or None")
        if self.collection_filter is not None and not isinstance(
            self.collection_filter, CollectionFilter
        ):
            raise _fail("collection_filter must be a CollectionFilter or None")
        object.__setattr__(self, "manifest_changes", tuple(self.manifest_changes))
        object.__setattr__(self, "collection_items", tuple(self.collection_items))
        held = {e.partition: e for e in self.partitions}
        for c in self.manifest_changes:
            if not isinstance(c, ManifestChange):
                raise _fail("manifest_changes must hold ManifestChange values")
            e = held.get(c.partition)
            if e is None or not e.start_seq < c.seq <= e.end_seq:
                raise _fail(
                    f"manifest change at partition {c.partition} seq {c.seq} lies outside "
                    "that partition's range in this backup"
                )
        ids = [c.id for c in self.collection_items]
        if ids != sorted(set(ids)):
            raise _fail("collection_items: ids must be ascending, each once")

    @property
    def filtered(self) -> bool:
        """True when the backup left some collections out (formats/repository.md §5.9)."""
        return self.collection_filter is not None

    def backed_up(self, scope: str, collection: str) -> bool:
        """True if this backup streamed that collection (a filtered backup says no for
        the collections it left out: they were not backed up, not empty)."""
        f = self.collection_filter
        return f is None or f.covers(scope, collection)

    def partition(self, p: int) -> PartitionEntry | None:
        """The entry for partition `p`, or None when this backup does not hold it."""
        return self._index.get(p)

    @property
    def partition_ids(self) -> list[int]:
        """The partitions this backup holds, ascending."""
        return [e.partition for e in self.partitions]

    def segment_files(self) -> list[str]:
        """Every segment file name, in (partition, seq) order."""
        return [s.file for e in self.partitions for s in e.segments]

    # -- JSON -----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """JSON object without the checksum (see `dumps`)."""
        return {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "backup_id": self.backup_id.format(),
            "bucket": self.bucket,
            "source": self.source,
            "started": format_time(self.started),
            "finished": format_time(self.finished),
            "full": self.full,
            "parent": None if self.parent is None else self.parent.format(),
            "partitions": [e.to_json() for e in self.partitions],
            "totals": self.totals.to_json(),
            "collections": None if self.collections is None else self.collections.to_json(),
            "manifest_changes": [change_to_json(c) for c in self.manifest_changes],
            "collection_filter": None
            if self.collection_filter is None
            else self.collection_filter.to_json(),
            "collection_items": [c.to_json() for c in self.collection_items],
        } | (
            {} if self.merged_through is None else {"merged_through": self.merged_through.format()}
        ) | (
            {} if self.version < REVISION_VERSION else {
                "revision": self.revision, "absorbed": [b.format() for b in self.absorbed]}
        ) | (
            {} if self.continuous is None else {"continuous": {
                "since": format_time(self.continuous)}}
        )  # fmt: skip

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse `to_json` output (no checksum key); anything else raises RepositoryError."""
        keys: tuple[str, ...] = ("format", "version", "backup_id", "bucket", "source", "started",
                                 "finished", "full", "parent", "partitions", "totals")  # fmt: skip
        # optional (formats/repository.md §8.9)
        if isinstance(data, dict) and "merged_through" in data:
            keys = (*keys, "merged_through")
        obj = data if isinstance(data, dict) else {}
        version = obj.get("version")
        known = isinstance(version, int) and not isinstance(version, bool)
        if not (known and version == 1):  # collections (formats/repository.md §5.9)
            keys = (*keys, "collections", "manifest_changes", "collection_filter",
                    "collection_items")  # fmt: skip
        # formats/repository.md §5.10 (and §5.11: version 4 has every version 3 key)
        if known and version in (REVISION_VERSION, CONTINUOUS_VERSION):
            keys = (*keys, "revision", "absorbed")
        if known and version == CONTINUOUS_VERSION:  # formats/repository.md §5.11
            keys = (*keys, "continuous")
        # format and version first: a newer manifest's keys are not unknown, it is newer
        if "format" in obj and obj["format"] != MANIFEST_FORMAT:
            raise _fail(f"format {obj['format']!r} is not {MANIFEST_FORMAT!r}")
        if known and version not in MANIFEST_VERSIONS:
            raise _fail(
                f"manifest version {version} is not supported (this upr reads versions "
                f"{', '.join(map(str, MANIFEST_VERSIONS))})"
            )
        o = _Obj(data, "manifest", keys)
        number = o.small_int("version", 1 << 31)
        parent = o.get("parent")
        partitions = tuple(
            PartitionEntry.from_json(e, f"partitions[{i}]")
            for i, e in enumerate(o.array("partitions"))
        )
        collections, changes, chosen, items = (
            _collection_fields(o) if version != 1 else (None, (), None, ())
        )
        revision, absorbed = _revision_fields(o, number) if number >= REVISION_VERSION else (1, ())
        return cls(
            BackupId.parse(o.string("backup_id")),
            o.string("bucket"),
            o.string("source"),
            parse_time(o.string("started")),
            parse_time(o.string("finished")),
            o.boolean("full"),
            None if parent is None else BackupId.parse(o.string("parent")),
            partitions,
            Totals.from_json(o.get("totals")),
            BackupId.parse(o.string("merged_through")) if "merged_through" in keys else None,
            collections=collections,
            manifest_changes=changes,
            collection_filter=chosen,
            collection_items=items,
            revision=revision,
            absorbed=absorbed,
            continuous=_continuous(o) if number == CONTINUOUS_VERSION else None,
        )

    def dumps(self) -> bytes:
        """The file bytes: indented JSON with a BLAKE2b-128 `checksum` of the canonical form."""
        obj = self.to_json()
        obj["checksum"] = checksum_hex(canonical_json(obj))
        data = (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        if len(data) > MAX_MANIFEST_BYTES:  # never written: no reader would take it
            raise _fail(f"manifest of backup {self.backup_id}: {len(data):,} bytes exceed "
                        f"the {MAX_MANIFEST_BYTES:,}-byte limit")  # fmt: skip
        return data

    @classmethod
    def loads(cls, data: bytes) -> Manifest:
        """Parse file bytes, verifying the checksum; errors raise RepositoryError (no path)."""
        obj = load_json(data)
        if not isinstance(obj, dict) or "checksum" not in obj:
            raise _fail("manifest has no checksum")
        recorded = obj.pop("checksum")
        if not isinstance(recorded, str) or not _HEX128.fullmatch(recorded):
            raise _fail(f"manifest checksum {recorded!r} is not 32 lowercase hex digits")
        if checksum_hex(canonical_json(obj)) != recorded:
            raise _fail("manifest checksum mismatch: the file was changed or damaged")
        return cls.from_json(obj)


BackupManifest = Manifest  # the name the collections contract uses


def _continuous(o: _Obj) -> datetime:
    """The version 4 field (formats/repository.md §5.11)."""
    c = _Obj(o.get("continuous"), "continuous", ("since",))
    return parse_time(c.string("since"))


def _revision_fields(o: _Obj, version: int) -> tuple[int, tuple[BackupId, ...]]:
    """The version 3 fields (formats/repository.md §5.10); a revision 1 without absorbed
    backups is written as version 2, so version 3 always says something."""
    revision = o.small_int("revision", REVISION_MAX)
    absorbed = tuple(BackupId.parse(b if isinstance(b, str) else repr(b))
                     for b in o.array("absorbed"))  # fmt: skip
    if version == REVISION_VERSION and revision == 1 and not absorbed:
        raise _fail("a version 3 manifest is a revision: revision > 1 or absorbed backups")
    return revision, absorbed


def _collection_fields(o: _Obj) -> tuple[Any, ...]:
    """The version 2 fields, in `Manifest` order after `merged_through`."""
    changes = tuple(change_from_json(c, f"manifest_changes[{i}]")
                    for i, c in enumerate(o.array("manifest_changes")))  # fmt: skip
    items = tuple(CollectionCount.from_json(c, f"collection_items[{i}]")
                  for i, c in enumerate(o.array("collection_items")))  # fmt: skip
    return (_collections(o.get("collections")), changes,
            CollectionFilter.from_json(o.get("collection_filter")), items)  # fmt: skip


# -- collections over a chain ---------------------------------------------------------


def _after(m: Manifest, start: CollectionsManifest,
           cut: Mapping[int, tuple[BackupId, int | None]] | None = None,
           ) -> CollectionsManifest:  # fmt: skip
    """The collections at the end of backup `m`, from those at its start: the changes
    its streams met, newer than the start manifest, in uid order (each partition reports
    every change: the first application counts, the repeats change nothing). With
    `cut`, only the changes a partition's state there includes (`chain_manifest`)."""
    changes = sorted((c for c in m.manifest_changes if c.manifest_uid > start.uid
                      and (cut is None or _included(m, c, cut))),
                     key=lambda c: (c.manifest_uid, c.partition, c.seq))  # fmt: skip
    for c in changes:
        start = apply_change(start, c)
    return start


def _included(m: Manifest, c: ManifestChange,
              cut: Mapping[int, tuple[BackupId, int | None]]) -> bool:  # fmt: skip
    """Whether the state of partition `c.partition` at its cut (a backup and a seq
    clip, None: all of it) holds the change `c` that backup `m` recorded."""
    at = cut.get(c.partition)
    if at is None:
        return False
    bid, clip = at
    return m.backup_id < bid or (m.backup_id == bid and (clip is None or c.seq <= clip))


def chain_manifest(
    backups: Sequence[Manifest], cut: Mapping[int, tuple[BackupId, int | None]] | None = None
) -> CollectionsManifest:
    """The collections as they stand at the end of the chain `backups` (in chain order):
    the newest backup's start manifest with the changes its streams met applied. A
    chain written before collections gives the default collection alone, which holds
    every record.

    With `cut` (a point in time: per partition its backup and seq clip), a change
    counts only when some partition's state at its cut holds it: a backup that holds a
    stretch of time (a rollup) may record a collection's drop after the point, and the
    collection is then alive at it."""
    m = CollectionsManifest()
    for b in backups:
        m = _after(b, b.collections if b.collections is not None else m, cut)
    return m


UNNAMED_SCOPE = "_unknown"  # the scope shown for an id that records hold but nothing names


def collection_history(backups: Sequence[Manifest]) -> dict[int, tuple[Path, bool]]:
    """Every collection id the chain saw (in a start manifest, a change or its records),
    with its last known name and whether it is dropped at the chain's end. A collection
    dropped and created again under the same name has a new id: two entries."""
    names: dict[int, Path] = {0: Path("_default", "_default")}
    m = CollectionsManifest()
    for b in backups:
        m = b.collections if b.collections is not None else m
        steps = [m]
        for c in sorted(b.manifest_changes, key=lambda c: (c.manifest_uid, c.partition, c.seq)):
            if c.manifest_uid > m.uid or c.kind.endswith("created"):
                steps.append(apply_change(steps[-1], c))
        for step in steps:
            names.update({c.id: Path(s.name, c.name) for s, c in step.collections()})
        m = _after(b, m)
        for n in b.collection_items:
            names.setdefault(n.id, Path(UNNAMED_SCOPE, f"collection-{n.id:x}"))
    live = {c.id for _s, c in m.collections()}
    return {cid: (path, cid not in live) for cid, path in sorted(names.items())}


# -- JSON helpers --------------------------------------------------------------------


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8: the bytes a checksum covers."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8"
    )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _fail(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise _fail(f"{name} is not valid JSON")


def load_json(data: bytes) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, size-capped."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise _fail(f"{len(data)} bytes exceed the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(f"not UTF-8 at byte {exc.start}") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise _fail(f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise _fail("not valid JSON: nested too deeply") from None


class _Obj:
    """Typed, strict field access to one JSON object, naming `where` in every error."""

    def __init__(self, data: Any, where: str, keys: Sequence[str]) -> None:
        self.where = where
        if not isinstance(data, dict):
            raise _fail(f"{where}: expected a JSON object")
        missing = [k for k in keys if k not in data]
        extra = sorted(set(data) - set(keys))
        if missing:
            raise _fail(f"{where}: missing key {missing[0]!r}")
        if extra:
            raise _fail(f"{where}: unknown key {extra[0]!r}")
        self.data: Mapping[str, Any] = data

    def get(self, key: str) -> Any:
        return self.data[key]

    def u64(self, key: str) -> int:
        v = self.data[key]
        if not isinstance(v, str) or not _DEC.fullmatch(v) or int(v) > U64_MAX:
            raise _fail(f"{self.where}: {key} {v!r} is not a decimal string in 0..2^64-1")
        return int(v)

    def opt_u64(self, key: str) -> int | None:
        return None if self.data[key] is None else self.u64(key)

    def small_int(self, key: str, hi: int) -> int:
        v = self.data[key]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
            raise _fail(f"{self.where}: {key} {v!r} is not an integer in 0..{hi}")
        return v

    def string(self, key: str) -> str:
        v = self.data[key]
        if not isinstance(v, str):
            raise _fail(f"{self.where}: {key} {v!r} is not a string")
        return v

    def boolean(self, key: str) -> bool:
        v = self.data[key]
        if not isinstance(v, bool):
            raise _fail(f"{self.where}: {key} {v!r} is not true or false")
        return v

    def array(self, key: str) -> list[Any]:
        v = self.data[key]
        if not isinstance(v, list):
            raise _fail(f"{self.where}: {key} is not an array")
        return v


def _failover_log(data: Any, where: str) -> FailoverLog:
    """The canonical failover-log form only (formats/failover-log.md, "Canonical form")."""
    if not isinstance(data, list):
        raise _fail(f"{where}: expected an array, newest entry first")
    pairs = []
    for i, item in enumerate(data):
        o = _Obj(item, f"{where}[{i}]", ("uuid", "seq"))
        pairs.append((o.u64("uuid"), o.u64("seq")))
    try:
        return FailoverLog.of(pairs)
    except InvalidFailoverLog as exc:
        raise _fail(f"{where}: {exc}") from None
