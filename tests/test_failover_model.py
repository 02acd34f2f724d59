"""A model of one partition's replication history, checked against both rollback rules.

The model (a hypothesis `RuleBasedStateMachine`) follows the UPR design specification
("Failover Log", "How clients roll back changes when seeing a new failover ID", "How UPR
Replicas/Clients find out where to rollback to and stream from") and
docs/protocol.md §2.7 and §4.

* **Nodes** (2 or 3, exactly one primary). Each holds its items by seq (item identity is a
  unique token, so two holders agree at seq s iff they hold the same token there), its
  persisted seq and the snapshot range persisted with it, its failover log (`FailoverLog`,
  capacity 3 or 25 so that trimming the oldest entry is exercised too) and the ends of its
  complete snapshots. The primary closes snapshots (checkpoints) at its high seq; a replica
  records the end of each marker it has received completely.
* **Primary operations.** Write (next seq, new token); close a checkpoint; persist up to
  some seq (the persisted snapshot range is the checkpoint holding that seq, whose end is the
  current high seq while the checkpoint is open); crash and restart: items above the
  persisted seq are lost, the shutdown was unclean, so a new entry is added at
  `last_snap_end if high == last_snap_end else last_snap_start` (docs/protocol.md §4.3);
  the items between that seq and the persisted high survive.
* **Replica operations.** Catch up from the primary as a DCP consumer (below); persist what
  it received (with its last marker's range and last complete snapshot; a rollback is
  persisted at once); crash and restart from disk (no new entry: only an active vbucket gets
  one at warm-up). Failover: promote a replica, which adds an entry at its last complete
  snapshot seq (`add_entry`, i.e. createEntry, drops entries above it first) and keeps the
  items of a partial snapshot above it. Rebalance: a replica catches up completely and takes
  over with no new entry (docs/protocol.md §4.3: "other than at the end of a takeover").
  Either way the old primary is demoted and resyncs at once against the new primary with the
  producer rule, as a real replica would (it asks with its open checkpoint's range, start =
  high).
* **Consumers** (1-2 clients, and every replica) follow docs/protocol.md §4.4: they keep the
  log from the last successful STREAM_REQ, the last seq received (`seen`), the last marker's
  bounds and the last complete snapshot (`snapshot_seq`). A request is (start = seen, uuid =
  newest uuid of the kept log or 0, the marker bounds); the primary answers with
  `needs_rollback`; ROLLBACK(r) drops items above r, prunes the log above r and retries with
  (r, r, r); success replaces the kept log with the primary's. Items then arrive in
  snapshots cut at the primary's checkpoint ends (the first marker starts at the requested
  start, later ones at their first item, docs/protocol.md §2.7), and the consumer may stop
  part-way.

Properties, checked after every step for every consumer against the current primary (and
for each request a consumer makes), where `agree` is the largest s ≤ min(seen, primary high)
such that consumer and primary hold the same token at every seq ≤ s:

1. producer rule: no rollback ⇒ agree ≥ seen; rollback to r ⇒ r ≤ agree;
2. seed rule: `rollback_point(...).rollback_seq ≤ agree`, and it never reports a history the
   model produced as impossible;
3. `needs_rollback` equals a literal transcription of the docs/protocol.md §4.2 rule, on the
   model's states and on arbitrary generated requests (`test_producer_rule_matches_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from upr_cli.errors import UsageError
from upr_cli.failover import (
    FailoverLog,
    ImpossibleHistory,
    RollbackDecision,
    needs_rollback,
    rollback_point,
)
from upr_cli.position import StreamPosition

U64_MAX = 2**64 - 1


# -- docs/protocol.md §4.2, transcribed literally -----------------------------------------


def spec_needs_rollback(
    table: list[tuple[int, int]],
    start: int,
    high: int,
    uuid: int,
    snap_start: int,
    snap_end: int,
    purge_seqno: int,
    client_purge_seqno: int,
    strict: bool,
    coll_max_high: int | None,
) -> int | None:
    """docs/protocol.md §4.2 line by line: None means no rollback, else the rollback seqno.

    `table` is newest-first (uuid, seqno) pairs.
    """
    upper = high
    if start == 0 and (not strict or uuid == 0):
        return None  # no rollback
    exempt = (
        coll_max_high is not None
        and start < purge_seqno
        and start >= coll_max_high
        and coll_max_high <= purge_seqno
    )
    if start < purge_seqno and start != 0 and not exempt and client_purge_seqno != purge_seqno:
        return 0  # may have missed purged tombstones
    # table is newest-first; search from the OLDEST entry towards the newest
    for i in reversed(range(len(table))):
        if table[i][0] == uuid:
            if i > 0:
                upper = table[i - 1][1]  # where the next (newer) branch began
            break
    else:
        return 0  # no common history
    if start == snap_start:  # client has nothing of this snapshot yet
        snap_end = start
    if snap_end <= upper:
        return None  # histories agree
    if start == snap_end:  # client has the whole snapshot
        snap_start = start
    return upper if upper < snap_start else snap_start


def same_as_spec(decision: RollbackDecision, spec: int | None, start: int) -> bool:
    """Our decision (flag, seq) equals the spec's answer; no rollback means "start at start"."""
    if spec is None:
        return not decision.rollback and decision.rollback_seq == start
    return decision.rollback and decision.rollback_seq == spec


