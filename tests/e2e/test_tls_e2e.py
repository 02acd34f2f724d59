"""`upr serve` with TLS (docs/protocol.md §13): the official SDK writes over
couchbases:// trusting the test CA, `upr tail uprs://` reads the same documents with
--cacert or UPR_CACERT, and every certificate or port mistake is one line on stderr."""

from __future__ import annotations

import asyncio
import datetime
import json
import signal
import sqlite3
from pathlib import Path

import pytest
import trustme

from tests.e2e.conftest import PASSWORD, USER, Node, upr
from tests.e2e.e2e_helpers import run
from upr_cli.net.bootstrap import connect
from upr_cli.net.tls import ClientTls, TlsError
from upr_cli.net.uri import SourceUri


class Certs:
    """A test CA, the node's certificate for 127.0.0.1 and an expired one."""

    def __init__(self, tmp: Path) -> None:
        ca = trustme.CA()
        self.cafile = tmp / "ca.pem"
        ca.cert_pem.write_to_path(str(self.cafile))
        now = datetime.datetime.now(datetime.UTC)
        day = datetime.timedelta(days=1)
        self.good = self._issue(ca, tmp, "node", {})
        past = {"not_before": now - 10 * day, "not_after": now - day}
        self.expired = self._issue(ca, tmp, "expired", past)

    @staticmethod
    def _issue(ca: trustme.CA, tmp: Path, name: str, kw: dict[str, datetime.datetime]) -> list[str]:
        leaf = ca.issue_cert("127.0.0.1", **kw)  # type: ignore[arg-type]
        cert, key = tmp / f"{name}.pem", tmp / f"{name}.key"
        cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(str(key))
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-port", "0"]


def start_tls(node: Node) -> int:
    """Start the node and read its second line: the TLS port."""
    node.start()
    assert node.proc is not None and node.proc.stdout is not None
    line = node.proc.stdout.readline()
    assert line.startswith("listening-tls uprs://127.0.0.1:"), line
    return int(line.rsplit(":", 1)[1].split("/")[0])


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    """Fresh test certificates."""
    return Certs(tmp_path)


def tls_uri(port: int, host: str = "127.0.0.1") -> str:
    """uprs:// with the test credentials."""
    return f"uprs://{USER}:{PASSWORD}@{host}:{port}/default"


def one_line_error(proc: object, *parts: str) -> None:
    """Exit 1 and exactly one line on stderr, holding every part, no traceback."""
    code, err = proc.returncode, proc.stderr  # type: ignore[attr-defined]
    assert code == 1, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("upr: error: "), err
    for part in parts:
        assert part in lines[0], (part, err)


