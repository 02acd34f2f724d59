"""The consumer's stream state machine alone (dcp/streams.py): encoded DCP messages in,
rows, events and decisions out; no consumer, no node, no socket, no event loop."""

from __future__ import annotations

import ast
import inspect
from types import ModuleType

import pytest

from upr_cli.collections import CollectionsManifest, ManifestChange, Path, encode_event
from upr_cli.dcp import filter as filter_module
from upr_cli.dcp import streams as streams_module
from upr_cli.dcp.events import Snapshot, StreamEnded, StreamOpened
from upr_cli.dcp.filter import StreamFilter
from upr_cli.dcp.streams import KEEP_BOUNDARIES, Part, Streams
from upr_cli.failover import FailoverLog
from upr_cli.position import StreamPosition
from upr_cli.protocol import Frame, FrameDecoder, Message, decode_message, leb128
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.protocol.header import Opcode
from upr_cli.protocol.messages import (
    STREAM_FOREVER,
    Mutation,
    Response,
    SeqnoAdvanced,
    SnapshotMarker,
    StreamEnd,
    StreamRequest,
    SystemEvent,
)

OLD, NEW = 0xAAAA, 0xBBBB
ADDR = ("127.0.0.1", 11210)


def _streams(seq: int = 0, *, until_end: bool = False, end: int = STREAM_FOREVER,
             boundaries: list[int] | None = None) -> tuple[Streams, Part]:  # fmt: skip
    s = Streams(positions={0: StreamPosition(0, NEW, seq, seq, seq)}, until_end=until_end,
                boundaries={0: boundaries} if boundaries is not None else None)  # fmt: skip
    part = s.add(0, ADDR, None)
    part.end = end
    s.settled(part, pinned=True)
    part.begin()
    return s, part


def _feed(s: Streams, *msgs: Message, collections: bool = False) -> list[object]:
    dec = FrameDecoder(collections=collections)
    dec.feed(b"".join(m.encode() for m in msgs))
    out: list[object] = []
    while rows := dec.read_rows():
        out += s.feed(rows)
    return out


def _marker(start: int, end: int, flags: int = 1) -> SnapshotMarker:
    return SnapshotMarker(start_seqno=start, end_seqno=end, flags=flags)


def _mutation(seq: int, cid: int | None = None) -> Mutation:
    key = b"k%d" % seq
    return Mutation(by_seqno=seq, key=key if cid is None else leb128.join_key(cid, key))


# -- stream ends (docs/protocol.md §2.6) --------------------------------------------------

# status → the partition is done (True) or its stream is requested again (False)
END_STATUSES = [
    (0, True),  # OK: the end seq was reached
    (1, True),  # CLOSED: we closed it
    (2, False),  # STATE_CHANGED: the vbucket changed state (a takeover, a failover)
    (3, False),  # DISCONNECTED
    (4, False),  # TOO_SLOW: the server's buffer for us overflowed
    (5, False),  # BACKFILL_FAIL
    (6, False),  # ROLLBACK: reopened, and the request is answered ROLLBACK
    (7, True),  # FILTER_EMPTY: every collection of the filter was dropped
    (8, False),  # LOST_PRIVILEGES
]


@pytest.mark.parametrize(("status", "done"), END_STATUSES)
def test_a_stream_end_status_ends_the_partition_or_reopens_it(status: int, done: bool) -> None:
    s, part = _streams()
    out = _feed(s, _marker(0, 5), _mutation(3), StreamEnd(status=status))
    ended = [e for e in out if isinstance(e, StreamEnded)]
    assert [(e.status, e.position.seq) for e in ended] == [(status, 3)]  # always told
    assert part.done is done
    assert s.reopen == ([] if done else [part])


@pytest.mark.parametrize("status", [2, 3, 4])
def test_a_finite_stream_that_reached_its_end_is_done_whatever_the_status(status: int) -> None:
    s, part = _streams(until_end=True, end=3)
    _feed(s, _marker(0, 3), _mutation(3), StreamEnd(status=status))
    assert part.done
    assert s.reopen == []


