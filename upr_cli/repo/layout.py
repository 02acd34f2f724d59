"""The repository on disk: `<repo>/repo.json`, `<repo>/<bucket>/<backup-id>/`.

formats/repository.md "Layout" is the normative description.

Theory of operation: `Repository` owns the layout and its names: repo.json, the bucket
and backup directories, which of them are committed, and where each file lives. It
reaches every file through one `Storage` (`upr_cli.storage`; a local directory today)
and hands the other jobs to their own modules, which share that storage:

* `manifests` reads, commits and repairs the two manifest files of a backup and checks
  the chain a reader uses (formats/repository.md §4.1, §8.8);
* `sweep` removes what interrupted and failed runs left, under the bucket's lock
  (formats/repository.md §4.4);
* `lock` is the bucket's lock;
* `pack` reads the members of a backup directory's `segments.pack` as the segment files
  they were (`PackedStorage`, the outermost layer of `storage`,
  formats/repository.md §12).

A backup directory exists from the moment a run starts writing segments into it, but
the backup exists only once its manifest does, so listing reports committed backups and
a directory with neither manifest file is an interrupted run: the next run reuses it
(resume) or the sweep removes it; one whose segments are in a pack (a `backup --follow`
killed between its pack and its manifest) is never reused, only swept. Commits go
forward only: a new backup id sorts after every committed one, so id order is chain
order (formats/repository.md §8).

Every path is built from the tested format/parse pairs in `names`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING

from upr_cli.errors import ExitCode, os_error
from upr_cli.fsio import FileOps
from upr_cli.repo import access as _access
from upr_cli.repo.access import Access
from upr_cli.repo.errors import RepositoryError
from upr_cli.repo.manifest import Manifest, load_json
from upr_cli.repo.manifests import (
    MANIFEST_COPY,
    MANIFEST_FILE,
    ManifestFile,
    ManifestStore,
)
from upr_cli.repo.names import (
    BackupId,
    SegmentName,
    check_bucket,
    format_backup_dir,
    format_time,
    parse_backup_dir,
    parse_cut_path,
    parse_time,
)
from upr_cli.repo.pack import PACK_NAME, PackedStorage
from upr_cli.repo.sweep import Sweeper
from upr_cli.storage import Storage, open_storage, unwrap

if TYPE_CHECKING:
    from upr_cli.repo.keys import Encryption
    from upr_cli.repo.lock import RepositoryLock

REPO_FILE = "repo.json"
"""The repository-level file, created by `Repository.init`."""
REPO_FORMAT = "upr-repository"
"""The `format` value of repo.json."""
REPO_VERSION = 2
"""The repository layout version this code writes (formats/repository.md §9): 2 added
backup revisions (`<id>-rNNNNNNNN` directories), removals in progress and readers' files."""
REPO_ENCRYPTED = 3
"""The version of an encrypted repository (formats/repository.md §10): version 2's
layout, every file but repo.json and the lock files sealed; older upr refuses it."""
REPO_VERSIONS = (1, 2, 3)
"""The layout versions this code reads; `upgrade` raises a version 1 repository to 2
before the first change only version 2 describes."""
LOCK_FILE = "lock"
"""The bucket's lock file (see `upr_cli.repo.lock`)."""

__all__ = [
    "LOCK_FILE",
    "MANIFEST_COPY",
    "MANIFEST_FILE",
    "REPO_FILE",
    "NotARepository",
    "RepoInfo",
    "Repository",
]


