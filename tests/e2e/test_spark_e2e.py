"""The `upr` Spark data source and `upr spark export` in Spark local mode, on a real
repository holding a failover's lost writes, and on one holding several collections, one
of them dropped between two backups (formats/spark.md)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from tests.e2e.collections_helpers import create, drop
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import wait_persisted
from upr_cli.repo import Repository, lost_ranges
from upr_cli.segments import SegmentReader
from upr_cli.spark.plan import SparkOptionError, parse_options
from upr_cli.store import Store

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::ResourceWarning")


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    from upr_cli.spark.jobs import session

    s = session("local[2]", {"spark.sql.shuffle.partitions": "4"}, app="upr-tests")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Three backups: full, one holding writes a SIGKILL then lost, one after the crash."""
    base = tmp_path_factory.mktemp("spark")
    node = Node(base / "node", "--flush-interval", "0.02", partitions=8)
    node.start()
    try:
        r = base / "repo"
        upr("load", node.uri, "--docs", "1500", "--update-ratio", "0.3", "--delete-ratio", "0.1")
        wait_persisted(node.uri)
        upr("backup", node.uri, "--repo", str(r))
        node.stop()
        node.start("--flush-interval", "3600")
        upr("load", node.uri, "--docs", "300", "--update-ratio", "0.5", "--seed", "2")
        upr("backup", node.uri, "--repo", str(r))
        node.kill()
        node.start("--flush-interval", "0.02")
        upr("load", node.uri, "--docs", "200", "--update-ratio", "0.5", "--seed", "3",
            "--prefix", "after")  # fmt: skip
        wait_persisted(node.uri)
        upr("backup", node.uri, "--repo", str(r))
        yield r
    finally:
        if node.alive():
            node.kill()


def _store_rows(db: Path) -> set[tuple[Any, ...]]:
    with Store(db, create=False) as s:
        t = 1 << 64
        return {
            (d.partition, d.key, d.seq, d.rev_seq - t if d.rev_seq >= 1 << 63 else d.rev_seq,
             d.cas - t if d.cas >= 1 << 63 else d.cas, d.flags, d.expiry, d.value)
            for d in s.documents(include_deleted=False)
        }  # fmt: skip


def test_export_of_the_state_equals_restore_to_sqlite(
    spark: Any, repo: Path, tmp_path: Path
) -> None:
    from upr_cli.spark.jobs import export

    ids = [str(m.backup_id) for m in Repository(repo).manifests("default")]
    for at in (ids[1], "latest"):  # before the crash (lost writes included), and after
        out = tmp_path / f"state-{at}"
        summary = export(spark, repo, out, at=at)
        table = ds.dataset(out, format="parquet", partitioning="hive").to_table()
        got = {
            (p, bytes(k), s, r, c, f, e, bytes(v))
            for p, k, s, r, c, f, e, v in zip(*(table.column(n).to_pylist() for n in (
                "partition", "key", "seq", "rev_seq", "cas", "flags", "expiry", "value")),
                strict=True)
        }  # fmt: skip
        db = tmp_path / f"restored-{at}.db"
        upr("restore", "--repo", str(repo), "--at", at, f"sqlite:{db}")
        want = _store_rows(db)
        assert got == want and summary.rows == len(want) > 500
        assert not table.column("deleted").to_pylist().count(True)
        # no collection was ever created: everything is the default collection
        cols = ("scope", "collection", "collection_id")
        names = zip(*(table.column(n).to_pylist() for n in cols), strict=True)
        assert set(names) == {("_default", "_default", 0)} and summary.collections == 1