def test_a_finite_stream_short_of_its_end_is_reopened() -> None:
    s, part = _streams(until_end=True, end=9)
    _feed(s, _marker(0, 9), _mutation(3), StreamEnd(status=3))
    assert not part.done
    assert s.reopen == [part]


def test_a_catch_up_stream_that_reached_its_catch_up_seq_reopens_silently() -> None:
    s, part = _streams(seq=2)
    s.filter = StreamFilter(ids={9})
    part.filter = s.filter.copy()
    part.pending, part.catchup, part.end = {0x90}, 6, 20
    req = s.request(part)
    assert (req.end_seqno, req.value) == (6, b"")  # unfiltered, up to the catch-up seq
    assert part.keep == {9, 0x90}
    out = _feed(s, _marker(3, 6), _mutation(4, 9), _mutation(5, 0), StreamEnd(status=0),
                collections=True)  # fmt: skip
    assert [bytes(r.key) for r in out if isinstance(r, DcpRecord)] == [b"k4"]  # 0: not followed
    assert not any(isinstance(e, StreamEnded) for e in out)
    assert s.reopen == [part]
    assert (part.catchup, part.done) == (5, False)
    assert s.request(part).value == b'{"collections":["9"]}'  # filtered again from here


# -- snapshot markers and boundaries (docs/design.md, "Snapshot boundaries") -------------


def test_a_marker_that_asks_for_it_is_acknowledged_on_its_partitions_link() -> None:
    s, _part = _streams()
    out = _feed(s, _marker(0, 5, flags=0x08 | 1), _marker(6, 9))
    assert [e for e in out if isinstance(e, Snapshot)] == [Snapshot(0, 0, 5, 9),
                                                          Snapshot(0, 6, 9, 1)]  # fmt: skip
    ((addr, data),) = s.outbox
    (frame,) = _frames(data)
    ack = decode_message(frame)
    assert addr == ADDR
    assert isinstance(ack, Response) and ack.opcode == Opcode.DCP_SNAPSHOT_MARKER


def _frames(data: bytes) -> list[Frame]:
    dec = FrameDecoder()
    dec.feed(data)
    return list(dec.frames())


# (markers and rows fed, as ("m", start, end) or ("r", seq, 0)) → the boundaries known
BOUNDARIES = [
    ([], [0]),  # the start position is one
    ([("m", 0, 10), ("r", 4, 0)], [0]),  # inside the first snapshot
    ([("m", 0, 10), ("r", 4, 0), ("m", 11, 20), ("r", 12, 0)], [0, 10]),  # the next marker
    ([("m", 0, 10), ("r", 10, 0), ("m", 11, 20), ("r", 20, 0)], [0, 10, 20]),  # at its end
    ([("m", 0, 10), ("r", 10, 0), ("m", 11, 20), ("r", 15, 0)], [0, 10]),
]


@pytest.mark.parametrize(("fed", "known"), BOUNDARIES)
def test_snapshot_boundaries_known(fed: list[tuple[str, int, int]], known: list[int]) -> None:
    s, _part = _streams()
    _feed(s, *[_marker(a, b) if kind == "m" else _mutation(a) for kind, a, b in fed])
    assert s.boundaries(0) == known


def test_boundaries_are_trimmed_to_the_newest_when_too_many() -> None:
    s, part = _streams()
    n = 2 * KEEP_BOUNDARIES + 1
    msgs: list[Message] = []
    for i in range(n + 1):
        msgs += [_marker(10 * i + 1, 10 * i + 10), _mutation(10 * i + 10)]
    _feed(s, *msgs)
    assert len(part.bounds) == KEEP_BOUNDARIES + 1
    assert part.bounds[-1] == 10 * n
    assert part.bounds[0] == 10 * (n - KEEP_BOUNDARIES)


def test_a_new_stream_forgets_the_boundaries_above_where_it_starts() -> None:
    s, part = _streams()
    _feed(s, _marker(0, 10), _mutation(10), _marker(11, 20), _mutation(20), _marker(21, 30))
    s.committed[0] = (NEW, 10, 0, 10)
    s.reset(part)
    part.begin()
    assert part.bounds == [0, 10]
    assert s.boundaries(0) == [0, 10]


