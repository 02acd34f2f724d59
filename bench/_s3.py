"""A local S3-compatible server for the benchmarks: moto's standalone server
(`moto_server`, from the `moto[server]` the dev lock pins) on a free loopback port, its
log in a file, started and stopped by the benchmark.

Theory of operation: the server is started with `-p 0` and names its port in its log
("Running on http://127.0.0.1:PORT"), which is polled (no port picked in advance, so no
race with another process for it; the log goes to a file, never an unread pipe, which
moto's request lines would fill). moto keeps every object in memory: the benchmark
deletes a repository's objects once it is done with it. The credentials are moto's
any-value test ones; the environment the `upr` commands get carries them and nothing of
the caller's AWS settings (profile, session token, endpoint).

The references an s3:// repository is held to (`bare_put`, `bare_get`): the same objects
moved with nothing else done, one boto3 request each, as many at once as the commands'
--transfers, so the time a backup or restore spends beyond them is the client's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _node import stop_process

#: moto answers any credentials; the region is what the client signs for
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}
#: the caller's AWS settings that would otherwise reach the commands
_DROPPED = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
            "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")  # fmt: skip


class Bare(NamedTuple):
    """A bare transfer: objects, bytes, seconds."""

    objects: int
    size: int
    seconds: float


def moto_server() -> str:
    """The `moto_server` script beside this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).parent / "moto_server"
    found = str(here) if here.exists() else shutil.which("moto_server")
    if found is None:
        raise SystemExit("moto_server not found: install the dev lock (moto[server])")
    return found


class S3Server:
    """moto's server on 127.0.0.1 and a boto3 client of it; `env` is the environment for
    `upr` commands that use it (with `--s3-endpoint endpoint`)."""

    def __init__(self, log: Path, timeout: float = 30.0) -> None:
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [moto_server(), "-H", "127.0.0.1", "-p", "0"],
                stdout=out, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        self.endpoint = ""
        while not self.endpoint:
            for line in log.read_text(errors="replace").splitlines():
                if "Running on http://127.0.0.1:" in line:
                    self.endpoint = line[line.index("http://") :].split()[0].rstrip("/")
            if self.proc.poll() is not None or time.monotonic() > deadline:
                stop_process(self.proc, 5)
                raise SystemExit(f"moto_server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        self.env = {k: v for k, v in os.environ.items() if k not in _DROPPED} | CREDENTIALS
        self.client = self._client()

    def _client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
            config=Config(max_pool_connections=32),
        )

    def bare_put(self, bucket: str, prefix: str, root: Path, workers: int) -> Bare:
        """One PutObject per file under the directory `root` (its bytes read before the
        clock starts), `workers` at once: the server's and the client library's speed
        with nothing else done, the reference a backup into the bucket is held to."""
        files = sorted(p for p in root.rglob("*") if p.is_file())
        bodies = [(f"{prefix}/{p.relative_to(root)}", p.read_bytes()) for p in files]

        def put(item: tuple[str, bytes]) -> None:
            self.client.put_object(Bucket=bucket, Key=item[0], Body=item[1])

        t = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(put, bodies))
        return Bare(len(bodies), sum(len(b) for _k, b in bodies), time.perf_counter() - t)

    def bare_get(self, bucket: str, prefix: str, workers: int) -> Bare:
        """One GetObject of each object under `prefix`, read whole, `workers` at once
        (the listing before the clock starts): the reference a restore is held to."""
        keys = [o["Key"] for o in self._objects(bucket, prefix)]

        def get(key: str) -> int:
            return len(self.client.get_object(Bucket=bucket, Key=key)["Body"].read())

        t = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            size = sum(pool.map(get, keys))
        return Bare(len(keys), size, time.perf_counter() - t)

    def create_bucket(self, bucket: str) -> None:
        """A new, empty bucket."""
        self.client.create_bucket(Bucket=bucket)

    def _objects(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o for page in pages for o in page.get("Contents", [])]

    def usage(self, bucket: str, prefix: str) -> tuple[int, int]:
        """(objects, bytes) under `prefix`."""
        objects = self._objects(bucket, prefix)
        return len(objects), sum(int(o["Size"]) for o in objects)

    def delete_prefix(self, bucket: str, prefix: str) -> None:
        """Delete every object under `prefix` (moto keeps them in memory)."""
        keys = [{"Key": o["Key"]} for o in self._objects(bucket, prefix)]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000]})

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 5 s."""
        stop_process(self.proc, 5)