def test_history_counts_equal_the_repository_and_flag_lost_writes(spark: Any, repo: Path) -> None:
    r = Repository(repo)
    manifests = r.manifests("default")
    df = spark.read.format("upr").option("view", "history").load(str(repo))
    per_backup = {
        row["backup_id"]: row["count"] for row in df.groupBy("backup_id").count().collect()
    }
    assert per_backup == {
        str(m.backup_id): sum(s.records for e in m.partitions for s in e.segments)
        for m in manifests if any(e.segments for e in m.partitions)
    }  # fmt: skip
    lost = 0
    for e in manifests[1].partitions:
        for rng in lost_ranges(manifests, e.partition):
            for seg in e.segments:
                path = r.segment_path("default", rng.backup_id, seg.file)
                if rng.backup_id == manifests[1].backup_id:
                    with SegmentReader(path) as reader:
                        lost += sum(1 for rec in reader.records() if rec[1] > rng.from_seq)
    assert lost > 0
    assert df.filter("lost").count() == lost
    assert df.filter("lost").select("backup_id").distinct().collect()[0][0] == str(
        manifests[1].backup_id
    )
    # the state view at the newest backup holds none of the lost versions
    state = spark.read.format("upr").load(str(repo))
    lost_rows = df.filter("lost").select("partition", "key", "seq")
    assert state.join(lost_rows, ["partition", "key", "seq"]).count() == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"view": "sideways"}, "option view: 'sideways' is not one of state, history"),
        ({"at": "20990101T000000.000000Z"}, "option at: no committed backup"),
        ({"path": "/no/such/repo"}, "option path: /no/such/repo: not a upr repository"),
        ({"partitions": "9-1"}, "option partitions:"),
        ({"collections": "app.users"}, "option collections: app.users: no such collection"),
        ({"collections": "app."}, "option collections: 'app.': a collection name must"),
    ],
)
def test_bad_options_fail_with_one_clear_message(
    spark: Any, repo: Path, options: dict[str, str], message: str
) -> None:
    from upr_cli.spark.jobs import spark_error

    opts = {"path": str(repo)} | options
    with pytest.raises(SparkOptionError, match="option"):
        parse_options(opts)  # the same check, without Spark
    with pytest.raises(Exception) as info:
        spark.read.format("upr").options(**opts).load().count()
    assert str(spark_error(info.value)).startswith(message)


def test_upr_spark_export_cli(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "json"
    proc = upr("spark", "export", "--repo", str(repo), "--output", str(out), "--format", "json",
               "--master", "local[1]", "--json", timeout=300)  # fmt: skip
    summary = json.loads(proc.stdout)
    assert summary["format"] == "json" and summary["items"] > 500
    # the JVM's start-up chatter stays off stderr; the summary gives the wall time
    assert [ln for ln in proc.stderr.splitlines() if not ln.startswith("upr")] == []
    assert 0 < summary["startup_seconds"] < summary["seconds"]
    assert sorted(p.name for p in out.glob("partition=*")) == [f"partition={i}" for i in range(8)]
    again = upr("spark", "export", "--repo", str(repo), "--output", str(out), check=False)
    assert again.returncode == 2 and "exists; give --overwrite" in again.stderr
    bad = upr("spark", "export", "--repo", str(repo), "--output", str(tmp_path / "x"), "--at",
              "nope", check=False)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "upr: error: option at: no committed backup 'nope' (see `upr info`)"
    )


