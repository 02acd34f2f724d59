"""The S3-compatible server of the s3:// tests: moto's standalone server (`moto[server]`,
a locked version that answers 412 to failed conditional writes) on a free loopback port,
one per test module, behind a fault-injecting proxy (`fault_proxy.py`); each test gets
its own bucket and the AWS settings in its environment (subprocesses inherit them)."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.e2e_helpers import reap
from tests.s3.fault_proxy import FaultProxy

_buckets = itertools.count(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def moto() -> Iterator[tuple[str, int]]:
    """moto's server on loopback, until the module's tests are done."""
    script = Path(sys.executable).with_name("moto_server")
    for _attempt in range(5):
        port = _free_port()
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "moto.server"]
        proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        if proc.poll() is None:
            break
        reap(proc)
    else:
        raise RuntimeError("moto_server did not start")
    try:
        yield ("127.0.0.1", port)
    finally:
        reap(proc)


@pytest.fixture(scope="module")
def proxy(moto: tuple[str, int]) -> Iterator[FaultProxy]:
    """The fault-injecting proxy in front of moto."""
    p = FaultProxy(moto).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def s3(proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """A new bucket; the AWS settings in the environment (through the proxy, its faults
    and records cleared); the working directory `tmp_path`, where no `s3:` directory
    may appear. Returns the bucket's name."""
    proxy.clear()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": proxy.url,
           "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials")}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "UPR_LEASE_SECONDS", "UPR_S3_READ_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    import boto3

    name = f"test-{os.getpid()}-{next(_buckets)}"
    boto3.client(
        "s3", endpoint_url=f"http://{proxy.upstream[0]}:{proxy.upstream[1]}"
    ).create_bucket(Bucket=name)
    yield name
    assert not (tmp_path / "s3:").exists(), "a local directory named s3: was created"
