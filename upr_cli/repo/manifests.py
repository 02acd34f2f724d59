"""A repository's manifests and chains: reading, committing and repairing a backup's two
manifest files, and checking the chain a reader uses (formats/repository.md §4.1, §8.8).

Theory of operation: a backup exists once its manifest does. The manifest is written
last, atomically (`Storage.write`), first as `manifest.json.copy`, then as
`manifest.json` (pgBackRest's manifest and `.copy`; WAL-G's sentinel). Either file
commits the backup: both hold the same bytes, so losing one loses nothing. Reading takes
`manifest.json`, or its copy when that one is missing or damaged; `verify --repair` and
the next backup rewrite the bad one from the good one (`repair`). Commits go forward
only: an incremental manifest's parent is the newest committed backup, so id order is
chain order (formats/repository.md §8). Readers and backups take the chain through
`chain`, which refuses a chain that is not whole (a damaged manifest, a missing parent,
a seq gap) with an error naming the missing piece, instead of reading around it.

Every file is reached through the repository's `Storage`; paths come from the layout
(`Repository`), which builds them from the tested format/parse pairs in `names`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from upr_cli.repo.chain import broken_parents, coverage_gaps, needed_from, ordered, plan_state
from upr_cli.repo.errors import BrokenChain, RepositoryError
from upr_cli.repo.lock import require_held
from upr_cli.repo.manifest import MAX_MANIFEST_BYTES, Manifest
from upr_cli.repo.names import BackupId, format_backup_dir, parse_backup_dir
from upr_cli.segments.format import SegmentError
from upr_cli.storage import LOCAL, Storage

if TYPE_CHECKING:
    from upr_cli.repo.layout import Repository
    from upr_cli.repo.lock import RepositoryLock

MANIFEST_FILE = "manifest.json"
"""A backup's manifest; its presence is the backup's commit point."""
MANIFEST_COPY = "manifest.json.copy"
"""The manifest's copy, written just before `manifest.json` and read when it is damaged."""


@dataclass(frozen=True, slots=True)
class ManifestFile:
    """One of a backup's two manifest files, as found: its bytes (None when missing)
    and the manifest they hold, or why they hold none (`error`)."""

    path: Path
    data: bytes | None
    manifest: Manifest | None
    error: str | None

    @property
    def valid(self) -> bool:
        """The file holds a valid manifest of its directory's backup."""
        return self.manifest is not None


def altered_twin(
    main: ManifestFile, copy: ManifestFile
) -> tuple[ManifestFile, ManifestFile] | None:
    """(altered, as written) when both files hold the same valid manifest but only one
    has the bytes upr writes (`Manifest.dumps`): the other was changed outside what its
    checksum covers (whitespace, a lost final newline), and the twin answers which is
    right. None otherwise (two files that really differ stay a question)."""
    if main.manifest is None or main.data is None or copy.data is None:
        return None
    if main.data == copy.data or main.manifest != copy.manifest:
        return None
    written = main.manifest.dumps()
    if main.data == written:
        return copy, main
    if copy.data == written:
        return main, copy
    return None


def load_manifest_file(path: Path, storage: Storage = LOCAL) -> Manifest:
    """Read, checksum and validate one manifest file; errors name the file."""
    data = _read(storage, path)
    if isinstance(data, str):
        raise RepositoryError(f"{path}: {data}")
    try:
        return Manifest.loads(data)
    except RepositoryError as exc:
        raise RepositoryError(f"{path}: {exc}") from None


