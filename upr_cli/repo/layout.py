"""The repository on disk: `<repo>/repo.json`, `<repo>/<bucket>/<backup-id>/`.

formats/repository.md "Layout" is the normative description.

Theory of operation: a backup directory exists from the moment a run starts writing
segments into it, but the backup exists only once its manifest does: the manifest is
written last, atomically (`fsio.atomic_write`), first as `manifest.json.copy`, then as
`manifest.json` (pgBackRest's manifest and `.copy`; WAL-G's sentinel). Either file
commits the backup (formats/repository.md §4.1): both hold the same bytes, so losing one
loses nothing. Hence:

* listing reports committed backups; reading takes `manifest.json`, or its copy when
  that one is missing or damaged; `verify --repair` and the next backup rewrite the bad
  one from the good one (`repair_manifest`);
* a directory with neither file is an interrupted run: the next run reuses it (resume)
  or `sweep` removes it. `sweep` runs under the bucket's lock and never removes a
  directory holding either file, whatever state it is in, nor one that a committed
  backup names as its parent, nor any that a damaged manifest could name
  (formats/repository.md §4.4);
* commits go forward only: a new backup id sorts after every committed one, and an
  incremental manifest's parent is the newest committed backup, so id order is chain
  order (formats/repository.md §8);
* readers and backups take the chain through `chain`, which refuses a chain that is not
  whole (a damaged manifest, a missing parent, a seq gap) with an error naming the
  missing piece (formats/repository.md §8.8), instead of reading around it.

Every path is built from the tested format/parse pairs in `names`.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from upr_cli.errors import ExitCode, os_error
from upr_cli.fsio import FileOps, atomic_write
from upr_cli.repo.chain import (
    broken_parents,
    coverage_gaps,
    needed_from,
    ordered,
    plan_state,
)
from upr_cli.repo.errors import BrokenChain, RepositoryError
from upr_cli.repo.manifest import MAX_MANIFEST_BYTES, Manifest, load_json
from upr_cli.repo.names import (
    BackupId,
    SegmentName,
    check_bucket,
    format_time,
    is_temp_name,
    parse_cut_path,
    parse_time,
    temp_name,
)

if TYPE_CHECKING:
    from upr_cli.repo.lock import RepositoryLock

REPO_FILE = "repo.json"
"""The repository-level file, created by `Repository.init`."""
REPO_FORMAT = "upr-repository"
"""The `format` value of repo.json."""
REPO_VERSION = 1
"""The repository layout version this code writes and reads."""
MANIFEST_FILE = "manifest.json"
"""A backup's manifest; its presence is the backup's commit point."""
MANIFEST_COPY = "manifest.json.copy"
"""The manifest's copy, written just before `manifest.json` and read when it is damaged."""
LOCK_FILE = "lock"
"""The bucket's lock file (see `upr_cli.repo.lock`)."""


