"""Replica undo (formats/cluster.md §5) on real SQLite files: a rollback to r restores,
for every key, the version it had at r, and removes the keys created above r."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from upr_cli.node.storage import DocRow, NodeStorage, PartitionRecord

VB = 3
KEYS = [b"a", b"b", b"c", b"d"]


def _doc(key: bytes, seq: int) -> DocRow:
    return DocRow(VB, key, seq, seq, seq, 0, 0, 0, False, 0, b"v%d" % seq)


def _record(seq: int) -> PartitionRecord:
    return PartitionRecord(VB, "replica", ((7, 0),), seq, 0, seq, seq)


def _flush(s: NodeStorage, keys: list[bytes], top: int, flushed: list[DocRow]) -> int:
    """Write one flush round: the newest version per key (the write queue dedups)."""
    newest: dict[bytes, DocRow] = {}
    for key in keys:
        top += 1
        newest[key] = _doc(key, top)
    docs = sorted(newest.values(), key=lambda d: d.seq)
    s.write_batch(docs, [_record(top)], undo={VB})
    flushed.extend(docs)
    return top


def _state_at(flushed: list[DocRow], seq: int) -> dict[bytes, DocRow]:
    out: dict[bytes, DocRow] = {}
    for d in flushed:
        if d.seq <= seq:
            out[d.key] = d
    return out


def _stored(s: NodeStorage) -> dict[bytes, DocRow]:
    return {k: d for k in KEYS if (d := s.get(VB, k)) is not None}


rounds = st.lists(st.lists(st.sampled_from(KEYS), min_size=1, max_size=5), max_size=6)


@settings(max_examples=80, deadline=None)
@given(
    before=st.lists(st.sampled_from(KEYS), max_size=4),
    first=rounds,
    second=rounds,
    cut1=st.floats(0, 1),
    cut2=st.floats(0, 1),
)
def test_rollback_restores_each_key_as_it_was(
    before: list[bytes], first: list[list[bytes]], second: list[list[bytes]],
    cut1: float, cut2: float,
) -> None:  # fmt: skip
    flushed: list[DocRow] = []
    with tempfile.TemporaryDirectory() as tmp, NodeStorage(Path(tmp), "u") as s:
        # versions persisted before the partition became replica (no undo for them)
        floor = 0
        for key in before:
            floor += 1
            s.write_batch([_doc(key, floor)], [_record(floor)])
            flushed.append(_doc(key, floor))
        s.start_undo(VB, floor)
        top = floor
        for rnd, cut in ((first, cut1), (second, cut2)):
            for keys in rnd:
                top = _flush(s, keys, top, flushed)
            to = floor + int(cut * (top - floor))
            above = [d for d in _stored(s).values() if d.seq > to]
            lost = s.rollback_replica(VB, to, _record(to))
            assert _stored(s) == _state_at(flushed, to)
            assert lost == len(above)
            flushed = [d for d in flushed if d.seq <= to]
            top = to
        kept = {(d.key, d.seq) for _to, d in s.lost_writes()}
        assert kept >= {(d.key, d.seq) for d in above}


def test_a_key_created_above_the_rollback_point_and_updated_disappears(tmp_path: Path) -> None:
    """The case the first implementation got wrong: no undo row for a creation, so the
    version the *update* replaced (created above r) came back."""
    with NodeStorage(tmp_path, "u") as s:
        s.start_undo(VB, 0)
        flushed: list[DocRow] = []
        top = _flush(s, [b"a"], 0, flushed)
        top = _flush(s, [b"a"], top, flushed)
        assert s.rollback_replica(VB, 0, _record(0)) == 1
        assert s.get(VB, b"a") is None
