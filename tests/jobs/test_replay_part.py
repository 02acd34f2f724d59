"""Replay's per-partition cut bookkeeping: a position is complete only at a snapshot end."""

from __future__ import annotations

from upr_cli.collections import ManifestChange
from upr_cli.jobs.replay import _Part
from upr_cli.position import StreamPosition
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord

UUID = 0xABC


def _row(seq: int) -> DcpRecord:
    return DcpRecord(OP_MUTATION, 0, seq, 1, seq, 0, 0, 0, 0, b"k%d" % seq, b"v", 0)


def test_a_stream_reopened_inside_a_snapshot_never_yields_a_complete_position() -> None:
    """Rows up to 13 of the snapshot [11, 20] arrived; the stream reopened from 13 (a
    state change): a cut at 13 is inside [11, 20], not a boundary."""
    st = _Part(0, StreamPosition(0, UUID, 10, 0, 10), StreamPosition(0, UUID, 10, 0, 10))
    st.uuid = UUID
    st.marks = [(11, 20)]
    st.rows = [_row(11), _row(13)]
    st.received = 13
    st.reset_to(StreamPosition(0, UUID, 13, 11, 20))
    got = st.take(13)
    assert got is not None
    rows, changes, position = got
    assert [r.by_seqno for r in rows] == [11, 13] and changes == []
    assert (position.seq, position.snap_start, position.snap_end) == (13, 11, 20)
    assert not position.complete


def test_a_cut_at_a_snapshot_end_is_complete_and_the_next_one_inside_is_not() -> None:
    st = _Part(0, StreamPosition(0, UUID, 0), StreamPosition(0, UUID, 0))
    st.uuid = UUID
    st.marks = [(1, 5), (6, 9)]
    st.rows = [_row(s) for s in (2, 5, 7)]
    st.received = 7
    got = st.take(5)
    assert got is not None
    position = got[2]
    assert position.complete and position.seq == 5
    st.applied = position
    got = st.take(7)
    assert got is not None
    position = got[2]
    assert (position.seq, position.snap_start, position.snap_end) == (7, 6, 9)


def test_manifest_changes_are_taken_with_the_rows_and_dropped_on_a_reopen() -> None:
    """A collection drop at 6 waits with the rows; a cut at 5 leaves it, one at 7 takes
    it; a reopen from 4 forgets everything above 4, the change too."""
    drop = ManifestChange(0, 6, "collection-dropped", 3, 8, 9)
    st = _Part(0, StreamPosition(0, UUID, 0), StreamPosition(0, UUID, 0))
    st.uuid = UUID
    st.marks = [(1, 7)]
    st.rows = [_row(s) for s in (2, 5, 7)]
    st.changes = [drop]
    st.received = st.complete = 7
    got = st.take(5)
    assert got is not None and got[1] == [] and st.changes == [drop]
    st.applied = got[2]
    got = st.take(7)
    assert got is not None and got[1] == [drop] and st.changes == []
    st.rows, st.changes = [_row(5)], [drop]
    st.reset_to(StreamPosition(0, UUID, 4, 1, 7))
    assert st.rows == [] and st.changes == []
