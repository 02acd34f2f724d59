"""The data path of `upr backup --follow`: streams kept open, cut at snapshot boundaries.

Theory of operation (docs/design.md "Continuous backup"). A `FollowStream` is a
`BackupStream` whose streams never end: every partition is streamed from where the chain
ends to the end of time, into one open `SegmentWriter` per partition, in a local work
directory (never in the repository: nothing uncommitted lives there between commits).
Beside what a backup tracks it notes, per partition, the snapshots whose end it has
received and when (its **points**): a snapshot ends when the record at its end seq
arrives, or when the next marker does (deduplication or a collection filter can leave
the end without a record). Only such an end is a state the source had
(formats/repository.md §8.4), so a commit cuts there.

`checkpoint` (called by the follower between batches, with nothing else running on the
sink) cuts each partition that moved: on the segment worker, after every record sent
before, the open segment is split at the partition's newest point: the records up to
it are finished into a segment file of the work directory, the rest (a snapshot still
arriving) go on in a new writer starting there. It returns one `PartitionResult` per
partition to commit, with its points; the partition's start moves to the cut. Rollbacks
in the open window are cut back by `BackupStream` exactly as in a backup, and one below
the last commit starts the partition again there with a rollback record, so the next
commit records it with its lost writes (formats/repository.md §5.5, §5.6).
"""

from __future__ import annotations

import functools
import io
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from upr_cli.dcp.events import Event, Rollback, Snapshot, StreamEnded, StreamOpened
from upr_cli.jobs.backup_stream import BackupInterrupted, BackupStream, PartitionResult, _Open
from upr_cli.protocol.decoder import R_VBUCKET, DcpRecord
from upr_cli.segments import SegmentHeader, SegmentWriter
from upr_cli.storage import LocalStorage


@dataclass
class _Points:
    """Per partition: markers whose end has not arrived, and ends received (seq, when)."""

    marks: list[tuple[int, int]] = field(default_factory=list)
    done: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Checkpoint:
    """What one commit takes: per partition its result and restore points."""

    results: dict[int, PartitionResult]
    points: dict[int, tuple[tuple[int, datetime], ...]]

    @property
    def items(self) -> int:
        """Records the commit holds."""
        return sum(r.items for r in self.results.values())


class _Held(io.BytesIO):
    """A finished segment kept in memory: its writer closes it, its bytes stay."""

    def close(self) -> None:
        """Kept open: the commit reads it (`WorkStorage.take`)."""


class WorkStorage(LocalStorage):
    """A follower's work files: each finished segment in memory until the commit packs
    it (a commit of a thousand partitions would otherwise create, rename and delete a
    thousand files), the bodies that spill under the memory limit on disk. Nothing here
    needs to be durable: the repository is written only by the commit."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[Path, _Held] = {}

    def create(self, path: Path) -> IO[bytes]:
        if path.name.endswith("-body"):  # a spill: on disk
            return super().create(path)
        f = self.files[path] = _Held()
        return f

    def append(self, f: IO[bytes], data: bytes) -> None:
        if isinstance(f, _Held):
            f.write(data)
        else:
            super().append(f, data)

    def copy(self, src: IO[bytes], dst: IO[bytes]) -> None:
        if isinstance(dst, _Held):
            shutil.copyfileobj(src, dst, 1 << 20)
        else:
            super().copy(src, dst)

    def sync(self, f: IO[bytes]) -> None:
        if not isinstance(f, _Held):
            super().sync(f)

    def sync_dir(self, path: Path) -> None:
        """Nothing to make durable."""

    def sync_all(self, paths: Iterable[Path]) -> None:
        """Nothing to make durable."""

    def replace(self, src: Path, dst: Path) -> None:
        if src in self.files:
            self.files[dst] = self.files.pop(src)
        else:
            super().replace(src, dst)

    def delete(self, path: Path) -> None:
        if self.files.pop(path, None) is None and path.name.endswith("-body"):
            super().delete(path)

    def take(self, path: Path) -> bytes:
        """A finished segment's bytes, forgotten here."""
        return self.files.pop(path).getvalue()


