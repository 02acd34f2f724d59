"""`upr repo copy`: copy a repository's backups into another repository, verified as it
goes (restic's `copy`): how plaintext backups become encrypted, or move into object
storage.

Theory of operation. A backup is its files (segments, cut-back segments) and its
manifest, which commits it (formats/repository.md §4.3). The copy writes, per bucket and
in chain (id) order, every committed backup of the source that the destination lacks:
the current revision of each (formats/repository.md §4.6), in a directory of the same
name, its files first and its manifest last, so the destination holds the same backups
under the same ids, with their rollback and cut-back records, lost writes, failover
logs and collections; it restores, verifies and `info`s as the source does. Everything
goes through the two repositories' `Storage`, so any pair of backends (a local
directory, an object store, an encrypting layer on either) works the same way.

* **Verified as it goes.** Each file is streamed from the source in chunks (never
  whole in memory) into a temp name in the destination while its BLAKE2b digest and its
  size are computed; only when both equal the manifest's is it published (renamed into
  place). A corrupt source file stops the copy with one line naming it; the backup it
  belongs to is not committed, and its directory is removed, so the destination holds
  only whole backups. The manifest written is the source's file, byte for byte.
* **Resumable and idempotent.** A backup the destination already holds with the same
  manifest is skipped (a manifest file its twin can restore is rewritten first, under
  the lock: a copy killed between its two manifest files). A rerun after a kill finds
  the killed run's uncommitted directory and reuses each file that is already there at
  its size and digest, removing the temp files the kill left. After a prune of the
  source, the next copy writes each new revision (it keeps every file of the revision
  the destination holds, formats/repository.md §8.10) and sweeps what it replaced and
  absorbed, as the prune did. A destination holding a different backup under one of
  the source's ids, or a backup the source neither has nor absorbed (removed outright),
  is refused: the two repositories are not copies of one another.
* **Locks.** The source bucket is read under its shared lock (`read_lock`, so no prune
  removes what is being read), the destination bucket written under its writer lock
  (`RepositoryLock`).
* **Parallel and bounded.** The files of a backup are copied by up to `transfers`
  threads (`--transfers`), each holding one chunk (`CHUNK` bytes) at a time.
* **Packs.** A backup whose segments are in a pack (a continuous commit,
  formats/repository.md §12) stays packed: its members are read and verified one by one
  into local temp files, then written as one pack in the destination.
* **Keys.** The two repositories have their own keys: the destination opens with the
  command's (`upr_cli.repo.access.current`), the source with the `Access` it is given
  (`source_access`: `--from-key-file`, `--from-key-command`, `UPR_FROM_KEY_FILE`,
  `UPR_FROM_PASSPHRASE`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upr_cli.errors import UsageError
from upr_cli.fsio import parse_temp_name, temp_path
from upr_cli.repo import (
    MANIFEST_COPY,
    MANIFEST_FILE,
    REPO_FILE,
    BackupId,
    Manifest,
    Repository,
    RepositoryError,
    RepositoryLock,
    SegmentEntry,
    is_temp_name,
)
from upr_cli.repo.access import Access, current
from upr_cli.repo.pack import PACK_NAME, write_pack
from upr_cli.repo.readers import read_lock, sweep_unless_read
from upr_cli.storage import display_location, is_s3, s3_parts, unwrap

__all__ = [
    "CHUNK",
    "BucketCopy",
    "CopyResult",
    "CorruptSource",
    "SourceAccess",
    "copy_repository",
    "source_access",
]

CHUNK = 1 << 20
"""Bytes a copying thread reads and writes at a time."""

#: progress: (bytes copied, bytes to copy, backups copied, backups to copy)
CopyProgress = Callable[[int, int, int, int], None]


class CorruptSource(RepositoryError):
    """A source file does not match its manifest: the copy stops there (exit 1)."""


class Diverged(RepositoryError):
    """The destination holds a backup that is not the source's: exit 1, nothing written."""


