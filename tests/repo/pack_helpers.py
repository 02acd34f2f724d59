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

from tests.repo.chain_gen import Step, restored
from tests.repo.repo_helpers import BUCKET
from upr_cli.jobs.inspect import info
from upr_cli.jobs.merge import merge
from upr_cli.jobs.prune import run as prune
from upr_cli.jobs.repo_copy import copy_repository
from upr_cli.jobs.retention import KeepRules
from upr_cli.repo import MANIFEST_FILE, BackupId, Manifest, Repository, access
from upr_cli.repo.manifests import MANIFEST_COPY
from upr_cli.repo.pack import PACK_NAME, write_pack
from upr_cli.storage import unwrap

STEPS = [  # a chain with cut-backs, a rollback, collections: what the pack tests pack
    Step("full", (5, 5, 5), (0, 0, 0), (False, False, False), 1),
    Step("inc", (4, 3, 0), (0, 0, 0), (True, False, False), 2),  # a cut-back on 0: cut-1/
    Step("inc", (3, 4, 5), (0, 3, 0), (False, False, False), 3),  # a rollback on 1
    Step("inc", (2, 5, 1), (0, 0, 0), (False, True, False), 4),  # a cut-back on 1
]


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


def observe(location: Path, work: Path, *, light: bool = False) -> dict[str, Any]:
    """What readers make of the repository at `location` (a path, or `s3:/…`): the state
    at every backup (restore --sqlite), the keys listed (ls), every version of some keys
    (examine), a document (cat), the lost writes (salvage), verify's problems. `light`
    (an object store, where each command costs a second): the newest state, the lost
    writes, verify's problems (`narrow` of a full one)."""
    from upr_cli.jobs.cat import KeyNotFound, cat
    from upr_cli.jobs.examine import examine
    from upr_cli.jobs.ls import list_keys, open_state

    repo = Repository(location)
    ids = repo.backups(BUCKET)[-1:] if light else repo.backups(BUCKET)
    out: dict[str, Any] = {}
    out["states"] = {str(b): restored(location, b, work / f"s-{b}.db") for b in ids}
    if light:
        return _rest(location, out)
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
    return _rest(location, out)


def _rest(location: Path, out: dict[str, Any]) -> dict[str, Any]:
    from upr_cli.jobs.inspect import verify
    from upr_cli.jobs.salvage import _repo_items

    out["salvage"] = _repo_items(location, None, None, {})
    out["problems"] = [p for r in verify(location) for p in (*r.problems, *r.leftovers)]
    return out


def narrow(full: dict[str, Any]) -> dict[str, Any]:
    """What `observe(…, light=True)` sees of a repository a full `observe` saw."""
    last = list(full["states"])[-1]
    return {"states": {last: full["states"][last]}, "salvage": full["salvage"],
            "problems": full["problems"]}  # fmt: skip


def _files(repo: Repository, d: Path) -> list[str]:
    return sorted(e.name for e in unwrap(repo.storage).list(d))


def check_packed_repository(src: Path, before: dict[str, Any], dst: Path, work: Path,
                            *, encrypted: bool, light: bool = False) -> None:  # fmt: skip
    """Copy `src` (plain) to `dst` (a path or `s3:/…`; sealed when `encrypted`: the key
    in UPR_PASSPHRASE), pack two of its backups (one with a cut-back, the newest), then:
    every reader reads as before (`before`: `observe` of `src`); a copy reads as before,
    its packed backups packed, and merges;
    a prune that absorbs the packed backup keeps the newest's `continuous` and points.
    An encrypted copy needs UPR_FROM_PASSPHRASE too (the same); `light`: `observe`'s."""
    copy_repository(src, dst, encrypt=encrypted)
    repo = Repository(dst)
    ids = repo.backups(BUCKET)
    packed = [ids[1], ids[-1]]
    for b in packed:
        pack_backup(repo, BUCKET, b)
        d = repo.backup_dir(BUCKET, b)
        assert _files(repo, d) == [MANIFEST_FILE, MANIFEST_COPY, PACK_NAME]
        m = Repository(dst).read_manifest(BUCKET, b)
        assert m.continuous is not None and any(e.points for e in m.partitions)
        # sealed in an encrypted repository: the pack's own magic is not to be seen
        assert (unwrap(repo.storage).read(d / PACK_NAME, 0, 8) == b"UPR-PACK") is not encrypted
    # the members list and stat like files, cut-K directories included
    r2 = Repository(dst)
    d = r2.backup_dir(BUCKET, ids[1])
    listed = {e.name: e for e in r2.storage.list(d)}
    assert listed["cut-1"].is_dir and PACK_NAME in listed
    m1 = r2.read_manifest(BUCKET, ids[1])
    for e in m1.partitions:
        for name, s in [(s.file, s) for s in e.segments] + e.cut_files():
            st = r2.storage.stat(d / name)
            assert st is not None and st.is_file and st.size == s.bytes
    assert observe(dst, work, light=light) == (narrow(before) if light else before)
    shown = info(dst)["buckets"][0]
    assert [b["backup_id"] for b in shown["backups"]] == [str(b) for b in ids]
    assert all(b["bytes_on_disk"] > 0 for b in shown["backups"]) and not shown["leftovers"]
    # a copy of the packed repository: its packed backups stay packed
    access.reset()
    copied = work / "copied"
    copy_repository(dst, copied, encrypt=encrypted)
    assert observe(copied, work) == before
    there = Repository(copied)
    for b in packed:
        assert there.read_manifest(BUCKET, b) == Repository(dst).read_manifest(BUCKET, b)
        d = there.backup_dir(BUCKET, b)
        assert _files(there, d) == [MANIFEST_FILE, MANIFEST_COPY, PACK_NAME]
    # a merge through a backup after the packed ids[1] (read from its pack) is its state
    merged = BackupId.parse(merge(copied, through=str(ids[2])).backup_id)
    assert restored(copied, merged, work / "merged.db") == before["states"][str(ids[2])]
    # a prune that keeps the newest: the packed ids[1] is absorbed, the packed newest
    # becomes a revision that is still a continuous commit, with its points
    k = Repository(dst).read_manifest(BUCKET, ids[-1])
    prune(dst, bucket=None, rules=KeepRules(last=1), apply_=True, drop_lost=False)
    rev = Repository(dst).read_manifest(BUCKET, ids[-1])
    assert rev.revision == 2 and set(rev.absorbed) == set(ids[:-1])
    assert rev.continuous == k.continuous
    for e in k.partitions:
        got = rev.partition(e.partition)
        assert got is not None and got.points == e.points
    after = observe(dst, work, light=True)
    assert after["states"] == {str(ids[-1]): before["states"][str(ids[-1])]}
    assert after["problems"] == []