class NotARepository(RepositoryError):
    """The path is not a upr repository (not a directory, no or an invalid repo.json): bad
    input, exit 2, in every command that takes a repository."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True, slots=True)
class RepoInfo:
    """What repo.json says: the layout version and when the repository was created."""

    version: int
    created: datetime

    def to_json(self) -> dict[str, object]:
        """The repo.json object."""
        return {
            "format": REPO_FORMAT,
            "version": self.version,
            "created": format_time(self.created),
        }

    @classmethod
    def from_json(cls, data: object, where: str) -> RepoInfo:
        """Parse repo.json; anything else raises RepositoryError naming `where`."""
        if not isinstance(data, dict) or set(data) != {"format", "version", "created"}:
            raise RepositoryError(f"{where}: expected keys 'format', 'version', 'created'")
        if data["format"] != REPO_FORMAT:
            raise RepositoryError(f"{where}: format {data['format']!r} is not {REPO_FORMAT!r}")
        version = data["version"]
        if isinstance(version, bool) or not isinstance(version, int):
            raise RepositoryError(f"{where}: version {version!r} is not an integer")
        if version != REPO_VERSION:
            raise RepositoryError(
                f"{where}: repository version {version} is not supported (this upr reads "
                f"version {REPO_VERSION})"
            )
        try:
            created = parse_time(data["created"])
        except RepositoryError as exc:
            raise RepositoryError(f"{where}: created: {exc}") from None
        return cls(version, created)


@dataclass(frozen=True, slots=True)
class _Scan:
    """One backup directory: its id and which of its two manifest files are present."""

    backup_id: BackupId
    path: Path
    has_manifest: bool
    has_copy: bool

    @property
    def committed(self) -> bool:
        """Either file commits the backup (formats/repository.md §4.1)."""
        return self.has_manifest or self.has_copy


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


class Repository:
    """A backup repository rooted at `path` (formats/repository.md)."""

    def __init__(self, path: str | os.PathLike[str], *, ops: FileOps | None = None) -> None:
        self.path = Path(path)
        self.ops = ops or FileOps()
        # manifests parsed, by (device, inode, size, mtime) of their file: a file is only
        # ever replaced by a rename (a new inode), so an entry never goes stale
        self._parsed: dict[tuple[int, int, int, int], Manifest] = {}

    def __repr__(self) -> str:
        return f"Repository({str(self.path)!r})"

    # -- repository ------------------------------------------------------------------

    @property
    def repo_file(self) -> Path:
        """`<repo>/repo.json`."""
        return self.path / REPO_FILE

    def init(self) -> RepoInfo:
        """Create the repository (directory and repo.json) on first use; else validate it.

        Only a missing or empty directory becomes a repository.
        """
        if not os.path.lexists(self.repo_file):
            self.check_init()
            created_dir = not self.path.exists()
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # a parent that is a file, /proc, a read-only or full disk
                raise os_error(exc, self.path, "cannot create the repository") from None
            if created_dir:
                self.ops.fsync_dir(self.path.parent)
            info = RepoInfo(REPO_VERSION, datetime.now(UTC))
            data = (json.dumps(info.to_json(), indent=2) + "\n").encode()
            with contextlib.suppress(FileExistsError):  # another process won: validate theirs
                self._publish_once(self.repo_file, data)
        return self.info()

    def check_init(self) -> None:
        """Raise what `init` would raise, changing nothing: the path must be a repository
        (repo.json valid) or a missing or empty directory. A backup checks this, then its
        source, before it creates anything (formats/repository.md §4.2)."""
        if os.path.lexists(self.repo_file):
            self.info()
            return
        if self.path.exists() and not self.path.is_dir():
            raise NotARepository(f"{self.path}: exists and is not a directory")
        if self.path.is_dir() and any(self.path.iterdir()):
            raise NotARepository(
                f"{self.path}: not empty and not a upr repository (no {REPO_FILE}): "
                "give a new or empty directory"
            )
        if not self.path.exists():
            self._probe_mkdir()

    def _probe_mkdir(self) -> None:
        """Create the path's missing directories and remove them again: the errors `init`
        would meet (a file in the way, a file system that refuses), none of its changes."""
        made: list[Path] = []
        try:
            for d in reversed([self.path, *self.path.parents]):
                if not os.path.lexists(d):
                    d.mkdir()
                    made.append(d)
        except OSError as exc:
            raise os_error(exc, self.path, "cannot create the repository") from None
        finally:
            for d in reversed(made):
                with contextlib.suppress(OSError):
                    d.rmdir()

    def _publish_once(self, path: Path, data: bytes) -> None:
        """Publish `path` atomically unless it exists (link(2) never replaces)."""
        tmp = path.with_name(temp_name(path.name))
        try:
            self.ops.write_file(tmp, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # no hard links on this file system: rename (may replace)
                self.ops.rename(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.ops.fsync_dir(path.parent)

    def info(self) -> RepoInfo:
        """Read and validate repo.json; a directory without one is not a repository."""
        try:
            raw = self.repo_file.read_bytes()
        except FileNotFoundError:
            raise NotARepository(
                f"{self.path}: not a upr repository (no {REPO_FILE}; `upr backup` creates one)"
            ) from None
        except OSError as exc:
            raise RepositoryError(f"{self.repo_file}: cannot read: {exc.strerror}") from None
        try:
            data = load_json(raw)
        except RepositoryError as exc:
            raise NotARepository(f"{self.repo_file}: {exc}") from None
        try:
            return RepoInfo.from_json(data, str(self.repo_file))
        except RepositoryError as exc:  # not one this upr reads: wrong keys, format, version
            raise NotARepository(str(exc)) from None

    def buckets(self) -> list[str]:
        """Bucket directories present, sorted."""
        if not self.path.is_dir():
            return []
        out = []
        for entry in os.scandir(self.path):
            if entry.is_dir(follow_symlinks=False):
                try:
                    out.append(check_bucket(entry.name))
                except RepositoryError:
                    continue
        return sorted(out)

    # -- paths -----------------------------------------------------------------------

    def bucket_dir(self, bucket: str) -> Path:
        """`<repo>/<bucket>`."""
        return self.path / check_bucket(bucket)

    def backup_dir(self, bucket: str, backup_id: BackupId) -> Path:
        """`<repo>/<bucket>/<backup-id>`."""
        return self.bucket_dir(bucket) / backup_id.format()

    def manifest_path(self, bucket: str, backup_id: BackupId) -> Path:
        """`<repo>/<bucket>/<backup-id>/manifest.json`."""
        return self.backup_dir(bucket, backup_id) / MANIFEST_FILE

    def lock_path(self, bucket: str) -> Path:
        """`<repo>/<bucket>/lock`."""
        return self.bucket_dir(bucket) / LOCK_FILE

    # -- listing ---------------------------------------------------------------------

    def _scan(self, bucket: str) -> list[_Scan]:
        """Backup directories of `bucket`, oldest first (names that parse as backup ids)."""
        d = self.bucket_dir(bucket)
        if not d.is_dir():
            return []
        out = []
        for entry in os.scandir(d):
            if not entry.is_dir(follow_symlinks=False) or not BackupId.is_valid(entry.name):
                continue
            path = Path(entry.path)
            out.append(_Scan(BackupId.parse(entry.name), path,
                             os.path.lexists(path / MANIFEST_FILE),
                             os.path.lexists(path / MANIFEST_COPY)))  # fmt: skip
        return sorted(out, key=lambda s: s.backup_id)

    def committed(self, bucket: str) -> list[BackupId]:
        """Ids of backups whose `manifest.json` or copy is present (valid or not), oldest
        first."""
        return [s.backup_id for s in self._scan(bucket) if s.committed]

    def backups(self, bucket: str) -> list[BackupId]:
        """Committed backups with a valid manifest (or copy), oldest first."""
        out = []
        for bid in self.committed(bucket):
            try:
                self.read_manifest(bucket, bid)
            except RepositoryError:
                continue
            out.append(bid)
        return out

    def damaged(self, bucket: str) -> list[tuple[BackupId, str]]:
        """Committed backups whose manifest and copy are both unreadable, with the reason."""
        return list(self.readable(bucket)[1].items())

    def readable(self, bucket: str) -> tuple[list[Manifest], dict[BackupId, str]]:
        """Every committed backup's manifest that can be read (oldest first), and the
        damaged ones with the reason: no check of the chain (`verify`, a new chain)."""
        manifests, damaged = [], {}
        for bid in self.committed(bucket):
            try:
                manifests.append(self.read_manifest(bucket, bid))
            except RepositoryError as exc:
                damaged[bid] = str(exc)
        return manifests, damaged

    def incomplete(self, bucket: str) -> list[BackupId]:
        """Backup directories with neither manifest file (interrupted runs), oldest first."""
        return [s.backup_id for s in self._scan(bucket) if not s.committed]

    def resumable(self, bucket: str) -> BackupId | None:
        """The interrupted run the next backup of `bucket` goes on from
        (formats/repository.md §4.2 step 2, §4.5): the newest uncommitted directory,
        newer than every committed backup, holding a segment file; else None."""
        scan = self._scan(bucket)
        newest = scan[-1] if scan else None
        if newest is None or newest.committed or not _holds_segments(newest.path):
            return None
        return newest.backup_id

    def leftovers(self, bucket: str) -> list[BackupId]:
        """Uncommitted directories that no resume can use, oldest first: every one but
        the `resumable` run, less those a committed backup names as its parent (a backup
        that lost both manifest files: a chain problem, not a leftover). The next backup
        of the bucket removes them (`sweep`, or it reuses the newest, empty one)."""
        keep = self.resumable(bucket)
        named = {b for m in self.readable(bucket)[0] for b in (m.parent, m.merged_through)
                 if b is not None}  # fmt: skip
        return [b for b in self.incomplete(bucket) if b != keep and b not in named]

    def manifests(self, bucket: str) -> list[Manifest]:
        """Every committed backup's manifest, oldest first, once the chain is checked
        whole at the newest backup (`chain`); any damaged one is an error."""
        return self.chain(bucket)

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
        committed = self.committed(bucket)
        if not committed:
            return [], []
        if at is None:
            at = committed[-1]
        elif at not in committed:
            raise RepositoryError(
                f"{self.backup_dir(bucket, at)}: backup {at} is not committed (no manifest)"
            )
        manifests, damaged = [], {}
        for bid in committed:
            if bid > at:
                break
            try:
                manifests.append(self.read_manifest(bucket, bid))
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
                    f"{self.backup_dir(bucket, gap.backup_id)}: partition {p}: seqs "
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
        d = self.backup_dir(bucket, recorded)
        if damaged and recorded in damaged:
            return f"{d}: backup {recorded}, the parent of backup {child}, is damaged"
        if not os.path.lexists(d):
            return f"{d}: backup {recorded}, the parent of backup {child}, is gone"
        if not (os.path.lexists(d / MANIFEST_FILE) or os.path.lexists(d / MANIFEST_COPY)):
            n = sum(1 for _ in d.rglob("*.seg")) if d.is_dir() else 0
            return (
                f"{d}: backup {recorded}, the parent of backup {child}, has no {MANIFEST_FILE} "
                f"and no {MANIFEST_COPY} ({n} segment files remain)"
            )
        between = "no backup" if expected is None else f"backup {expected}"
        return f"backup {child} continues backup {recorded}, but {between} comes before it"

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
                path = self.segment_path(bucket, step.backup_id, step.segment.file)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    out.append(f"{path}: missing (listed by backup {step.backup_id})")
                    continue
                except OSError as exc:
                    out.append(f"{path}: cannot read: {exc.strerror}")
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_size != step.segment.bytes:
                    out.append(f"{path}: {st.st_size} bytes, the manifest of backup "
                               f"{step.backup_id} says {step.segment.bytes}")  # fmt: skip
        return out

    # -- writing ---------------------------------------------------------------------

    def next_backup_id(self, bucket: str) -> BackupId:
        """A new id: now, or just after the newest backup directory if the clock lags."""
        scan = self._scan(bucket)
        return BackupId.now(after=scan[-1].backup_id if scan else None)

    def new_backup_dir(
        self, bucket: str, backup_id: BackupId, *, after: BackupId | None = None
    ) -> Path:
        """Create (or reuse, when uncommitted) the directory of backup `backup_id`.

        It must be newer than every committed backup, or, for a merge standing in for
        the committed backup `after` (formats/repository.md §8.9), sort right after it:
        newer than `after` and older than every committed backup after `after`.
        """
        self.info()
        committed = self.committed(bucket)
        self._check_place(bucket, backup_id, after, committed)
        bdir = self.bucket_dir(bucket)
        if not bdir.is_dir():
            try:
                self.ops.mkdir(bdir)
            except FileExistsError:
                pass  # created meanwhile by another run: nothing to make durable here
            else:
                self.ops.fsync_dir(self.path)
        d = self.backup_dir(bucket, backup_id)
        try:
            self.ops.mkdir(d)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                raise RepositoryError(f"{d}: exists and is not a directory") from None
            return d  # an interrupted run's directory: reused
        self.ops.fsync_dir(bdir)
        return d

    def discard_empty(self, bucket: str, backup_id: BackupId, lock: RepositoryLock) -> bool:
        """Remove an uncommitted backup directory that holds nothing (a run that failed
        before it finished a segment), so that a failed run leaves no backup behind.
        Needs the bucket's lock, held; True when the directory is gone."""
        self._check_lock(bucket, lock)
        d = self.backup_dir(bucket, backup_id)
        try:
            d.rmdir()  # only ever an empty one
        except FileNotFoundError:
            return True
        except OSError:
            return False
        self.ops.fsync_dir(d.parent)
        return True

    def remove_empty_bucket(self, bucket: str) -> None:
        """Remove the bucket directory when it is empty (a first run that failed and
        released its lock): the repository is as it was before that run. A run that
        has just created it again keeps it (rmdir refuses a directory with a lock)."""
        d = self.bucket_dir(bucket)
        try:
            d.rmdir()
        except OSError:
            return
        self.ops.fsync_dir(self.path)

    def _check_place(self, bucket: str, backup_id: BackupId, after: BackupId | None,
                     committed: list[BackupId]) -> None:  # fmt: skip
        """A new backup's id is newest; a merge's sorts right after the backup it merges
        through (formats/repository.md §8.9)."""
        where = self.backup_dir(bucket, backup_id)
        if after is None:
            if committed and backup_id <= committed[-1]:
                raise RepositoryError(
                    f"{where}: backup id {backup_id} is not newer than the committed backup "
                    f"{committed[-1]}"
                )
            return
        if after not in committed:
            raise RepositoryError(f"{where}: merges through {after}, which is not committed")
        between = [c for c in committed if after < c <= backup_id]
        if backup_id <= after or between:
            raise RepositoryError(
                f"{where}: a merge through {after} must sort right after it"
                + (f" (backup {between[0]} is in between)" if between else "")
            )

    def write_manifest(self, manifest: Manifest) -> Path:
        """Commit a backup: check its segments and place in the chain, write copy, then manifest."""
        self.info()
        bucket, bid = manifest.bucket, manifest.backup_id
        d = self.backup_dir(bucket, bid)
        path = d / MANIFEST_FILE
        if not d.is_dir():
            raise RepositoryError(f"{d}: no such backup directory (use new_backup_dir)")
        if os.path.lexists(path) or os.path.lexists(d / MANIFEST_COPY):
            raise RepositoryError(f"{path}: backup {bid} is already committed")
        committed = self.committed(bucket)
        newest = committed[-1] if committed else None
        self._check_place(bucket, bid, manifest.merged_through, committed)
        if not manifest.full and manifest.parent != newest:
            raise RepositoryError(
                f"{path}: parent {manifest.parent} is not the newest committed backup {newest}"
            )
        if manifest.parent is not None:  # never on top of a parent that cannot be read
            self.read_manifest(bucket, manifest.parent)
        files = [(s.file, s) for e in manifest.partitions for s in e.segments]
        files += [f for e in manifest.partitions for f in e.cut_files()]
        for name, entry in files:
            seg = d / name
            try:
                st = os.lstat(seg)
            except FileNotFoundError:
                raise RepositoryError(
                    f"{seg}: segment file listed in the manifest is missing"
                ) from None
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry.bytes:
                raise RepositoryError(
                    f"{seg}: size {st.st_size} differs from the manifest's {entry.bytes} bytes"
                )
        data = manifest.dumps()
        atomic_write(d / MANIFEST_COPY, data, self.ops)
        atomic_write(path, data, self.ops)  # the commit point
        return path

    # -- reading ---------------------------------------------------------------------

    def read_manifest(self, bucket: str, backup_id: BackupId) -> Manifest:
        """The manifest of a committed backup: `manifest.json`, or its copy when that one
        is missing or damaged; when neither is valid, the error names both files."""
        d = self.backup_dir(bucket, backup_id)
        path = d / MANIFEST_FILE
        if not os.path.lexists(path) and not os.path.lexists(d / MANIFEST_COPY):
            raise RepositoryError(f"{path}: backup {backup_id} is not committed (no manifest)")
        main = self._file(path, bucket, backup_id)
        if main.manifest is not None:
            return main.manifest
        copy = self._file(d / MANIFEST_COPY, bucket, backup_id)
        if copy.manifest is not None:
            return copy.manifest
        raise RepositoryError(f"{path}: {main.error}; {copy.path}: {copy.error}")

    def manifest_files(self, bucket: str, backup_id: BackupId) -> tuple[ManifestFile, ManifestFile]:
        """`manifest.json` and `manifest.json.copy` of a backup, each checked on its own
        (its checksum, its content, its directory): what `verify` reports."""
        d = self.backup_dir(bucket, backup_id)
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
            st = os.stat(path)
        except FileNotFoundError:
            return ManifestFile(path, None, None, "missing")
        except OSError as exc:
            return ManifestFile(path, None, None, f"cannot read: {exc.strerror}")
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        known = self._parsed.get(key)
        if known is not None and known.bucket == bucket and known.backup_id == backup_id:
            data = self._read(path) if with_data else None
            if not isinstance(data, str):
                return ManifestFile(path, data, known, None)
        data = self._read(path)
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
        except RepositoryError as exc:
            return ManifestFile(path, data if with_data else None, None, str(exc))
        self._parsed[key] = m
        return ManifestFile(path, data if with_data else None, m, None)

    @staticmethod
    def _read(path: Path) -> bytes | str:
        """A manifest file's bytes (at most the size limit and one byte), or why not."""
        try:
            with open(path, "rb") as f:
                return f.read(MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            return "missing"
        except OSError as exc:
            return f"cannot read: {exc.strerror}"

    def repair_manifest(self, bucket: str, backup_id: BackupId, lock: RepositoryLock) -> list[Path]:
        """Rewrite a backup's missing or damaged manifest file from its valid twin
        (atomically); returns the files rewritten. Needs the bucket's lock, held. Two
        valid files that differ, or two damaged ones, are left as they are."""
        self._check_lock(bucket, lock)
        main, copy = self.manifest_files(bucket, backup_id)
        pair = altered_twin(main, copy)
        if pair is not None and pair[1].data is not None:
            atomic_write(pair[0].path, pair[1].data, self.ops)
            return [pair[0].path]
        good = main if main.valid else copy if copy.valid else None
        if good is None or good.data is None:
            return []
        out = []
        for f in (main, copy):
            if not f.valid:
                atomic_write(f.path, good.data, self.ops)
                out.append(f.path)
        return out

    def heal(self, bucket: str, lock: RepositoryLock) -> list[tuple[Path, str]]:
        """`repair_manifest` for every committed backup: (file rewritten, its problem)."""
        out = []
        for bid in self.committed(bucket):
            d = self.backup_dir(bucket, bid)
            main = self._file(d / MANIFEST_FILE, bucket, bid)
            copy = self._file(d / MANIFEST_COPY, bucket, bid)
            if main.valid and copy.valid:
                continue
            why = {f.path: f.error or "" for f in (main, copy)}
            out += [(path, why[path]) for path in self.repair_manifest(bucket, bid, lock)]
        return out

    def segment_path(self, bucket: str, backup_id: BackupId, file: str) -> Path:
        """The path of a segment file named in a manifest (or `cut-K/NAME`).

        Cut-back segments live in `cut-K/` (formats/repository.md §5.6).
        """
        d = self.backup_dir(bucket, backup_id)
        if file.startswith("cut-"):
            k, name = parse_cut_path(file)
            return d / f"cut-{k}" / name.format()
        return d / SegmentName.parse(file).format()

    # -- sweeping --------------------------------------------------------------------

    def _check_lock(self, bucket: str, lock: RepositoryLock) -> None:
        if not lock.held or lock.path != self.lock_path(bucket):
            raise RepositoryError(f"{self.lock_path(bucket)}: this needs the bucket's lock, held")

    def sweep(self, bucket: str, running: BackupId, lock: RepositoryLock) -> list[Path]:
        """Remove temp files, and the backup directories older than `running` that an
        interrupted run provably left (formats/repository.md §4.4): neither manifest
        file, no committed backup naming it as its parent, and no damaged manifest
        newer than it (whose parent link cannot be read). Needs the bucket's lock, held.
        """
        try:
            self._check_lock(bucket, lock)
        except RepositoryError:
            raise RepositoryError(
                f"{self.lock_path(bucket)}: sweep needs this bucket's lock, held"
            ) from None
        removed: list[Path] = []
        bdir = self.bucket_dir(bucket)
        if not bdir.is_dir():
            return removed
        self._sweep_temp(bdir, removed)
        scan = self._scan(bucket)
        named: set[BackupId] = set()  # parents named by a committed backup
        unreadable: BackupId | None = None  # the newest backup whose links cannot be read
        for s in scan:
            if s.committed:
                try:
                    m = self.read_manifest(bucket, s.backup_id)
                except RepositoryError:
                    unreadable = s.backup_id
                    continue
                named.update(b for b in (m.parent, m.merged_through) if b is not None)
        for s in scan:
            self._sweep_temp(s.path, removed)
            if (s.backup_id < running and not s.committed and s.backup_id not in named
                    and (unreadable is None or s.backup_id > unreadable)):  # fmt: skip
                self.ops.remove_tree(s.path)
                removed.append(s.path)
        if removed:
            self.ops.fsync_dir(bdir)
        return removed

    def _sweep_temp(self, d: Path, removed: list[Path]) -> None:
        """Remove regular files named like temp files directly inside `d`."""
        found = False
        for entry in os.scandir(d):
            if is_temp_name(entry.name) and entry.is_file(follow_symlinks=False):
                self.ops.remove(Path(entry.path))
                removed.append(Path(entry.path))
                found = True
        if found:
            self.ops.fsync_dir(d)


def load_manifest_file(path: Path) -> Manifest:
    """Read, checksum and validate one manifest file; errors name the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise RepositoryError(f"{path}: missing") from None
    except OSError as exc:
        raise RepositoryError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return Manifest.loads(data)
    except RepositoryError as exc:
        raise RepositoryError(f"{path}: {exc}") from None


def _holds_segments(d: Path) -> bool:
    """True when a backup directory holds a finished segment file (or a cut-back one)."""
    return any(d.glob("p*.seg")) or any(d.glob("cut-*/p*.seg"))
