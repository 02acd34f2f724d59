"""`upr ls`: the keys the state at a backup holds, as a restore would write them.

Theory of operation. The state at backup K (formats/repository.md §8.1) is, per
partition, the latest record of every (collection, key) among the segments
`plan_state` names, each read up to its seq cut; a deletion or expiration means the
key is not restored. `open_state` resolves `--at` as `upr restore --at` does
(`jobs.state.select`: an id, a unique prefix, latest or oldest; or a time,
`--at-time`, each partition then at its restore point: docs/design.md "Point-in-time
restore"), checks the chain up to K whole (`source.open_bucket`) and every segment
file it reads present at its size (`jobs.state.check_files`); block checksums are
verified as the blocks are read, through the repository's storage.

Collections are by name at the end of the chain (`chain_manifest`, as the Spark
reader and restore take them): records of a collection dropped by K, or left out by
the filter of K's backup, are not part of the state. `--collection` keeps the ids
whose names its paths (SCOPE or SCOPE.COLLECTION, comma-separated, as the Spark
`collections` option) cover; a path no backup up to K ever named is a usage error.

Memory is bounded by one partition's keys: partitions are read one at a time, and
for each (collection, key) only its latest seq, whether it is a tombstone and its
body's length are kept (never a value). The keys are then listed in seq order, so
the whole listing is in partition then seq order.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from upr_cli.collections import Path as CollectionPath
from upr_cli.errors import UsageError
from upr_cli.jobs.state import Selection, check_files, select
from upr_cli.protocol.decoder import OP_MUTATION
from upr_cli.repo import BackupId, Manifest, Repository
from upr_cli.segments import Record, SegmentReader
from upr_cli.source import open_bucket
from upr_cli.spark.plan import collection_names


@dataclass(frozen=True, slots=True)
class StateAt:
    """The state at one backup, checked and ready to read."""

    repo: Repository
    bucket: str
    backup_id: BackupId
    manifests: list[Manifest]  # the chain up to `backup_id`, oldest first
    partitions: tuple[int, ...]  # every partition a backup up to `backup_id` holds
    names: dict[int, tuple[str, str]]  # (scope, collection) of every id the chain met
    keep: frozenset[int]  # the ids whose records the state holds (and that were asked)
    selection: Selection  # what `at` resolved to (per partition, at a point in time)

    @property
    def label(self) -> str:
        """The state as messages name it: its backup id, or the time asked."""
        point = self.selection.point
        return str(self.backup_id) if point is None else point.asked

    def records(self, partition: int) -> Iterator[tuple[BackupId, Record]]:
        """The data records the state at `backup_id` reads for `partition`, in plan
        order (chain order, then seq), each with its backup; the latest per (collection,
        key) is the state's. Records of collections outside `keep` are left out."""
        keep = self.keep
        for step in self.selection.steps(self.manifests, partition):
            path = self.repo.segment_path(self.bucket, step.backup_id, step.name)
            with SegmentReader(path, self.repo.storage) as reader:
                for rec in reader.records():
                    if rec.seq > step.max_seq:
                        break
                    if rec.collection in keep:
                        yield step.backup_id, rec


def open_state(
    repo_dir: Path,
    bucket: str | None,
    at: str = "latest",
    collections: Sequence[CollectionPath] = (),
    option: str = "--collection",
    *,
    held: contextlib.ExitStack | None = None,
    command: str = "ls",
) -> StateAt:
    """The state at `at` (module doc); `collections` keeps only what those paths name.
    With `held`, the bucket's shared lock is entered into it (`source.open_bucket`):
    the caller reads the state before it closes `held`."""
    repo, b, manifests = open_bucket(repo_dir, bucket, at, held=held, command=command)
    sel = select(manifests, at, bucket=b)
    check_files(repo, b, manifests, sel)
    chain = [m for m in manifests if m.backup_id <= sel.backup_id]
    names = collection_names(chain)
    f = chain[-1].collection_filter
    keep = {c.id for s, c in sel.collections(chain).collections()
            if f is None or f.covers(s.name, c.name)}  # fmt: skip
    if collections:
        missing = [str(p) for p in collections if not any(p.covers(*n) for n in names.values())]
        if missing:
            raise UsageError(f"{option} {', '.join(missing)}: no such collection in the backups "
                             f"up to {sel.backup_id} (they have {known(names)})")  # fmt: skip
        keep &= {cid for cid, n in names.items() if any(p.covers(*n) for p in collections)}
    return StateAt(repo, b, sel.backup_id, chain, sel.partitions, names, frozenset(keep), sel)


def known(names: dict[int, tuple[str, str]]) -> str:
    """The collection names a chain met, sorted, for a message."""
    return ", ".join(sorted({f"{s}.{c}" for s, c in names.values()}))


class Key(NamedTuple):
    """One key of the state: where its latest record is, and what it is."""

    partition: int
    seq: int
    collection: int  # the collection id
    key: bytes
    deleted: bool  # a tombstone: the key is not restored
    bytes: int  # the body's length as stored (no xattrs)


def list_keys(state: StateAt, *, deleted: bool = False) -> Iterator[Key]:
    """The keys of the state, partition by partition, each in seq order; tombstones too
    with `deleted`. One partition's keys (no value) are held at a time."""
    for p in state.partitions:
        latest: dict[tuple[int, bytes], tuple[int, bool, int]] = {}
        for _bid, rec in state.records(p):
            latest[rec.collection, rec.key] = (rec.seq, rec.op != OP_MUTATION, len(rec.value))
        rows = sorted(latest.items(), key=lambda kv: kv[1][0])
        latest.clear()
        for (cid, key), (seq, gone, n) in rows:
            if deleted or not gone:
                yield Key(p, seq, cid, key, gone, n)


def key_text(key: bytes) -> str:
    """A key as one line of text: its UTF-8, invalid bytes as `\\xNN` and characters that
    are not printable (a newline, a tab) as Python escapes them."""
    text = key.decode("utf-8", errors="backslashreplace")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def key_fields(key: bytes) -> dict[str, str]:
    """A key in JSON, as `upr tail` gives it: `key` its text (invalid UTF-8 bytes as
    `\\xNN`), and `key_b64` its bytes in base64 when it is not UTF-8."""
    try:
        return {"key": key.decode("utf-8")}
    except UnicodeDecodeError:
        return {"key": key.decode("utf-8", errors="backslashreplace"),
                "key_b64": base64.b64encode(key).decode()}  # fmt: skip
