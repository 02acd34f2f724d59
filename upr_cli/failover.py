"""Failover logs and the two rollback rules.

A failover log is a partition's branch history: newest-first (uuid, seq) entries, each
marking where a new history branch began (the UPR design specification, "Failover Log";
docs/protocol.md §4.3).

* The **seed rule** (`rollback_point`) is the client-side algorithm of the UPR design
  specification, "How UPR Replicas/Clients find out where to rollback to and stream
  from": sentinel entries, common ancestor, next newer entries (docs/design.md "The two
  rollback rules").
* The **producer rule** (`needs_rollback`) is what a DCP producer runs to answer
  STREAM_REQ (docs/protocol.md §4.2, kv_engine `FailoverTable::needsRollback`).

Both return a `RollbackDecision` carrying the seq and why (matched entry, bound, step),
so tools can print the reasoning. 64-bit values travel in JSON as decimal strings.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from upr_cli.errors import UprError, UsageError
from upr_cli.position import StreamPosition

MAX_ENTRIES = 25
U64_MAX = (1 << 64) - 1


class InvalidFailoverLog(UsageError):
    """A failover log given to upr is malformed (not newest-first, uuid 0, bad numbers)."""


class ImpossibleHistory(UprError):
    """The logs describe a history that cannot happen (the design's "Not possible!" example)."""

    exit_code = 3


@dataclass(frozen=True, slots=True, order=True)
class FailoverEntry:
    """One branch start: `uuid` (never 0) began a history at `seq`."""

    uuid: int
    seq: int

    def __str__(self) -> str:
        return f"{self.uuid:x}@{self.seq}"

    def to_json(self) -> dict[str, str]:
        """JSON object with decimal strings (64-bit safe)."""
        return {"uuid": str(self.uuid), "seq": str(self.seq)}


def new_uuid(rng: random.Random | None = None) -> int:
    """A fresh failover uuid: random 64 bits shifted right by 16, not 0 (docs/protocol.md §4.3)."""
    r = rng or random.SystemRandom()
    while True:
        u = r.getrandbits(64) >> 16
        if u:
            return u


@dataclass(frozen=True, slots=True)
class FailoverLog:
    """An immutable, validated failover log, newest entry first."""

    entries: tuple[FailoverEntry, ...] = ()
    max_entries: int = MAX_ENTRIES

    def __post_init__(self) -> None:
        problem = _problem(self.entries, self.max_entries)
        if problem:
            raise InvalidFailoverLog(problem)

    # -- construction -------------------------------------------------------------

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, int]], max_entries: int = MAX_ENTRIES) -> FailoverLog:
        """A log from (uuid, seq) pairs, newest first; invalid input raises InvalidFailoverLog."""
        return cls(tuple(FailoverEntry(u, s) for u, s in pairs), max_entries)

    @classmethod
    def sanitised(
        cls, pairs: Iterable[tuple[int, int]], max_entries: int = MAX_ENTRIES
    ) -> FailoverLog:
        """A log from a possibly corrupt table, as kv_engine loads one (docs/protocol.md §4.3).

        Entries with uuid 0, or whose seq exceeds the (newer) entry before them, are
        dropped; so are repeated uuids; the oldest beyond `max_entries` go too.
        """
        kept: list[FailoverEntry] = []
        seen: set[int] = set()
        for u, s in pairs:
            if u == 0 or not 0 <= s <= U64_MAX or u > U64_MAX or u in seen:
                continue
            if kept and s > kept[-1].seq:
                continue
            kept.append(FailoverEntry(u, s))
            seen.add(u)
        return cls(tuple(kept[:max_entries]), max_entries)

    @classmethod
    def initial(
        cls, rng: random.Random | None = None, max_entries: int = MAX_ENTRIES
    ) -> FailoverLog:
        """The log of a brand-new partition: one entry {random uuid, 0}."""
        return cls((FailoverEntry(new_uuid(rng), 0),), max_entries)

    # -- queries ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[FailoverEntry]:
        return iter(self.entries)

    @property
    def latest(self) -> FailoverEntry:
        """The newest entry (the current branch)."""
        if not self.entries:
            raise InvalidFailoverLog("the failover log is empty")
        return self.entries[0]

    def pairs(self) -> tuple[tuple[int, int], ...]:
        """(uuid, seq) pairs, newest first (the wire form, docs/protocol.md §2.4)."""
        return tuple((e.uuid, e.seq) for e in self.entries)

    def find(self, uuid: int) -> int | None:
        """Index of the entry with this uuid, or None."""
        for i, e in enumerate(self.entries):
            if e.uuid == uuid:
                return i
        return None

    def entry_at(self, seq: int) -> FailoverEntry | None:
        """The newest entry whose seq ≤ `seq`: the branch a position at `seq` belongs to."""
        for e in self.entries:
            if e.seq <= seq:
                return e
        return None

    # -- changes (each returns a new log) -----------------------------------------

    def add_entry(self, uuid: int, seq: int) -> FailoverLog:
        """Start a branch at `seq`: drop entries above it, push {uuid, seq}, trim the oldest."""
        kept = tuple(e for e in self.entries if e.seq <= seq)
        return FailoverLog((FailoverEntry(uuid, seq), *kept)[: self.max_entries], self.max_entries)

    def prune_above(self, seq: int) -> FailoverLog:
        """Drop entries above `seq` (the client side of a rollback, docs/protocol.md §4.4)."""
        return FailoverLog(tuple(e for e in self.entries if e.seq <= seq), self.max_entries)

    def rolled_back(self, seq: int, rng: random.Random | None = None) -> FailoverLog:
        """A producer's log after rolling back to `seq`: prune, and if empty add {new uuid, seq}."""
        pruned = self.prune_above(seq)
        return pruned if pruned.entries else pruned.add_entry(new_uuid(rng), seq)

    # -- JSON -----------------------------------------------------------------------

    def to_json(self) -> list[dict[str, str]]:
        """[{"uuid": "<decimal>", "seq": "<decimal>"}, …], newest first."""
        return [e.to_json() for e in self.entries]

    @classmethod
    def from_json(cls, data: Any, max_entries: int = MAX_ENTRIES) -> FailoverLog:
        """Parse either JSON form (see `parse_uuid`); errors raise InvalidFailoverLog."""
        if isinstance(data, dict) and "failover_log" in data:
            data = data["failover_log"]
        if not isinstance(data, list):
            raise InvalidFailoverLog("a failover log must be a JSON array, newest entry first")
        pairs = []
        for i, item in enumerate(data):
            if isinstance(item, dict):
                if set(item) - {"uuid", "seq", "uuid_hex"} or not {"uuid", "seq"} <= set(item):
                    raise InvalidFailoverLog(f"entry {i}: expected keys 'uuid' and 'seq'")
                pairs.append(
                    (
                        parse_uuid(item["uuid"], hex_strings=False, where=f"entry {i}"),
                        parse_seq(item["seq"], where=f"entry {i}"),
                    )
                )
            elif isinstance(item, list) and len(item) == 2:
                pairs.append(
                    (
                        parse_uuid(item[0], hex_strings=True, where=f"entry {i}"),
                        parse_seq(item[1], where=f"entry {i}"),
                    )
                )
            else:
                raise InvalidFailoverLog(f'entry {i}: expected [uuid, seq] or {{"uuid", "seq"}}')
        return cls.of(pairs, max_entries)

    @classmethod
    def loads(cls, text: str, max_entries: int = MAX_ENTRIES) -> FailoverLog:
        """Parse JSON text."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidFailoverLog(
                f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from None
        return cls.from_json(data, max_entries)

    def __str__(self) -> str:
        return "[" + ", ".join(str(e) for e in self.entries) + "]"


def _problem(entries: Sequence[FailoverEntry], max_entries: int) -> str | None:
    if max_entries < 1:
        return f"max_entries must be at least 1, got {max_entries}"
    if len(entries) > max_entries:
        return f"{len(entries)} entries exceed the maximum of {max_entries}"
    seen: set[int] = set()
    for i, e in enumerate(entries):
        if not isinstance(e.uuid, int) or not isinstance(e.seq, int):
            return f"entry {i}: uuid and seq must be integers"
        if e.uuid == 0:
            return f"entry {i}: uuid 0 is not a valid failover id"
        if not 0 < e.uuid <= U64_MAX:
            return f"entry {i}: uuid {e.uuid} is outside 1..2^64-1"
        if not 0 <= e.seq <= U64_MAX:
            return f"entry {i}: seq {e.seq} is outside 0..2^64-1"
        if e.uuid in seen:
            return f"entry {i}: uuid {e.uuid:x} appears twice"
        seen.add(e.uuid)
        if i and e.seq > entries[i - 1].seq:
            return (
                f"not newest-first: entry {i} ({e}) has a higher seq than entry {i - 1} "
                f"({entries[i - 1]})"
            )
    return None


_HEX = re.compile(r"(0[xX])?[0-9a-fA-F]+")
_DEC = re.compile(r"[0-9]+")


def parse_uuid(value: Any, *, hex_strings: bool, where: str = "uuid") -> int:
    """A uuid from JSON: an integer, or a string (hex in [uuid, seq] pairs, decimal in objects).

    A "0x" prefix always means hex.
    """
    if isinstance(value, bool):
        raise InvalidFailoverLog(f"{where}: uuid must be an integer or a string")
    if isinstance(value, int):
        u = value
    elif isinstance(value, str):
        v = value.strip()
        if v[:2].lower() == "0x" or hex_strings:
            if not _HEX.fullmatch(v):
                raise InvalidFailoverLog(f"{where}: uuid {value!r} is not a hex string")
            u = int(v, 16)
        else:
            if not _DEC.fullmatch(v):
                raise InvalidFailoverLog(
                    f"{where}: uuid {value!r} is not a decimal string (use 0x… for hex)"
                )
            u = int(v)
    else:
        raise InvalidFailoverLog(f"{where}: uuid must be an integer or a string")
    if u == 0:
        raise InvalidFailoverLog(f"{where}: uuid 0 is not a valid failover id")
    if not 0 < u <= U64_MAX:
        raise InvalidFailoverLog(f"{where}: uuid {value!r} is outside 1..2^64-1")
    return u


def parse_seq(value: Any, *, where: str = "seq") -> int:
    """A seqno from JSON: a non-negative integer or decimal string below 2^64."""
    if isinstance(value, bool):
        raise InvalidFailoverLog(f"{where}: seq must be an integer")
    if isinstance(value, str) and _DEC.fullmatch(value.strip()):
        value = int(value)
    if not isinstance(value, int):
        raise InvalidFailoverLog(f"{where}: seq {value!r} must be a non-negative integer")
    if value < 0:
        raise InvalidFailoverLog(f"{where}: seq {value} is negative")
    if value > U64_MAX:
        raise InvalidFailoverLog(f"{where}: seq {value} exceeds 2^64-1")
    return value


# ---------------------------------------------------------------- decisions


@dataclass(frozen=True, slots=True)
class RollbackDecision:
    """Where a client must roll back to and restart from, and why."""

    rule: str  # "seed" or "dcp"
    rollback_seq: int
    rollback: bool  # True if the client must discard anything it holds above rollback_seq
    step: str  # which step decided
    common_ancestor: FailoverEntry | None = None
    bound: int | None = None  # the upper bound of the client's branch (dcp) / next-entry seq (seed)
    explanation: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        """JSON object with 64-bit values as decimal strings (docs/output.md §4)."""
        ca = self.common_ancestor
        return {
            "rule": self.rule,
            "rollback_seq": str(self.rollback_seq),
            "must_roll_back": self.rollback,
            "step": self.step,
            "common_ancestor": None if ca is None else {**ca.to_json(), "uuid_hex": f"{ca.uuid:x}"},
            "bound": None if self.bound is None else str(self.bound),
            "explanation": list(self.explanation),
        }


# The sentinels of the UPR design specification's "Examples" (docs/design.md "The two
# rollback rules"):
SERVER_SENTINEL = "ffffffff"  # always the highest seq the client has seen
CLIENT_SENTINEL = "00000000"  # always the client's last snapshot seq


@dataclass(frozen=True, slots=True)
class _Row:
    entry: FailoverEntry | None  # None for a sentinel
    seq: int
    label: str


def rollback_point(
    server_log: FailoverLog, client_log: FailoverLog, snapshot_seq: int, seen_seq: int
) -> RollbackDecision:
    """The seed rule: the UPR design specification's client-side rollback algorithm.

    From the section "How UPR Replicas/Clients find out where to rollback to and stream
    from". `snapshot_seq` is the client's last complete (persisted) snapshot, `seen_seq`
    the highest seq it has seen. Raises ImpossibleHistory for the design's "Not
    possible!" example.
    """
    parse_seq(snapshot_seq, where="snapshot seq")
    parse_seq(seen_seq, where="seen seq")
    if snapshot_seq > seen_seq:
        raise UsageError(f"snapshot seq {snapshot_seq} exceeds seen seq {seen_seq}")
    if not server_log.entries:
        raise InvalidFailoverLog(
            "the server's failover log is empty (a server always has an entry)"
        )
    why: list[str] = []
    client_entries = list(client_log.entries)
    # Step 2: if the logs differ, the client sentinel carries its last snapshot seq and
    # entries newer than that snapshot are elided.
    if server_log.entries != client_log.entries:
        elided = [e for e in client_entries if e.seq > snapshot_seq]
        client_entries = [e for e in client_entries if e.seq <= snapshot_seq]
        if elided:
            why.append(
                f"logs differ: elided client entries above snapshot {snapshot_seq}: "
                + ", ".join(str(e) for e in elided)
            )
        else:
            why.append("logs differ")
    else:
        why.append("logs are equal")
    client = [_Row(None, snapshot_seq, CLIENT_SENTINEL)] + [
        _Row(e, e.seq, f"{e.uuid:x}") for e in client_entries
    ]
    # Step 3: the server sentinel carries the highest seq the client has seen.
    server = [_Row(None, seen_seq, SERVER_SENTINEL)] + [
        _Row(e, e.seq, f"{e.uuid:x}") for e in server_log.entries
    ]
    why.append(
        f"server log with sentinel: {_rows(server)}; client log with sentinel: {_rows(client)}"
    )
    # Step 4: the newest entry present in both logs is the common ancestor.
    client_index = {r.entry: i for i, r in enumerate(client) if r.entry is not None}
    found = [(si, client_index[r.entry]) for si, r in enumerate(server) if r.entry in client_index]
    if not found:
        why.append("no common ancestor: roll back everything")
        return RollbackDecision(
            "seed", 0, seen_seq > 0, "no-common-ancestor", None, None, tuple(why)
        )
    si, ci = found[0]
    ancestor = server[si].entry
    s_next, c_next = server[si - 1], client[ci - 1]
    why.append(
        f"common ancestor {ancestor}; next newer entries: server {s_next.label}@{s_next.seq}, "
        f"client {c_next.label}@{c_next.seq}"
    )
    if s_next.entry is None and c_next.entry is not None:
        raise ImpossibleHistory(
            f"not possible: the client saw failover id {c_next.label}@{c_next.seq} after the "
            f"common ancestor {ancestor}, but the server's newest entry is still {ancestor}"
        )
    # Step 5: both sentinels → the larger; otherwise the smaller.
    if s_next.entry is None and c_next.entry is None:
        seq, step = max(s_next.seq, c_next.seq), "both-sentinels-larger"
        why.append(f"both are sentinels: take the larger, {seq}")
    else:
        seq, step = min(s_next.seq, c_next.seq), "next-entries-smaller"
        why.append(f"not both sentinels: take the smaller, {seq}")
    return RollbackDecision(
        "seed", seq, seq < seen_seq, step, ancestor, min(s_next.seq, c_next.seq), tuple(why)
    )


def _rows(rows: list[_Row]) -> str:
    return "[" + ", ".join(f"{r.label}@{r.seq}" for r in rows) + "]"


def needs_rollback(  # spec-shaped: the rule of docs/protocol.md §4.2, step by step
    server_log: FailoverLog,
    position: StreamPosition,
    *,
    high: int,
    purge_seq: int = 0,
    client_purge_seq: int = 0,
    strict: bool = False,
    collection_max_high: int | None = None,
) -> RollbackDecision:
    """The producer rule for a STREAM_REQ (docs/protocol.md §4.2), with its explanation.

    `position` is what the request sends: start (its `seq`), uuid and snapshot bounds.
    `rollback` is False when the stream may start at `start`. The caller has already
    checked `snap_start ≤ start ≤ snap_end` (docs/protocol.md §4.1 step 5); this function
    refuses arguments that break it, since a server answers ERANGE before reaching the
    rule.
    """
    start, uuid = position.seq, position.uuid
    snap_start, snap_end = position.snap_start, position.snap_end
    for name, v in (
        ("start", start),
        ("snap start", snap_start),
        ("snap end", snap_end),
        ("high seq", high),
        ("purge seq", purge_seq),
        ("client purge seq", client_purge_seq),
    ):
        parse_seq(v, where=name)
    if not snap_start <= start <= snap_end:  # docs/protocol.md §4.1 step 5
        raise UsageError(
            f"snap start {snap_start} ≤ start {start} ≤ snap end {snap_end} does not hold: "
            "the server answers ERANGE before the rollback check"
        )
    why: list[str] = []

    def no(
        step: str, msg: str, bound: int | None = None, ca: FailoverEntry | None = None
    ) -> RollbackDecision:
        why.append(msg)
        return RollbackDecision("dcp", start, False, step, ca, bound, tuple(why))

    def yes(
        seq: int, step: str, msg: str, bound: int | None = None, ca: FailoverEntry | None = None
    ) -> RollbackDecision:
        why.append(msg)
        return RollbackDecision("dcp", seq, True, step, ca, bound, tuple(why))

    upper = high
    if start == 0 and (not strict or uuid == 0):
        return no("start-zero", "start is 0: nothing to lose, no rollback")
    exempt = (
        collection_max_high is not None
        and start < purge_seq
        and start >= collection_max_high
        and collection_max_high <= purge_seq
    )
    if start < purge_seq and start != 0 and not exempt and client_purge_seq != purge_seq:
        return yes(
            0,
            "purged",
            f"start {start} is below the purge seqno {purge_seq}: the client "
            "may have missed purged tombstones, roll back to 0",
        )
    index = None
    for i in reversed(range(len(server_log.entries))):  # oldest first, as kv_engine searches
        if server_log.entries[i].uuid == uuid:
            index = i
            break
    if index is None:
        return yes(
            0,
            "unknown-uuid",
            f"uuid {uuid:x} is not in the server's failover log: no common history, roll back to 0",
        )
    entry = server_log.entries[index]
    if index > 0:
        upper = server_log.entries[index - 1].seq
        why.append(
            f"uuid {uuid:x} matched entry {index} ({entry}); the next branch began at "
            f"{upper}, the upper bound"
        )
    else:
        why.append(f"uuid {uuid:x} is the newest entry; the upper bound is the high seqno {high}")
    if start == snap_start:
        snap_end = start
        why.append(
            f"start equals snap start: the client holds nothing of that snapshot, "
            f"snap end := {start}"
        )
    if snap_end <= upper:
        return no(
            "within-branch",
            f"snap end {snap_end} ≤ upper bound {upper}: histories agree, no rollback",
            upper,
            entry,
        )
    if start == snap_end:
        snap_start = start
        why.append(f"start equals snap end: the snapshot is complete, snap start := {start}")
    if upper < snap_start:
        return yes(
            upper,
            "upper-bound",
            f"snap end {snap_end} > upper bound {upper} < snap start "
            f"{snap_start}: roll back to the upper bound {upper}",
            upper,
            entry,
        )
    return yes(
        snap_start,
        "snap-start",
        f"snap end {snap_end} > upper bound {upper} ≥ snap start "
        f"{snap_start}: roll back to the snapshot start {snap_start}",
        upper,
        entry,
    )