# -- ROLLBACK answers --------------------------------------------------------------------

LOG = FailoverLog.sanitised(((NEW, 15), (OLD, 0)))

# (the caller's boundaries, where the partition stands, the failover log, r) →
# (where it restarts, on which branch)
ROLLBACKS = [
    ([], 30, LOG, 30, (30, NEW)),  # r is where it stands: a boundary
    ([10, 20], 30, LOG, 25, (20, NEW)),  # inside a snapshot: the boundary below
    ([10, 20], 30, LOG, 12, (10, OLD)),  # below the branch point: the older branch
    ([10, 20], 30, LOG, 5, (0, OLD)),  # below every boundary: the beginning
    ([10, 20], 30, FailoverLog(), 25, (20, NEW)),  # no log kept: the position's branch
    ([40], 30, LOG, 35, (30, NEW)),  # a caller's boundary above where it stands is no use
]


@pytest.mark.parametrize(("bounds", "seq", "log", "r", "restart"), ROLLBACKS)
def test_a_rollback_goes_back_to_a_boundary_on_its_branch(
    bounds: list[int], seq: int, log: FailoverLog, r: int, restart: tuple[int, int]
) -> None:
    s = Streams(positions={0: StreamPosition(0, NEW, seq, seq, seq)}, boundaries={0: bounds})
    part = s.add(0, ADDR, log)
    s.stale = False
    ev = s.rollback(part, r)
    to, uuid = restart
    assert s.events == [ev]
    assert (ev.asked, ev.to_seq, ev.uuid, ev.previous.seq) == (r, to, uuid, seq)
    assert part.position() == StreamPosition(0, uuid, to, to, to)
    assert s.committed[0] == (uuid, to, to, to)  # a reconnect resumes from there
    assert s.stale
    assert all(e.seq <= to for e in part.log.entries)  # the log is pruned above it
    assert all(b <= to for b in s.bounds[0])


def test_a_rollback_takes_back_the_drops_above_it() -> None:
    s, part = _streams(seq=10)
    part.filter = StreamFilter(ids={9})
    part.forgotten = {0x90: 8}
    part.delivered = [ManifestChange(0, 9, "collection-dropped", 3, 8, 0x91)]
    s.rollback(part, 5)
    assert part.delivered == []  # handed over again
    assert part.pending == {0x90}  # forgotten: caught up on, unfiltered
    assert part.forgotten == {}
    assert 0 in s.settling


# -- the stream request ------------------------------------------------------------------


def test_the_request_starts_where_the_partition_stands() -> None:
    s, part = _streams(seq=7)
    part.filter = StreamFilter(ids={9, 10})
    req = s.request(part)
    assert isinstance(req, StreamRequest)
    assert (req.vbucket, req.start_seqno, req.vbucket_uuid, req.snap_end_seqno) == (0, 7, NEW, 7)
    assert req.end_seqno == STREAM_FOREVER
    assert req.value == b'{"collections":["9","a"]}'
    assert part.keep is None


def test_an_accepted_stream_moves_the_position_to_the_newest_branch() -> None:
    s, part = _streams(seq=7)
    part.uuid = OLD
    req = s.request(part)
    s.accepted(part, ((NEW, 5), (OLD, 0)), req)
    (opened,) = s.events
    assert isinstance(opened, StreamOpened)
    assert opened.position == StreamPosition(0, OLD, 7, 7, 7)  # where it was asked
    assert part.uuid == NEW


# -- collections: the filter, its drops and its resume (docs/protocol.md §12.4) ---------

MANIFEST = CollectionsManifest.from_json(
    b'{"uid":"5","scopes":[{"name":"_default","uid":"0","collections":'
    b'[{"name":"_default","uid":"0"}]},{"name":"app","uid":"8","collections":'
    b'[{"name":"users","uid":"9"}]}]}'
)