def test_watch_tasks_counts_the_jobs_of_its_block(spark: Any) -> None:
    """The `upr spark` progress: tasks done of how many, from Spark's status tracker,
    only for the jobs the block starts, up to every task of them."""
    import time

    from upr_cli.spark.jobs import watch_tasks

    spark.sparkContext.parallelize(range(3), 3).count()  # a job before: not counted
    seen: list[tuple[int, int]] = []

    def slow(x: int) -> int:
        time.sleep(0.3)
        return x

    with watch_tasks(spark, lambda done, total: seen.append((done, total)), every=0.05):
        spark.sparkContext.parallelize(range(6), 6).map(slow).count()
        time.sleep(0.2)  # one poll after the job ended
    assert seen and all(0 <= done <= total == 6 for done, total in seen)
    assert seen[-1] == (6, 6) and seen[0][0] < 6
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_merge_equals_the_chain_and_restores_the_same(
    spark: Any, repo: Path, tmp_path: Path
) -> None:
    import shutil

    from upr_cli.spark.merge import merge

    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    before = [str(m.backup_id) for m in Repository(copy).manifests("default")]
    chain_db = tmp_path / "chain.db"
    upr("restore", "--repo", str(copy), f"sqlite:{chain_db}")
    summary = merge(spark, copy)
    assert summary.through == before[-1] and summary.merged == len(before)
    manifests = Repository(copy).manifests("default")
    merged = manifests[-1]
    assert str(merged.backup_id) == summary.backup_id and merged.full and merged.parent is None
    info = json.loads(upr("info", "--repo", str(copy), "--json").stdout)
    assert summary.backup_id in json.dumps(info)
    upr("verify", "--repo", str(copy))  # checksums and chain of the merged backup
    merged_db = tmp_path / "merged.db"
    upr("restore", "--repo", str(copy), "--at", summary.backup_id, f"sqlite:{merged_db}")
    with Store(chain_db, create=False) as a, Store(merged_db, create=False) as b:
        assert list(a.documents()) == list(b.documents())  # tombstones included
        assert a.positions() == b.positions()
    # through an older backup: the merge sorts right after it, the later backups go on
    # from it as they did from that backup (formats/repository.md §8.9)
    at_b1 = tmp_path / "at-b1.db"
    upr("restore", "--repo", str(copy), "--at", before[1], f"sqlite:{at_b1}")
    older = merge(spark, copy, through=before[1])
    ids = [str(m.backup_id) for m in Repository(copy).manifests("default")]
    assert ids.index(older.backup_id) == ids.index(before[1]) + 1
    upr("verify", "--repo", str(copy))  # the chain (parents, gaps) still holds
    merged_b1 = tmp_path / "merged-b1.db"
    upr("restore", "--repo", str(copy), "--at", older.backup_id, f"sqlite:{merged_b1}")
    latest_db = tmp_path / "latest-after.db"
    upr("restore", "--repo", str(copy), f"sqlite:{latest_db}")
    with Store(at_b1, create=False) as a, Store(merged_b1, create=False) as b:
        assert list(a.documents()) == list(b.documents())
    with Store(chain_db, create=False) as a, Store(latest_db, create=False) as b:
        assert list(a.documents()) == list(b.documents())  # the newest state is unchanged