@dataclass(frozen=True, slots=True)
class SourceAccess(Access):
    """The source's settings: its key from `--from-key-file` (else `UPR_FROM_KEY_FILE`)
    or `--from-key-command`, its passphrase from `UPR_FROM_PASSPHRASE`; the usual
    `UPR_KEY_FILE` and `UPR_PASSPHRASE` are the destination's."""

    def passphrase(self) -> bytes | None:
        """`UPR_FROM_PASSPHRASE`, when set."""
        return os.environb.get(b"UPR_FROM_PASSPHRASE")

    def key_path(self) -> Path | None:
        """`--from-key-file`, else `UPR_FROM_KEY_FILE`."""
        if self.key_file is not None:
            return self.key_file
        env = os.environ.get("UPR_FROM_KEY_FILE")
        return Path(env) if env else None


def source_access(key_file: Path | None = None, key_command: str | None = None) -> Access:
    """The source's `Access`: its own key options (see `SourceAccess`), the command's
    object-store settings (`--s3-endpoint`, `--transfers`)."""
    now = current()
    return SourceAccess(key_file=key_file, key_command=key_command,
                        s3_endpoint=now.s3_endpoint, transfers=now.transfers)  # fmt: skip


@dataclass
class BucketCopy:
    """One bucket's part of a copy: the backups copied (or, in a dry run, to copy) and
    those the destination already held, and the bytes written."""

    bucket: str
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes: int = 0
    files: int = 0
    files_reused: int = 0

    def to_json(self) -> dict[str, Any]:
        """The bucket's entry of `--json`."""
        return {
            "bucket": self.bucket,
            "backups_copied": len(self.copied),
            "backups_skipped": len(self.skipped),
            "bytes": self.bytes,
            "files": self.files,
            "files_reused": self.files_reused,
            "copied": self.copied,
            "skipped": self.skipped,
        }


@dataclass
class CopyResult:
    """What a copy did (or, with `dry_run`, would do)."""

    source: str
    destination: str
    dry_run: bool
    encrypted: bool
    buckets: list[BucketCopy]
    seconds: float = 0.0

    @property
    def copied(self) -> int:
        """Backups copied, every bucket."""
        return sum(len(b.copied) for b in self.buckets)

    @property
    def skipped(self) -> int:
        """Backups the destination already held, every bucket."""
        return sum(len(b.skipped) for b in self.buckets)

    @property
    def bytes(self) -> int:
        """Bytes written (or, in a dry run, to write), every bucket."""
        return sum(b.bytes for b in self.buckets)

    def to_json(self) -> dict[str, Any]:
        """`--json` (docs/output.md)."""
        return {
            "source": self.source,
            "destination": self.destination,
            "dry_run": self.dry_run,
            "encrypted": self.encrypted,
            "backups_copied": self.copied,
            "backups_skipped": self.skipped,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "buckets": [b.to_json() for b in self.buckets],
        }


# -- checks before anything is written ---------------------------------------------------


def _nested(a: Path, b: Path) -> bool:
    """`a` and `b` are one location, or one holds the other."""
    if is_s3(a) != is_s3(b):
        return False
    if is_s3(a):
        (ba, pa), (bb, pb) = s3_parts(a), s3_parts(b)
        if ba != bb:
            return False
        pa, pb = pa + "/", pb + "/"
        return pa.startswith(pb) or pb.startswith(pa) or not pa.strip("/") or not pb.strip("/")
    ra, rb = a.resolve(), b.resolve()
    return ra == rb or ra in rb.parents or rb in ra.parents


def _check_locations(src: Path, dst: Path) -> None:
    if _nested(src, dst):
        same = display_location(src) == display_location(dst) or (
            not is_s3(src) and src.resolve() == dst.resolve()
        )
        what = "are the same repository" if same else "are nested (one holds the other)"
        raise UsageError(
            f"--from {display_location(src)} and --to {display_location(dst)} {what}: "
            "copy into another location"
        )


def _is_encrypted(repo: Repository) -> bool:
    """The repository is read through a sealing layer (it holds a data key)."""
    return isinstance(getattr(repo.storage, "data_key", None), bytes)


def _open_source(path: Path, access: Access) -> Repository:
    src = Repository(path, access=access)
    src.info()  # NotARepository (exit 2) when it is none
    return src


def _drop_killed_init(dst: Repository) -> None:
    """Remove what a copy killed while it created the destination left: repo.json's
    temp file, alone in the directory (else `check_init` refuses it as not empty)."""
    storage = dst.storage
    if storage.stat(dst.repo_file) is not None:
        return
    entries = storage.list(dst.path)
    if entries and all(e.is_file and parse_temp_name(e.name) == REPO_FILE for e in entries):
        for e in entries:
            storage.delete(dst.path / e.name)


