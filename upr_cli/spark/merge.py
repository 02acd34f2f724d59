"""`upr spark merge`: one full backup equal to the chain's state through a backup, written
by Spark tasks.

Theory of operation (formats/repository.md §8.9; docs/design.md "Data flows" (6. Spark)).
The driver is `upr merge`'s (`upr_cli.jobs.merge.run`): it resolves `--through`, takes
the bucket's lock, sweeps, picks the new backup's id and directory, plans every
partition's pieces and resume point at B, and commits the manifest once every partition
is written. Only the writing differs: here the partitions are balanced by the bytes they
read into Spark tasks (largest first, each into the task with the fewest bytes), and
each task writes its partitions' merged segments with `jobs.merge.write_partition`
(`jobs.compact.write_latest`: bounded memory, checksums verified as read) into the new
backup's directory, on storage every executor shares, and returns what it wrote. A task
that fails fails the job before the commit: the uncommitted directory is swept by the
next backup or merge. Use it for a repository too large for one machine; `upr merge`
does the same on one.

Each task opens the repository from its location with the `Access` the driver ships in
the task's closure: the driver's settings and, for an encrypted repository, the data key
it unlocked (formats/spark.md §7). The tasks read and write through that repository's
storage (sealed blocks, or objects in an s3:// repository), never the user's key and
never a plaintext file of their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from upr_cli.jobs.compact import Written
from upr_cli.jobs.merge import MergeRun, MergeSummary, PartitionWork, run, write_partition
from upr_cli.repo import Repository
from upr_cli.repo.access import Access
from upr_cli.spark.plan import DEFAULT_PARTITIONS

__all__ = ["MergeSummary", "groups", "merge", "write_group"]


def groups(work: tuple[PartitionWork, ...], n: int = DEFAULT_PARTITIONS) -> list[list[int]]:
    """The partitions of each task: largest first, each into the task with the fewest
    bytes (LPT), deterministic; partitions with nothing to read are left to the driver's
    commit (an entry without a segment)."""
    units = sorted((w for w in work if w.pieces), key=lambda w: (-w.bytes, w.partition))
    k = max(1, min(n, len(units)))
    bins: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for w in units:
        i = min(range(k), key=lambda j: (load[j], j))
        bins[i].append(w.partition)
        load[i] += w.bytes
    return [sorted(b) for b in bins if b]


def write_group(
    plan: MergeRun, partitions: list[int], access: Access | None = None
) -> Iterator[tuple[int, tuple[Written, ...]]]:
    """In a task: each partition's merged segment, written into the run's directory
    through the repository opened with `access` (the driver's, shipped with the task)."""
    repo = Repository(plan.repo, access=access)
    by_p = {w.partition: w for w in plan.work}
    for p in partitions:
        yield p, write_partition(repo, plan, by_p[p])


def merge(spark: Any, repo_dir: Path, *, through: str = "latest",
          bucket: str | None = None) -> MergeSummary:  # fmt: skip
    """Write and commit the merged full backup; returns its summary."""

    def write(repo: Repository, plan: MergeRun) -> list[tuple[int, tuple[Written, ...]]]:
        from upr_cli.spark.jobs import spark_error

        tasks = groups(plan.work)
        shipped = repo.keyed_access()  # in the pickled closure only (formats/spark.md §7)
        try:
            rdd = spark.sparkContext.parallelize(tasks, max(1, len(tasks)))
            out: list[tuple[int, tuple[Written, ...]]] = rdd.flatMap(
                lambda ps: list(write_group(plan, ps, shipped))
            ).collect()
        except Exception as exc:  # noqa: BLE001 - Spark wraps everything; report one line
            raise spark_error(exc) from None
        return out

    return run(repo_dir, through=through, bucket=bucket, write=write)
