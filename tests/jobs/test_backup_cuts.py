"""Cut-back segments an interrupted backup left are listed again by the next run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.segments.test_segments import header, rows_for
from upr_cli.jobs.backup import _leftover_cuts
from upr_cli.repo import format_segment_name
from upr_cli.segments import SegmentWriter


def _cut(directory: Path, k: int, part: int, seqs: list[int], to: int) -> Path:
    d = directory / f"cut-{k}"
    d.mkdir(exist_ok=True)
    w = SegmentWriter(d / "x.open", header(start=to, end=seqs[-1], part=part))
    w.add(rows_for(seqs, part))
    return Path(w.finish(path=d / format_segment_name(part, seqs[0], seqs[-1])).path)


def test_leftover_cuts_are_renumbered_in_order_and_broken_ones_left_alone(tmp_path: Path) -> None:
    a = _cut(tmp_path, 2, 3, [11, 12, 13], 10)
    b = _cut(tmp_path, 5, 3, [21, 22], 20)
    c = _cut(tmp_path, 1, 7, [5], 4)
    bad = _cut(tmp_path, 3, 3, [31, 32], 30)
    bad.write_bytes(bad.read_bytes()[:-3])  # truncated: not verifiable
    (tmp_path / "cut-1" / "notes.txt").write_text("a user's file")
    found = _leftover_cuts(tmp_path)
    assert sorted(found) == [3, 7]
    assert [(f, t, Path(i.path).relative_to(tmp_path).as_posix()) for f, t, i in found[3]] == [
        (13, 10, f"cut-1/{a.name}"),
        (22, 20, f"cut-2/{b.name}"),
    ]
    assert [(f, t, Path(i.path).name) for f, t, i in found[7]] == [(5, 4, c.name)]
    assert (tmp_path / "cut-1" / a.name).exists() and (tmp_path / "cut-2" / b.name).exists()
    assert not a.exists() and not b.exists() and bad.exists()  # moved; the broken one stays


def _open_segment(tmp_path: Path) -> tuple[Any, list[int], Callable[..., SegmentWriter]]:
    """Partition 3's open segment of a run that began at 100, holding records 101-150."""
    from upr_cli.jobs.backup_stream import _Open

    hdr = header(start=100, end=200, part=3)
    w = SegmentWriter(tmp_path / "p0003.open", hdr)
    w.add(rows_for(list(range(101, 151)), 3))

    def open_cut(p: int, log: object, r: int, k: int) -> SegmentWriter:
        return SegmentWriter(tmp_path / f"p{p:04x}.cut-{k}", header(start=r, end=r, part=p))

    return _Open(3, w, hdr.failover_log, 100), [w.buffered], open_cut


def test_a_cut_that_takes_every_record_leaves_no_empty_segment(tmp_path: Path) -> None:
    """A rollback to the run's start, the new active holding nothing more: the records
    move to cut-1/, and the partition's own segment is dropped, not written empty."""
    from upr_cli.dcp.events import StreamEnded
    from upr_cli.jobs.backup_stream import _cut, _finish
    from upr_cli.position import StreamPosition

    st, held, open_cut = _open_segment(tmp_path)
    _cut(st, 150, 100, 100, held, open_cut, format_segment_name)
    ended = StreamEnded(3, 0, StreamPosition(3, st.log.latest.uuid, 100, 100, 100))
    res = _finish(st, ended, tmp_path, format_segment_name, held)
    assert res.segment is None and res.items == 0 and held == [0]
    assert [(f, t, i.records) for f, t, i in res.cuts] == [(150, 100, 50)]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.seg")) == [
        f"cut-1/{format_segment_name(3, 101, 150)}"
    ]


def test_a_cut_below_the_asked_seq_keeps_only_what_the_source_lost(tmp_path: Path) -> None:
    """ROLLBACK(120) inside a snapshot the run received: the consumer goes back to the
    boundary 110. Records above 120 are lost writes (cut-1/); those in (110, 120] the
    source still has and streams again, so they are dropped, not kept as lost."""
    from upr_cli.jobs.backup_stream import _cut

    st, held, open_cut = _open_segment(tmp_path)
    w = st.writer
    assert w is not None
    _cut(st, 150, 110, 120, held, open_cut, format_segment_name)
    assert w.last_seq == 110 and held == [w.buffered]
    assert [(f, t, i.first_seq, i.last_seq, i.records) for f, t, i in st.cuts] == [
        (150, 120, 121, 150, 30)
    ]
    # asked at or above everything held: nothing is lost, the segment is only cut back
    _cut(st, 110, 105, 130, held, open_cut, format_segment_name)
    assert w.last_seq == 105 and len(st.cuts) == 1


def test_memory_pressure_spills_open_writers_not_finished_ones(tmp_path: Path) -> None:
    """Over its memory budget the worker spills the largest writers; a partition whose
    stream ended earlier keeps its finished writer in `_opened` and must be skipped (a CI
    run backing up 5 MiB documents failed with "segment already finished")."""
    from upr_cli.failover import FailoverLog
    from upr_cli.jobs.backup_stream import BackupStream, _Open

    done = SegmentWriter(tmp_path / "a.open", header(start=0, end=5000, part=1))
    done.add(rows_for(list(range(1, 5001)), 1))
    done.finish(path=tmp_path / format_segment_name(1, 1, 5000))
    live = SegmentWriter(tmp_path / "b.open", header(start=0, end=100, part=2))
    log = FailoverLog.of([(1, 0)])
    s: Any = object.__new__(BackupStream)
    s._held, s.memory_budget = [0], 1
    s._opened = {1: _Open(1, done, log, 0), 2: _Open(2, live, log, 0)}
    s._add_all([(s._opened[2], rows_for(list(range(1, 50)), 2))])
    assert live.buffered == 0  # spilled; the finished one was left alone
    live.abort()