def _exists(path: Path) -> bool:
    """A repository is at `path` (its repo.json), whatever it holds."""
    return Repository(path).backend.stat(path / REPO_FILE) is not None


def _open_destination(path: Path, *, encrypt: bool, dry_run: bool) -> tuple[Repository, bool]:
    """The destination, created when missing or empty (encrypted with `encrypt`); and
    whether it existed as a repository."""
    dst = Repository(path)
    if not dry_run:
        _drop_killed_init(dst)
    dst.check_init()  # a non-empty directory that is not a repository: refused
    existed = dst.storage.stat(dst.repo_file) is not None
    if encrypt and existed and not _is_encrypted(dst):
        raise UsageError(
            f"--to {display_location(path)}: a plaintext repository exists there; "
            "--encrypt copies into a new (or empty) location"
        )
    if dry_run or existed:
        return dst, existed
    if encrypt:
        from upr_cli.repo.keys import create_encrypted

        create_encrypted(dst)
        dst = Repository(path)  # opened again: now through its encrypting layer
    else:
        dst.init()
    return dst, existed


# -- the plan of one bucket -----------------------------------------------------------------


def _source_backups(src: Repository, bucket: str) -> list[Manifest]:
    """The source's committed backups, oldest first, once its chain is checked whole;
    a damaged manifest stops the copy (a copy without it would not be the source)."""
    manifests, damaged = src.readable(bucket)
    if damaged:
        bid, why = next(iter(damaged.items()))
        raise RepositoryError(
            f"source backup {bid} of bucket {bucket} is damaged ({why}): `upr verify "
            "--repair` the source first"
        )
    src.chain(bucket)  # BrokenChain naming the missing piece
    return manifests


def _to_copy(src_ms: list[Manifest], dst: Repository | None, bucket: str) -> list[Manifest]:
    """The source's backups the destination lacks, or holds in an older revision (the
    source was pruned since the last copy); `Diverged` when it holds another backup
    under one of their ids, or one the source neither has nor absorbed."""
    if dst is None or bucket not in dst.buckets():
        return list(src_ms)
    have, damaged = dst.readable(bucket)
    where = display_location(dst.bucket_dir(bucket))
    if damaged:
        bid = next(iter(damaged))
        raise Diverged(f"{where}: destination backup {bid} is damaged; `upr verify --repair` it")
    mine = {m.backup_id: m for m in src_ms}
    absorbed = {b for m in src_ms for b in m.absorbed}
    done = set()
    for m in have:
        theirs = mine.get(m.backup_id)
        if theirs is None:
            if m.backup_id in absorbed:
                continue  # a prune of the source merged it forward: so will the copy
            raise Diverged(
                f"{where}: the destination holds backup {m.backup_id}, which the source does "
                "not: not a copy of this repository (copy into a new location)"
            )
        if theirs == m:
            done.add(m.backup_id)
        elif not _later_revision(m, theirs):
            rev = (f" (revision {m.revision} here, {theirs.revision} in the source)"
                   if theirs.revision != m.revision else "")  # fmt: skip
            raise Diverged(
                f"{where}: the destination holds a different backup {m.backup_id}{rev}: "
                "not a copy of this repository (copy into a new location)"
            )
    return [m for m in src_ms if m.backup_id not in done]


def _later_revision(old: Manifest, new: Manifest) -> bool:
    """`new` is a later revision of the backup `old` is (formats/repository.md §4.6): the
    same backup, and every file of `old` is among `new`'s (a revision keeps its
    predecessor's segments and cut-back records, formats/repository.md §8.10)."""
    same = (old.backup_id, old.bucket, old.source, old.started, old.finished)
    if same != (new.backup_id, new.bucket, new.source, new.started, new.finished):
        return False
    kept = {s.checksum for _, s in _files(new)}
    return new.revision > old.revision and all(s.checksum in kept for _, s in _files(old))


def _files(m: Manifest) -> list[tuple[str, SegmentEntry]]:
    """(path in the backup directory, entry) of every file a manifest lists."""
    out = [(s.file, s) for e in m.partitions for s in e.segments]
    return out + [f for e in m.partitions for f in e.cut_files()]


