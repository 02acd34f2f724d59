"""Spark on an encrypted repository (formats/spark.md §7): the `upr` data source, `upr
spark export`, `upr spark merge` and the distributed backup and restore give what they
give on a plaintext repository; what the executors write is sealed; without the key a
read fails with one line; and the key (the passphrase, the key file's bytes, the data
key in any spelling) appears in no Spark log (log4j at INFO, the Python workers'
output), not in the event log (which holds the Environment the UI shows and the plans)
and not in the data source's options.

One session serves every test. Its JVM, and so every Python worker it starts, has
UPR_PASSPHRASE in its environment, as `upr spark export` run with UPR_PASSPHRASE set
gives it: that opens the repository `phrase` only, so a task that opened `enc` (key
file KEY) with anything but the data key its driver shipped would fail.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from tests.e2e.conftest import Node
from tests.e2e.e2e_helpers import docs, run, set_keys, wait_persisted
from tests.e2e.test_encrypted_e2e import call, ok
from tests.s3.conftest import moto
from upr_cli.repo import Repository, access
from upr_cli.repo.access import Access

__all__ = ["moto"]  # tests/s3's fixture: moto's server on loopback

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::ResourceWarning")

MARKERS = {b"sealed-%d" % i: b'{"body":"SPARK-PLAINTEXT-%d"}' % i for i in range(12)}
PASSPHRASE = b"spark-test-passphrase-" + os.urandom(8).hex().encode()
KEY = os.urandom(32)  # the key file's bytes


class Env:
    def __init__(self, node: Node, base: Path) -> None:
        self.node, self.base = node, base
        self.plain, self.enc, self.key = base / "plain", base / "enc", base / "key"
        self.phrase = base / "phrase"

    def data_keys(self) -> list[bytes]:
        """The data keys of `enc` and `phrase`."""
        out = [*Repository(self.enc, access=Access(key_file=self.key)).keyed_access()
               .data_keys.values()]  # fmt: skip
        with _passphrase():
            out += Repository(self.phrase, access=Access()).keyed_access().data_keys.values()
        assert len(out) == 2
        return out


@contextlib.contextmanager
def _passphrase() -> Iterator[None]:
    """UPR_PASSPHRASE set in this process's environment for the block."""
    os.environ["UPR_PASSPHRASE"] = PASSPHRASE.decode()
    try:
        yield
    finally:
        del os.environ["UPR_PASSPHRASE"]


@contextlib.contextmanager
def _aws_credentials() -> Iterator[None]:
    """moto's test credentials in this process's environment for the block (the JVM
    started in it hands them to its Python workers; the endpoint is an option)."""
    saved = {k: os.environ.get(k) for k in AWS}
    os.environ.update(AWS)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


AWS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """A node, and the same two backups of it (full, incremental) in a plaintext and in
    an encrypted repository (`enc`, its key the file KEY); a backup of the end state in
    `phrase`, encrypted with PASSPHRASE."""
    e = Env(Node(tmp_path_factory.mktemp("spark-enc") / "node", "--flush-interval", "0.02",
                 partitions=4).start(), tmp_path_factory.mktemp("repos"))  # fmt: skip
    e.key.write_bytes(KEY)
    try:
        for seed in (1, 2):
            ok("load", e.node.uri, "--docs", "400", "--update-ratio", "0.3", "--delete-ratio",
               "0.1", "--seed", str(seed))  # fmt: skip
            if seed == 1:
                run(set_keys(e.node.uri, MARKERS))
            wait_persisted(e.node.uri)
            ok("backup", e.node.uri, "--repo", str(e.plain), "--no-progress")
            ok("backup", e.node.uri, "--repo", str(e.enc), "--no-progress", "--encrypt",
               "--key-file", str(e.key))  # fmt: skip
        with _passphrase():
            ok("backup", e.node.uri, "--repo", str(e.phrase), "--no-progress", "--encrypt")
        yield e
    finally:
        if e.node.alive():
            e.node.kill()


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("eventlog")


def _event_log(where: Path) -> dict[str, str]:
    """Spark's event log into `where`, one plain-text file (what the history UI shows)."""
    return {"spark.eventLog.enabled": "true", "spark.eventLog.dir": str(where),
            "spark.eventLog.compress": "false",
            "spark.eventLog.rolling.enabled": "false"}  # fmt: skip


@pytest.fixture(scope="module")
def jvm_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's JVM writes its stdout and stderr (log4j, the Python workers)."""
    return tmp_path_factory.mktemp("jvm") / "output.log"


