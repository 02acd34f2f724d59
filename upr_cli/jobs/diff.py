"""`upr diff A B`: how two holders of a bucket's history relate, partition by partition.

Theory of operation (the UPR design specification, "Failover Log" and "How UPR
Replicas/Clients find out where to rollback to and stream from"). A failover log names
the branches a partition's history went through, newest first: (uuid, seq) says "from
seq on, history follows branch uuid". Two logs share history up to their newest common
entry (the common ancestor, matched by uuid and seq). After it, A followed the
ancestor's branch up to `a_end` (the seq of A's next newer entry, else A's own seq) and
B up to `b_end`; both hold the same history up to S = min(a_end, b_end), so:

* no newer entries on either side: one branch; equal seqs are **identical**, else B is
  **behind** or **ahead**;
* newer entries on A's side only: B is **behind** when it holds nothing above A's
  branch point (b_seq ≤ a_end): it can catch up from A; else it **diverged** at a_end
  (B's seqs above are writes A's history does not have: lost writes);
* the mirror case gives **ahead** or **diverged** at b_end;
* newer entries on both sides: **diverged** at S;
* no common entry: **no common history** (B must start again from 0).

For each partition both rollback rules give where B would restart streaming from A: the
seed rule (B's log, last complete snapshot, seen seq) and the producer rule
(docs/protocol.md §4.2: B's position against A's log, A's high seq).

When B is a replay store (sqlite:PATH), a diverged partition also names its lost keys:
the store's documents above the divergence, tombstones included, each a (collection,
key) pair, since the same key may be in several collections (formats/store.md §3.2).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from upr_cli.errors import UprError
from upr_cli.failover import FailoverEntry, needs_rollback, rollback_point
from upr_cli.jobs.rollback_point import SourceState, load_source
from upr_cli.net.tls import ClientTls
from upr_cli.position import StreamPosition

STATUSES = (
    "identical",
    "behind",
    "ahead",
    "diverged",
    "no-common-history",
    "only-in-a",
    "only-in-b",
)


@dataclass(frozen=True, slots=True)
class PartitionDiff:
    """How B's history of one partition relates to A's."""

    partition: int
    status: str
    a_seq: int | None = None
    b_seq: int | None = None
    diverged_at: int | None = None
    common_ancestor: FailoverEntry | None = None
    only_in_a: tuple[FailoverEntry, ...] = ()
    only_in_b: tuple[FailoverEntry, ...] = ()
    seed_rule: int | str | None = None  # rollback seq, or why there is none
    dcp_rule: int | str | None = None
    lost_seqs: tuple[int, int] | None = None  # (from, to]: B's seqs not in A's history
    lost_keys: tuple[LostKey, ...] = ()  # B's documents in lost_seqs (B a store only)

    def to_json(self) -> dict[str, Any]:
        """JSON form: seqs and uuids as decimal strings (docs/output.md §4)."""

        def ent(e: FailoverEntry) -> dict[str, str]:
            return {**e.to_json(), "uuid_hex": f"{e.uuid:x}"}

        return {
            "partition": self.partition,
            "status": self.status,
            "a_seq": _dec(self.a_seq),
            "b_seq": _dec(self.b_seq),
            "diverged_at": _dec(self.diverged_at),
            "common_ancestor": None if self.common_ancestor is None else ent(self.common_ancestor),
            "only_in_a": [ent(e) for e in self.only_in_a],
            "only_in_b": [ent(e) for e in self.only_in_b],
            "rollback_seqs": {"seed": _dec(self.seed_rule), "dcp": _dec(self.dcp_rule)},
            "lost_seqs": None if self.lost_seqs is None else [str(s) for s in self.lost_seqs],
            "lost_keys": [k.to_json() for k in self.lost_keys],
        }


@dataclass(frozen=True, slots=True)
class LostKey:
    """A key B holds above the divergence, in its collection (names where B has them)."""

    collection_id: int
    scope: str | None
    collection: str | None
    key: bytes
    seq: int
    deleted: bool

    def __str__(self) -> str:
        """`scope.collection:key` outside the default collection, else the key."""
        key = self.key.decode(errors="backslashreplace")
        if not self.collection_id:
            return key
        if self.collection is None:
            return f"#{self.collection_id:x}:{key}"
        return f"{self.scope}.{self.collection}:{key}"

    def to_json(self) -> dict[str, Any]:
        """JSON form: names and id, the key as text (or base64), the seq as a string."""
        try:
            key: dict[str, str] = {"key": self.key.decode()}
        except UnicodeDecodeError:
            key = {"key_b64": base64.b64encode(self.key).decode()}
        return {"scope": self.scope, "collection": self.collection,
                "collection_id": self.collection_id, **key, "seq": str(self.seq),
                "deleted": self.deleted}  # fmt: skip


def _dec(value: int | str | None) -> str | None:
    """A seq as a decimal string; a rule's "none: why" and a missing seq pass through."""
    return str(value) if isinstance(value, int) else value


