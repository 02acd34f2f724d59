"""Turn a committed backup into a packed continuous commit, as `upr backup --follow`
commits one (formats/repository.md §12): its segment files (cut-back ones too) into one
`segments.pack`, the files deleted, its manifest rewritten with `continuous` and a
restore point per segment end. Works through the repository's storage: plain, sealed
or an object store."""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.repo.repo_helpers import BUCKET
from upr_cli.repo import MANIFEST_FILE, BackupId, Manifest, Repository
from upr_cli.repo.manifests import MANIFEST_COPY
from upr_cli.repo.pack import PACK_NAME, write_pack
from upr_cli.storage import unwrap


def continuous(m: Manifest) -> Manifest:
    """`m` as a continuous commit: since its start, a point at every segment's end (one
    microsecond apart, in seq order, the last at or before `finished`)."""
    entries = []
    for e in m.partitions:
        seqs = sorted({s.last_seq for s in e.segments if e.start_seq < s.last_seq <= e.end_seq})
        first = m.finished - timedelta(microseconds=len(seqs))
        points = tuple((q, first + timedelta(microseconds=i)) for i, q in enumerate(seqs, 1))
        entries.append(replace(e, points=points))
    return replace(m, partitions=tuple(entries), continuous=m.started)


def pack_backup(repo: Repository, bucket: str, backup_id: BackupId) -> Path:
    """Pack backup `backup_id` of `bucket` in place; the pack's path."""
    m = repo.read_manifest(bucket, backup_id)
    d = repo.backup_dir(bucket, backup_id)
    names = [s.file for e in m.partitions for s in e.segments]
    names += [name for e in m.partitions for name, _s in e.cut_files()]
    storage = repo.storage
    with tempfile.TemporaryDirectory() as tmp:
        members = []
        for i, name in enumerate(names):
            local = Path(tmp) / str(i)
            local.write_bytes(storage.read(d / name))
            members.append((name, local))
        write_pack(storage, d, members)
    raw = unwrap(storage)
    for name in names:
        raw.delete(d / name)
    for sub in {name.split("/", 1)[0] for name in names if "/" in name}:
        with contextlib.suppress(OSError):  # an object store has no directories
            raw.remove_dir(d / sub)
    data = continuous(m).dumps()
    storage.write(d / MANIFEST_COPY, data)
    storage.write(d / MANIFEST_FILE, data)
    return d / PACK_NAME


def observe(location: Path, work: Path) -> dict[str, Any]:
    """What readers make of the repository at `location` (a path, or `s3:/…`): the state
    at every backup (restore --sqlite), the keys listed (ls), every version of some keys
    (examine), a document (cat), the lost writes (salvage), verify's problems."""
    from tests.repo.chain_gen import restored
    from upr_cli.jobs.cat import KeyNotFound, cat
    from upr_cli.jobs.examine import examine
    from upr_cli.jobs.inspect import verify
    from upr_cli.jobs.ls import list_keys, open_state
    from upr_cli.jobs.salvage import _repo_items

    repo = Repository(location)
    ids = repo.backups(BUCKET)
    out: dict[str, Any] = {}
    out["states"] = {str(b): restored(location, b, work / f"s-{b}.db") for b in ids}
    with contextlib.ExitStack() as held:
        keys = [list(list_keys(open_state(location, None, str(b), held=held), deleted=True))
                for b in ids]  # fmt: skip
    out["ls"] = keys
    names = sorted({k.key for k in keys[-1]})[:4]
    out["examine"] = [examine(location, k, partitions=[0, 1, 2]) for k in names]
    docs = []  # cat finds a key in its hashed partition: those the chain put there
    for k in keys[-1]:
        if not k.deleted and k.collection == 0:
            with contextlib.suppress(KeyNotFound):
                docs.append(cat(location, k.key))
    assert docs
    out["cat"] = docs
    out["salvage"] = _repo_items(location, None, None, {})
    out["problems"] = [p for r in verify(location) for p in (*r.problems, *r.leftovers)]
    return out