# -- the model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """A STREAM_REQ as a consumer sends it (docs/protocol.md §4.4)."""

    start: int
    uuid: int
    snap_start: int
    snap_end: int

    def __str__(self) -> str:
        return f"(start={self.start}, uuid={self.uuid:x}, snap=[{self.snap_start},{self.snap_end}])"


@dataclass
class Consumer:
    """What a DCP consumer keeps for the partition."""

    name: str
    log: FailoverLog
    items: list[str] = field(default_factory=list)  # items[s - 1] is the token at seq s
    snapshot_seq: int = 0  # last complete snapshot
    marker: tuple[int, int] = (0, 0)  # last marker's bounds

    @property
    def seen(self) -> int:
        return len(self.items)

    def request(self) -> Request:
        uuid = self.log.latest.uuid if self.log.entries else 0
        return Request(self.seen, uuid, *self.marker)

    def roll_back(self, r: int) -> None:
        """ROLLBACK(r): drop items above r, prune the log above r, next ask with (r, r, r)."""
        del self.items[r:]
        r = self.seen
        self.log = self.log.prune_above(r)
        self.snapshot_seq = r
        self.marker = (r, r)

    def describe(self) -> str:
        return (
            f"{self.name}: seen={self.seen} snapshot_seq={self.snapshot_seq} "
            f"marker={list(self.marker)} log={self.log} items={self.items}"
        )


@dataclass
class Node(Consumer):
    """A server's copy of the partition (a consumer too while it is a replica)."""

    persisted: int = 0
    persisted_range: tuple[int, int] = (0, 0)  # last_snap_start, last_snap_end on disk
    persisted_snapshot: int = 0  # last complete snapshot on disk
    ends: list[int] = field(default_factory=lambda: [0])  # complete snapshot / checkpoint ends

    @property
    def high(self) -> int:
        return len(self.items)

    def roll_back(self, r: int) -> None:
        super().roll_back(r)  # a replica rolls back on disk, so this is persisted at once
        self.ends = [e for e in self.ends if e < self.seen] + [self.seen]
        self.flush()

    def flush(self) -> None:
        """A replica persists all it received, with its last marker's range."""
        self.persisted = self.high
        self.persisted_range = self.marker
        self.persisted_snapshot = self.snapshot_seq

    def checkpoint_range(self, seq: int) -> tuple[int, int]:
        """The checkpoint holding `seq` (≥ 1): (first seq, end, or high if still open)."""
        prev = max(e for e in self.ends if e < seq)
        end = min((e for e in self.ends if e >= seq), default=self.high)
        return prev + 1, end

    def describe(self) -> str:
        return (
            f"{super().describe()} persisted={self.persisted} "
            f"persisted_range={list(self.persisted_range)} "
            f"persisted_snapshot={self.persisted_snapshot} ends={self.ends}"
        )


def agree(consumer: Consumer, primary: Node) -> int:
    """Largest s ≤ min(seen, high) with identical tokens at every seq ≤ s."""
    bound = min(consumer.seen, primary.high)
    s = 0
    while s < bound and consumer.items[s] == primary.items[s]:
        s += 1
    return s


