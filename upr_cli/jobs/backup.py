"""`upr backup`: incremental backups that survive failovers (docs/design.md "3. Backup").

One run (`_BackupRun`): take the bucket's lock, sweep leftovers, read where every
partition's newest committed backup ended, decide each partition's start against the
live source, stream into a new backup directory (`stream_to_segments`), then commit the
manifest last. Every repository file (the segments an interrupted run left, the
cut-back directories, the syncs before the commit) is reached through the repository's
storage (docs/design.md "Storage").

Where a partition starts (docs/design.md "The two rollback rules"): from the stored end,
unless the source's branch no longer holds it. Both rules are evaluated against the
live failover log before streaming: the producer rule (docs/protocol.md "4.2 The
producer's rollback rule", what the server will answer) and the seed rule (the UPR
design specification's client-side rule, from the stored and the live logs). When they
disagree the lower seq wins and a warning says so; the manifest records the rollback
(from, to, seed rule seq, producer seq). A ROLLBACK the server still sends (a failover
between the check and the stream) is followed and recorded too. Records of earlier
backups above a rollback point stay in place: they are the lost writes.

Collections: every collection is backed up unless `include` or `exclude` (cbbackupmgr's
--include-data and --exclude-data) narrow it. The source's manifest is read at the
start and recorded with the backup; an include list goes to the source as a stream
filter, an exclude list becomes the include list of every other collection of that
manifest. The manifest records the filter, so a reader knows a collection left out was
not backed up rather than empty (formats/repository.md §5.9). An incremental backup
keeps its chain's filter: streams resume where the previous backup ended, so a
collection that backup left out would miss its changes for good. It also passes the
collection ids the chain followed (`followed_ids`): the filter is resolved by name at
every run, so a collection dropped (or dropped and created again) since would otherwise
never have its drop recorded, and a path of the filter that is gone for good is no
error for a chain that had it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from upr_cli.collections import CollectionsError, CollectionsManifest, ManifestChange
from upr_cli.collections import Path as CollectionPath
from upr_cli.dcp.consumer import WireCompression
from upr_cli.dcp.states import partition_states
from upr_cli.errors import UprError, UsageError
from upr_cli.failover import FailoverLog, ImpossibleHistory, needs_rollback, rollback_point
from upr_cli.jobs.backup_stream import (
    DEFAULT_MEMORY,
    BackupInterrupted,
    PartitionResult,
    StreamStats,
    stream_to_segments,
)
from upr_cli.jobs.merge import is_merge_source
from upr_cli.memory import MemoryLimit
from upr_cli.net.collections_manifest import fetch_collections_manifest
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition, boundary_at
from upr_cli.repo import (
    BackupId,
    BrokenChain,
    CutBack,
    Manifest,
    PartitionEntry,
    Repository,
    RepositoryError,
    RepositoryLock,
    ResumePoint,
    RollbackRecord,
    SegmentEntry,
    Totals,
    format_segment_name,
    parse_cut_path,
    parse_segment_name,
    resume_point,
    snapshot_boundaries,
)
from upr_cli.repo.manifest import CollectionCount, CollectionFilter, Points
from upr_cli.repo.readers import sweep_unless_read
from upr_cli.segments import SegmentError, SegmentHeader, SegmentInfo, SegmentReader
from upr_cli.storage import LOCAL, Storage

log = logging.getLogger(__name__)

#: `stream_to_segments`, or a stand-in with its keywords (a distributed backup).
Streamer = Callable[..., Awaitable[dict[int, PartitionResult]]]
FOLLOW_UPS = 3  # follow-up backups for partitions a failover overtook after they ended


@dataclass
class StartDecision:
    """Where one partition's stream starts in this run, and why."""

    position: StreamPosition
    log: FailoverLog
    rollback: RollbackRecord | None = None
    warning: str | None = None


@dataclass(frozen=True, slots=True)
class PartitionRollback:
    """One rollback of a partition a run met (docs/output.md §4): the server moved its
    start from `from_seq` to `to_seq`, at the start or `during_run`; `cut_records` of
    this run's records it took back were kept as lost writes."""

    partition: int
    from_seq: int
    to_seq: int
    seed_rule_seq: int | None
    producer_seq: int
    during_run: bool
    cut_records: int

    def to_json(self) -> dict[str, Any]:
        """JSON object: seqs as decimal strings (`from`, `to`), the rest as they are."""
        seed = self.seed_rule_seq
        return {
            "partition": self.partition,
            "from": str(self.from_seq),
            "to": str(self.to_seq),
            "seed_rule_seq": None if seed is None else str(seed),
            "producer_seq": str(self.producer_seq),
            "during_run": self.during_run,
            "cut_records": self.cut_records,
        }