def _dropped(seq: int, cid: int) -> SystemEvent:
    ev, version, key, value = encode_event(ManifestChange(0, seq, "collection-dropped", 6, 8, cid))
    return SystemEvent(by_seqno=seq, event=ev, version=version, key=key, value=value)


def test_a_resumed_filter_catches_up_on_the_ids_the_source_no_longer_has() -> None:
    s = Streams(positions={0: StreamPosition(0, NEW, 4), 1: StreamPosition(1, NEW, 0)},
                collections=[Path("app", "users"), Path("app", "orders")],
                followed_ids=[9, 0x90])  # fmt: skip
    s.resolve(MANIFEST)  # app.orders was dropped since: lenient, as a resume
    assert s.filter is not None and s.filter.ids == {9}
    p0, p1 = s.add(0, ADDR, None), s.add(1, ADDR, None)
    assert (p0.pending, p1.pending) == ({0x90}, set())  # p1 starts at 0: it holds none
    assert s.need_catchup([p0, p1]) == [p0]  # its catch-up seq is still to be pinned
    s.highs.update({0: 12, 1: 12})
    s.settled(p0, pinned=True)  # at open, the high read after the manifest
    assert p0.catchup == 12
    assert s.need_catchup([p0]) == []
    assert s.followed(0) == {9, 0x90}
    req = s.request(p0)
    assert (req.start_seqno, req.end_seqno, req.value) == (4, 12, b"")


def test_a_drop_is_forgotten_once_the_caller_committed_past_it() -> None:
    s, part = _streams(seq=2)
    s.filter = StreamFilter(ids={9, 0x90})
    part.filter = s.filter.copy()
    out = _feed(s, _marker(3, 5), _dropped(4, 0x90), _mutation(5, 9), collections=True)
    assert [c.collection_id for c in out if isinstance(c, ManifestChange)] == [0x90]
    s.commit({0: StreamPosition(0, NEW, 3)})
    assert s.followed(0) == {9, 0x90}  # not committed past its drop yet
    s.commit()
    assert s.followed(0) == {9}
    assert part.forgotten == {0x90: 4}
    assert s.settling == set()


def test_a_filter_that_lost_every_collection_ends_its_stream() -> None:
    s, part = _streams(seq=2)
    part.filter = StreamFilter(ids=set())
    s.filter = StreamFilter(ids={9})
    assert s.filter_ended(part)
    (ended,) = s.events
    assert isinstance(ended, StreamEnded) and ended.status == 7
    assert part.done and s.filter_emptied


def test_a_refused_filter_is_judged_by_the_nodes_manifest() -> None:
    s, part = _streams(seq=2)
    part.filter = StreamFilter(ids={9, 0x90})
    s.uid = 6
    assert s.refilter(part, MANIFEST) == "behind"  # uid 5: the newest has not reached it
    s.uid = 5
    assert s.refilter(part, MANIFEST) == "changed"
    assert (part.filter.ids, part.pending, part.catchup) == ({9}, {0x90}, None)
    assert s.refilter(part, MANIFEST) == "stands"


# -- positions and commits ---------------------------------------------------------------


def test_positions_advance_as_items_arrive_and_commit_copies_the_moved_ones() -> None:
    s, part = _streams()
    s.commit()
    other = s.add(1, ADDR, None)
    s.settled(other, pinned=True)
    _feed(s, _marker(0, 9), _mutation(3), SeqnoAdvanced(by_seqno=6))
    assert part.seq == 6
    assert s.committed[0] == (NEW, 0, 0, 0)
    s.commit()
    assert s.committed[0] == (NEW, 6, 0, 9)
    assert s.dirty == set()


@pytest.mark.parametrize("module", [streams_module, filter_module])
def test_the_state_machine_does_no_io(module: ModuleType) -> None:
    """Sans-IO (the h11 shape): no asyncio, socket or network layer below it."""
    tree = ast.parse(inspect.getsource(module))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    io = {n for n in names if n.split(".")[0] in ("asyncio", "socket", "ssl", "selectors")
          or n.startswith(("upr_cli.net", "upr_cli.dcp.links", "upr_cli.dcp.opening"))}  # fmt: skip
    assert names and not io
