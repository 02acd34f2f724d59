"""The repository on disk: `<repo>/repo.json`, `<repo>/<bucket>/<backup-id>/`.

formats/repository.md "Layout" is the normative description.

Theory of operation: a backup directory exists from the moment a run starts writing
segments into it, but the backup exists only once its `manifest.json` does: the manifest
is written last, atomically (`fsio.atomic_write`), after its copy `manifest.json.copy`,
and its rename is the commit point (DESIGN "Reliability principles"; WAL-G's sentinel,
pgBackRest's manifest and `.copy`). Hence:

* listing (`backups`) reports committed backups only, and reading falls back to the copy
  when `manifest.json` is damaged;
* a directory without `manifest.json` is an interrupted run: the next run reuses it
  (resume) or `sweep` removes it. `sweep` runs under the bucket's lock and never removes
  a directory holding a `manifest.json`, whatever state that file is in;
* commits go forward only: a new backup id sorts after every committed one, and an
  incremental manifest's parent is the newest committed backup, so id order is chain
  order (DESIGN "Chain semantics").

Every path is built from the tested format/parse pairs in `names` (STYLE 9).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from upr_cli.repo.errors import RepositoryError
from upr_cli.repo.fsio import DiskOps, atomic_write
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
    """One backup directory: its id and whether `manifest.json` is present."""

    backup_id: BackupId
    path: Path
    committed: bool


class Repository:
    """A backup repository rooted at `path` (formats/repository.md)."""

    def __init__(self, path: str | os.PathLike[str], *, ops: DiskOps | None = None) -> None:
        self.path = Path(path)
        self.ops = ops or DiskOps()

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
            if self.path.exists() and not self.path.is_dir():
                raise RepositoryError(f"{self.path}: exists and is not a directory")
            if self.path.is_dir() and any(self.path.iterdir()):
                raise RepositoryError(
                    f"{self.path}: not empty and not a upr repository (no {REPO_FILE}): "
                    "give a new or empty directory"
                )
            created_dir = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
            if created_dir:
                self.ops.fsync_dir(self.path.parent)
            info = RepoInfo(REPO_VERSION, datetime.now(UTC))
            data = (json.dumps(info.to_json(), indent=2) + "\n").encode()
            with contextlib.suppress(FileExistsError):  # another process won: validate theirs
                self._publish_once(self.repo_file, data)
        return self.info()

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
            raise RepositoryError(
                f"{self.path}: not a upr repository (no {REPO_FILE}; `upr backup` creates one)"
            ) from None
        except OSError as exc:
            raise RepositoryError(f"{self.repo_file}: cannot read: {exc.strerror}") from None
        try:
            data = load_json(raw)
        except RepositoryError as exc:
            raise RepositoryError(f"{self.repo_file}: {exc}") from None
        return RepoInfo.from_json(data, str(self.repo_file))

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
            committed = os.path.lexists(path / MANIFEST_FILE)
            out.append(_Scan(BackupId.parse(entry.name), path, committed))
        return sorted(out, key=lambda s: s.backup_id)

    def committed(self, bucket: str) -> list[BackupId]:
        """Ids of backups whose `manifest.json` is present (valid or not), oldest first."""
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
        out = []
        for bid in self.committed(bucket):
            try:
                self.read_manifest(bucket, bid)
            except RepositoryError as exc:
                out.append((bid, str(exc)))
        return out

    def incomplete(self, bucket: str) -> list[BackupId]:
        """Backup directories without `manifest.json` (interrupted runs), oldest first."""
        return [s.backup_id for s in self._scan(bucket) if not s.committed]

    def manifests(self, bucket: str) -> list[Manifest]:
        """Every committed backup's manifest, oldest first; any damaged one is an error."""
        return [self.read_manifest(bucket, bid) for bid in self.committed(bucket)]

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
        the committed backup `after` (§8.6), sort right after it: newer than `after`
        and older than every committed backup after `after`.
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

    def _check_place(self, bucket: str, backup_id: BackupId, after: BackupId | None,
                     committed: list[BackupId]) -> None:  # fmt: skip
        """A new backup's id is newest; a merge's sorts right after the backup it merges
        through (formats/repository.md §8.6)."""
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
        if os.path.lexists(path):
            raise RepositoryError(f"{path}: backup {bid} is already committed")
        committed = self.committed(bucket)
        newest = committed[-1] if committed else None
        self._check_place(bucket, bid, manifest.merged_through, committed)
        if not manifest.full and manifest.parent != newest:
            raise RepositoryError(
                f"{path}: parent {manifest.parent} is not the newest committed backup {newest}"
            )
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
        """The manifest of a committed backup; falls back to the copy; errors name the file."""
        d = self.backup_dir(bucket, backup_id)
        path = d / MANIFEST_FILE
        if not os.path.lexists(path):
            raise RepositoryError(f"{path}: backup {backup_id} is not committed (no manifest)")
        try:
            return self._load(path, bucket, backup_id)
        except RepositoryError as first:
            try:
                return self._load(d / MANIFEST_COPY, bucket, backup_id)
            except RepositoryError:
                raise first from None

    def _load(self, path: Path, bucket: str, backup_id: BackupId) -> Manifest:
        """Read and validate one manifest file."""
        m = load_manifest_file(path)
        if m.bucket != bucket or m.backup_id != backup_id:
            raise RepositoryError(
                f"{path}: the manifest is for backup {m.backup_id} of bucket {m.bucket!r}, "
                f"not {backup_id} of {bucket!r}"
            )
        return m

    def segment_path(self, bucket: str, backup_id: BackupId, file: str) -> Path:
        """The path of a segment file named in a manifest (or `cut-K/NAME`, §5.6)."""
        d = self.backup_dir(bucket, backup_id)
        if file.startswith("cut-"):
            k, name = parse_cut_path(file)
            return d / f"cut-{k}" / name.format()
        return d / SegmentName.parse(file).format()

    # -- sweeping --------------------------------------------------------------------

    def sweep(self, bucket: str, running: BackupId, lock: RepositoryLock) -> list[Path]:
        """Remove temp files and uncommitted backup directories older than `running`.

        Needs the bucket's lock, held. A directory holding `manifest.json` is never removed.
        """
        if not lock.held or lock.path != self.lock_path(bucket):
            raise RepositoryError(f"{self.lock_path(bucket)}: sweep needs this bucket's lock, held")
        removed: list[Path] = []
        bdir = self.bucket_dir(bucket)
        if not bdir.is_dir():
            return removed
        self._sweep_temp(bdir, removed)
        for s in self._scan(bucket):
            self._sweep_temp(s.path, removed)
            if s.backup_id < running and not os.path.lexists(s.path / MANIFEST_FILE):
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