def test_the_sdk_writes_over_tls_and_tail_reads_over_tls(
    node_factory: type[Node], certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.options import ClusterOptions

    node = node_factory("--flush-interval", "0.02", *certs.good)
    tls = start_tls(node)
    # cert_path is the SDK's CA (trust store) file; over TLS it logs in with PLAIN
    auth = PasswordAuthenticator(USER, PASSWORD, cert_path=str(certs.cafile))
    cluster = Cluster(f"couchbases://127.0.0.1:{tls}=kv", ClusterOptions(auth))
    try:
        docs = cluster.bucket("default").default_collection()
        for i in range(20):
            docs.upsert(f"k{i}", {"i": i})
        assert docs.get("k7").content_as[dict] == {"i": 7}
    finally:
        cluster.close()
    want = {f"k{i}": {"i": i} for i in range(20)}

    out = upr("tail", tls_uri(tls), "--until-end", "--format", "json",
              "--cacert", str(certs.cafile)).stdout  # fmt: skip
    assert {r["key"]: r["value"] for r in map(json.loads, out.splitlines())} == want

    monkeypatch.setenv("UPR_CACERT", str(certs.cafile))  # what every command reads
    out = upr("tail", tls_uri(tls), "--until-end", "--format", "json").stdout
    assert {r["key"]: r["value"] for r in map(json.loads, out.splitlines())} == want
    monkeypatch.delenv("UPR_CACERT")

    # mistakes: each one line, exit 1
    one_line_error(upr("tail", tls_uri(tls), "--until-end", check=False),
                   "certificate verify failed", "(use --cacert FILE)")  # fmt: skip
    one_line_error(upr("tail", tls_uri(tls, "localhost"), "--until-end", "--cacert",
                       str(certs.cafile), check=False),
                   "Hostname mismatch, certificate is not valid for 'localhost'")  # fmt: skip
    one_line_error(upr("tail", tls_uri(node.port), "--until-end", "--cacert",
                       str(certs.cafile), check=False),
                   "TLS handshake failed", "a plain data port?")  # fmt: skip
    one_line_error(upr("tail", node.uri.replace(str(node.port), str(tls)), "--until-end",
                       check=False), "during HELLO (a TLS port?")  # fmt: skip

    loose = upr("tail", tls_uri(tls), "--until-end", "--count", "1", "--no-verify")
    assert loose.stdout.count("\n") == 1
    assert "upr: warning: --no-verify: the server certificate is not checked" in loose.stderr


def test_a_node_killed_during_the_tls_handshake_is_not_called_a_plain_port(
    node_factory: type[Node], certs: Certs
) -> None:
    """The ClientHello waits in a stopped node's socket, then the node is killed: the
    connection was closed during the handshake, and the port answers nothing plain
    afterwards, so no "a plain data port?" hint (net/probe.py)."""
    node = node_factory(*certs.good)
    tls = start_tls(node)
    assert node.proc is not None
    uri = SourceUri.parse(tls_uri(tls)).with_tls(ClientTls(str(certs.cafile)))

    async def main() -> str:
        node.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        attempt = asyncio.create_task(connect(uri, timeout=10))
        await asyncio.sleep(0.3)
        node.kill()
        with pytest.raises(TlsError) as info:
            await attempt
        return str(info.value)

    assert run(main()) == f"127.0.0.1:{tls}: the connection was closed during the TLS handshake"


def test_an_expired_certificate_is_one_line(node_factory: type[Node], certs: Certs) -> None:
    tls = start_tls(node_factory(*certs.expired))
    proc = upr("tail", tls_uri(tls), "--until-end", "--cacert", str(certs.cafile), check=False)
    one_line_error(proc, "certificate verify failed: certificate has expired")


def test_load_backup_restore_and_replay_over_tls(
    node_factory: type[Node], certs: Certs, tmp_path: Path
) -> None:
    """Every data command takes uprs:// with --cacert: a load, a backup, a restore into
    a second TLS node with another partition count, and a replay of it; a wrong CA is
    refused by each before anything is written."""
    src = node_factory(*certs.good, name="src")
    src_port = start_tls(src)
    dst = node_factory(*certs.good, partitions=8, name="dst")
    dst_port = start_tls(dst)
    ca = ["--cacert", str(certs.cafile)]
    upr("load", tls_uri(src_port), "--docs", "300", "--update-ratio", "0.2",
        "--delete-ratio", "0.1", *ca)  # fmt: skip
    repo = tmp_path / "repo"
    upr("backup", tls_uri(src_port), "--repo", str(repo), *ca)
    out = json.loads(upr("restore", "--repo", str(repo), tls_uri(dst_port), "--json", *ca).stdout)
    assert out["target_partitions"] == 8 and out["errors"] == 0
    db = tmp_path / "replica.db"
    upr("replay", tls_uri(dst_port), "--into", str(db), *ca)
    src_tail = upr("tail", tls_uri(src_port), "--until-end", "--format", "json", *ca).stdout
    live = {}
    for line in src_tail.splitlines():
        row = json.loads(line)
        if "event" not in row:  # a change (events also have an op)
            live[row["key"]] = row["op"] == "mutation"
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT key FROM documents WHERE NOT deleted")
        replayed = {bytes(k).decode() if isinstance(k, bytes) else k for (k,) in rows}
    conn.close()
    assert replayed == {k for k, alive in live.items() if alive}
    wrong = trustme.CA()
    other = tmp_path / "other-ca.pem"
    wrong.cert_pem.write_to_path(str(other))
    for cmd in (["restore", "--repo", str(repo), tls_uri(dst_port)],
                ["replay", tls_uri(dst_port), "--into", str(tmp_path / "x.db")]):  # fmt: skip
        proc = upr(*cmd, "--cacert", str(other), check=False)
        one_line_error(proc, "certificate verify failed")