def _manifest_bytes(src: Repository, bucket: str, backup_id: BackupId) -> bytes:
    """The bytes of the source's manifest file that reading takes (`manifest.json`, else
    its copy): copied as they are."""
    main, copy = src.manifest_files(bucket, backup_id)
    good = main if main.valid else copy
    if good.data is None or not good.valid:  # cannot happen: it was just read
        raise RepositoryError(f"{main.path}: {main.error}; {copy.path}: {copy.error}")
    return good.data


# -- copying ---------------------------------------------------------------------------------


class _Copier:
    """Copies the backups of one bucket, under its locks."""

    def __init__(self, src: Repository, dst: Repository, bucket: str, lock: RepositoryLock,
                 tally: BucketCopy, progress: Callable[[int], None]) -> None:  # fmt: skip
        self.src, self.dst, self.bucket = src, dst, bucket
        self.lock = lock
        self.tally = tally
        self.progress = progress
        self.transfers = max(1, dst.access.transfers)
        self._guard = threading.Lock()
        self._stop = threading.Event()

    def backup(self, m: Manifest) -> None:
        """Copy one backup: its files (verified), then its manifest (the commit point)."""
        dst, bucket = self.dst, self.bucket
        d = dst.revision_dir(bucket, m.backup_id, m.revision)
        if m.revision > 1 or m.absorbed:
            dst.upgrade()  # a revision needs repository version 2 (formats/repository.md §9)
        self._make_dir(d)
        files = _files(m)
        packed = self._packed(m)
        subs = [] if packed else sorted({n.split("/", 1)[0] for n, _ in files if "/" in n})
        for sub in subs:
            self._make_dir(d / sub)
        try:
            if packed:
                self._copy_pack(m, d, files)
            else:
                self._copy_files(m, d, files)
        except CorruptSource:
            with contextlib.suppress(OSError, RepositoryError):
                dst.sweeper.discard(d)  # never a part of a backup left behind
            raise
        for sub in subs:
            dst.storage.sync_dir(d / sub)
        dst.storage.sync_dir(d)
        self._check_sizes(d, files)
        data = _manifest_bytes(self.src, bucket, m.backup_id)
        dst.storage.write(d / MANIFEST_COPY, data)  # the commit point
        dst.storage.write(d / MANIFEST_FILE, data)
        dst.scan(bucket)  # the layout's cache of current revisions

    def _packed(self, m: Manifest) -> bool:
        """The source's backup keeps its segments in a pack (formats/repository.md §12)."""
        d = self.src.backup_dir(self.bucket, m.backup_id)
        return unwrap(self.src.storage).stat(d / PACK_NAME) is not None

    def _copy_pack(self, m: Manifest, d: Path, files: list[tuple[str, SegmentEntry]]) -> None:
        """A packed backup stays one: its members, each verified as it is read into a
        local temp file, written as the destination's pack (`write_pack`: a temp name,
        durable, renamed; a killed copy's pack is replaced)."""
        with tempfile.TemporaryDirectory(prefix="upr-copy-") as tmp:
            members = []
            for i, (name, entry) in enumerate(files):
                source = self.src.segment_path(self.bucket, m.backup_id, name)
                local = Path(tmp) / str(i)
                with open(local, "wb") as out:
                    self._stream(m, source, entry, out.write)
                members.append((name, local))
            if members:
                write_pack(self.dst.storage, d, members)
        with self._guard:
            self.tally.files += len(files)
            self.tally.bytes += sum(entry.bytes for _, entry in files)

    def _stream(self, m: Manifest, source: Path, entry: SegmentEntry,
                put: Callable[[bytes], object]) -> None:  # fmt: skip
        """Read the source's file `source` chunk by chunk into `put`; `CorruptSource`
        unless its size and digest are its manifest entry's."""
        digest = hashlib.blake2b(digest_size=16)
        size = 0
        try:
            reader = self.src.storage.open_read(source)
        except FileNotFoundError:
            raise CorruptSource(
                f"{display_location(source)}: source segment missing (listed by backup "
                f"{m.backup_id} of bucket {self.bucket}); backup not copied"
            ) from None
        with reader as f:
            while chunk := f.read(CHUNK):
                if self._stop.is_set():
                    raise _Stopped
                digest.update(chunk)
                size += len(chunk)
                if size > entry.bytes:
                    break
                put(chunk)
                self.progress(len(chunk))
        if size != entry.bytes or digest.hexdigest() != entry.checksum:
            if size != entry.bytes:
                got = f"{size}" if size < entry.bytes else f"more than {entry.bytes}"
                what = f"{got} bytes, the manifest says {entry.bytes}"
            else:
                what = f"BLAKE2b {digest.hexdigest()}, the manifest says {entry.checksum}"
            raise CorruptSource(
                f"{display_location(source)}: corrupt source segment ({what}); backup "
                f"{m.backup_id} of bucket {self.bucket} not copied"
            )

    def _make_dir(self, d: Path) -> None:
        """Create `d` (or reuse a killed copy's, without the temp files it left)."""
        storage = self.dst.storage
        try:
            storage.make_dir(d)
        except FileExistsError:
            st = storage.stat(d)
            if st is None or not st.is_dir:
                raise RepositoryError(f"{d}: exists and is not a directory") from None
            stale = [e.name for e in storage.list(d) if e.is_file and is_temp_name(e.name)]
            for name in stale:
                storage.delete(d / name)
            if stale:
                storage.sync_dir(d)
            return
        storage.sync_dir(d.parent)

    def _copy_files(self, m: Manifest, d: Path, files: list[tuple[str, SegmentEntry]]) -> None:
        """Copy `files`, `transfers` at a time. The first failure (or a signal) stops the
        others at their next chunk, each removing its temp file."""
        if not files:
            return
        pool = ThreadPoolExecutor(max_workers=min(self.transfers, len(files)),
                                  thread_name_prefix="upr-copy")  # fmt: skip
        futures: list[Future[None]] = []
        try:
            # the source's paths found here: its layout's cache is not shared with threads
            paths = [self.src.segment_path(self.bucket, m.backup_id, n) for n, _ in files]
            futures += [pool.submit(self._copy_file, m, d, name, entry, source)
                        for (name, entry), source in zip(files, paths, strict=True)]  # fmt: skip
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f.exception() for f in futures if f in finished and f.exception()]
            if failed and failed[0] is not None:
                raise failed[0]
        except BaseException:
            self._stop.set()
            raise
        finally:
            for f in futures:
                f.cancel()
            pool.shutdown(wait=True)
            self._stop.clear()

    def _copy_file(self, m: Manifest, d: Path, name: str, entry: SegmentEntry,
                   source: Path) -> None:  # fmt: skip
        """Stream the source's file `source` into `d / name`, published only whole and
        as its manifest entry says (or reuse it there, when a killed copy finished it)."""
        if self._stop.is_set():
            return
        dst = self.dst
        target = d / name
        if self._already(target, entry):
            with self._guard:
                self.tally.files_reused += 1
            return
        tmp = temp_path(target)
        out = dst.storage.create(tmp)
        try:
            self._stream(m, source, entry, lambda chunk: dst.storage.append(out, chunk))
            dst.storage.sync(out)
            out.close()
            dst.storage.replace(tmp, target)
        except BaseException:
            out.close()
            with contextlib.suppress(OSError):
                dst.storage.delete(tmp)
            raise
        with self._guard:
            self.tally.files += 1
            self.tally.bytes += entry.bytes

    def _already(self, target: Path, entry: SegmentEntry) -> bool:
        """`target` is there already, whole: a killed copy's file, reused."""
        storage = self.dst.storage
        st = storage.stat(target)
        if st is None or not st.is_file or st.size != entry.bytes:
            if st is not None and st.is_file:
                storage.delete(target)  # cannot be: files are published whole
            return False
        digest = hashlib.blake2b(digest_size=16)
        with storage.open_read(target) as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        if digest.hexdigest() == entry.checksum:
            self.progress(entry.bytes)
            return True
        storage.delete(target)
        return False

    def _check_sizes(self, d: Path, files: list[tuple[str, SegmentEntry]]) -> None:
        """Every file the manifest lists is there at its size (as a commit checks)."""
        for name, entry in files:
            st = self.dst.storage.stat(d / name)
            if st is None or not st.is_file or st.size != entry.bytes:
                raise RepositoryError(f"{d / name}: not copied whole; run the copy again")


