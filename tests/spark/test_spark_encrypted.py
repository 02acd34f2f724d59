"""Spark on an encrypted repository (formats/spark.md §6): the `upr` data source, `upr
spark export`, `upr spark merge` and the distributed backup and restore give what they
give on a plaintext repository; what the executors write is sealed; without a key a
read fails with one line; and the key (the passphrase, the data key in any spelling)
appears in no Spark log, not in the event log (which holds the Environment the UI shows)
and not in the data source's options.

One module session (event log on) serves every test but one: the export with the
passphrase in UPR_PASSPHRASE runs as a real `upr spark export` process, since the Python
worker that plans inherits its environment from the driver that started the JVM.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from tests.e2e.conftest import Node
from tests.e2e.e2e_helpers import docs, run, set_keys, wait_persisted
from tests.e2e.test_encrypted_e2e import call, ok
from upr_cli.repo import Repository, access
from upr_cli.repo.access import Access

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::ResourceWarning")

MARKERS = {b"sealed-%d" % i: b'{"body":"SPARK-PLAINTEXT-%d"}' % i for i in range(12)}
PASSPHRASE = b"spark-test-passphrase-" + os.urandom(8).hex().encode()


class Env:
    def __init__(self, node: Node, base: Path) -> None:
        self.node, self.base = node, base
        self.plain, self.enc, self.key = base / "plain", base / "enc", base / "key"

    def data_key(self) -> bytes:
        keys = Repository(self.enc, access=Access(key_file=self.key)).keyed_access().data_keys
        (key,) = keys.values()
        return key


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """A node, and the same two backups of it (full, incremental) in a plaintext and in
    an encrypted repository (its key: a key file holding PASSPHRASE)."""
    e = Env(Node(tmp_path_factory.mktemp("spark-enc") / "node", "--flush-interval", "0.02",
                 partitions=8).start(), tmp_path_factory.mktemp("repos"))  # fmt: skip
    e.key.write_bytes(PASSPHRASE + b"\n")
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
            "spark.eventLog.compress": "false", "spark.eventLog.rolling.enabled": "false"}  # fmt: skip


@pytest.fixture(scope="module")
def spark(events: Path) -> Iterator[Any]:
    from upr_cli.spark.jobs import session

    s = session("local[2]", {"spark.sql.shuffle.partitions": "4"} | _event_log(events),
                app="upr-enc-tests")  # fmt: skip
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


def _leaks(blob: bytes, data_key: bytes) -> list[str]:
    return [f"{what} {s[:6]!r}…" for what, secret in (("passphrase", PASSPHRASE),
            ("data key", data_key)) for s in _spellings(secret) if s in blob]  # fmt: skip


def test_the_source_and_export_read_an_encrypted_repository_as_a_plain_one(
    spark: Any, env: Env, tmp_path: Path
) -> None:
    from upr_cli.spark.jobs import export, spark_error

    plain = _state(spark, env.plain)
    assert len(plain) > 150
    assert _state(spark, env.enc, keyFile=str(env.key)) == plain
    history = spark.read.format("upr").option("view", "history")
    assert (history.option("keyFile", str(env.key)).load(str(env.enc)).count()
            == history.load(str(env.plain)).count())  # fmt: skip
    access.configure(key_file=env.key)  # as `upr spark export --key-file KEY` does
    try:
        got = export(spark, env.enc, tmp_path / "enc")
    finally:
        access.reset()
    want = export(spark, env.plain, tmp_path / "plain")
    assert got.rows == want.rows == len(plain)
    cols = ["partition", "key", "seq", "value"]
    tables = [ds.dataset(tmp_path / n, format="parquet", partitioning="hive").to_table(cols)
              for n in ("enc", "plain")]  # fmt: skip
    assert tables[0].sort_by([("key", "ascending")]) == tables[1].sort_by([("key", "ascending")])
    # without a key: one line, from the data source and from the command
    with pytest.raises(Exception) as info:
        spark.read.format("upr").load(str(env.enc)).count()
    msg = str(spark_error(info.value))
    assert "\n" not in msg and "key" in msg and str(env.enc) in msg, msg
    proc = call("spark", "export", "--repo", str(env.enc), "--to", str(tmp_path / "x"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "key" in proc.stderr and not (tmp_path / "x").exists()


def test_spark_merge_writes_a_sealed_full_backup_equal_to_the_chain(
    spark: Any, env: Env, tmp_path: Path, keyed: None
) -> None:
    from upr_cli.spark.merge import merge

    repo = tmp_path / "enc"
    shutil.copytree(env.enc, repo)
    before = set(Repository(repo).backups("default"))
    summary = merge(spark, repo)
    assert summary.merged == 2 and summary.backup_id not in before
    merged = _state(spark, repo, keyFile=str(env.key), at=summary.backup_id)
    assert merged == _state(spark, env.plain)
    assert _plaintext(repo) == []
    ok("verify", "--repo", str(repo), "--key-file", str(env.key))


def test_distributed_backup_and_restore_of_an_encrypted_repository(
    spark: Any, env: Env, tmp_path: Path, keyed: None
) -> None:
    from upr_cli.jobs.backup import backup
    from upr_cli.net.uri import SourceUri
    from upr_cli.spark.distributed import spark_restore, spark_streamer

    repo = tmp_path / "dist"
    ok("repo", "init", "--repo", str(repo), "--encrypt", "--key-file", str(env.key))
    access.configure(key_file=env.key)  # `ok` forgets the settings it ran with
    uri = SourceUri.parse(env.node.uri)
    got = asyncio.run(backup(uri, repo, streamer=spark_streamer(spark, 3, repo)))
    assert got.full and got.items > 150
    segments = list(repo.rglob("*.seg*"))
    assert segments and _plaintext(repo) == []  # the executors wrote sealed files only
    assert _state(spark, repo, keyFile=str(env.key)) == _state(spark, env.plain)
    dst = Node(tmp_path / "dst", "--flush-interval", "0.02", partitions=8).start()
    try:
        summary = spark_restore(spark, repo, SourceUri.parse(dst.uri), tasks=3)
        assert summary.failure is None and summary.written > 150
        assert docs(dst.uri) == docs(env.node.uri)
    finally:
        dst.kill()


def test_the_key_is_in_no_spark_log_event_log_or_option(
    spark: Any, env: Env, events: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """--key-file in this process's session; UPR_PASSPHRASE in a real `upr` process."""
    from upr_cli.spark.jobs import access_options, export

    data_key = env.data_key()
    access.configure(key_file=env.key)
    try:
        options = access_options()
        summary = export(spark, env.enc, tmp_path / "k", fmt="json")
    finally:
        access.reset()
    assert summary.rows > 150 and options == {"keyFile": str(env.key)}
    out, err = capfd.readouterr()
    logs = sorted(p for p in events.rglob("*") if p.is_file())
    log = b"".join(p.read_bytes() for p in logs)
    # the event log holds the Environment the UI shows and the plans of the read
    assert b"SparkListenerEnvironmentUpdate" in log and b"BatchScan upr" in log, logs
    blob = log + out.encode() + err.encode() + repr(options).encode()
    assert _leaks(blob, data_key) == []

    ev = tmp_path / "events"
    ev.mkdir()
    envvars = {k: v for k, v in os.environ.items() if not k.startswith("UPR_")}
    proc = subprocess.run(
        [sys.executable, "-m", "upr_cli", "spark", "export", "--repo", str(env.enc), "--to",
         str(tmp_path / "p"), "--master", "local[1]", "--json",
         *(a for k, v in _event_log(ev).items() for a in ("--conf", f"{k}={v}"))],
        capture_output=True, timeout=300, check=False,
        env=envvars | {"UPR_PASSPHRASE": PASSPHRASE.decode()},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert b'"items": %d' % summary.rows in proc.stdout
    log = b"".join(p.read_bytes() for p in ev.rglob("*") if p.is_file())
    assert b"SparkListenerEnvironmentUpdate" in log and b"BatchScan upr" in log
    assert _leaks(log + proc.stdout + proc.stderr, data_key) == []