class PartitionHistories(RuleBasedStateMachine):
    """Histories of one partition: nodes, failovers, crashes, clients (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[Node] = []
        self.clients: list[Consumer] = []
        self.primary = 0
        self.history: list[str] = []
        self._uuids = 0
        self._tokens = 0

    # -- helpers ----------------------------------------------------------------------

    @property
    def prim(self) -> Node:
        return self.nodes[self.primary]

    @property
    def replicas(self) -> list[Node]:
        return [n for i, n in enumerate(self.nodes) if i != self.primary]

    def fresh_uuid(self) -> int:
        self._uuids += 1
        return 0xA0 + self._uuids

    def note(self, line: str) -> None:
        self.history.append(line)

    def report(self, consumer: Consumer, problem: str) -> str:
        lines = [
            problem,
            "history:",
            *(f"  {i:2}. {h}" for i, h in enumerate(self.history, 1)),
            "state:",
            f"  primary {self.prim.describe()}",
            *(f"  replica {n.describe()}" for n in self.replicas),
            *(f"  client  {c.describe()}" for c in self.clients),
            f"checked consumer: {consumer.name}",
        ]
        return "\n".join(lines)

    def check(self, consumer: Consumer, when: str) -> RollbackDecision:
        """Properties 1-3 for `consumer` against the current primary; the producer's answer."""
        p = self.prim
        req = consumer.request()
        a = agree(consumer, p)
        d = needs_rollback(
            p.log,
            StreamPosition(0, req.uuid, req.start, req.snap_start, req.snap_end),
            high=p.high,
        )
        spec = spec_needs_rollback(
            list(p.log.pairs()),
            req.start,
            p.high,
            req.uuid,
            req.snap_start,
            req.snap_end,
            0,
            0,
            False,
            None,
        )
        head = f"[{when}] request {req} to {p.name} (high {p.high}, log {p.log}), agree={a}"
        assert same_as_spec(d, spec, req.start), self.report(
            consumer,
            f"{head}\nproducer rule differs from docs/protocol.md §4.2: ours rollback={d.rollback} "
            f"seq={d.rollback_seq} ({d.step}), spec {spec}",
        )
        if d.rollback:
            assert d.rollback_seq <= a, self.report(
                consumer,
                f"{head}\nUNSAFE producer rule: rollback to {d.rollback_seq} > agree {a} "
                f"({d.step}; {' / '.join(d.explanation)})",
            )
        else:
            assert a >= consumer.seen, self.report(
                consumer,
                f"{head}\nUNSAFE producer rule: no rollback, but the consumer's items diverge "
                f"above {a} ({d.step}; {' / '.join(d.explanation)})",
            )
        try:
            s = rollback_point(p.log, consumer.log, consumer.snapshot_seq, consumer.seen)
        except ImpossibleHistory as exc:
            raise AssertionError(
                self.report(
                    consumer, f"{head}\nseed rule calls a modelled history impossible: {exc}"
                )
            ) from None
        assert s.rollback_seq <= a, self.report(
            consumer,
            f"{head}\nUNSAFE seed rule: rollback_point(server {p.log}, client {consumer.log}, "
            f"snapshot {consumer.snapshot_seq}, seen {consumer.seen}) = {s.rollback_seq} > "
            f"agree {a} ({s.step}; {' / '.join(s.explanation)})",
        )
        event(f"producer rule: {d.step}")
        event(f"seed rule: {s.step}")
        return d

    def handshake(self, c: Consumer) -> list[str]:
        """STREAM_REQ until success, following the rollback protocol (docs/protocol.md §4.4)."""
        steps = []
        for _ in range(64):
            req = c.request()
            d = self.check(c, f"{c.name} asks")
            if not d.rollback:
                c.log = self.prim.log
                steps.append(f"{req} ok")
                return steps
            steps.append(f"{req} -> ROLLBACK {d.rollback_seq}")
            c.roll_back(d.rollback_seq)
        raise AssertionError(self.report(c, f"no agreement after 64 requests: {steps}"))

    def stream(self, c: Consumer, n: int) -> list[str]:
        """Receive up to n items in snapshots from the primary, starting at c.seen."""
        p = self.prim
        pos, got, first = c.seen, [], True
        while n > 0 and pos < p.high:
            end = min((e for e in p.ends if e > pos), default=p.high)
            c.marker = (pos if first else pos + 1, end)
            first = False
            k = min(n, end - pos)
            c.items.extend(p.items[pos : pos + k])
            pos, n = pos + k, n - k
            got.append(f"marker {list(c.marker)} items {pos - k + 1}..{pos}")
            if pos == end:
                c.snapshot_seq = end
                if isinstance(c, Node) and end > c.ends[-1]:
                    c.ends.append(end)
        return got

    def sync(self, c: Consumer, n: int) -> None:
        steps = self.handshake(c)
        got = self.stream(c, n)
        self.note(
            f"{c.name} streams from {self.prim.name}: {'; '.join(steps)}"
            + (f"; {'; '.join(got)}" if got else "; nothing received")
        )

    # -- rules ------------------------------------------------------------------------

    @initialize(
        n_nodes=st.integers(2, 3),
        n_clients=st.integers(1, 2),
        max_entries=st.sampled_from([3, 25]),
    )
    def setup(self, n_nodes: int, n_clients: int, max_entries: int) -> None:
        empty = FailoverLog((), max_entries)
        self.nodes = [Node(f"n{i}", empty) for i in range(n_nodes)]
        self.clients = [Consumer(f"c{i}", empty) for i in range(n_clients)]
        self.prim.log = empty.add_entry(self.fresh_uuid(), 0)
        self.note(f"{n_nodes} nodes, {n_clients} clients; n0 primary, log {self.prim.log}")

    @rule(k=st.integers(1, 3))
    def write(self, k: int) -> None:
        p = self.prim
        for _ in range(k):
            self._tokens += 1
            p.items.append(f"{p.name}.{self._tokens}")
        self.note(f"{p.name} writes {k}: high {p.high}")

    @rule()
    def checkpoint(self) -> None:
        p = self.prim
        if p.high > p.ends[-1]:
            p.ends.append(p.high)
            self.note(f"{p.name} closes a checkpoint at {p.high}")

    @rule(k=st.integers(1, 4))
    def persist(self, k: int) -> None:
        p = self.prim
        seq = min(p.high, p.persisted + k)
        if seq > p.persisted:
            p.persisted, p.persisted_range = seq, p.checkpoint_range(seq)
            first, end = p.persisted_range
            p.persisted_snapshot = seq if seq == end else first - 1
            self.note(f"{p.name} persists to {seq}, snapshot range {list(p.persisted_range)}")

    @rule()
    def crash_restart(self) -> None:
        p = self.prim
        lost = p.items[p.persisted :]
        del p.items[p.persisted :]
        p.ends = [e for e in p.ends if e < p.high] + [p.high]
        snap_start, snap_end = p.persisted_range
        seq = snap_end if p.high == snap_end else snap_start
        p.log = p.log.add_entry(self.fresh_uuid(), seq)
        p.marker, p.snapshot_seq = (p.high, p.high), p.high  # unused until it is demoted
        self.note(
            f"{p.name} crashes (lost {lost}), warms up at {p.high} with range "
            f"{[snap_start, snap_end]}: entry at {seq}, log {p.log}"
        )

    @rule(which=st.integers(0, 1), n=st.integers(0, 6))
    def replica_catches_up(self, which: int, n: int) -> None:
        replicas = self.replicas
        self.sync(replicas[which % len(replicas)], n)

    @rule(which=st.integers(0, 1), n=st.integers(0, 6))
    def client_streams(self, which: int, n: int) -> None:
        self.sync(self.clients[which % len(self.clients)], n)

    @rule(which=st.integers(0, 1))
    def promote(self, which: int) -> None:
        replicas = self.replicas
        new, old = replicas[which % len(replicas)], self.prim
        seq = new.snapshot_seq
        new.log = new.log.add_entry(self.fresh_uuid(), seq)
        if new.high > new.ends[-1]:
            new.ends.append(new.high)  # the partial snapshot's items stay
        self.primary = self.nodes.index(new)
        self.note(
            f"{new.name} promoted (high {new.high}, snapshot {seq}): log {new.log}; "
            f"{old.name} demoted"
        )
        self.demote(old)

    @rule(which=st.integers(0, 1))
    def takeover(self, which: int) -> None:
        """Rebalance: a replica catches up and takes over; no new entry (docs/protocol.md §4.3)."""
        new, old = self.replicas[which % len(self.replicas)], self.prim
        self.sync(new, old.high)
        if new.high > new.ends[-1]:
            new.ends.append(new.high)
        self.primary = self.nodes.index(new)
        self.note(f"{new.name} takes over from {old.name} at {new.high}: log {new.log}")
        self.demote(old)

    def demote(self, old: Node) -> None:
        """The old primary resumes as a consumer from its open checkpoint: start = high."""
        old.marker = (old.checkpoint_range(old.high)[0], old.high) if old.high else (0, 0)
        old.snapshot_seq = old.high
        self.sync(old, 0)

    @rule(which=st.integers(0, 1))
    def replica_flushes(self, which: int) -> None:
        r = self.replicas[which % len(self.replicas)]
        if r.persisted != r.high or r.persisted_range != r.marker:
            r.flush()
            self.note(f"{r.name} persists to {r.high}, snapshot range {list(r.marker)}")

    @rule(which=st.integers(0, 1))
    def replica_crashes(self, which: int) -> None:
        """A replica restarts from disk; replicas add no failover entry at warm-up."""
        r = self.replicas[which % len(self.replicas)]
        lost = r.items[r.persisted :]
        del r.items[r.persisted :]
        r.marker, r.snapshot_seq = r.persisted_range, r.persisted_snapshot
        r.ends = [e for e in r.ends if e <= r.snapshot_seq]
        self.note(
            f"{r.name} crashes (lost {lost}), warms up at {r.high}, marker {list(r.marker)}, "
            f"snapshot {r.snapshot_seq}"
        )

    # -- properties -------------------------------------------------------------------

    @invariant()
    def rules_are_safe_for_every_consumer(self) -> None:
        for c in [*self.clients, *self.replicas]:
            self.check(c, "after step")