@dataclass
class BackupSummary:
    """What a run did (the CLI's summary table and --json)."""

    backup_id: str
    bucket: str
    full: bool
    items: int
    bytes_read: int
    bytes_written: int
    partitions: int
    rollbacks: list[PartitionRollback] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    reused_segments: int = 0
    follow_ups: list[str] = field(default_factory=list)  # backups committed right after
    collections: int = 1  # collections backed up (the source's, less those filtered out)
    manifest_changes: int = 0  # collection and scope changes met (each partition's)

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md §4): counts and bytes as integers."""
        return {
            "backup_id": self.backup_id,
            "bucket": self.bucket,
            "full": self.full,
            "items": self.items,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "partition_count": self.partitions,
            "ratio": round(self.bytes_read / self.bytes_written, 2) if self.bytes_written else None,
            "seconds": round(self.seconds, 3),
            "items_per_s": round(self.items / self.seconds) if self.seconds else 0,
            "rollbacks": [rb.to_json() for rb in self.rollbacks],
            "warnings": self.warnings,
            "reused_segments": self.reused_segments,
            "follow_ups": self.follow_ups,
            "collection_count": self.collections,  # `collections` is a list everywhere
            "manifest_changes": self.manifest_changes,
        }


async def _live_state(
    uri: SourceUri, partitions: list[int] | None, wait_for: float = 60.0
) -> tuple[int, dict[int, FailoverLog], dict[int, tuple[int, int]]]:
    """The partition count, live failover logs and (high, purge), each partition from its
    active node (formats/cluster.md; a node away is waited for up to `wait_for` s)."""
    states, count = await partition_states(uri, partitions, failover_logs=True,
                                           name="upr-backup-check", wait_for=wait_for)  # fmt: skip
    logs = {p: st.failover_log for p, st in states.items() if st.failover_log is not None}
    return count, logs, {p: (st.high_seq, st.purge_seq) for p, st in states.items()}


def decide_start(
    p: int,
    stored: ResumePoint,
    live: FailoverLog | None,
    high: int,
    purge: int,
    bounds: Callable[[], list[int]] = lambda: [0],
) -> StartDecision:
    """Both rules against the live log; the lower seq wins; a rollback then lands on the
    newest snapshot boundary of the chain at or below it (`bounds`, asked only when a
    rollback is needed: docs/design.md, "Snapshot boundaries")."""
    pos = stored.position
    if live is None or not live.entries:
        return StartDecision(pos, stored.failover_log)
    producer = needs_rollback(live, pos, high=high, purge_seq=purge)
    producer_seq = producer.rollback_seq if producer.rollback else pos.seq
    snapshot = pos.snap_end if pos.complete else pos.snap_start
    warning = None
    try:
        seed_seq: int | None = rollback_point(
            live, stored.failover_log, min(snapshot, pos.seq), pos.seq
        ).rollback_seq
    except ImpossibleHistory as exc:
        seed_seq, warning = None, f"partition {p}: seed rule: {exc}"
    to = producer_seq if seed_seq is None else min(producer_seq, seed_seq)
    if seed_seq is not None and seed_seq != producer_seq:
        warning = (
            f"partition {p}: the seed rule says {seed_seq}, the producer rule "
            f"{producer_seq}; using {to}"
        )
    if to >= pos.seq:
        return StartDecision(pos, stored.failover_log, None, warning)
    to = boundary_at(bounds(), to)
    entry = live.entry_at(to)
    start = StreamPosition(p, entry.uuid if entry else 0, to, to, to)
    record = RollbackRecord(pos.seq, to, seed_seq, producer_seq)
    return StartDecision(start, live.prune_above(to) if entry else live, record, warning)


def decide_starts(repo: Repository, bucket: str, manifests: Sequence[Manifest],
                  live_logs: dict[int, FailoverLog], seqs: dict[int, tuple[int, int]],
                  note: Callable[[str], None]) -> dict[int, StartDecision]:  # fmt: skip
    """`decide_start` for every partition the chain holds (`seqs`: live high and purge
    seqs); each warning goes to `note`. Reads the chain's segment headers only when a
    rollback needs their snapshot boundaries: a dry run uses it as it is."""

    def snapshots_of(bid: BackupId, seg: SegmentEntry) -> tuple[tuple[int, int], ...]:
        try:
            with SegmentReader(repo.segment_path(bucket, bid, seg.file), repo.storage) as r:
                return r.header.snapshots
        except (SegmentError, OSError):
            return ()  # verify names the damage; the backup ends cover the rest

    out = {}
    for p in sorted({e.partition for m in manifests for e in m.partitions}):
        rp = resume_point(manifests, p)
        if rp is None:
            continue
        high, purge = seqs.get(p, (0, 0))
        bounds = functools.partial(snapshot_boundaries, manifests, p, snapshots_of)
        d = decide_start(p, rp, live_logs.get(p), high, purge, bounds)
        out[p] = d
        if d.warning:
            note(d.warning)
    return out


def now_utc() -> datetime:
    """The current time, UTC."""
    return datetime.now(UTC)


async def backup(
    uri: SourceUri,
    repo_dir: Path,
    *,
    full: bool = False,
    partitions: list[int] | None = None,
    on_progress: Callable[[StreamStats], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    streamer: Streamer | None = None,
    include: Sequence[CollectionPath] = (),
    exclude: Sequence[CollectionPath] = (),
    wait: float = 120.0,
    on_notice: Callable[[str], None] | None = None,
    compression: WireCompression = "auto",
    memory: MemoryLimit = DEFAULT_MEMORY,
    encrypt: bool = False,
) -> BackupSummary:
    """Run one backup of `uri`'s bucket into the repository; returns its summary.

    `include` backs up only those scopes and collections, `exclude` every other one
    (at most one of the two: `collection_filter`).

    `streamer` replaces `stream_to_segments` (same keywords, plus `end_seqs`: the high
    seqs pinned here, once): `upr backup --master` divides the partitions among Spark
    tasks with it. Everything else (the lock, where each partition starts, the commit of
    the manifest) stays here, on the driver.

    A failover can also take back records of a partition whose stream had already
    ended in this run. After the commit every partition's end is checked against its
    live failover log (the producer rule, docs/protocol.md "4.2 The producer's rollback
    rule"); those it no longer holds get a follow-up incremental backup at once, which
    records the rollback (the records above it stay in the first one as lost writes), so
    the newest backup restores to the actives' state. At most `FOLLOW_UPS` rounds.

    A node lost while streaming is reconnected for up to `wait` seconds (`math.inf`: for
    ever; `on_notice` hears when the link is lost and when it is back); one that
    restarted from a crash ends each stream at its new branch's high seq, the rollback
    recorded as after a failover (docs/protocol.md §4.5). `compression` is the links'
    Snappy (`--wire-compression`, formats/wire.md "Snappy"). `memory` is the budget for
    the run's buffers (`--memory-limit`; each Spark task keeps to it in its own process).
    `encrypt` creates a new repository encrypted (formats/repository.md §10; an existing
    plaintext one is refused, an encrypted one used as it is).
    """
    chosen = collection_filter(include, exclude)
    first = await _backup_once(uri, repo_dir, full=full, partitions=partitions,
                               on_progress=on_progress, on_warning=on_warning,
                               streamer=streamer, chosen=chosen, wait=wait,
                               on_notice=on_notice, compression=compression,
                               memory=memory, encrypt=encrypt)  # fmt: skip
    summary = first
    for _ in range(FOLLOW_UPS):
        try:
            overtaken = await _overtaken(uri, repo_dir, summary.bucket, summary.backup_id)
        except (UprError, OSError) as exc:  # committed already: the next run checks again
            note = (f"backup {summary.backup_id} is committed; checking it against the "
                    f"source afterwards failed: {exc}")  # fmt: skip
            first.warnings.append(note)
            (on_warning or log.warning)(note)
            return first
        if not overtaken:
            return first
        more = " …" if len(overtaken) > 8 else ""
        note = (f"partitions {overtaken[:8]}{more}: a failover took back records after their "
                "streams ended; a follow-up backup records it")  # fmt: skip
        first.warnings.append(note)
        (on_warning or log.warning)(note)
        summary = await _backup_once(uri, repo_dir, partitions=overtaken,
                                     on_progress=on_progress, on_warning=on_warning,
                                     streamer=streamer, chosen=chosen, wait=wait,
                                     on_notice=on_notice, compression=compression,
                                     memory=memory)  # fmt: skip
        first.follow_ups.append(summary.backup_id)
        first.rollbacks += summary.rollbacks
        first.warnings += summary.warnings
        first.items += summary.items
        first.bytes_read += summary.bytes_read
        first.bytes_written += summary.bytes_written
        first.seconds += summary.seconds
    raise BackupInterrupted(
        f"partitions kept failing over during {FOLLOW_UPS + 1} backups in a row "
        f"(the last, {summary.backup_id}, is committed); run it again"
    )


async def _overtaken(uri: SourceUri, repo_dir: Path, bucket: str, backup_id: str) -> list[int]:
    """Partitions of a committed backup whose end their active's history no longer holds."""
    manifest = Repository(repo_dir).read_manifest(bucket, BackupId.parse(backup_id))
    entries = [e for e in manifest.partitions if e.failover_log.entries]
    if not entries:
        return []
    _count, logs, seqs = await _live_state(uri, [e.partition for e in entries], wait_for=10.0)
    out = []
    for e in entries:
        live = logs.get(e.partition)
        if live is None or not live.entries:
            continue
        high, purge = seqs.get(e.partition, (0, 0))
        at = StreamPosition(e.partition, e.uuid, e.end_seq, e.snap_start, e.snap_end)
        d = needs_rollback(live, at, high=high, purge_seq=purge)
        if d.rollback:
            out.append(e.partition)
    return out


async def _backup_once(
    uri: SourceUri,
    repo_dir: Path,
    *,
    full: bool = False,
    partitions: list[int] | None = None,
    on_progress: Callable[[StreamStats], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    streamer: Streamer | None = None,
    chosen: CollectionFilter | None = None,
    wait: float = 120.0,
    on_notice: Callable[[str], None] | None = None,
    compression: WireCompression = "auto",
    memory: MemoryLimit = DEFAULT_MEMORY,
    encrypt: bool = False,
) -> BackupSummary:
    """One backup, committed (see `backup`)."""
    if uri.bucket is None:
        raise UsageError("the source URI names no bucket")
    bucket = uri.bucket
    repo = Repository(repo_dir)
    if encrypt:  # the ciphers and Argon2 are imported by encrypted backups only
        from upr_cli.repo import keys

        keys.refuse_plain(repo)
    repo.check_init()  # an encrypted repository is unlocked here, or refused
    # Nothing is created before the source has answered (formats/repository.md §4.2): a
    # wrong password, an unknown bucket or filter leaves the repository as it was.
    collections = await _check_source(uri, repo, bucket, full=full, chosen=chosen)
    if encrypt:
        from upr_cli.repo import keys

        keys.ensure_encrypted(repo)
    repo.init()
    warn = on_warning or log.warning
    started = now_utc(), time.monotonic()
    st = repo.storage.stat(repo.bucket_dir(bucket), follow_links=True)
    new_bucket = st is None or not st.is_dir
    try:
        with RepositoryLock(repo, bucket, on_stale=warn) as lock:
            run = _BackupRun.open(uri, bucket, repo_dir, repo, lock, full=full, warn=warn,
                                  started=started)  # fmt: skip
            try:
                run.read_collections(chosen, collections)
                await run.plan(partitions)
                results = await run.stream(streamer, on_progress, wait=wait, on_notice=on_notice,
                                           compression=compression, memory=memory)  # fmt: skip
                manifest, rollbacks, bytes_read = run.commit(results)
            except BaseException:
                repo.discard_empty(bucket, run.backup_id, lock)  # no segment: no leftover
                raise
    except BaseException:
        if new_bucket:
            repo.remove_empty_bucket(bucket)
        raise
    return BackupSummary(
        str(manifest.backup_id),
        run.bucket,
        run.parent is None,
        manifest.totals.items,
        bytes_read,
        manifest.totals.bytes_written,
        len(manifest.partitions),
        rollbacks,
        run.warnings,
        time.monotonic() - run.t0,
        sum(len(ru.segments) for ru in run.reused.values()),
        collections=run.collection_count,
        manifest_changes=len(manifest.manifest_changes),
    )


class _BackupRun:
    """The steps of one backup, under the bucket's lock: open the backup directory, plan
    where each partition starts, stream, then commit the manifest."""

    def __init__(
        self,
        uri: SourceUri,
        bucket: str,
        repo_dir: Path,
        repo: Repository,
        *,
        manifests: list[Manifest],
        backup_id: BackupId,
        warn: Callable[[str], None],
        warnings: list[str],
        started: tuple[datetime, float],
    ) -> None:
        self.uri = uri
        self.repo_dir = repo_dir
        self.repo = repo
        self.bucket = bucket
        self.manifests = manifests  # the chain this backup continues (none: a full one)
        self.parent = manifests[-1] if manifests else None
        self.backup_id = backup_id
        self.directory = repo.new_backup_dir(self.bucket, backup_id)
        self.warn = warn
        self.warnings = warnings
        self.started, self.t0 = started
        self.decisions: dict[int, StartDecision] = {}
        self.positions: dict[int, StreamPosition] = {}
        self.logs: dict[int, FailoverLog] = {}
        self.seqs: dict[int, tuple[int, int]] = {}  # live (high, purge) per partition
        self.reused: dict[int, _Reused] = {}  # an interrupted run's segments, kept
        self.follow: list[int] = []  # reused partitions streamed on past the reused end
        self.cuts: dict[int, list[tuple[int, int, SegmentInfo]]] = {}  # left, streamed on
        self.kept_cuts: dict[int, list[tuple[int, int, SegmentInfo]]] = {}  # left, reused
        self.to_stream: list[int] = []
        self.collections: CollectionsManifest | None = None  # the source's, at the start
        self.filter: CollectionFilter | None = None
        self.stream_paths: list[CollectionPath] | None = None  # None: every collection
        self.followed: dict[int, set[int]] | None = None  # per partition (`followed_ids`)

    @classmethod
    def open(
        cls,
        uri: SourceUri,
        bucket: str,
        repo_dir: Path,
        repo: Repository,
        lock: RepositoryLock,
        *,
        full: bool,
        warn: Callable[[str], None],
        started: tuple[datetime, float],
    ) -> _BackupRun:
        """Heal, check the chain and open the backup directory (an interrupted run's)."""
        warnings = []
        # A lost or damaged manifest file whose twin is valid is rewritten from it; then an
        # incremental backup goes on only from a chain that is whole
        # (formats/repository.md §8.8): never on top of a damaged manifest, a missing
        # parent, a seq gap or a missing segment file.
        # (An atomic rewrite from the valid twin: a reader sees either file whole, so the
        # heal needs no exclusion of readers, like `upr verify --repair`.)
        for path, why in repo.heal(bucket, lock):
            note = f"{path}: {why}; rewritten from its twin"
            warnings.append(note)
            warn(note)
        manifests = [] if full else _checked_chain(repo, bucket, repo_dir)
        # An interrupted run after the newest committed backup is continued in place: its
        # finished segments are reused once verified (the sweep keeps it, drops older ones).
        committed = repo.committed(bucket)
        newest = committed[-1] if committed else None
        leftovers = [b for b in repo.incomplete(bucket) if newest is None or b > newest]
        backup_id = leftovers[-1] if leftovers else repo.next_backup_id(bucket)
        # only when no reader is there (formats/repository.md §7.2): else the next run does
        sweep_unless_read(repo, bucket, backup_id, lock)
        return cls(uri, bucket, repo_dir, repo, manifests=manifests, backup_id=backup_id, warn=warn,
                   warnings=warnings, started=started)  # fmt: skip

    def read_collections(
        self, chosen: CollectionFilter | None, collections: CollectionsManifest | None
    ) -> None:
        """Take the source's manifest (read by `_check_source`) and turn the filter into
        the paths to stream, against the chain as checked under the lock."""
        self.collections = collections
        self.filter = chosen
        self.stream_paths = checked_filter(self.bucket, chosen, collections, self.manifests)

    @property
    def collection_count(self) -> int:
        """How many collections this backup streams (at its start)."""
        m = self.collections or CollectionsManifest()
        f = self.filter
        return sum(1 for s, c in m.collections() if f is None or f.covers(s.name, c.name))

    def note(self, warning: str) -> None:
        """A warning for the summary, shown now too."""
        self.warnings.append(warning)
        self.warn(warning)

    async def plan(self, partitions: list[int] | None) -> None:
        """Where each partition starts, against the live source; what is reused."""
        count, live_logs, self.seqs = await _live_state(self.uri, None)
        wanted = partitions if partitions is not None else list(range(count))
        if self.parent is not None:
            self._decide_starts(live_logs)
        self.positions = {p: d.position for p, d in self.decisions.items()}
        self.logs = {p: d.log for p, d in self.decisions.items()}
        self._reuse(wanted, live_logs)
        if self.parent is not None and self.stream_paths is not None:
            extra = {p: ru.segments for p, ru in self.reused.items()}
            self.followed = followed_ids(self.manifests, self.filter, self.positions, extra)

    def _decide_starts(self, live_logs: dict[int, FailoverLog]) -> None:
        self.decisions = decide_starts(self.repo, self.bucket, self.manifests, live_logs,
                                       self.seqs, self.note)  # fmt: skip

    def _reuse(self, wanted: list[int], live_logs: dict[int, FailoverLog]) -> None:
        """Segments an interrupted run finished end at its high seqs: each reused partition
        goes on from there to this run's high seq in a follow-on segment, so that the
        backup holds every write acknowledged before it started
        (formats/repository.md §4.5)."""
        storage = self.repo.storage
        reused = self.reused = _reusable(self.directory, wanted, self.positions, storage)
        for p in _overtaken_reuse(reused, live_logs, self.seqs):
            log.warning("partition %d: the source no longer holds the end of the segments an "
                        "interrupted run left; streamed again", p)  # fmt: skip
            _remove(storage, reused.pop(p).segments)  # streamed again
        self.follow = [p for p, ru in reused.items() if self.seqs.get(p, (0, 0))[0] > ru.end_seq]
        for p in self.follow:
            self.positions[p], self.logs[p] = reused[p].position, reused[p].failover_log
        self.cuts = _leftover_cuts(self.directory, storage)
        self.kept_cuts = {p: self.cuts.pop(p, []) for p in reused if p not in self.follow}
        self.to_stream = [p for p in wanted if p not in reused or p in self.follow]

    async def stream(
        self,
        streamer: Streamer | None,
        on_progress: Callable[[StreamStats], None] | None,
        *,
        wait: float = 120.0,
        on_notice: Callable[[str], None] | None = None,
        compression: WireCompression = "auto",
        memory: MemoryLimit = DEFAULT_MEMORY,
    ) -> dict[int, PartitionResult]:
        """Stream the partitions that need it; every partition's result, reused ones too."""
        results: dict[int, PartitionResult] = {}
        to_stream, seqs = self.to_stream, self.seqs
        if to_stream:
            results.update(
                await (streamer or stream_to_segments)(
                    self.uri,
                    self.directory,
                    bucket=self.bucket,
                    positions=self.positions,
                    failover_logs=self.logs,
                    boundaries={p: snapshot_boundaries(self.manifests, p) for p in self.positions},
                    partitions=to_stream,
                    segment_name=format_segment_name,
                    on_progress=on_progress,
                    end_seqs=None if streamer is None
                    else {p: seqs.get(p, (0, 0))[0] for p in to_stream},
                    cuts=self.cuts,
                    collections=self.stream_paths,
                    followed_ids=self.followed,
                    wait=wait,
                    on_notice=on_notice,
                    compression=compression,
                    memory=memory,
                    storage=self.repo.storage,
                )
            )  # fmt: skip
        for p, ru in self.reused.items():
            results[p] = self._with_reused(p, ru, results.get(p))
        return results

    def _with_reused(self, p: int, ru: _Reused, r: PartitionResult | None) -> PartitionResult:
        """The result of a reused partition: its follow-on goes on from the reused
        segments, or (rolled back below their end meanwhile) the backup ends there."""
        if r is not None and r.rollback is None:
            return replace(r, start_seq=ru.start_seq)
        cuts = self.kept_cuts.get(p, []) if r is None else r.cuts
        if r is not None:  # the follow-up after the commit records the rollback (`backup`)
            if r.segment is not None:  # this run's records on the new branch go
                _remove(self.repo.storage, [r.segment])
            self.note(f"partition {p}: a failover took back records of the segments an "
                      "interrupted run left; a follow-up backup records it")  # fmt: skip
        return PartitionResult(p, ru.failover_log, ru.start_seq, ru.end_seq, ru.snapshot, None,
                               cuts=cuts)  # fmt: skip

    def commit(
        self, results: dict[int, PartitionResult]
    ) -> tuple[Manifest, list[PartitionRollback], int]:
        """Write the manifest (the backup's commit point); it, the rollbacks, bytes read."""
        # cut-back segments (this run's, an interrupted run's): durable before the commit
        cut_paths = [Path(info.path) for r in results.values() for _f, _t, info in r.cuts]
        if cut_paths:
            storage = self.repo.storage
            storage.sync_all(cut_paths)  # the files, then their cut-K directories
            storage.sync_dir(self.directory)  # the cut-K directories' entries
        entries, bytes_read = [], 0
        rollbacks: list[PartitionRollback] = []
        segments: list[SegmentInfo] = []  # every segment the manifest lists
        for p, r in sorted(results.items()):
            decision = self.decisions.get(p)
            rb = decision.rollback if decision is not None else None
            if r.rollback is not None:  # the server still rolled us back while streaming
                rb = RollbackRecord(*r.rollback[:2], None, r.rollback[2])
            prefix = self.reused[p].segments if p in self.reused else []
            segments += [*prefix, *([r.segment] if r.segment is not None else [])]
            entries.append(_entry(r, rb, prefix))
            rollbacks += _rollbacks(p, r, rb)
            bytes_read += sum(s.raw_bytes for s in prefix)
            if r.segment is not None:
                bytes_read += r.segment.raw_bytes
        parent = self.parent
        manifest = Manifest(
            backup_id=self.backup_id,
            bucket=self.bucket,
            source=self.uri.redacted(),
            started=self.started,
            finished=now_utc(),
            full=parent is None,
            parent=None if parent is None else parent.backup_id,
            partitions=tuple(entries),
            totals=Totals.derive(entries, bytes_read),
            collections=self.collections,
            manifest_changes=tuple(_changes(segments)),
            collection_filter=self.filter,
            collection_items=tuple(_counts(segments)),
        )
        if parent is not None:  # still whole at the commit (cached: no manifest read again)
            _checked_chain(self.repo, self.bucket, self.repo_dir)
        self.repo.write_manifest(manifest)
        return manifest, rollbacks, bytes_read


async def _check_source(
    uri: SourceUri, repo: Repository, bucket: str, *, full: bool, chosen: CollectionFilter | None
) -> CollectionsManifest | None:
    """Connect, authenticate, select the bucket, read its collections manifest and check
    the filter (against the chain too, read without the lock), before the repository
    is touched; the source's manifest. A chain with a damaged manifest is checked under
    the lock, where its repair or its error comes first."""
    collections = await fetch_collections_manifest(uri)
    manifests: list[Manifest] = []
    if not full and repo.storage.stat(repo.repo_file, follow_links=True) is not None:
        manifests, damaged = repo.readable(bucket)
        if damaged:
            return collections
    checked_filter(bucket, chosen, collections, manifests)
    return collections


def checked_filter(
    bucket: str,
    chosen: CollectionFilter | None,
    collections: CollectionsManifest | None,
    manifests: Sequence[Manifest],
) -> list[CollectionPath] | None:
    """The paths to stream (`stream_paths`) for the chain an incremental backup continues
    (`manifests`; none for a full one): an unknown collection, or a filter other than
    the chain's, is an error."""
    parent = manifests[-1].collection_filter if manifests else None
    if manifests and _key(parent) != _key(chosen):

        def say(f: CollectionFilter | None) -> str:
            return "every collection" if f is None else f"--{f.mode}-data {','.join(f.paths)}"

        raise UsageError(
            f"the chain of {bucket} was backed up with {say(parent)}; an incremental "
            f"backup keeps it (this one asked for {say(chosen)}): use that, or --full to "
            "start a new chain"
        )
    chain = [m.collections for m in manifests if m.collections is not None]
    return stream_paths(chosen, collections, chain)


def collection_filter(
    include: Sequence[CollectionPath], exclude: Sequence[CollectionPath]
) -> CollectionFilter | None:
    """The filter of --include-data or --exclude-data (both: a usage error, as in
    cbbackupmgr); None backs up every collection."""
    if include and exclude:
        raise UsageError("--include-data and --exclude-data cannot be used together")
    if include:
        return CollectionFilter("include", tuple(sorted({str(p) for p in include})))
    if exclude:
        return CollectionFilter("exclude", tuple(sorted({str(p) for p in exclude})))
    return None


def _key(f: CollectionFilter | None) -> tuple[str, tuple[str, ...]] | None:
    return None if f is None else (f.mode, f.paths)


def stream_paths(
    f: CollectionFilter | None,
    m: CollectionsManifest | None,
    chain: Sequence[CollectionsManifest] = (),
) -> list[CollectionPath] | None:
    """What the stream filter asks for: the include list, or every collection of the
    source's manifest an exclude list leaves (None: every collection). A path the
    manifest does not know is a CollectionsError naming it; so is leaving nothing.

    `chain` are the manifests the backups of the chain started from (an incremental
    backup): a path one of them had was dropped since, which is no error; the consumer
    resolves it leniently and hands over its drop (`followed_ids`)."""
    if f is None:
        return None
    paths = [CollectionPath.parse(t) for t in f.paths]
    have = m or CollectionsManifest()
    unknown = [str(p) for p in paths if not _known(have, p)]
    unknown = [t for t in unknown if not any(_known(c, CollectionPath.parse(t)) for c in chain)]
    if unknown:
        src = "the source has no collections" if m is None else f"manifest uid {have.uid:x}"
        raise CollectionsError(f"--{f.mode}-data: unknown collection {', '.join(unknown)} ({src})")
    if f.mode == "include":
        return paths
    left = [CollectionPath(s.name, c.name) for s, c in have.collections()
            if f.covers(s.name, c.name)]  # fmt: skip
    # all the chain followed is gone: the consumer resolves those paths to nothing
    # (their drops may still be owed) rather than streaming every collection
    gone = {CollectionPath(s.name, c.name) for old in chain for s, c in old.collections()
            if f.covers(s.name, c.name)}  # fmt: skip
    if not left and gone:
        return sorted(gone, key=str)
    if not left:
        raise CollectionsError(f"--exclude-data {','.join(f.paths)} leaves no collection")
    if m is None or len(left) == len(list(have.collections())):
        return None  # nothing left out: no stream filter
    return left


def _known(m: CollectionsManifest, p: CollectionPath) -> bool:
    return (m.scope(p.scope) if p.collection is None else m.lookup(p)) is not None


def followed_ids(
    chain: Sequence[Manifest],
    f: CollectionFilter | None,
    positions: dict[int, StreamPosition],
    reused: dict[int, list[SegmentInfo]] | None = None,
) -> dict[int, set[int]]:
    """Per partition, the collection ids the chain's filter followed up to the position
    this run resumes it from (docs/protocol.md §12.4): those of the last backup's start
    manifest the filter covers and those created since (its streams, or `reused`
    segments of an interrupted run, met the events), less those whose drop on that
    partition the chain recorded at or below the position. A drop above it (a rollback
    took the position below it) must come again, so its id stays."""
    if not chain:
        return {}
    start = chain[-1].collections or CollectionsManifest()
    later = [c for segs in (reused or {}).values() for s in segs for c in s.changes]
    since = [*chain[-1].manifest_changes, *later]  # after the start manifest was read
    scopes = {
        s.id: s.name for m in chain if m.collections is not None for s in m.collections.scopes
    }
    scopes.update({c.scope_id: c.name for c in since if c.kind == "scope-created" and c.name})

    def covers(scope: str | None, name: str) -> bool:
        # a scope nothing names: followed; at worst a catch-up that finds no drop
        return f is None or scope is None or f.covers(scope, name)

    covered = {c.id for s, c in start.collections() if covers(s.name, c.name)}
    created: dict[int, set[int]] = {}
    for c in since:
        cid = c.collection_id if c.kind == "collection-created" else None
        if cid is not None and covers(scopes.get(c.scope_id), c.name or ""):
            created.setdefault(c.partition, set()).add(cid)
    dropped: dict[int, set[int]] = {}
    for c in (*(c for m in chain for c in m.manifest_changes), *later):
        pos = positions.get(c.partition)
        if c.kind == "collection-dropped" and pos is not None and c.seq <= pos.seq:
            dropped.setdefault(c.partition, set()).add(c.collection_id or 0)
    return {p: (covered | created.get(p, set())) - dropped.get(p, set()) for p in positions}


def _changes(segments: Sequence[SegmentInfo]) -> list[ManifestChange]:
    """The manifest changes the segments hold, by partition and seq."""
    return sorted((c for s in segments for c in s.changes), key=lambda c: (c.partition, c.seq))


def _counts(segments: Sequence[SegmentInfo]) -> list[CollectionCount]:
    """Data records per collection id over the segments, by id."""
    total: dict[int, list[int]] = {}
    for s in segments:
        for cid, items, deleted in s.counts:
            t = total.setdefault(cid, [0, 0])
            t[0] += items
            t[1] += deleted
    return [CollectionCount(cid, a, b) for cid, (a, b) in sorted(total.items())]


def _rollbacks(p: int, r: PartitionResult, rb: RollbackRecord | None) -> list[PartitionRollback]:
    """The summary's rollbacks of one partition: where it started (or the server rolled
    it back while streaming), and a failover mid-run that took this run's records back."""
    out: list[PartitionRollback] = []
    cut_records = sum(s.records for *_, s in r.cuts)
    if rb is not None:
        out.append(PartitionRollback(p, rb.from_seq, rb.to_seq, rb.seed_rule_seq,
                                     rb.producer_seq, r.rollback is not None,
                                     0 if r.cut_back else cut_records))  # fmt: skip
    if r.cut_back is not None:  # a failover mid-run: this run's records above `to` went
        frm, to, producer = r.cut_back
        out.append(PartitionRollback(p, frm, to, None, producer, True, cut_records))
    return out


def _checked_chain(repo: Repository, bucket: str, repo_dir: Path) -> list[Manifest]:
    """The chain an incremental backup continues, checked whole
    (formats/repository.md §8.8) and with every segment file its newest state reads
    present at its size; otherwise `BrokenChain` saying why, and how to repair or start
    a new chain."""
    try:
        manifests = repo.chain(bucket)
        bad = repo.missing_files(bucket, manifests, manifests[-1].backup_id) if manifests else []
        if bad:
            also = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise BrokenChain(f"{bad[0]}{also}")
    except RepositoryError as exc:
        raise BrokenChain(
            f"{exc}; refusing to back up on top of a broken chain: `upr verify --repo "
            f"{repo_dir}` names every problem (`--repair` rewrites a lost manifest from its "
            "copy), or `upr backup --full` starts a new chain"
        ) from None
    return manifests


@dataclass
class _Reused:
    """Segments an interrupted run finished for one partition, in seq order, each going
    on where the one before ended, the first starting where this run starts it."""

    partition: int
    start_seq: int
    segments: list[SegmentInfo]
    failover_log: FailoverLog  # the newest segment's
    end_seq: int
    snapshot: tuple[int, int]  # the last snapshot, containing end_seq

    @property
    def position(self) -> StreamPosition:
        """Where a follow-on stream of the partition starts."""
        uuid = self.failover_log.latest.uuid if self.failover_log.entries else 0
        return StreamPosition(self.partition, uuid, self.end_seq, *self.snapshot)


def _remove(storage: Storage, segments: Sequence[SegmentInfo]) -> None:
    """Delete segment files of this uncommitted run that its manifest will not list."""
    for seg in segments:
        storage.delete(Path(seg.path))


def _reusable(
    directory: Path,
    wanted: list[int],
    positions: dict[int, StreamPosition],
    storage: Storage = LOCAL,
) -> dict[int, _Reused]:
    """Segments an interrupted run finished: kept if they verify and, per partition, make
    a run from where this run starts it, each on the branch the one before went on
    (a resumed run's follow-on segments included); anything else is removed and
    streamed again (formats/repository.md §4.5)."""
    found: dict[int, list[tuple[SegmentHeader, SegmentInfo]]] = {}
    want = set(wanted)
    names = sorted(e.name for e in storage.list(directory))
    for path in [directory / n for n in names if n.startswith("p") and n.endswith(".seg")]:
        try:
            name = parse_segment_name(path.name)
        except RepositoryError:
            continue
        p = name.partition
        try:
            with SegmentReader(path, storage) as reader:
                info = reader.verify()
                header = reader.header
        except SegmentError as exc:
            log.warning("%s: not reused: %s", path.name, exc.reason)
            storage.delete(path)
            continue
        if (p not in want or header.partition != p or not info.records
                or is_merge_source(header.source)):  # fmt: skip
            storage.delete(path)  # a killed merge's segments are no stream's: not reused
            continue
        found.setdefault(p, []).append((header, info))
    out: dict[int, _Reused] = {}
    for p, segs in sorted(found.items()):
        start = positions[p].seq if p in positions else 0
        by_start: dict[int, tuple[SegmentHeader, SegmentInfo]] = {}
        for header, info in sorted(segs, key=lambda hi: hi[1].first_seq):
            by_start.setdefault(header.start_seq, (header, info))
        run: list[tuple[SegmentHeader, SegmentInfo]] = []
        at = start
        while at in by_start:
            header, info = by_start[at]
            if run and header.failover_log.find(run[-1][0].uuid) is None:
                break  # not the history the segment before went on
            run.append((header, info))
            at = header.end_seq
        kept = {info.path for _h, info in run}
        for _h, info in segs:
            if info.path not in kept:
                storage.delete(Path(info.path))
        if not run:
            continue
        header = run[-1][0]
        end = header.end_seq
        snap = header.snapshots[-1] if header.snapshots else (end, end)
        if not snap[0] <= end <= snap[1]:  # as the manifest records it (`_entry`)
            snap = (end, end)
        out[p] = _Reused(p, start, [i for _h, i in run], header.failover_log, end, snap)
    return out


def _overtaken_reuse(
    reused: dict[int, _Reused],
    live_logs: dict[int, FailoverLog],
    seqs: dict[int, tuple[int, int]],
) -> list[int]:
    """Reused partitions whose end the live source no longer holds (the producer rule
    against its failover log): a failover since the interrupted run took records back."""
    out = []
    for p, ru in reused.items():
        live = live_logs.get(p)
        if live is None or not live.entries:
            continue
        high, purge = seqs.get(p, (0, 0))
        if needs_rollback(live, ru.position, high=high, purge_seq=purge).rollback:
            out.append(p)
    return out


def _leftover_cuts(
    directory: Path, storage: Storage = LOCAL
) -> dict[int, list[tuple[int, int, SegmentInfo]]]:
    """Cut-back segments an interrupted run wrote (formats/repository.md §5.6): lost
    writes still, so this run lists them again, per partition in their old order and
    numbered again 1..n (a file that does not verify stays where it is, unlisted)."""
    found: dict[int, list[tuple[int, str, Path]]] = {}
    # cut-*/p*.seg (a cut-* that is no directory lists nothing)
    cut_dirs = [directory / e.name for e in storage.list(directory) if e.name.startswith("cut-")]
    for path in [d / e.name for d in cut_dirs for e in storage.list(d)
                 if e.name.startswith("p") and e.name.endswith(".seg")]:  # fmt: skip
        try:
            k, name = parse_cut_path(f"{path.parent.name}/{path.name}")
        except RepositoryError:
            continue
        found.setdefault(name.partition, []).append((k, path.name, path))
    out: dict[int, list[tuple[int, int, SegmentInfo]]] = {}
    for p, paths in sorted(found.items()):
        cuts = out.setdefault(p, [])
        for _k, _name, path in sorted(paths):
            try:
                with SegmentReader(path, storage) as reader:
                    info, to = reader.verify(), reader.header.start_seq
            except SegmentError as exc:
                log.warning("%s: not listed: %s", path, exc.reason)
                continue
            want = directory / f"cut-{len(cuts) + 1}" / path.name
            if want != path:
                storage.make_dirs(want.parent)  # its parent, the backup's, is there
                storage.replace(path, want)
                info = replace(info, path=str(want))
            cuts.append((info.last_seq, to, info))
    return out


def _segment_entry(seg: SegmentInfo) -> SegmentEntry:
    return SegmentEntry(Path(seg.path).name, seg.first_seq, seg.last_seq, seg.records,
                        seg.bytes, seg.checksum)  # fmt: skip


def _entry(
    r: PartitionResult, rb: RollbackRecord | None, reused: Sequence[SegmentInfo] = (),
    points: Sequence[tuple[int, datetime]] = (),
) -> PartitionEntry:  # fmt: skip
    """The manifest entry of a partition: `reused` segments (an interrupted run's), then
    this run's; a follower's commit gives its restore `points`."""
    segments = tuple(_segment_entry(s) for s in (*reused, r.segment) if s is not None)
    uuid = r.failover_log.latest.uuid if r.failover_log.entries else 0
    snap_start, snap_end = r.snapshot
    end = r.end_seq
    if not snap_start <= end <= snap_end:  # no marker this run: the range end is complete
        snap_start = snap_end = end
    cuts = tuple(CutBack(f, t, (_segment_entry(seg),)) for f, t, seg in r.cuts)
    return PartitionEntry(r.partition, uuid, r.failover_log, r.start_seq, end, snap_start,
                          snap_end, segments, rb, cuts,
                          points=Points.checked(points, f"partition {r.partition}",
                                                r.start_seq, end) if points else ())  # fmt: skip


__all__ = ["BackupId", "BackupSummary", "backup", "decide_start"]
