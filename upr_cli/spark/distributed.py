"""`upr backup … --master` and `upr restore … --master`: partitions divided among Spark tasks.

Theory of operation (docs/design.md "Data flows" (6. Spark)). The driver keeps every
decision that makes a backup or restore what it is: for a backup, the lock, where each
partition starts, the high seqs pinned once (so the tasks stop where a local run would),
and the commit of the manifest after every task succeeded; for a restore, the choice of
the state. The tasks only move data: each streams a contiguous share of the partitions
from the source into segments in the new backup's directory (on storage every executor
shares, fsynced there) with the same `stream_to_segments` a local backup uses, or writes
its share of the state to the target node with the same `restore_to_node`. A failed task
fails the job: the manifest is never written and the directory is swept by the next run.

The source URI, credentials included, travels to the executors in the task closures
(they connect to the cluster themselves); run such jobs only on a Spark cluster you
trust with those credentials.

The repository travels the same way (formats/spark.md §7): the driver unlocks it once
and ships its location and an `Access` carrying the data key in the closures; each
task opens the repository's storage from them (`Repository(root, access=shipped)`) and
writes its segments through it, sealed in an encrypted repository and as objects in an
s3:// one, never as plaintext files beside them. A restore task runs
`restore_to_node` under the shipped access (`access.using`). The key is in no option,
SparkConf or environment variable of the executors.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from upr_cli.collections import Path as CollectionPath
from upr_cli.dcp.consumer import WireCompression
from upr_cli.failover import FailoverLog
from upr_cli.jobs.backup_stream import DEFAULT_MEMORY, PartitionResult, stream_to_segments
from upr_cli.jobs.restore import RestoreSummary, restore_to_node
from upr_cli.memory import MemoryLimit
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition
from upr_cli.repo import Repository
from upr_cli.repo import access as _access
from upr_cli.repo.access import Access
from upr_cli.storage import Storage


def shares(partitions: list[int], tasks: int) -> list[list[int]]:
    """Contiguous shares of the partitions, one per task (at most `tasks`, none empty)."""
    k = max(1, min(tasks, len(partitions)))
    size = -(-len(partitions) // k)
    return [partitions[i : i + size] for i in range(0, len(partitions), size)]


def shipped_access(root: Path, storage: Storage | None = None) -> Access:
    """This process's access to the repository at `root` with its data key when it is
    encrypted: what a task opens it with. `storage`, the driver's storage of it, gives
    the key when it holds one (no second unlock: no second run of a key command)."""
    key, repo_id = getattr(storage, "data_key", None), getattr(storage, "repo_id", None)
    if isinstance(key, bytes) and isinstance(repo_id, bytes):
        now = _access.current()
        return replace(now, data_keys={**now.data_keys, repo_id.hex(): key})
    return Repository(root).keyed_access()


def spark_streamer(spark: Any, tasks: int, root: Path) -> Callable[..., Any]:
    """A `stream_to_segments` stand-in that runs one share of the partitions per task,
    each writing into the repository at `root` through its storage (opened in the task
    with the access the driver ships)."""

    async def stream(uri: SourceUri, directory: Path, *, bucket: str,
                     positions: dict[int, StreamPosition],
                     failover_logs: dict[int, FailoverLog] | None = None,
                     partitions: list[int] | None = None,
                     segment_name: Callable[[int, int, int], str],
                     end_seqs: dict[int, int] | None = None,
                     cuts: dict[int, list[Any]] | None = None,
                     boundaries: dict[int, list[int]] | None = None,
                     collections: list[CollectionPath] | None = None,
                     followed_ids: dict[int, set[int]] | None = None,
                     wait: float = 120.0,
                     compression: WireCompression = "auto",
                     memory: MemoryLimit = DEFAULT_MEMORY,
                     storage: Storage | None = None,
                     **_ignored: Any) -> dict[int, PartitionResult]:  # fmt: skip
        shipped = shipped_access(root, storage)  # the driver's storage: not picklable
        logs = failover_logs or {}
        ends = end_seqs or {}
        left = cuts or {}  # an interrupted run's cut-back segments (their lists go on)
        bounds = boundaries or {}  # where a mid-run rollback may land (snapshot boundaries)

        def run(share: list[int]) -> list[tuple[int, PartitionResult]]:
            store = Repository(root, access=shipped).storage  # unlocked with the data key
            got = asyncio.run(stream_to_segments(
                uri, directory, bucket=bucket,
                positions={p: positions[p] for p in share if p in positions},
                failover_logs={p: logs[p] for p in share if p in logs}, partitions=share,
                segment_name=segment_name, end_seqs={p: ends[p] for p in share if p in ends},
                cuts={p: left[p] for p in share if p in left},
                boundaries={p: bounds[p] for p in share if p in bounds},
                collections=collections,  # each task's streams filter the same way
                followed_ids=None if followed_ids is None else
                {p: followed_ids[p] for p in share if p in followed_ids},
                wait=wait,  # each task waits for a lost node as the command says (--wait)
                compression=compression,  # and sets Snappy as it says (--wire-compression)
                memory=memory,  # and keeps to --memory-limit, each in its own process
                storage=store,  # sealed or object storage as the repository is: never plain
            ))  # fmt: skip
            return sorted(got.items())

        groups = shares(sorted(partitions or []), tasks)
        loop = asyncio.get_running_loop()
        rdd = spark.sparkContext.parallelize(groups, max(1, len(groups)))
        items = await loop.run_in_executor(None, lambda: rdd.flatMap(run).collect())
        return dict(items)

    return stream


def spark_restore(spark: Any, repo_dir: Path, target: SourceUri, *, tasks: int,
                  partitions: list[int] | None = None, **kw: Any) -> RestoreSummary:  # fmt: skip
    """`restore_to_node` with the partitions divided among Spark tasks; counts summed."""
    import time

    from upr_cli.jobs.state import precheck, select
    from upr_cli.source import open_bucket

    t0 = time.monotonic()
    with contextlib.ExitStack() as held:
        # The driver holds the bucket's shared lock for the whole run, each task its own
        # (`restore_to_node` takes it): no prune or sweep removes a segment meanwhile.
        repo, b, manifests = open_bucket(repo_dir, kw.get("bucket"), kw.get("at", "latest"),
                                         held=held, command="spark restore")  # fmt: skip
        sel = select(manifests, kw.get("at", "latest"), partitions)
        # The driver checks every segment of every task's share before any task writes (a
        # task checking its own share would find damage after others wrote theirs);
        # --skip-corrupt hands no task a damaged partition.
        checked = precheck(repo, b, manifests, sel) if kw.get("check", True) else None
        if checked is not None and not kw.get("skip_corrupt", False):
            checked.refuse()
        damage = checked.damage if checked is not None else {}
        groups = shares([p for p in sel.partitions if p not in damage], tasks)
        # The driver checks the target and creates the missing collections once, reading no
        # partition (only the plan), so the tasks never race to change the manifest.
        first = asyncio.run(restore_to_node(repo_dir, target, partitions=[], **kw))
        shipped = repo.keyed_access()  # in the pickled closure only (formats/spark.md §7)

        def run(share: list[int]) -> list[RestoreSummary]:
            with _access.using(shipped):  # restore_to_node opens the repository through it
                return [asyncio.run(restore_to_node(repo_dir, target, partitions=share, **kw))]

        parts = spark.sparkContext.parallelize(groups, max(1, len(groups))).flatMap(run).collect()
        total = RestoreSummary(str(sel.backup_id), target.redacted(), kw.get("dry_run", False),
                               precheck=checked, left_out=sorted(damage))  # fmt: skip
        total.skipped += [f"partition {p}: {why}" for p in sorted(damage) for why in damage[p]]
        total.plan = first.plan
        # each task writes its records' xattrs as `keep_xattrs` says, as a local restore does
        total.keep_xattrs, total.target_xattrs = first.keep_xattrs, first.target_xattrs
        by = total.plan.by_source() if total.plan else {}
        for s in parts:
            total.dropped += s.dropped
            total.excluded += s.excluded  # --include-data/--exclude-data
            for c in s.plan.collections if s.plan else ():
                if c.source_id in by:
                    by[c.source_id].documents += c.documents
                    by[c.source_id].deletions += c.deletions
            for name in ("partitions", "documents", "deletions", "written", "conflicts",
                         "absent_deletes", "xattrs", "xattrs_left_out", "bytes"):  # fmt: skip
                setattr(total, name, getattr(total, name) + getattr(s, name))
            for k, v in s.errors.items():
                total.errors[k] = total.errors.get(k, 0) + v
            total.skipped += s.skipped
            total.left_out += s.left_out
            total.refused += s.refused
            total.complete += s.complete
            total.failure = total.failure or s.failure
        total.seconds = time.monotonic() - t0
    return total