@dataclass
class DiffReport:
    """Every partition's diff and the counts per status."""

    a: str
    b: str
    partitions: list[PartitionDiff] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        """Partitions per status (every status present, zeros included)."""
        out = dict.fromkeys(STATUSES, 0)
        for d in self.partitions:
            out[d.status] += 1
        return out

    @property
    def identical(self) -> bool:
        """True when every partition is identical."""
        return all(d.status == "identical" for d in self.partitions)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "counts": self.counts,
            "partitions": [d.to_json() for d in self.partitions],
        }


def _position(b: SourceState, partition: int) -> StreamPosition:
    """B's stream position: as recorded, else its newest branch at its seen seq."""
    if b.position is not None:
        return b.position
    uuid = b.log.latest.uuid if b.log.entries else 0
    snap = min(b.snapshot_seq, b.seen_seq)
    return StreamPosition(partition, uuid, b.seen_seq, snap, b.seen_seq)


def _rules(partition: int, a: SourceState, b: SourceState) -> tuple[int | str, int | str]:
    try:
        seed: int | str = rollback_point(a.log, b.log, b.snapshot_seq, b.seen_seq).rollback_seq
    except UprError as exc:
        seed = f"none: {exc}"
    if not a.known_seq:
        return seed, "none: A's high seq is unknown (the JSON gives no seq)"
    pos = _position(b, partition)
    try:
        d = needs_rollback(a.log, pos, high=a.seen_seq)
        dcp: int | str = d.rollback_seq
    except UprError as exc:
        dcp = f"none: {exc}"
    return seed, dcp


def compare(partition: int, a: SourceState, b: SourceState) -> PartitionDiff:
    """The diff of one partition (module docstring)."""
    seed, dcp = _rules(partition, a, b)
    a_seq, b_seq = a.seen_seq, b.seen_seq
    b_pairs = {(e.uuid, e.seq) for e in b.log.entries}
    ia = next((i for i, e in enumerate(a.log.entries) if (e.uuid, e.seq) in b_pairs), None)

    def mk(status: str, at: int | None = None, ancestor: FailoverEntry | None = None,
           new_a: tuple[FailoverEntry, ...] = (), new_b: tuple[FailoverEntry, ...] = ()
           ) -> PartitionDiff:  # fmt: skip
        lost = (at, b_seq) if at is not None and b_seq > at else None
        return PartitionDiff(partition, status, a_seq, b_seq, at, ancestor, new_a, new_b,
                             seed, dcp, lost)  # fmt: skip

    if ia is None:
        if not a.log.entries and not b.log.entries and a_seq == b_seq == 0:
            return mk("identical")
        return mk("no-common-history", 0, None, a.log.entries, b.log.entries)
    ancestor = a.log.entries[ia]
    key = (ancestor.uuid, ancestor.seq)
    ib = next(i for i, e in enumerate(b.log.entries) if (e.uuid, e.seq) == key)
    new_a, new_b = a.log.entries[:ia], b.log.entries[:ib]
    a_end = new_a[-1].seq if new_a else a_seq
    b_end = new_b[-1].seq if new_b else b_seq
    if not new_a and not new_b:
        if not a.known_seq or not b.known_seq or a_seq == b_seq:
            return mk("identical", None, ancestor)
        return mk("behind" if b_seq < a_seq else "ahead", None, ancestor)
    if new_a and not new_b:
        if b_seq <= a_end:
            return mk("behind", None, ancestor, new_a)
        return mk("diverged", a_end, ancestor, new_a)
    if new_b and not new_a:
        if a_seq <= b_end:
            return mk("ahead", None, ancestor, (), new_b)
        return mk("diverged", b_end, ancestor, (), new_b)
    return mk("diverged", min(a_end, b_end), ancestor, new_a, new_b)