class NotARepository(RepositoryError):
    """The path is not a upr repository (not a directory, no or an invalid repo.json): bad
    input, exit 2, in every command that takes a repository."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True, slots=True)
class RepoInfo:
    """What repo.json says: the layout version and when the repository was created; an
    encrypted repository's id and `encryption` (formats/repository.md §10)."""

    version: int
    created: datetime
    id: str | None = None
    encryption: Encryption | None = None

    def to_json(self) -> dict[str, object]:
        """The repo.json object."""
        out: dict[str, object] = {
            "format": REPO_FORMAT,
            "version": self.version,
            "created": format_time(self.created),
        }
        if self.encryption is not None:
            out["id"] = self.id
            out["encryption"] = self.encryption.to_json()
        return out

    def dumps(self) -> bytes:
        """repo.json's bytes."""
        return (json.dumps(self.to_json(), indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, data: object, where: str) -> RepoInfo:
        """Parse repo.json; anything else raises RepositoryError naming `where`."""
        plain = {"format", "version", "created"}
        if isinstance(data, dict) and data.get("version") == REPO_ENCRYPTED:
            plain |= {"id", "encryption"}
        if not isinstance(data, dict) or set(data) != plain:
            raise RepositoryError(f"{where}: expected keys {', '.join(map(repr, plain))}")
        if data["format"] != REPO_FORMAT:
            raise RepositoryError(f"{where}: format {data['format']!r} is not {REPO_FORMAT!r}")
        version = data["version"]
        if isinstance(version, bool) or not isinstance(version, int):
            raise RepositoryError(f"{where}: version {version!r} is not an integer")
        if version not in REPO_VERSIONS:
            raise RepositoryError(
                f"{where}: repository version {version} is not supported (this upr reads "
                f"versions {', '.join(map(str, REPO_VERSIONS))})"
            )
        try:
            created = parse_time(data["created"])
        except RepositoryError as exc:
            raise RepositoryError(f"{where}: created: {exc}") from None
        if version != REPO_ENCRYPTED:
            return cls(version, created)
        repo_id = data["id"]
        if not isinstance(repo_id, str) or len(repo_id) != 32 or repo_id != repo_id.lower():
            raise RepositoryError(f"{where}: id {repo_id!r} is not 16 bytes in hex")
        try:
            bytes.fromhex(repo_id)
        except ValueError:
            raise RepositoryError(f"{where}: id {repo_id!r} is not 16 bytes in hex") from None
        from upr_cli.repo.keys import Encryption  # here: a plain repository never loads it

        return cls(
            version,
            created,
            repo_id,
            Encryption.from_json(data["encryption"], f"{where}: encryption"),
        )


@dataclass(frozen=True, slots=True)
class Scan:
    """One backup directory: its id and which of its two manifest files are present."""

    backup_id: BackupId
    path: Path
    has_manifest: bool
    has_copy: bool
    revision: int = 1

    @property
    def committed(self) -> bool:
        """Either file commits the backup (formats/repository.md §4.1)."""
        return self.has_manifest or self.has_copy


class Repository:
    """A backup repository rooted at `path` (formats/repository.md): its layout, and the
    jobs done on it (`ManifestStore`, `Sweeper`) through one `Storage`."""

    def __init__(
        self, path: str | os.PathLike[str], *, ops: FileOps | None = None,
        storage: Storage | None = None, access: Access | None = None,
    ) -> None:  # fmt: skip
        """`storage` is the backend (default: the local directory, making its system
        calls through `ops`, which tests subclass to fail any of them); `access` the key
        and settings to open it with (default: this command's, `access.current`)."""
        self.path = Path(path)
        self.access = access if access is not None else _access.current()
        self.backend: Storage = storage or open_storage(self.path, ops, self.access)
        self._storage: Storage | None = None  # decided once repo.json is read
        self.manifest_store = ManifestStore(self)
        self.sweeper = Sweeper(self)
        # (bucket, id) -> the directory of the backup's current revision, as the last
        # scan of the bucket found it (formats/repository.md §4.6)
        self._current: dict[tuple[str, BackupId], Path] = {}

    def __repr__(self) -> str:
        return f"Repository({str(self.path)!r})"

    @property
    def storage(self) -> Storage:
        """What every file is reached through: the backend, or over it the sealing layer
        of an encrypted repository (formats/repository.md §10), unlocked on first use
        with the key of `self.access`, before anything else is read or written (no
        key or a wrong one: `MissingKey`, `WrongKey`); outermost, the layer that reads
        the members of packs as segment files (`PackedStorage`,
        formats/repository.md §12). Until repo.json exists, the backend."""
        if self._storage is not None:
            return self._storage
        info = self.peek()
        if info is None:
            return self.backend
        if info.encryption is None:
            self._storage = PackedStorage(self.backend)
        else:  # the ciphers and Argon2 are imported by encrypted repositories only
            from upr_cli.repo.keys import open_encrypted

            self._storage = PackedStorage(open_encrypted(self, info))
        return self._storage

    def peek(self) -> RepoInfo | None:
        """repo.json as it is, read through the backend; None when there is none or it
        is not valid (`info` says why)."""
        try:
            return RepoInfo.from_json(load_json(self.backend.read(self.repo_file)), "")
        except (OSError, RepositoryError):
            return None

    def forget_storage(self) -> None:
        """Read repo.json again on next use (it was just created)."""
        self._storage = None

    def keyed_access(self) -> Access:
        """`self.access` carrying this repository's data key when it is encrypted (what
        a Spark executor opens it with, without the user's key)."""
        storage = self.storage
        data_key = getattr(storage, "data_key", None)
        repo_id = getattr(storage, "repo_id", None)
        if not isinstance(data_key, bytes) or not isinstance(repo_id, bytes):
            return self.access
        keys = {**self.access.data_keys, repo_id.hex(): data_key}
        return replace(self.access, data_keys=keys)

    def _is_dir(self, path: Path) -> bool:
        """A directory is at `path` (a link to one counts)."""
        st = self.storage.stat(path, follow_links=True)
        return st is not None and st.is_dir

    # -- repository ------------------------------------------------------------------

    @property
    def repo_file(self) -> Path:
        """`<repo>/repo.json`."""
        return self.path / REPO_FILE

    def init(self) -> RepoInfo:
        """Create the repository (directory and repo.json) on first use; else validate it.

        Only a missing or empty directory becomes a repository.
        """
        if self.storage.stat(self.repo_file) is None:
            self.check_init()
            created_dir = self.storage.stat(self.path, follow_links=True) is None
            try:
                self.storage.make_dirs(self.path)
            except OSError as exc:  # a parent that is a file, /proc, a read-only or full disk
                raise os_error(exc, self.path, "cannot create the repository") from None
            if created_dir:
                self.storage.sync_dir(self.path.parent)
            # the lowest version that describes it: a repository becomes version 2 at its
            # first revision (`upgrade`), so older upr reads every repository it can
            info = RepoInfo(REPO_VERSIONS[0], datetime.now(UTC))
            data = (json.dumps(info.to_json(), indent=2) + "\n").encode()
            with contextlib.suppress(FileExistsError):  # another process won: validate theirs
                self.storage.write_if_absent(self.repo_file, data)
        return self.info()

    def check_init(self) -> None:
        """Raise what `init` would raise, changing nothing: the path must be a repository
        (repo.json valid) or a missing or empty directory. A backup checks this, then its
        source, before it creates anything (formats/repository.md §4.2)."""
        if self.storage.stat(self.repo_file) is not None:
            self.info()
            return
        st = self.storage.stat(self.path, follow_links=True)
        if st is not None and not st.is_dir:
            raise NotARepository(f"{self.path}: exists and is not a directory")
        if st is not None and self.storage.list(self.path):
            raise NotARepository(
                f"{self.path}: not empty and not a upr repository (no {REPO_FILE}): "
                "give a new or empty directory"
            )
        if st is None:
            self._probe_mkdir()

    def _probe_mkdir(self) -> None:
        """Create the path's missing directories and remove them again: the errors `init`
        would meet (a file in the way, a file system that refuses), none of its changes."""
        made: list[Path] = []
        try:
            for d in reversed([self.path, *self.path.parents]):
                if self.storage.stat(d) is None:
                    self.storage.make_dir(d)
                    made.append(d)
        except OSError as exc:
            raise os_error(exc, self.path, "cannot create the repository") from None
        finally:
            for d in reversed(made):
                with contextlib.suppress(OSError):
                    self.storage.remove_dir(d)

    def info(self) -> RepoInfo:
        """Read and validate repo.json; a directory without one is not a repository."""
        try:
            raw = self.storage.read(self.repo_file)
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

    def upgrade(self) -> RepoInfo:
        """Raise a version 1 repository to version 2 (formats/repository.md §9) before
        the first change only version 2 describes: repo.json rewritten atomically, its
        creation time kept. Version 1 readers then refuse it rather than misread it."""
        info = self.info()
        if info.version < REPO_VERSION:
            info = RepoInfo(REPO_VERSION, info.created)
            data = (json.dumps(info.to_json(), indent=2) + "\n").encode()
            self.storage.write(self.repo_file, data)
        return info

    def buckets(self) -> list[str]:
        """Bucket directories present, sorted."""
        out = []
        for entry in self.storage.list(self.path):
            if entry.is_dir:
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
        """`<repo>/<bucket>/<backup-id>`, or the directory of its newest committed
        revision `<backup-id>-rNNNNNNNN` (formats/repository.md §4.6)."""
        found = self._current.get((bucket, backup_id))
        if found is None:
            self.scan(bucket)
            found = self._current.get((bucket, backup_id))
        return found if found is not None else self.revision_dir(bucket, backup_id, 1)

    def revision_dir(self, bucket: str, backup_id: BackupId, revision: int) -> Path:
        """`<repo>/<bucket>/<backup-id>[-rNNNNNNNN]`: one revision's directory."""
        return self.bucket_dir(bucket) / format_backup_dir(backup_id, revision)

    def manifest_path(self, bucket: str, backup_id: BackupId) -> Path:
        """`<repo>/<bucket>/<backup-id>/manifest.json`."""
        return self.backup_dir(bucket, backup_id) / MANIFEST_FILE

    def lock_path(self, bucket: str) -> Path:
        """`<repo>/<bucket>/lock`."""
        return self.bucket_dir(bucket) / LOCK_FILE

    def segment_path(self, bucket: str, backup_id: BackupId, file: str) -> Path:
        """The path of a segment file named in a manifest (or `cut-K/NAME`).

        Cut-back segments live in `cut-K/` (formats/repository.md §5.6).
        """
        d = self.backup_dir(bucket, backup_id)
        if file.startswith("cut-"):
            k, name = parse_cut_path(file)
            return d / f"cut-{k}" / name.format()
        return d / SegmentName.parse(file).format()

    # -- listing ---------------------------------------------------------------------

    def scan_all(self, bucket: str) -> list[Scan]:
        """Every backup directory of `bucket`, every revision, in (id, revision) order."""
        d = self.bucket_dir(bucket)
        stat = self.storage.stat
        out = []
        for entry in self.storage.list(d):
            if not entry.is_dir:
                continue
            try:
                backup_id, revision = parse_backup_dir(entry.name)
            except RepositoryError:
                continue
            path = d / entry.name
            out.append(Scan(backup_id, path, stat(path / MANIFEST_FILE) is not None,
                            stat(path / MANIFEST_COPY) is not None, revision))  # fmt: skip
        return sorted(out, key=lambda s: (s.backup_id, s.revision))

    def scan(self, bucket: str) -> list[Scan]:
        """Backup directories of `bucket`, one per id, oldest first: the newest committed
        revision of each (its first directory while none is committed). The other
        revisions are superseded or unfinished (`stale_revisions`)."""
        current: dict[BackupId, Scan] = {}
        for s in self.scan_all(bucket):
            had = current.get(s.backup_id)
            if had is None or s.committed:
                current[s.backup_id] = s
        for key in [k for k in self._current if k[0] == bucket]:
            del self._current[key]
        self._current.update(((bucket, b), s.path) for b, s in current.items())
        return sorted(current.values(), key=lambda s: s.backup_id)

    def committed_revision(self, bucket: str, backup_id: BackupId, path: Path) -> None:
        """Note that `path`, a revision just committed, is `backup_id`'s current
        directory (what the next `scan` would find, without listing the bucket)."""
        self._current[(bucket, backup_id)] = path

    def stale_revisions(self, bucket: str) -> list[Scan]:
        """The revision directories that are not their backup's current one: older
        revisions a newer committed one replaced, and a revision whose writer was
        interrupted before it committed. `sweep` removes them (formats/repository.md §4.4)."""
        current = {s.path for s in self.scan(bucket)}
        return [s for s in self.scan_all(bucket) if s.path not in current]

    def committed_all(self, bucket: str) -> list[BackupId]:
        """Ids of backups whose `manifest.json` or copy is present (valid or not), oldest
        first, those a revision absorbed included (until the sweep removes them)."""
        return [s.backup_id for s in self.scan(bucket) if s.committed]

    def committed(self, bucket: str) -> list[BackupId]:
        """Ids of committed backups (valid or not), oldest first: `committed_all` less
        the backups a committed revision absorbed (removed, formats/repository.md §4.6)."""
        ids = self.committed_all(bucket)
        gone = self.absorbed(bucket) if ids else set()
        return [b for b in ids if b not in gone]

    def absorbed(self, bucket: str) -> set[BackupId]:
        """The backups committed revisions absorbed: removed, whatever is left of them."""
        return self.manifest_store.absorbed(bucket)

    def backups(self, bucket: str) -> list[BackupId]:
        """Committed backups with a valid manifest (or copy), oldest first."""
        return [m.backup_id for m in self.readable(bucket)[0]]

    def damaged(self, bucket: str) -> list[tuple[BackupId, str]]:
        """Committed backups whose manifest and copy are both unreadable, with the reason."""
        return list(self.readable(bucket)[1].items())

    def readable(self, bucket: str) -> tuple[list[Manifest], dict[BackupId, str]]:
        """`ManifestStore.readable`: the manifests that can be read, and the damaged."""
        return self.manifest_store.readable(bucket)

    def manifests(self, bucket: str) -> list[Manifest]:
        """Every committed backup's manifest, oldest first, once the chain is checked
        whole at the newest backup (`chain`); any damaged one is an error."""
        return self.manifest_store.chain(bucket)

    def incomplete(self, bucket: str) -> list[BackupId]:
        """Backup directories with neither manifest file (interrupted runs) that a run
        can go on in, oldest first: not those holding a pack (`packed_leftovers`)."""
        return [s.backup_id for s in self.scan(bucket)
                if not s.committed and not self._holds_pack(s.path)]  # fmt: skip

    def packed_leftovers(self, bucket: str) -> list[BackupId]:
        """Uncommitted backup directories holding a `segments.pack`: a `backup --follow`
        stopped between its pack and its manifest. Never resumed: the sweep removes
        them (formats/repository.md §12)."""
        return [s.backup_id for s in self.scan(bucket)
                if not s.committed and self._holds_pack(s.path)]  # fmt: skip

    def resumable(self, bucket: str) -> BackupId | None:
        """The interrupted run the next backup of `bucket` goes on from
        (formats/repository.md §4.2 step 2, §4.5): the newest uncommitted directory,
        newer than every committed backup, holding a segment file; else None."""
        scan = self.scan(bucket)
        newest = scan[-1] if scan else None
        if newest is None or newest.committed or not self._holds_segments(newest.path):
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
        ids = sorted([*self.incomplete(bucket), *self.packed_leftovers(bucket)])
        return [b for b in ids if b != keep and b not in named]

    # -- writing ---------------------------------------------------------------------

    def next_backup_id(self, bucket: str) -> BackupId:
        """A new id: now, or just after the newest backup directory if the clock lags."""
        scan = self.scan(bucket)
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
        self.check_place(bucket, backup_id, after, committed)
        bdir = self.bucket_dir(bucket)
        if not self._is_dir(bdir):
            try:
                self.storage.make_dir(bdir)
            except FileExistsError:
                pass  # created meanwhile by another run: nothing to make durable here
            else:
                self.storage.sync_dir(self.path)
        d = self.backup_dir(bucket, backup_id)
        try:
            self.storage.make_dir(d)
        except FileExistsError:
            st = self.storage.stat(d)
            if st is None or not st.is_dir:
                raise RepositoryError(f"{d}: exists and is not a directory") from None
            return d  # an interrupted run's directory: reused
        self.storage.sync_dir(bdir)
        return d

    def check_place(self, bucket: str, backup_id: BackupId, after: BackupId | None,
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

    def _holds_segments(self, d: Path) -> bool:
        """True when a backup directory holds a finished segment file (or a cut-back
        one) of its own, not in a pack (its files as the backend lists them)."""
        raw = unwrap(self.storage)
        entries = raw.list(d)
        if any(fnmatchcase(e.name, "p*.seg") for e in entries):
            return True
        return any(
            fnmatchcase(f.name, "p*.seg")
            for e in entries if fnmatchcase(e.name, "cut-*")
            for f in raw.list(d / e.name)
        )  # fmt: skip

    def _holds_pack(self, d: Path) -> bool:
        """True when the directory `d` holds a `segments.pack`."""
        return unwrap(self.storage).stat(d / PACK_NAME) is not None

    # -- the jobs of `ManifestStore` and `Sweeper`, by the names callers know -----------

    def write_manifest(self, manifest: Manifest) -> Path:
        """Commit a backup (`ManifestStore.write`)."""
        return self.manifest_store.write(manifest)

    def read_manifest(self, bucket: str, backup_id: BackupId) -> Manifest:
        """The manifest of a committed backup (`ManifestStore.read`)."""
        return self.manifest_store.read(bucket, backup_id)

    def manifest_files(self, bucket: str, backup_id: BackupId) -> tuple[ManifestFile, ManifestFile]:
        """Both manifest files of a backup, each checked on its own (`ManifestStore.files`)."""
        return self.manifest_store.files(bucket, backup_id)

    def repair_manifest(self, bucket: str, backup_id: BackupId, lock: RepositoryLock) -> list[Path]:
        """Rewrite a backup's bad manifest file from its twin (`ManifestStore.repair`)."""
        return self.manifest_store.repair(bucket, backup_id, lock)

    def heal(self, bucket: str, lock: RepositoryLock) -> list[tuple[Path, str]]:
        """`repair_manifest` for every committed backup (`ManifestStore.heal`)."""
        return self.manifest_store.heal(bucket, lock)

    def chain(self, bucket: str, at: BackupId | None = None) -> list[Manifest]:
        """The chain up to `at`, checked whole (`ManifestStore.chain`)."""
        return self.manifest_store.chain(bucket, at)

    def describe_parent(
        self, bucket: str, child: BackupId, recorded: BackupId | None,
        expected: BackupId | None, damaged: Mapping[BackupId, str] | None = None,
    ) -> str:  # fmt: skip
        """One line on a backup whose parent is out of place (`ManifestStore.describe_parent`)."""
        return self.manifest_store.describe_parent(bucket, child, recorded, expected, damaged)

    def missing_files(
        self, bucket: str, manifests: Sequence[Manifest], at: BackupId,
        partitions: Iterable[int] | None = None,
    ) -> list[str]:  # fmt: skip
        """The segment files the state at `at` reads that are missing or of the wrong
        size (`ManifestStore.missing_files`)."""
        return self.manifest_store.missing_files(bucket, manifests, at, partitions)

    def sweep(self, bucket: str, running: BackupId, lock: RepositoryLock) -> list[Path]:
        """Remove what interrupted runs left (`Sweeper.sweep`)."""
        return self.sweeper.sweep(bucket, running, lock)

    def discard_empty(self, bucket: str, backup_id: BackupId, lock: RepositoryLock) -> bool:
        """Remove a failed run's empty backup directory (`Sweeper.discard_empty`)."""
        return self.sweeper.discard_empty(bucket, backup_id, lock)

    def remove_empty_bucket(self, bucket: str) -> None:
        """Remove an empty bucket directory (`Sweeper.remove_empty_bucket`)."""
        self.sweeper.remove_empty_bucket(bucket)
