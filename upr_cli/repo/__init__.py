"""The backup repository: layout, manifests, chains, locks (formats/repository.md).

`names` holds every on-disk name as a format/parse pair; `manifest` the validated
manifest dataclasses; `layout` the `Repository` (repo.json, directories, listing, paths);
`manifests` the reading, commit and repair of manifest files and the chain check;
`sweep` the removal of what interrupted runs left; `lock` the per-bucket
`RepositoryLock`; `readers` the readers' shared `ReadLock` and the `ExclusiveAccess`
that removes or rewrites under them; `lease` the same three as leases, for a
repository in object storage (formats/repository.md §11.3); `chain` the pure chain
semantics of formats/repository.md §8. Every file is reached through the repository's
`upr_cli.storage.Storage`.
"""

from upr_cli.fsio import FileOps, atomic_write
from upr_cli.lockholder import LockHolder
from upr_cli.repo.chain import (
    NO_CUT,
    ParentMismatch,
    PlanStep,
    ResumePoint,
    SeqRange,
    broken_parents,
    coverage_gaps,
    cut,
    lost_cut,
    lost_ranges,
    needed_from,
    plan_state,
    resume_point,
    snapshot_boundaries,
)
from upr_cli.repo.errors import BrokenChain, RepositoryError, RepositoryLocked
from upr_cli.repo.layout import LOCK_FILE, REPO_FILE, RepoInfo, Repository
from upr_cli.repo.lock import RepositoryLock
from upr_cli.repo.manifest import (
    CutBack,
    Manifest,
    PartitionEntry,
    RollbackRecord,
    SegmentEntry,
    Totals,
    checksum_hex,
)
from upr_cli.repo.manifests import (
    MANIFEST_COPY,
    MANIFEST_FILE,
    ManifestFile,
    ManifestStore,
    altered_twin,
    load_manifest_file,
)
from upr_cli.repo.names import (
    BackupId,
    SegmentName,
    check_bucket,
    format_cut_path,
    format_segment_name,
    format_time,
    is_temp_name,
    parse_cut_path,
    parse_segment_name,
    parse_temp_name,
    parse_time,
    temp_name,
)
from upr_cli.repo.sweep import Sweeper

__all__ = [
    "LOCK_FILE",
    "MANIFEST_COPY",
    "MANIFEST_FILE",
    "NO_CUT",
    "REPO_FILE",
    "BackupId",
    "BrokenChain",
    "CutBack",
    "FileOps",
    "LockHolder",
    "Manifest",
    "ManifestFile",
    "ManifestStore",
    "ParentMismatch",
    "PartitionEntry",
    "PlanStep",
    "RepoInfo",
    "Repository",
    "RepositoryError",
    "RepositoryLock",
    "RepositoryLocked",
    "ResumePoint",
    "RollbackRecord",
    "SegmentEntry",
    "SegmentName",
    "SeqRange",
    "Sweeper",
    "Totals",
    "altered_twin",
    "atomic_write",
    "broken_parents",
    "check_bucket",
    "checksum_hex",
    "coverage_gaps",
    "cut",
    "format_cut_path",
    "format_segment_name",
    "format_time",
    "is_temp_name",
    "load_manifest_file",
    "lost_cut",
    "lost_ranges",
    "needed_from",
    "parse_cut_path",
    "parse_segment_name",
    "parse_temp_name",
    "parse_time",
    "plan_state",
    "resume_point",
    "snapshot_boundaries",
    "temp_name",
]