def diff_sources(
    a: str, b: str, partitions: list[int] | None = None, tls: ClientTls | None = None
) -> DiffReport:
    """Load both sources (upr://, repo:, sqlite:, JSON; `tls` for uprs:// ones) and
    compare every partition."""
    sa = _load(a, partitions, tls)
    sb = _load(b, partitions, tls)
    report = DiffReport(_redact(a), _redact(b))
    for p in sorted(set(sa) | set(sb)):
        if p not in sb:
            report.partitions.append(PartitionDiff(p, "only-in-a", a_seq=sa[p].seen_seq))
        elif p not in sa:
            report.partitions.append(PartitionDiff(p, "only-in-b", b_seq=sb[p].seen_seq))
        else:
            report.partitions.append(compare(p, sa[p], sb[p]))
    if b.startswith("sqlite:") and any(d.lost_seqs for d in report.partitions):
        report.partitions = _with_lost_keys(Path(b.removeprefix("sqlite:")), report.partitions)
    return report


def _load(spec: str, partitions: list[int] | None, tls: ClientTls | None
          ) -> dict[int, SourceState]:  # fmt: skip
    """`load_source`, but a repository at a time (`repo:DIR@TIME`) is read here: each
    partition at its restore point (`jobs.state.select`, as `restore --at-time`)."""
    from upr_cli.repo.pitr import looks_like_time
    from upr_cli.source import parse_source

    if spec.startswith("repo:"):
        source = parse_source(spec, {"repo"})
        if source.path is not None and source.at is not None and looks_like_time(source.at):
            return repo_states_at(source.path, source.at, partitions)
    return load_source(spec, partitions, tls, "diff")


def repo_states_at(path: Path, at: str, partitions: list[int] | None) -> dict[int, SourceState]:
    """Per partition, the failover log and position of the state at `at` (a time):
    the restore point's backup, its position moved down to the point (`pitr.resume_at`)."""
    import contextlib

    from upr_cli.jobs.state import select
    from upr_cli.repo.pitr import resume_at
    from upr_cli.source import open_bucket

    with contextlib.ExitStack() as held:
        _repo, b, manifests = open_bucket(path, None, at, held=held, command="diff")
        sel = select(manifests, at, partitions, bucket=b, option="@")
    out = {}
    assert sel.point is not None
    for p, pick in sel.point.picks.items():
        rp = resume_at(manifests, p, pick)
        if rp is not None:
            pos = rp.position
            out[p] = SourceState(rp.failover_log, pos.seq, pos.seq, pos)
    return out


def _with_lost_keys(path: Path, diffs: list[PartitionDiff]) -> list[PartitionDiff]:
    """The diffs, each diverged one with the store's documents above its divergence."""
    from upr_cli.store import Store

    with Store(path, create=False) as store:
        names = store.collections()
        out = []
        for d in diffs:
            if d.lost_seqs is not None:
                keys = []
                for doc in store.documents_above(d.partition, d.lost_seqs[0]):
                    c = names.get(doc.collection)
                    keys.append(LostKey(doc.collection, c.scope if c else None,
                                        c.name if c else None, bytes(doc.key), doc.seq,
                                        doc.deleted))  # fmt: skip
                d = replace(d, lost_keys=tuple(sorted(keys, key=lambda k: k.seq)))
            out.append(d)
    return out


def _redact(spec: str) -> str:
    if spec.startswith(("upr://", "couchbase://", "uprs://", "couchbases://")):
        from upr_cli.net.uri import SourceUri

        return SourceUri.parse(spec).redacted()
    return spec