def _read(storage: Storage, path: Path) -> bytes | str:
    """A manifest file's bytes (at most the size limit and one byte), or why not."""
    try:
        return storage.read(path, 0, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"cannot read: {exc.strerror}"
    except SegmentError as exc:  # a sealed file that fails to open (formats/repository.md §10)
        return exc.reason


def absorbed_ids(manifests: Iterable[Manifest]) -> set[BackupId]:
    """The backups that committed revisions took over (removed by `upr prune`)."""
    return {b for m in manifests for b in m.absorbed}


_REMEMBERED = 1024
"""Backups whose facts `ManifestStore.remember` keeps: a follower's tail needs some
dozens (fanout - 1 per level and a rollup at work); those that never join a rollup
(its size bound) must not add up over a session of weeks."""


class ManifestStore:
    """The manifests of one repository and the chains they form."""

    def __init__(self, layout: Repository) -> None:
        self.layout = layout
        # manifests parsed, by (device, inode, size, mtime) of their file: a file is only
        # ever replaced by a rename (a new inode), so an entry never goes stale
        self._parsed: dict[tuple[int, int, int, int], Manifest] = {}
        self._written: dict[tuple[str, BackupId], tuple[int, frozenset[BackupId]]] = {}

    @property
    def storage(self) -> Storage:
        """The repository's storage (sealing once an encrypted repository is unlocked)."""
        return self.layout.storage

    def committed_mark(self, d: Path) -> bool:
        """Either manifest file is present in backup directory `d` (valid or not)."""
        st = self.storage.stat
        return st(d / MANIFEST_FILE) is not None or st(d / MANIFEST_COPY) is not None

    # -- reading ---------------------------------------------------------------------

    def read(self, bucket: str, backup_id: BackupId) -> Manifest:
        """The manifest of a committed backup: `manifest.json`, or its copy when that one
        is missing or damaged; when neither is valid, the error names both files."""
        d = self.layout.backup_dir(bucket, backup_id)
        if not self.committed_mark(d):  # a newer revision since the last scan, and
            self.layout.scan(bucket)  # the one known then removed: look again
            d = self.layout.backup_dir(bucket, backup_id)
        path = d / MANIFEST_FILE
        if not self.committed_mark(d):
            raise RepositoryError(f"{path}: backup {backup_id} is not committed (no manifest)")
        main = self._file(path, bucket, backup_id)
        if main.manifest is not None:
            return main.manifest
        copy = self._file(d / MANIFEST_COPY, bucket, backup_id)
        if copy.manifest is not None:
            return copy.manifest
        raise RepositoryError(f"{path}: {main.error}; {copy.path}: {copy.error}")

    def files(self, bucket: str, backup_id: BackupId) -> tuple[ManifestFile, ManifestFile]:
        """`manifest.json` and `manifest.json.copy` of a backup, each checked on its own
        (its checksum, its content, its directory): what `verify` reports."""
        d = self.layout.backup_dir(bucket, backup_id)
        main = self._file(d / MANIFEST_FILE, bucket, backup_id, with_data=True)
        copy = self._file(d / MANIFEST_COPY, bucket, backup_id, with_data=True, twin=main)
        return main, copy

    def _file(
        self, path: Path, bucket: str, backup_id: BackupId, *, with_data: bool = False,
        twin: ManifestFile | None = None,
    ) -> ManifestFile:  # fmt: skip
        """One manifest file, read, checksummed and validated, naming its backup: its
        bytes only `with_data` (or when it must be parsed). A `twin` with the same bytes
        is not parsed again."""
        try:
            st = self.storage.stat(path, follow_links=True)
        except OSError as exc:
            return ManifestFile(path, None, None, f"cannot read: {exc.strerror}")
        if st is None:
            return ManifestFile(path, None, None, "missing")
        known = self._parsed.get(st.version)
        if known is not None and known.bucket == bucket and known.backup_id == backup_id:
            data = _read(self.storage, path) if with_data else None
            if not isinstance(data, str):
                return ManifestFile(path, data, known, None)
        data = _read(self.storage, path)
        if isinstance(data, str):
            return ManifestFile(path, None, None, data)
        try:
            if twin is not None and twin.manifest is not None and twin.data == data:
                m = twin.manifest
            else:
                m = Manifest.loads(data)
            if m.bucket != bucket or m.backup_id != backup_id:
                raise RepositoryError(
                    f"the manifest is for backup {m.backup_id} of bucket {m.bucket!r}, "
                    f"not {backup_id} of {bucket!r}"
                )
            if format_backup_dir(m.backup_id, m.revision) != path.parent.name:
                raise RepositoryError(
                    f"the manifest is revision {m.revision} of backup {m.backup_id}, "
                    f"not the one of directory {path.parent.name}"
                )
        except RepositoryError as exc:
            return ManifestFile(path, data if with_data else None, None, str(exc))
        self._parsed[st.version] = m
        return ManifestFile(path, data if with_data else None, m, None)

    def readable(self, bucket: str) -> tuple[list[Manifest], dict[BackupId, str]]:
        """Every committed backup's manifest that can be read (oldest first), and the
        damaged ones with the reason: no check of the chain (`verify`, a new chain)."""
        manifests, damaged = self._read_all(bucket)
        # a backup a committed revision took over is removed, whatever is left of its
        # directory until the sweep (formats/repository.md §4.6)
        gone = absorbed_ids(manifests)
        if gone:
            manifests = [m for m in manifests if m.backup_id not in gone]
            damaged = {b: why for b, why in damaged.items() if b not in gone}
        return manifests, damaged

    def _read_all(self, bucket: str) -> tuple[list[Manifest], dict[BackupId, str]]:
        manifests, damaged = [], {}
        for bid in self.layout.committed_all(bucket):
            try:
                manifests.append(self.read(bucket, bid))
            except RepositoryError as exc:
                damaged[bid] = str(exc)
        # forget the bucket's manifests no longer there (a long-running follower rolls
        # up and removes thousands): the cache stays the size of the repository
        there = {id(m) for m in manifests}
        for key in [k for k, m in self._parsed.items() if m.bucket == bucket
                    and id(m) not in there]:  # fmt: skip
            del self._parsed[key]
        return manifests, damaged

    def absorbed(self, bucket: str) -> set[BackupId]:
        """The backups that the readable committed revisions absorbed."""
        return absorbed_ids(self._read_all(bucket)[0])

    # -- writing ---------------------------------------------------------------------

    def write(self, manifest: Manifest) -> Path:
        """Commit a backup: check its segments and place in the chain, write copy, then manifest."""
        layout = self.layout
        layout.info()
        bucket, bid = manifest.bucket, manifest.backup_id
        d = layout.backup_dir(bucket, bid)
        path = d / MANIFEST_FILE
        st = self.storage.stat(d, follow_links=True)
        if st is None or not st.is_dir:
            raise RepositoryError(f"{d}: no such backup directory (use new_backup_dir)")
        if self.committed_mark(d):
            raise RepositoryError(f"{path}: backup {bid} is already committed")
        committed = layout.committed(bucket)
        newest = committed[-1] if committed else None
        layout.check_place(bucket, bid, manifest.merged_through, committed)
        if not manifest.full and manifest.parent != newest:
            raise RepositoryError(
                f"{path}: parent {manifest.parent} is not the newest committed backup {newest}"
            )
        if manifest.parent is not None:  # never on top of a parent that cannot be read
            self.read(bucket, manifest.parent)
        self._check_files(d, manifest)
        data = manifest.dumps()
        self.storage.write(d / MANIFEST_COPY, data)  # the commit point
        self.storage.write(path, data)
        return path

    def remember(self, manifest: Manifest) -> None:
        """`manifest` was just committed by this process: a later revision's checks
        take its revision and the backups it absorbed from here, without reading it (a
        follower commits every few seconds and rolls its commits up; parsing them again
        would take seconds under the lock, keeping them whole megabytes of restore
        points each)."""
        key = (manifest.bucket, manifest.backup_id)
        self._written.pop(key, None)
        self._written[key] = (manifest.revision, frozenset(manifest.absorbed))
        while len(self._written) > _REMEMBERED:  # the oldest go: read again if needed
            del self._written[next(iter(self._written))]

    def forget(self, bucket: str) -> None:
        """Drop what is cached of `bucket`'s manifests (a long-running writer that read
        its chain once)."""
        for key in [k for k, m in self._parsed.items() if m.bucket == bucket]:
            del self._parsed[key]

    def _facts(self, bucket: str, backup_id: BackupId) -> tuple[int, frozenset[BackupId]]:
        """A committed backup's current revision and the backups it absorbed: as this
        process committed them (`remember`) when that is still the current revision,
        else read."""
        d = self.layout.backup_dir(bucket, backup_id)
        known = self._written.get((bucket, backup_id))
        if known is not None and self.committed_mark(d):
            with contextlib.suppress(RepositoryError):
                if parse_backup_dir(d.name)[1] == known[0]:
                    return known
        m = self.read(bucket, backup_id)
        return m.revision, frozenset(m.absorbed)

    def write_revision(
        self, manifest: Manifest, lock: RepositoryLock, data: bytes | None = None
    ) -> Path:
        """Commit a revision of a committed backup (formats/repository.md §4.6): its
        directory is `<id>-rNNNNNNNN` for the manifest's revision, which must be one more
        than the current revision's; every file it lists is present at its size; the
        backups it absorbs are committed and older. Copy first, then the manifest: the
        copy's rename is the commit point, as for a backup (formats/repository.md §4.3).
        `data` is the manifest's bytes when they were made already (`Manifest.dumps`).
        Needs the lock."""
        require_held(lock, self.layout.lock_path(manifest.bucket))
        bucket, bid = manifest.bucket, manifest.backup_id
        d = self.layout.revision_dir(bucket, bid, manifest.revision)
        revision, absorbed = self._facts(bucket, bid)
        if manifest.revision != revision + 1:
            raise RepositoryError(
                f"{d}: revision {manifest.revision} does not follow the current revision "
                f"{revision} of backup {bid}"
            )
        if self.committed_mark(d):
            raise RepositoryError(f"{d}: revision {manifest.revision} is already committed")
        # a backup it absorbs is committed, or was absorbed already (by K or by one of the
        # backups it now absorbs, whose directory the sweep may have removed)
        committed = set(self.layout.committed_all(bucket))
        known = committed | absorbed
        for b in set(manifest.absorbed) & committed:
            known |= self._facts(bucket, b)[1]
        stray = [b for b in manifest.absorbed if b not in known]
        if stray:
            raise RepositoryError(f"{d}: absorbs backup {stray[0]}, which is not committed")
        self._check_files(d, manifest)
        data = manifest.dumps() if data is None else data
        self.storage.write(d / MANIFEST_COPY, data)  # the commit point
        self.storage.write(d / MANIFEST_FILE, data)
        self.layout.committed_revision(bucket, bid, d)  # the backup's current directory
        self.remember(manifest)
        for b in manifest.absorbed:  # gone for every reader
            self._written.pop((bucket, b), None)
        return d / MANIFEST_FILE

    def _check_files(self, d: Path, manifest: Manifest) -> None:
        """Every segment file the manifest lists is a regular file of its recorded size."""
        files = [(s.file, s) for e in manifest.partitions for s in e.segments]
        files += [f for e in manifest.partitions for f in e.cut_files()]
        for name, entry in files:
            seg = d / name
            found = self.storage.stat(seg)
            if found is None:
                raise RepositoryError(f"{seg}: segment file listed in the manifest is missing")
            if not found.is_file or found.size != entry.bytes:
                raise RepositoryError(
                    f"{seg}: size {found.size} differs from the manifest's {entry.bytes} bytes"
                )

    def repair(self, bucket: str, backup_id: BackupId, lock: RepositoryLock) -> list[Path]:
        """Rewrite a backup's missing or damaged manifest file from its valid twin
        (atomically); returns the files rewritten. Needs the bucket's lock, held. Two
        valid files that differ, or two damaged ones, are left as they are."""
        require_held(lock, self.layout.lock_path(bucket))
        main, copy = self.files(bucket, backup_id)
        pair = altered_twin(main, copy)
        if pair is not None and pair[1].data is not None:
            self.storage.write(pair[0].path, pair[1].data)
            return [pair[0].path]
        good = main if main.valid else copy if copy.valid else None
        if good is None or good.data is None:
            return []
        out = []
        for f in (main, copy):
            if not f.valid:
                self.storage.write(f.path, good.data)
                out.append(f.path)
        return out

    def heal(self, bucket: str, lock: RepositoryLock) -> list[tuple[Path, str]]:
        """`repair` for every committed backup: (file rewritten, its problem)."""
        out = []
        for bid in self.layout.committed(bucket):
            d = self.layout.backup_dir(bucket, bid)
            main = self._file(d / MANIFEST_FILE, bucket, bid)
            copy = self._file(d / MANIFEST_COPY, bucket, bid)
            if main.valid and copy.valid:
                continue
            why = {f.path: f.error or "" for f in (main, copy)}
            out += [(path, why[path]) for path in self.repair(bucket, bid, lock)]
        return out

    # -- the chain a reader uses (formats/repository.md §8.8) -------------------------

    def chain(self, bucket: str, at: BackupId | None = None) -> list[Manifest]:
        """The manifests of the committed backups up to `at` (default: the newest
        committed one, damaged or not), oldest first, after checking that the state at
        `at` can be read whole; otherwise `BrokenChain` naming the missing piece.

        Within the backups that state can depend on (`needed_from`), no manifest may be
        damaged and no incremental backup's parent missing; no partition may have seqs
        that no backup covers (`coverage_gaps` at `at`)."""
        problems, manifests = self._chain_problems(bucket, at)
        if problems:
            more = len(problems) - 1
            also = f" (and {more} more: `upr verify` names them)" if more else ""
            raise BrokenChain(f"{problems[0]}{also}")
        return manifests

    def _chain_problems(self, bucket: str, at: BackupId | None) -> tuple[list[str], list[Manifest]]:
        layout = self.layout
        committed = layout.committed(bucket)
        if not committed:
            return [], []
        if at is None:
            at = committed[-1]
        elif at not in committed:
            raise RepositoryError(
                f"{layout.backup_dir(bucket, at)}: backup {at} is not committed (no manifest)"
            )
        manifests, damaged = [], {}
        for bid in committed:
            if bid > at:
                break
            try:
                manifests.append(self.read(bucket, bid))
            except RepositoryError as exc:
                damaged[bid] = str(exc)
        start = needed_from(manifests, at)
        window = [m for m in manifests if start is None or m.backup_id >= start]
        problems = [f"backup {bid} is damaged: {why}" for bid, why in damaged.items()
                    if start is None or bid > start]  # fmt: skip
        for mm in broken_parents(window):
            problems.append(self.describe_parent(bucket, mm.backup_id, mm.recorded, mm.expected,
                                                 damaged))  # fmt: skip
        for p in sorted({e.partition for m in manifests for e in m.partitions}):
            for gap in coverage_gaps(manifests, p, at=at):
                problems.append(
                    f"{layout.backup_dir(bucket, gap.backup_id)}: partition {p}: seqs "
                    f"({gap.from_seq}, {gap.to_seq}] before backup {gap.backup_id} are in no "
                    "backup (a backup in between is missing)"
                )
        return problems, manifests

    def describe_parent(
        self,
        bucket: str,
        child: BackupId,
        recorded: BackupId | None,
        expected: BackupId | None,
        damaged: Mapping[BackupId, str] | None = None,
    ) -> str:
        """One line on an incremental backup whose parent is not the backup before it:
        what is (or is not) at the parent's place (formats/repository.md §8.6)."""
        if recorded is None:  # cannot happen for an incremental manifest; said plainly
            return f"backup {child} names no parent"
        d = self.layout.backup_dir(bucket, recorded)
        if damaged and recorded in damaged:
            return f"{d}: backup {recorded}, the parent of backup {child}, is damaged"
        if self.storage.stat(d) is None:
            return f"{d}: backup {recorded}, the parent of backup {child}, is gone"
        if not self.committed_mark(d):
            n = self._count_segments(d)
            return (
                f"{d}: backup {recorded}, the parent of backup {child}, has no {MANIFEST_FILE} "
                f"and no {MANIFEST_COPY} ({n} segment files remain)"
            )
        between = "no backup" if expected is None else f"backup {expected}"
        return f"backup {child} continues backup {recorded}, but {between} comes before it"

    def _count_segments(self, d: Path) -> int:
        """Files named `*.seg` anywhere under `d` (symbolic links not followed)."""
        n = 0
        for e in self.storage.list(d):
            n += e.name.endswith(".seg")
            if e.is_dir:
                n += self._count_segments(d / e.name)
        return n

    def missing_files(
        self, bucket: str, manifests: Sequence[Manifest], at: BackupId,
        partitions: Iterable[int] | None = None,
    ) -> list[str]:  # fmt: skip
        """The segment files the state at `at` reads (formats/repository.md §8.2) that are
        missing or whose size differs from their manifest's, each as one line naming the
        file: a cheap check (no file is read) made before anything is written."""
        chain = ordered(manifests)
        held = sorted({e.partition for m in chain if m.backup_id <= at for e in m.partitions})
        wanted = held if partitions is None else [p for p in held if p in set(partitions)]
        out = []
        for p in wanted:
            for step in plan_state(chain, at=at, partition=p):
                path = self.layout.segment_path(bucket, step.backup_id, step.segment.file)
                try:
                    st = self.storage.stat(path, follow_links=True)
                except OSError as exc:
                    out.append(f"{path}: cannot read: {exc.strerror}")
                    continue
                if st is None:
                    out.append(f"{path}: missing (listed by backup {step.backup_id})")
                    continue
                if not st.is_file or st.size != step.segment.bytes:
                    out.append(f"{path}: {st.size} bytes, the manifest of backup "
                               f"{step.backup_id} says {step.segment.bytes}")  # fmt: skip
        return out