def _fresh_jvm() -> None:
    """Shut down a JVM an earlier module of this worker started: PySpark keeps one JVM per
    process, and this module's must start with UPR_PASSPHRASE in its environment."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    gateway = SparkContext._gateway
    if gateway is not None:
        gateway.shutdown()
        SparkContext._gateway = None
        SparkContext._jvm = None


@pytest.fixture(scope="module")
def spark(events: Path, jvm_log: Path) -> Iterator[Any]:
    """The session; its JVM started with UPR_PASSPHRASE set and its output to `jvm_log`."""
    from upr_cli.spark.jobs import session

    _fresh_jvm()
    saved = [os.dup(1), os.dup(2)]
    with open(jvm_log, "ab") as f, _passphrase(), _aws_credentials():
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            s = session("local[2]", {"spark.sql.shuffle.partitions": "4"} | _event_log(events),
                        app="upr-enc-tests")  # fmt: skip
        finally:
            for fd, old in ((1, saved[0]), (2, saved[1])):
                os.dup2(old, fd)
                os.close(old)
    yield s
    s.stop()


@pytest.fixture
def keyed(env: Env) -> Iterator[None]:
    """The command's access as `--key-file KEY` records it."""
    access.reset()
    access.configure(key_file=env.key)
    yield
    access.reset()


def _state(spark: Any, repo: Path, **options: str) -> set[tuple[Any, ...]]:
    df = spark.read.format("upr").options(**options).load(str(repo))
    cols = ("partition", "key", "seq", "cas", "value", "collection")
    return {tuple(bytes(v) if isinstance(v, bytearray) else v for v in r)
            for r in df.select(*cols).collect()}  # fmt: skip


def _plaintext(root: Path) -> list[str]:
    """The files under `root` that hold a document body in the clear."""
    return [str(p) for p in root.rglob("*") if p.is_file()
            and any(v in p.read_bytes() for v in MARKERS.values())]  # fmt: skip


def _spellings(secret: bytes) -> list[bytes]:
    b64 = base64.b64encode(secret)
    return [secret, secret.hex().encode(), secret.hex().upper().encode(), b64.rstrip(b"="),
            base64.urlsafe_b64encode(secret).rstrip(b"=")]  # fmt: skip


@pytest.fixture(scope="module")
def plain(spark: Any, env: Env) -> set[tuple[Any, ...]]:
    """The state the plaintext repository's data source gives."""
    rows = _state(spark, env.plain)
    assert len(rows) > 150
    return rows