class FollowStream(BackupStream):
    """A `BackupStream` over streams that stay open, cut by `checkpoint`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.work = WorkStorage()
        super().__init__(*args, storage=self.work, **kwargs)  # type: ignore[arg-type]
        self._points: dict[int, _Points] = {}
        self._changed: set[int] = set()  # partitions with something to commit
        self.bytes_since = 0  # bytes received since the last checkpoint

    def plan(self) -> None:
        """Nothing is planned: the streams have no end."""

    # -- the Sink, plus the points -------------------------------------------------------

    async def records(self, records: list[DcpRecord]) -> None:
        """Take them as a backup does, then note the snapshots whose end arrived."""
        before = self.stats.bytes_in
        await super().records(records)
        self.bytes_since += self.stats.bytes_in - before
        now = time.time()
        points, last = self._points, self._last
        for vb in {r[R_VBUCKET] for r in records}:
            pts = points.get(vb)
            if pts is not None and pts.marks:
                self._complete(vb, pts, last.get(vb, -1), now)

    def _complete(self, vb: int, pts: _Points, upto: int, now: float) -> None:
        """Markers whose end is at or below `upto` are whole: points at `now`."""
        while pts.marks and pts.marks[0][1] <= upto:
            end = pts.marks.pop(0)[1]
            if not pts.done or end > pts.done[-1][0]:
                pts.done.append((end, now))
                self._changed.add(vb)

    async def event(self, event: Event) -> None:
        """Follow a stream's life as a backup does; markers and rollbacks move points."""
        if isinstance(event, Snapshot):
            pts = self._points.setdefault(event.partition, _Points())
            # a new marker: the snapshot before it was sent whole, its end or not
            self._complete(event.partition, pts, 1 << 64, time.time())
            pts.marks.append((event.start, event.end))
            self._complete(event.partition, pts, self._last.get(event.partition, -1), time.time())
        elif isinstance(event, StreamOpened) and event.partition in self._opened:
            # reopened (reconnect, move): the marker it was cut off in is not whole
            self._points.setdefault(event.partition, _Points()).marks.clear()
        elif isinstance(event, Rollback):
            pts = self._points.setdefault(event.partition, _Points())
            pts.marks.clear()
            pts.done = [(q, t) for q, t in pts.done if q <= event.to_seq]
            self._changed.add(event.partition)
        await super().event(event)

    async def _stream_ended(self, ev: StreamEnded) -> None:
        if self.consumer.parts[ev.partition].done:  # an open-ended stream never ends done
            raise BackupInterrupted(f"partition {ev.partition}: the source ended its stream")

    # -- commits -----------------------------------------------------------------------

    def pending(self) -> bool:
        """Whether a checkpoint now would commit something."""
        return bool(self._changed)

    async def checkpoint(self) -> Checkpoint:
        """Cut every partition that moved at its newest point (module docstring)."""
        await self._flush()
        cuts: dict[int, tuple[int, tuple[int, int], list[tuple[int, float]]]] = {}
        for p in sorted(self._changed):
            st = self._opened.get(p)
            if st is None:
                continue
            pts = self._points.get(p, _Points())
            taken = [(q, t) for q, t in pts.done if q > st.start]
            if not taken and st.rollback is None:
                continue  # a cut back alone waits for the next point (it needs an end)
            at = taken[-1][0] if taken else st.start
            snap = next(((a, b) for a, b in reversed(st.snapshots) if b == at), (at, at))
            cuts[p] = (at, snap, taken)
            pts.done = []
        self._changed -= set(cuts)
        self.bytes_since = 0
        job = functools.partial(self._cut_all, {p: (c[0], c[1]) for p, c in cuts.items()})
        results = await self.worker.run(job)
        points = {p: tuple((q, datetime.fromtimestamp(t, UTC)) for q, t in cuts[p][2])
                  for p in results}  # fmt: skip
        return Checkpoint(results, points)

    def _cut_all(self, cuts: dict[int, tuple[int, tuple[int, int]]]) -> dict[int, PartitionResult]:
        """On the worker: each partition's records up to its cut into a finished file."""
        return {p: self._cut_one(self._opened[p], at, snap) for p, (at, snap) in cuts.items()}

    def _cut_one(self, st: _Open, at: int, snap: tuple[int, int]) -> PartitionResult:
        p, w, info = st.partition, st.writer, None
        if w is not None and w.first_seq and w.first_seq <= at:
            before = w.buffered
            rest = None
            if w.last_seq > at:  # a snapshot still arriving: its records go on
                rest = self._writer_at(st, at)
                w.truncate(at, rest)
            self._held[0] -= before
            info = w.finish(
                end_seq=at,
                snapshots=tuple(s for s in st.snapshots if s[1] <= at),
                sync=False,
                failover_log=st.log,
                path=self.directory / self.segment_name(p, w.first_seq, w.last_seq),
            )
            # the common case, every record taken, opens the next writer only when the
            # next record comes (`_add_all`)
            st.writer = rest if rest is not None and rest.first_seq else None
            if rest is not None:
                self._held[0] += rest.buffered
                if st.writer is None:
                    rest.abort()
        result = PartitionResult(
            p,
            st.log,
            st.start,
            at,
            snap,
            info,
            st.rollback,
            info.records if info else 0,
            st.cut_back,
            list(st.cuts),
        )
        st.start, st.rollback, st.cut_back, st.cuts = at, None, None, []
        st.snapshots = [s for s in st.snapshots if s[1] > at]
        return result

    def _writer_at(self, st: _Open, at: int) -> SegmentWriter:
        header = SegmentHeader(self.bucket, st.partition, st.log, at, at, (), self._created,
                               self._source, self.block_size)  # fmt: skip
        return SegmentWriter(self.directory / f"p{st.partition:04x}.open-{at}", header,
                             storage=self.storage, compressor=self._zstd)  # fmt: skip

    def work_files(self, result: PartitionResult) -> list[tuple[str, bytes]]:
        """(name in the pack, bytes) of a result's segment and cut-back segments, taken
        from the work storage."""
        take = self.work.take
        out = []
        if result.segment is not None:
            out.append((Path(result.segment.path).name, take(Path(result.segment.path))))
        for k, (_f, _t, info) in enumerate(result.cuts, 1):
            out.append((f"cut-{k}/{Path(info.path).name}", take(Path(info.path))))
        return out
