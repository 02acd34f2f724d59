"""The sweep: what an interrupted or failed run left in a bucket, removed under the
bucket's lock (formats/repository.md §4.4).

Theory of operation: a backup directory with neither manifest file is an interrupted
run. The next run reuses the newest one (resume) or `sweep` removes it, with every temp
file (`.NAME.tmp-RANDOM`, the segment writer's `-body` spills included). `sweep` never
removes a directory holding either manifest file, whatever state it is in, nor one that
a committed backup names as its parent, nor any that a damaged manifest could name. A
run that fails before it finished a segment removes its own empty directory
(`discard_empty`), and a first run that fails removes the empty bucket directory
(`remove_empty_bucket`), so a failed run leaves the repository as it was. Every removal
goes through the repository's `Storage` and is made durable by a sync of its directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from upr_cli.repo.errors import RepositoryError
from upr_cli.repo.lock import require_held
from upr_cli.repo.names import BackupId, is_temp_name, temp_name
from upr_cli.storage import unwrap

if TYPE_CHECKING:
    from upr_cli.repo.layout import Repository
    from upr_cli.repo.lock import RepositoryLock
    from upr_cli.storage import Storage

REMOVED_SUFFIX = "-removed"
"""The temp-name suffix of a directory being removed (`Sweeper.discard`)."""


class Sweeper:
    """Removes the leftovers of interrupted and failed runs from a repository's buckets."""

    def __init__(self, layout: Repository) -> None:
        self.layout = layout

    @property
    def storage(self) -> Storage:
        """The repository's storage (sealing once an encrypted repository is unlocked)."""
        return self.layout.storage

    def sweep(self, bucket: str, running: BackupId, lock: RepositoryLock) -> list[Path]:
        """Remove temp files, and the backup directories older than `running` that an
        interrupted run provably left (formats/repository.md §4.4): neither manifest
        file, no committed backup naming it as its parent, and no damaged manifest
        newer than it (whose parent link cannot be read). Needs the bucket's lock, held.
        """
        layout = self.layout
        require_held(lock, layout.lock_path(bucket), "sweep needs this bucket's lock, held")
        removed: list[Path] = []
        bdir = layout.bucket_dir(bucket)
        st = self.storage.stat(bdir, follow_links=True)
        if st is None or not st.is_dir:
            return removed
        self._sweep_temp(bdir, removed)
        scan = layout.scan(bucket)
        named: set[BackupId] = set()  # parents named by a committed backup
        unreadable: BackupId | None = None  # the newest backup whose links cannot be read
        for s in scan:
            if s.committed:
                try:
                    m = layout.read_manifest(bucket, s.backup_id)
                except RepositoryError:
                    unreadable = s.backup_id
                    continue
                named.update(b for b in (m.parent, m.merged_through) if b is not None)
        for s in scan:
            self._sweep_temp(s.path, removed)
            if (s.backup_id < running and not s.committed and s.backup_id not in named
                    and (unreadable is None or s.backup_id > unreadable)):  # fmt: skip
                self.storage.delete_tree(s.path)
                removed.append(s.path)
        # what a prune left when it stopped between its commits and its removals
        # (formats/repository.md §4.6): revisions replaced or never committed, and the
        # directories of the backups a committed revision absorbed
        gone = layout.absorbed(bucket)
        stale = layout.stale_revisions(bucket)
        stale += [s for s in layout.scan_all(bucket) if s.backup_id in gone and s not in stale]
        for s in stale:
            removed.append(self.discard(s.path))
        if removed:
            self.storage.sync_dir(bdir)
        return removed

    def discard(self, path: Path) -> Path:
        """Remove a directory of the bucket so that no reader ever sees part of it: a
        rename to a temp name (`.NAME.tmp-RANDOM-removed`, which no reader lists and the
        sweep removes), then the removal of its content. Needs the bucket's lock, held
        by the caller. Returns `path`."""
        tmp = path.with_name(temp_name(path.name) + REMOVED_SUFFIX)
        self.storage.replace(path, tmp)
        self.storage.sync_dir(path.parent)
        self.storage.delete_tree(tmp)
        return path

    def _sweep_temp(self, d: Path, removed: list[Path]) -> None:
        """Remove regular files named like temp files directly inside `d`, and the
        directories a removal renamed (`discard`) and did not finish removing."""
        found = False
        for entry in unwrap(self.storage).list(d):  # its own files: no pack's members
            removal = entry.is_dir and entry.name.endswith(REMOVED_SUFFIX)
            if is_temp_name(entry.name) and (entry.is_file or removal):
                if entry.is_dir:
                    self.storage.delete_tree(d / entry.name)
                else:
                    self.storage.delete(d / entry.name)
                removed.append(d / entry.name)
                found = True
        if found:
            self.storage.sync_dir(d)

    def discard_empty(self, bucket: str, backup_id: BackupId, lock: RepositoryLock) -> bool:
        """Remove an uncommitted backup directory that holds nothing (a run that failed
        before it finished a segment), so that a failed run leaves no backup behind.
        Needs the bucket's lock, held; True when the directory is gone."""
        require_held(lock, self.layout.lock_path(bucket))
        d = self.layout.backup_dir(bucket, backup_id)
        try:
            self.storage.remove_dir(d)  # only ever an empty one
        except FileNotFoundError:
            return True
        except OSError:
            return False
        self.storage.sync_dir(d.parent)
        return True

    def remove_empty_bucket(self, bucket: str) -> None:
        """Remove the bucket directory when it is empty (a first run that failed and
        released its lock): the repository is as it was before that run. A run that
        has just created it again keeps it (rmdir refuses a directory with a lock)."""
        try:
            self.storage.remove_dir(self.layout.bucket_dir(bucket))
        except OSError:
            return
        self.storage.sync_dir(self.layout.path)