def test_the_source_and_export_read_an_encrypted_repository_as_a_plain_one(
    spark: Any, env: Env, plain: set[tuple[Any, ...]], tmp_path: Path
) -> None:
    from upr_cli.spark.jobs import export, spark_error
    from upr_cli.spark.plan import SparkOptionError, parse_options

    assert _state(spark, env.enc, keyFile=str(env.key)) == plain
    access.configure(key_file=env.key)  # as `upr spark export --key-file KEY` does
    try:
        got = export(spark, env.enc, tmp_path / "enc")
    finally:
        access.reset()
    table = ds.dataset(tmp_path / "enc", format="parquet", partitioning="hive").to_table()
    cols = ("partition", "key", "seq", "cas", "value", "collection")
    rows = set(zip(*(table.column(c).to_pylist() for c in cols), strict=True))
    assert got.rows == len(plain) and rows == plain
    # without the key: one line, from the data source (its worker has the passphrase
    # of `phrase` only), from its planner and from the command
    with pytest.raises(Exception) as info:
        spark.read.format("upr").load(str(env.enc)).count()
    msg = str(spark_error(info.value))
    assert "\n" not in msg and "key opens none" in msg and str(env.enc) in msg, msg
    with pytest.raises(SparkOptionError) as err:
        parse_options({"path": str(env.enc)})
    assert str(err.value).startswith("option keyFile: ") and "\n" not in str(err.value)
    proc = call("spark", "export", "--repo", str(env.enc), "--output", str(tmp_path / "x"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "key" in proc.stderr and not (tmp_path / "x").exists()


def test_spark_merge_writes_a_sealed_full_backup_equal_to_the_chain(
    spark: Any, env: Env, plain: set[tuple[Any, ...]], tmp_path: Path, keyed: None
) -> None:
    from upr_cli.spark.merge import merge

    repo = tmp_path / "enc"
    shutil.copytree(env.enc, repo)
    before = set(Repository(repo).backups("default"))
    summary = merge(spark, repo)
    assert summary.merged == 2 and summary.backup_id not in before
    merged = _state(spark, repo, keyFile=str(env.key), at=summary.backup_id)
    assert merged == plain
    assert _plaintext(repo) == []
    ok("verify", "--repo", str(repo), "--key-file", str(env.key))


def test_the_source_and_merge_on_an_encrypted_repository_in_s3(
    spark: Any, env: Env, plain: set[tuple[Any, ...]], moto: tuple[str, int],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import boto3

    from upr_cli.spark.merge import merge
    from upr_cli.storage import parse_location

    endpoint = f"http://{moto[0]}:{moto[1]}"
    for k, v in (AWS | {"AWS_ENDPOINT_URL": endpoint}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    boto3.client("s3").create_bucket(Bucket="spark-enc")
    url = "s3://spark-enc/cb"
    key = str(env.key)
    # an encrypted source is copied into a new plaintext one only on purpose
    refused = call("repo", "copy", "--from", str(env.enc), "--to", url, "--from-key-file", key)
    assert refused.returncode == 2 and "--decrypt" in refused.stderr, refused.stderr
    ok("repo", "copy", "--from", str(env.enc), "--to", url, "--from-key-file", key,
       "--key-file", key, "--encrypt")  # fmt: skip
    # the executors open the bucket with the endpoint and the data key their tasks carry
    assert _state(spark, Path(url), keyFile=key, s3Endpoint=endpoint) == plain
    access.reset()
    access.configure(key_file=env.key, s3_endpoint=endpoint)
    try:
        summary = merge(spark, parse_location(url))
    finally:
        access.reset()
    assert summary.merged == 2
    got = _state(spark, Path(url), keyFile=key, s3Endpoint=endpoint, at=summary.backup_id)
    assert got == plain
    ok("verify", "--repo", url, "--key-file", key)
    objects = boto3.resource("s3").Bucket("spark-enc").objects.filter(Prefix="cb/")
    for o in objects:
        data = o.get()["Body"].read()
        assert o.key == "cb/repo.json" or data[:8] == b"UPR-SEAL", o.key
        assert not [v for v in MARKERS.values() if v in data], o.key
    assert not (tmp_path / "s3:").exists()


def test_the_key_is_in_no_spark_log_event_log_or_option(
    spark: Any, env: Env, plain: set[tuple[Any, ...]], events: Path, jvm_log: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    """An export with the passphrase in UPR_PASSPHRASE, one with --key-file."""
    from upr_cli.spark.jobs import access_options, export

    data_keys = env.data_keys()
    spark.sparkContext.setLogLevel("INFO")
    try:
        with _passphrase():
            options = [access_options()]
            by_phrase = export(spark, env.phrase, tmp_path / "phrase", fmt="json")
        access.configure(key_file=env.key)
        options.append(access_options())
        by_file = export(spark, env.enc, tmp_path / "file", fmt="json")
    finally:
        access.reset()
        spark.sparkContext.setLogLevel("ERROR")
    assert by_phrase.rows == by_file.rows == len(plain)
    assert options == [{}, {"keyFile": str(env.key)}]  # a path: no secret
    log = b"".join(p.read_bytes() for p in events.rglob("*") if p.is_file())
    # the event log holds the Environment the UI shows and the plans of both reads
    assert b"SparkListenerEnvironmentUpdate" in log and log.count(b"BatchScan upr") >= 2
    output = jvm_log.read_bytes()
    assert b" INFO " in output  # log4j's lines at INFO, the two exports' among them
    leaks = [f"{what} {s[:6]!r}…" for what, secret in (("passphrase", PASSPHRASE),
             ("key file", KEY), *(("data key", k) for k in data_keys))
             for s in _spellings(secret) if s in log + output + repr(options).encode()]  # fmt: skip
    assert leaks == []


def test_distributed_restore_and_backup_of_an_encrypted_repository(
    spark: Any, env: Env, plain: set[tuple[Any, ...]], tmp_path: Path, keyed: None
) -> None:
    """The module's last Spark test: `upr backup --master` stops the session it ran on."""
    from upr_cli.net.uri import SourceUri
    from upr_cli.spark.distributed import spark_restore
    from upr_cli.store import Store

    dst = Node(tmp_path / "dst", "--flush-interval", "0.02", partitions=4).start()
    try:
        summary = spark_restore(spark, env.enc, SourceUri.parse(dst.uri), tasks=3)
        assert summary.failure is None and summary.written == len(plain)
        assert docs(dst.uri) == docs(env.node.uri)
    finally:
        dst.kill()
    repo, db = tmp_path / "dist", tmp_path / "restored.db"
    k = ("--key-file", str(env.key))
    ok("repo", "init", "--repo", str(repo), "--encrypt", *k)
    ok("backup", env.node.uri, "--repo", str(repo), "--no-progress", "--master", "local[2]",
       "--spark-tasks", "3", *k)  # fmt: skip
    assert list(repo.rglob("*.seg")) and _plaintext(repo) == []  # the executors sealed them
    ok("verify", "--repo", str(repo), *k)
    ok("restore", "--repo", str(repo), f"sqlite:{db}", "--no-progress", *k)
    t = 1 << 64
    with Store(db, create=False) as store:
        got = {(d.partition, d.key, d.seq, d.cas - t if d.cas >= 1 << 63 else d.cas, d.value)
               for d in store.documents(include_deleted=False)}  # fmt: skip
    assert got == {row[:5] for row in plain}


def test_access_using_sets_the_access_of_a_block_and_restores_it() -> None:
    """What a restore task runs under: the shipped access, the previous one after."""
    access.reset()
    shipped = Access(data_keys={"ab": b"k" * 32})
    before = access.current()
    with pytest.raises(RuntimeError), access.using(shipped) as got:
        assert got is shipped and access.current() is shipped
        raise RuntimeError
    assert access.current() is before and "kkkk" not in repr(shipped)
