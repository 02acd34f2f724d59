"""The consumer's snapshot boundaries (docs/design.md, "Snapshot boundaries"), driven
through its real decode path with encoded DCP messages: no node, no socket."""

from __future__ import annotations

from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import Rollback
from upr_cli.dcp.streams import Part as _Part
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import FrameDecoder
from upr_cli.protocol.messages import Mutation, SnapshotMarker

UUID = 0xABCDEF


def _consumer(seq: int = 0) -> tuple[DcpConsumer, _Part]:
    c = DcpConsumer(SourceUri.parse("upr://127.0.0.1:1/default"), partitions=[0])
    part = _Part(0, UUID, seq, seq, seq)
    c.parts[0] = part
    c._committed[0] = (UUID, seq, seq, seq)
    c._begin_stream(part)
    return c, part


def _feed(c: DcpConsumer, *msgs: tuple[str, int, int]) -> None:
    """('m', start, end) is a snapshot marker, ('r', seq, 0) a mutation of key k<seq>."""
    wire = b""
    for kind, a, b in msgs:
        if kind == "m":
            wire += SnapshotMarker(vbucket=0, opaque=1, start_seqno=a, end_seqno=b,
                                   flags=1).encode()  # fmt: skip
        else:
            wire += Mutation(vbucket=0, opaque=1, by_seqno=a, key=b"k%d" % a).encode()
    dec = FrameDecoder()
    dec.feed(wire)
    c._decode(dec.read_rows())


def _rolled(c: DcpConsumer) -> Rollback:
    (ev,) = [e for e in c._events if isinstance(e, Rollback)]
    return ev


def test_snapshots_completed_on_the_stream_are_boundaries() -> None:
    c, part = _consumer()
    _feed(c, ("m", 0, 10), ("r", 4, 0), ("r", 10, 0), ("m", 11, 20), ("r", 15, 0), ("r", 20, 0),
          ("m", 21, 30), ("r", 25, 0))  # fmt: skip
    assert c.boundaries(0) == [0, 10, 20]
    c._rollback(part, 17)  # inside [11, 20]: back to 10, not 17
    ev = _rolled(c)
    assert (ev.asked, ev.to_seq) == (17, 10)
    assert part.position().seq == part.snap_start == part.snap_end == 10


def test_a_snapshot_ending_where_the_next_marker_comes_is_complete_without_its_end_row() -> None:
    c, part = _consumer()
    _feed(c, ("m", 0, 10), ("r", 4, 0))
    assert c.boundaries(0) == [0]  # 10 is not reached while the snapshot may go on
    _feed(c, ("m", 11, 20), ("r", 12, 0))
    assert c.boundaries(0) == [0, 10]  # the next marker says [0, 10] was sent whole
    assert part.seq == 12


def test_boundaries_of_a_stream_a_reconnect_threw_away_are_forgotten() -> None:
    """Stream 1 completes 10 and 20; the sink committed 10 only; the link drops. Stream 2,
    from 10, sends [10, 40] deduplicated across 20. A ROLLBACK(25) must land on 10: 20 was
    a boundary of stream 1, not of what the sink holds now."""
    c, part = _consumer()
    _feed(c, ("m", 0, 10), ("r", 10, 0), ("m", 11, 20), ("r", 20, 0), ("m", 21, 30),
          ("r", 22, 0))  # fmt: skip
    c._committed[0] = (UUID, 10, 0, 10)
    c._reset(part)
    c._begin_stream(part)  # as _open_streams does for the new stream
    _feed(c, ("m", 10, 40), ("r", 27, 0), ("r", 40, 0))
    assert 20 not in c.boundaries(0)
    c._rollback(part, 25)
    assert _rolled(c).to_seq == 10


def test_the_callers_boundaries_count_and_a_rollback_prunes_them() -> None:
    c = DcpConsumer(SourceUri.parse("upr://127.0.0.1:1/default"), partitions=[0],
                    boundaries={0: [3, 8, 15]})  # fmt: skip
    c._bounds[0] = [b for b in c._bounds[0] if b <= 15]
    part = _Part(0, UUID, 15, 15, 15)
    c.parts[0] = part
    c._committed[0] = (UUID, 15, 15, 15)
    c._rollback(part, 12)
    assert _rolled(c).to_seq == 8
    assert c.boundaries(0) == [3, 8]


def test_without_any_known_boundary_a_rollback_resets() -> None:
    c, part = _consumer()
    _feed(c, ("m", 0, 10), ("r", 5, 0))  # partial, and the stream began at 0
    part.seq = 7
    c._events.clear()
    c._rollback(part, 6)
    assert _rolled(c).to_seq == 0