PartitionHistories.TestCase.settings = settings(
    max_examples=1000, stateful_step_count=50, deadline=None, database=None
)
TestPartitionHistories = PartitionHistories.TestCase


# -- property 3 on arbitrary requests -----------------------------------------------------

seqs = st.one_of(st.integers(0, 12), st.integers(U64_MAX - 2, U64_MAX))


@st.composite
def tables(draw: st.DrawFn) -> list[tuple[int, int]]:
    n = draw(st.integers(1, 6))
    uuids = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n, unique=True))
    at = sorted(draw(st.lists(seqs, min_size=n, max_size=n)), reverse=True)
    return list(zip(uuids, at, strict=True))


@settings(max_examples=2000, deadline=None, database=None)
@given(
    table=tables(),
    data=st.data(),
    bounds=st.lists(seqs, min_size=3, max_size=3).map(sorted),
    high=seqs,
    purge=st.one_of(st.just(0), seqs),
    strict=st.booleans(),
    coll_max_high=st.one_of(st.none(), seqs),
)
def test_producer_rule_matches_spec(
    table: list[tuple[int, int]],
    data: st.DataObject,
    bounds: list[int],
    high: int,
    purge: int,
    strict: bool,
    coll_max_high: int | None,
) -> None:
    uuid = data.draw(st.one_of(st.sampled_from([u for u, _ in table]), st.integers(0, 10)))
    client_purge = data.draw(st.one_of(st.just(0), st.just(purge), seqs))
    snap_start, start, snap_end = bounds
    d = needs_rollback(
        FailoverLog.of(table),
        StreamPosition(0, uuid, start, snap_start, snap_end),
        high=high,
        purge_seq=purge,
        client_purge_seq=client_purge,
        strict=strict,
        collection_max_high=coll_max_high,
    )
    spec = spec_needs_rollback(
        table, start, high, uuid, snap_start, snap_end, purge, client_purge, strict, coll_max_high
    )
    assert same_as_spec(d, spec, start), (d, spec)


@st.composite
def bounds_not_around_start(draw: st.DrawFn) -> tuple[int, int, int]:
    """(snap_start, start, snap_end) with start below snap_start or above snap_end."""
    low, top = sorted(draw(st.lists(seqs, min_size=2, max_size=2, unique=True)))
    other = draw(seqs)
    if draw(st.booleans()):
        return top, low, max(top, other)  # start < snap_start
    return min(low, other), top, low  # start > snap_end


@settings(max_examples=300, deadline=None, database=None)
@given(bounds=bounds_not_around_start(), uuid=st.integers(0, 3), high=seqs)
def test_producer_rule_refuses_snapshots_not_around_start(
    bounds: tuple[int, int, int], uuid: int, high: int
) -> None:
    snap_start, start, snap_end = bounds
    with pytest.raises(UsageError, match="ERANGE"):
        needs_rollback(
            FailoverLog.of([(1, 0)]),
            StreamPosition(0, uuid, start, snap_start, snap_end),
            high=high,
        )