class _Stopped(Exception):
    """Another thread's file failed: this one stops."""


# -- the command -------------------------------------------------------------------------------


def copy_repository(
    source: Path,
    destination: Path,
    *,
    bucket: str | None = None,
    encrypt: bool = False,
    decrypt: bool = False,
    dry_run: bool = False,
    access: Access | None = None,
    on_progress: CopyProgress | None = None,
) -> CopyResult:
    """Copy every committed backup of `source` (every bucket, or `bucket`) that
    `destination` lacks, in chain order; with `dry_run` only say what would be copied.
    `access` opens the source (default: `source_access()`). An encrypted source is never
    copied into a new plaintext destination unless `decrypt` says so."""
    t0 = time.monotonic()
    _check_locations(source, destination)
    src = _open_source(source, access if access is not None else source_access())
    buckets = src.buckets()
    if bucket is not None:
        if bucket not in buckets:
            raise UsageError(f"{display_location(source)}: no bucket {bucket!r} (it holds "
                             f"{', '.join(buckets) or 'none'})")  # fmt: skip
        buckets = [bucket]
    if encrypt and decrypt:
        raise UsageError("--encrypt and --decrypt: give one (a copy is encrypted or not)")
    if _is_encrypted(src) and not (encrypt or decrypt) and not _exists(destination):
        raise UsageError(
            f"{display_location(source)} is encrypted: give --encrypt for an encrypted "
            "copy, or --decrypt to write a plaintext one on purpose"
        )
    dst, existed = _open_destination(destination, encrypt=encrypt, dry_run=dry_run)
    readable = existed or not dry_run
    result = CopyResult(display_location(source), display_location(destination), dry_run,
                        encrypt or (existed and _is_encrypted(dst)), [])  # fmt: skip
    state = _Totals(on_progress)
    with contextlib.ExitStack() as held:
        plans = []
        for b in buckets:
            held.enter_context(read_lock(src, b, "copy"))
            todo = _to_copy(_source_backups(src, b), dst if readable else None, b)
            tally = BucketCopy(b)
            left = {m.backup_id for m in todo}
            tally.skipped = [str(i) for i in src.backups(b) if i not in left]
            plans.append((b, todo, tally))
            state.add([sum(s.bytes for _, s in _files(m)) for m in todo])
        for b, todo, tally in plans:
            result.buckets.append(tally)
            if dry_run:
                tally.copied = [str(m.backup_id) for m in todo]
                tally.bytes = sum(s.bytes for m in todo for _, s in _files(m))
                continue
            _copy_bucket(src, dst, b, todo, tally, state)
    result.seconds = time.monotonic() - t0
    return result