def test_streaming_converges_and_survives_a_sigkill_with_rollback_rows(
    spark: Any, node_factory: type[Node], tmp_path: Path, spawned: Callable[..., Any]
) -> None:
    """A live node under load streamed into a sink batch by batch; SIGKILL and restart:
    the query goes on, rollback markers appear, and the rows applied in order (markers
    undoing what is above them) equal the node's state."""
    import subprocess
    import sys
    import time

    from tests.e2e.e2e_helpers import docs

    node = node_factory("--flush-interval", "0.02", partitions=8).start()
    upr("load", node.uri, "--docs", "800", "--update-ratio", "0.3", "--delete-ratio", "0.1")
    persisted = {p: h for p, (_u, h, _p) in wait_persisted(node.uri).items()}
    node.stop()
    node.start("--flush-interval", "3600")  # what follows is never persisted
    batches: list[list[Any]] = []
    df = spark.readStream.format("upr").option("source", node.uri).load()
    q = (
        df.writeStream.foreachBatch(lambda b, i: batches.append(sorted(b.collect(), key=_order)))
        .option("checkpointLocation", str(tmp_path / "ck"))
        .start()
    )
    try:
        load = spawned(sys.executable, "-m", "upr_cli", "load", node.uri, "--docs", "600",
                       "--update-ratio", "0.4", "--seed", "7", "--rate", "2000",
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        load.wait(timeout=60)
        q.processAllAvailable()  # under load, then caught up
        seen = {(r["partition"], r["seq"]) for b in batches for r in b}
        assert any(s > persisted[p] for p, s in seen)  # the sink holds unpersisted writes
        node.kill()
        time.sleep(1.0)  # triggers meanwhile find the node down and wait
        assert q.isActive
        node.start("--flush-interval", "0.02")
        upr("load", node.uri, "--docs", "300", "--update-ratio", "0.5", "--seed", "8",
            "--prefix", "after")  # fmt: skip
        wait_persisted(node.uri)
        q.processAllAvailable()
    finally:
        q.stop()
    markers = [r for b in batches for r in b if r["op"] == "rollback"]
    assert {m["partition"] for m in markers} == set(persisted)
    # an offset is not a snapshot boundary: the marker resets the partition (formats/spark.md §5)
    assert all(m["seq"] == 0 for m in markers)
    assert _apply(batches) == {k: v[0] for k, v in docs(node.uri).items()}


def _order(row: Any) -> tuple[int, int, int]:
    """Within a batch: per partition, the marker first, then rows by seq."""
    return (row["partition"], 0 if row["op"] == "rollback" else 1, row["seq"])


def _apply(batches: list[list[Any]]) -> dict[bytes, bytes]:
    history: dict[int, list[tuple[int, bytes, str, bytes]]] = {}
    for batch in batches:
        for r in batch:
            h = history.setdefault(r["partition"], [])
            if r["op"] == "rollback":
                h[:] = [e for e in h if e[0] <= r["seq"]]
            else:
                h.append((r["seq"], bytes(r["key"]), r["op"], bytes(r["value"])))
    state: dict[bytes, bytes] = {}
    for h in history.values():
        for _seq, key, op, value in sorted(h):
            if op == "mutation":
                state[key] = value
            else:
                state.pop(key, None)
    return state


def _records(repo: Path) -> dict[tuple[int, int], list[tuple[Any, ...]]]:
    """(backup index, partition) -> the records of its segments."""
    r = Repository(repo)
    out: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
    for i, m in enumerate(r.manifests("default")):
        for e in m.partitions:
            recs = out.setdefault((i, e.partition), [])
            for seg in e.segments:
                with SegmentReader(r.segment_path("default", m.backup_id, seg.file)) as reader:
                    recs += [tuple(bytes(x) if isinstance(x, memoryview) else x for x in rec)
                             for rec in reader.records()]  # fmt: skip
    return out


def test_distributed_backup_and_restore_equal_the_local_ones(
    spark: Any, node_factory: type[Node], tmp_path: Path
) -> None:
    import asyncio

    from tests.e2e.e2e_helpers import docs
    from upr_cli.jobs.backup import backup
    from upr_cli.jobs.restore import restore_to_node
    from upr_cli.net.uri import SourceUri
    from upr_cli.spark.distributed import spark_restore, spark_streamer

    src = node_factory("--flush-interval", "0.02", partitions=8, name="src").start()
    uri = SourceUri.parse(src.uri)
    local, dist = tmp_path / "local", tmp_path / "dist"
    for seed in (1, 2):  # a full backup, then an incremental one
        upr("load", src.uri, "--docs", "900", "--update-ratio", "0.3", "--delete-ratio", "0.1",
            "--seed", str(seed))  # fmt: skip
        wait_persisted(src.uri)
        a = asyncio.run(backup(uri, local))
        b = asyncio.run(backup(uri, dist, streamer=spark_streamer(spark, 3, dist)))
        assert (a.items, a.full) == (b.items, b.full) and b.items > 0
    assert _records(local) == _records(dist)
    for m_a, m_b in zip(Repository(local).manifests("default"),
                        Repository(dist).manifests("default"), strict=True):  # fmt: skip
        assert [(e.partition, e.start_seq, e.end_seq, e.uuid) for e in m_a.partitions] == [
            (e.partition, e.start_seq, e.end_seq, e.uuid) for e in m_b.partitions
        ]
    upr("verify", "--repo", str(dist))

    dst_a = node_factory("--flush-interval", "0.02", partitions=8, name="dst-a").start()
    dst_b = node_factory("--flush-interval", "0.02", partitions=8, name="dst-b").start()
    ra = asyncio.run(restore_to_node(dist, SourceUri.parse(dst_a.uri)))
    rb = spark_restore(spark, dist, SourceUri.parse(dst_b.uri), tasks=3)
    assert (ra.written, ra.documents, ra.partitions) == (rb.written, rb.documents, rb.partitions)
    assert docs(dst_a.uri) == docs(dst_b.uri) == docs(src.uri)


def test_a_distributed_restore_checks_every_share_before_any_task_writes(
    spark: Any, node_factory: type[Node], tmp_path: Path
) -> None:
    from tests.e2e.e2e_helpers import docs
    from tests.e2e.test_restore_damage_e2e import PARTS, doc, flip_in_block, write_repo
    from upr_cli.jobs.state import DamagedBackup
    from upr_cli.net.bootstrap import partition_of
    from upr_cli.net.uri import SourceUri
    from upr_cli.spark.distributed import spark_restore

    rows = [doc(i) for i in range(120)]
    repo = write_repo(tmp_path / "repo", rows)
    seg = flip_in_block(repo, PARTS - 1)
    dst = node_factory("--flush-interval", "0.02", partitions=PARTS, name="dst").start()
    uri = SourceUri.parse(dst.uri)
    with pytest.raises(DamagedBackup, match=rf"{seg.name}, block 0: block checksum mismatch"):
        spark_restore(spark, repo, uri, tasks=PARTS)
    assert docs(dst.uri) == {}  # no task wrote its share
    got = spark_restore(spark, repo, uri, tasks=PARTS, skip_corrupt=True)
    assert got.left_out == [PARTS - 1] and got.failure is None
    kept = [r for r in rows if partition_of(bytes(r.key), PARTS) != PARTS - 1]
    assert got.written == len(kept) and sorted(docs(dst.uri)) == sorted(r.key for r in kept)


def test_pyspark_finds_the_source_without_register(repo: Path, tmp_path: Path) -> None:
    """A plain PySpark session (no upr import) reads format("upr") via pyspark_upr."""
    import subprocess
    import sys

    script = tmp_path / "plain.py"
    script.write_text(
        "import os, sys\n"
        "os.environ['PYSPARK_PYTHON'] = sys.executable\n"
        "from pyspark.sql import SparkSession\n"
        "s = (SparkSession.builder.master('local[1]').config('spark.ui.enabled', 'false')\n"
        "     .config('spark.driver.host', '127.0.0.1')\n"
        "     .config('spark.driver.bindAddress', '127.0.0.1').getOrCreate())\n"
        f"print('rows', s.read.format('upr').load({str(repo)!r}).count())\n"
        "s.stop()\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = int(proc.stdout.split("rows ")[1].split()[0])
    assert rows > 500


def test_streaming_into_a_memory_sink_under_load_converges(
    spark: Any, node_factory: type[Node], tmp_path: Path, spawned: Callable[..., Any]
) -> None:
    import subprocess
    import sys

    from tests.e2e.e2e_helpers import docs

    node = node_factory("--flush-interval", "0.02", partitions=8).start()
    upr("load", node.uri, "--docs", "500")
    df = spark.readStream.format("upr").option("source", node.uri).load()
    q = (df.writeStream.format("memory").queryName("upr_rows")
         .option("checkpointLocation", str(tmp_path / "ck")).start())  # fmt: skip
    try:
        load = spawned(sys.executable, "-m", "upr_cli", "load", node.uri, "--docs", "1500",
                       "--update-ratio", "0.4", "--delete-ratio", "0.1", "--seed", "4",
                       "--rate", "3000", stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)  # fmt: skip
        q.processAllAvailable()  # while the load runs
        load.wait(timeout=60)
        q.processAllAvailable()
        rows = spark.sql("SELECT partition, seq, key, op, value FROM upr_rows").collect()
    finally:
        q.stop()
    latest: dict[tuple[int, bytes], tuple[int, str, bytes]] = {}
    for r in rows:  # no rollback here: the latest seq per key is the key's state
        k = (r["partition"], bytes(r["key"]))
        if k not in latest or r["seq"] > latest[k][0]:
            latest[k] = (r["seq"], r["op"], bytes(r["value"]))
    state = {k[1]: v[2] for k, v in latest.items() if v[1] == "mutation"}
    assert state == {k: v[0] for k, v in docs(node.uri).items()}


# -- collections --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def coll_repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, int]]]:
    """Two backups of a node with app.users, app.orders, tmp.x and the default
    collection; tmp.x dropped between them. Yields the repository and the number of
    documents each collection holds at the end (from `upr load`'s summaries)."""
    base = tmp_path_factory.mktemp("spark-coll")
    node = Node(base / "node", "--flush-interval", "0.02", partitions=8)
    node.start()
    try:
        r = base / "repo"
        create(node.uri, "app.users", "app.orders", "tmp.x")
        first = json.loads(upr("load", node.uri, "--docs", "600", "--update-ratio", "0.3",
                               "--delete-ratio", "0.1", "--collections",
                               "app.users,app.orders,tmp.x", "--json").stdout)  # fmt: skip
        upr("load", node.uri, "--docs", "100", "--prefix", "plain")
        wait_persisted(node.uri)
        upr("backup", node.uri, "--repo", str(r))
        drop(node.uri, "tmp.x")
        upr("load", node.uri, "--docs", "100", "--prefix", "late", "--collections", "app.users")
        wait_persisted(node.uri)
        upr("backup", node.uri, "--repo", str(r))
        live = {f"{c['scope']}.{c['collection']}": c["created"] - c["deletes"]
                for c in first["collections"]}  # fmt: skip
        live["app.users"] += 100
        live["_default._default"] = 100
        del live["tmp.x"]
        yield r, live
    finally:
        node.close()


def _counts(df: Any) -> dict[str, int]:
    return {f"{r['scope']}.{r['collection']}": r["count"]
            for r in df.groupBy("scope", "collection").count().collect()}  # fmt: skip


def test_a_read_names_collections_filters_them_and_leaves_a_dropped_one_out_of_the_state(
    spark: Any, coll_repo: tuple[Path, dict[str, int]]
) -> None:
    repo, live = coll_repo
    assert _counts(spark.read.format("upr").load(str(repo))) == live  # tmp.x was dropped
    some = spark.read.format("upr").option("collections", "app").load(str(repo))
    assert _counts(some) == {k: v for k, v in live.items() if k.startswith("app.")}
    # the history keeps the dropped collection's records, under its name
    hist = spark.read.format("upr").option("view", "history").option("collections", "tmp.x")
    rows = hist.load(str(repo)).select("collection_id", "backup_id").distinct().collect()
    assert len({r["collection_id"] for r in rows}) == 1 and len(rows) == 1  # backup 1 only


def test_export_partitioned_by_collection(
    coll_repo: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    repo, live = coll_repo
    out = tmp_path / "by-collection"
    summary = json.loads(upr("spark", "export", "--repo", str(repo), "--output", str(out),
                             "--partition-by", "collection", "--master", "local[1]",
                             "--json", timeout=300).stdout)  # fmt: skip
    assert summary["partition_by"] == "collection" and summary["items"] == sum(live.values())
    assert summary["collection_count"] == len(live) == 3
    dirs = sorted(f"{d.parent.name}/{d.name}" for d in out.glob("scope=*/collection=*"))
    assert dirs == ["scope=_default/collection=_default", "scope=app/collection=orders",
                    "scope=app/collection=users"]  # fmt: skip
    table = ds.dataset(out, format="parquet", partitioning="hive").to_table()
    got: dict[str, int] = {}
    for scope, coll in zip(table.column("scope").to_pylist(),
                           table.column("collection").to_pylist(), strict=True):  # fmt: skip
        got[f"{scope}.{coll}"] = got.get(f"{scope}.{coll}", 0) + 1
    assert got == live
    bad = upr("spark", "export", "--repo", str(repo), "--output", str(tmp_path / "x"),
              "--partition-by", "scope", check=False)  # fmt: skip
    assert bad.returncode == 2 and "--partition-by: 'scope' is not one of" in bad.stderr
    bad = upr("spark", "export", "--repo", str(repo), "--output", str(tmp_path / "x"),
              "--collections", "app.nope", check=False)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        "upr: error: option collections: app.nope: no such collection in the backups up to"
    )


def test_streaming_filters_collections_on_the_source(
    spark: Any, node_factory: type[Node], tmp_path: Path
) -> None:
    from upr_cli.spark.jobs import spark_error

    node = node_factory("--flush-interval", "0.02", partitions=8).start()
    create(node.uri, "app.users", "app.orders")
    summary = json.loads(upr("load", node.uri, "--docs", "400", "--update-ratio", "0.3",
                             "--delete-ratio", "0.1", "--collections", "app.users,app.orders",
                             "--json").stdout)  # fmt: skip
    users = next(c for c in summary["collections"] if c["collection"] == "users")
    upr("load", node.uri, "--docs", "50", "--prefix", "plain")
    df = spark.readStream.format("upr").option("source", node.uri)
    sink = df.option("collections", "app.users").load().writeStream.format("memory")
    q = sink.queryName("upr_users").option("checkpointLocation", str(tmp_path / "ck")).start()
    try:
        q.processAllAvailable()
        rows = spark.sql("SELECT * FROM upr_users").collect()
    finally:
        q.stop()
    assert {(r["scope"], r["collection"], r["collection_id"]) for r in rows} == {
        ("app", "users", users["collection_id"])
    }
    latest: dict[tuple[int, bytes], tuple[int, str]] = {}
    for r in rows:
        k = (r["partition"], bytes(r["key"]))
        if k not in latest or r["seq"] > latest[k][0]:
            latest[k] = (r["seq"], r["op"])
    assert (
        sum(op == "mutation" for _s, op in latest.values()) == users["created"] - users["deletes"]
    )
    bad = df.option("collections", "app.nope").load().writeStream.format("memory")
    with pytest.raises(Exception) as info:  # the driver checks it when the query starts
        q = bad.queryName("upr_nope").option("checkpointLocation", str(tmp_path / "ck2")).start()
        try:
            q.processAllAvailable()
        finally:
            q.stop()
    assert "option collections: unknown collection app.nope" in str(spark_error(info.value))


def test_merge_keeps_collections_apart_and_leaves_a_dropped_one_out(
    spark: Any, coll_repo: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    import shutil

    import pyarrow as pa

    from upr_cli.repo.manifest import chain_manifest, collection_history
    from upr_cli.spark.batch import arrow_schema, read_group
    from upr_cli.spark.merge import merge
    from upr_cli.spark.plan import plan

    def state(repo: Path, at: str) -> dict[tuple[str, str, bytes], tuple[int, bytes]]:
        opts, ms = parse_options({"path": str(repo), "at": at})
        batches = [b for g in plan(opts, ms) for b in read_group(g)]
        rows = pa.Table.from_batches(batches, schema=arrow_schema("state")).to_pylist()
        return {(r["scope"], r["collection"], r["key"]): (r["collection_id"], r["value"])
                for r in rows}  # fmt: skip

    repo, live = coll_repo
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    chain = state(copy, "latest")
    summary = merge(spark, copy)
    manifests = Repository(copy).manifests("default")
    merged = manifests[-1]
    assert str(merged.backup_id) == summary.backup_id
    assert merged.collections == chain_manifest(manifests[:-1])  # tmp.x is gone
    assert state(copy, summary.backup_id) == chain
    per = {f"{s}.{c}": 0 for s, c, _k in chain}
    for s, c, _k in chain:
        per[f"{s}.{c}"] += 1
    assert per == live
    # every record the merge wrote is counted under its collection; none is tmp.x's
    assert sum(c.items + c.deleted for c in merged.collection_items) == summary.records
    gone = [cid for cid, (p, dropped) in collection_history(manifests).items() if dropped]
    assert [str(collection_history(manifests)[cid][0]) for cid in gone] == ["tmp.x"]
    assert gone[0] not in {c.id for c in merged.collection_items}