class _Totals:
    """Progress over every bucket: bytes and backups, done of all."""

    def __init__(self, report: CopyProgress | None) -> None:
        self.report = report
        self.bytes_total = 0
        self.backups_total = 0
        self.bytes = 0
        self.backups = 0
        self._guard = threading.Lock()

    def add(self, sizes: list[int]) -> None:
        self.bytes_total += sum(sizes)
        self.backups_total += len(sizes)

    def moved(self, n: int) -> None:
        with self._guard:
            self.bytes += n
            self.tell()

    def backup_done(self) -> None:
        with self._guard:
            self.backups += 1
            self.tell()

    def tell(self) -> None:
        if self.report is not None:
            self.report(self.bytes, self.bytes_total, self.backups, self.backups_total)


def _copy_bucket(src: Repository, dst: Repository, bucket: str, todo: list[Manifest],
                 tally: BucketCopy, state: _Totals) -> None:  # fmt: skip
    """Copy `todo` into `dst` under the bucket's writer lock; first heal what a killed
    copy left between a backup's two manifest files, and sweep its temp files."""
    fresh = bucket not in dst.buckets()
    if fresh and not todo:
        return
    ok = False
    try:
        with RepositoryLock(dst, bucket) as lock:
            dst.heal(bucket, lock)
            # what a killed copy left: temp files, an older run's directories
            running = todo[0].backup_id if todo else dst.resumable(bucket)
            sweep_unless_read(dst, bucket, running or dst.next_backup_id(bucket), lock)
            copier = _Copier(src, dst, bucket, lock, tally, state.moved)
            for m in todo:
                copier.backup(m)
                tally.copied.append(str(m.backup_id))
                state.backup_done()
            if todo:  # the revisions copied replaced older ones, absorbed backups
                mark = dst.resumable(bucket) or dst.next_backup_id(bucket)
                sweep_unless_read(dst, bucket, mark, lock)
        ok = True
    finally:
        if fresh and not ok:
            dst.remove_empty_bucket(bucket)
