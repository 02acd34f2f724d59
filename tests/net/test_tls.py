"""TLS on the data port (docs/protocol.md §13): URIs, the cluster map's kvSSL ports,
the client's certificate checks and their one-line errors, and PLAIN over TLS, against
an in-process `NodeServer` listening on both ports."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trustme

from tests.dcp.inprocess import run
from upr_cli.net.bootstrap import BootstrapError, connect, map_nodes
from upr_cli.net.connection import Connection, ConnectionClosed
from upr_cli.net.tls import CertificateError, ClientTls, TlsConfigError, TlsError
from upr_cli.net.uri import SourceUri
from upr_cli.node.server import NodeConfig, NodeServer

SCENARIO_S = 10.0  # TLS handshakes and key loading on a shared, slow machine


class Pki:
    """A test CA and PEM files for the node: good, expired, for another name."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.ca = trustme.CA()
        self.cafile = self._write("ca.pem", self.ca.cert_pem.bytes())
        now = datetime.datetime.now(datetime.UTC)
        self.good = self._issue("good", "127.0.0.1")
        self.expired = self._issue("expired", "127.0.0.1", not_before=now - _DAYS * 10,
                                   not_after=now - _DAYS)  # fmt: skip
        self.other_name = self._issue("other", "db.example.com")

    def _write(self, name: str, data: bytes) -> str:
        path = self.dir / name
        path.write_bytes(data)
        return str(path)

    def _issue(self, name: str, *names: str, **kw: datetime.datetime) -> tuple[str, str]:
        leaf = self.ca.issue_cert(*names, **kw)  # type: ignore[arg-type]
        cert = self._write(f"{name}.pem", b"".join(p.bytes() for p in leaf.cert_chain_pems))
        return cert, self._write(f"{name}.key", leaf.private_key_pem.bytes())


_DAYS = datetime.timedelta(days=1)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A fresh CA with the node's certificates."""
    return Pki(tmp_path)


@asynccontextmanager
async def tls_node(tmp: Path, cert: tuple[str, str]) -> AsyncIterator[NodeServer]:
    """A node on free ports, plain and TLS; admin/pw, and (--no-auth) PLAIN for anyone."""
    config = NodeConfig(data_dir=tmp / "node", port=0, partitions=4, users={"admin": "pw"},
                        no_auth=True, tls_cert=Path(cert[0]), tls_key=Path(cert[1]),
                        tls_port=0)  # fmt: skip
    server = NodeServer(config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def tls_uri(server: NodeServer, cafile: str | None, *, password: str = "pw") -> SourceUri:
    """uprs:// to the node's TLS port, trusting `cafile`."""
    uri = SourceUri.parse(f"uprs://admin:{password}@127.0.0.1:{server.tls_port}/default")
    return uri.with_tls(ClientTls(cafile=cafile))


# -- URIs -------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["uprs", "couchbases", "UPRS"])
def test_tls_schemes_default_to_port_11207(scheme: str) -> None:
    uri = SourceUri.parse(f"{scheme}://127.0.0.1,h2:1/b")
    assert uri.secure and uri.port == 11207 and uri.seeds == (("h2", 1),)
    assert uri.redacted() == f"{scheme.lower()}://127.0.0.1:11207,h2:1/b"


def test_plain_schemes_stay_on_11210() -> None:
    for scheme in ("upr", "couchbase"):
        uri = SourceUri.parse(f"{scheme}://127.0.0.1/b")
        assert not uri.secure and uri.port == 11210


def test_tls_settings_follow_the_uri_to_other_nodes() -> None:
    tls = ClientTls(cafile="/ca.pem")
    uri = SourceUri.parse("uprs://u:p@a/b").with_tls(tls)
    assert uri.at("c", 2).tls == tls and uri.rebase("c", 2).tls == tls


def test_settings_come_from_the_environment() -> None:
    env = {"UPR_CACERT": "/ca.pem", "UPR_CERT": "/c.pem", "UPR_KEY": "/c.key"}
    assert ClientTls.from_env(env) == ClientTls("/ca.pem", "/c.pem", "/c.key")
    assert ClientTls.from_env({}) == ClientTls()


# -- the cluster map ------------------------------------------------------------------------

MAP = {
    "vBucketServerMap": {"serverList": ["$HOST:11210", "10.0.0.2:11210"],
                         "vBucketMap": [[0], [1], [-1]]},
    "nodesExt": [
        {"thisNode": True, "services": {"kv": 11210, "kvSSL": 11207}},
        {"hostname": "10.0.0.2", "services": {"kv": 11210, "kvSSL": 21207}},
    ],
}  # fmt: skip


def test_a_tls_client_takes_the_kvssl_ports_of_the_map() -> None:
    plain = map_nodes(SourceUri.parse("upr://10.0.0.1/b"), MAP)
    tls = map_nodes(SourceUri.parse("uprs://10.0.0.1/b"), MAP)
    assert plain == ([("10.0.0.1", 11210), ("10.0.0.2", 11210)], [0, 1, -1])
    assert tls == ([("10.0.0.1", 11207), ("10.0.0.2", 21207)], [0, 1, -1])


def test_a_node_without_kvssl_is_an_error_not_a_plain_fallback() -> None:
    config = {**MAP, "nodesExt": [MAP["nodesExt"][0]]}  # type: ignore[index]
    with pytest.raises(BootstrapError, match=r"node 10\.0\.0\.2:11210 no TLS data port"):
        map_nodes(SourceUri.parse("uprs://10.0.0.1/b"), config)


# -- settings that cannot be used ---------------------------------------------------------


def test_unusable_files_are_usage_errors(tmp_path: Path, pki: Pki) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(TlsConfigError, match=r"cannot read .*missing\.pem: no such file"):
        ClientTls(cafile=str(tmp_path / "missing.pem")).context()
    with pytest.raises(TlsConfigError, match="is not a PEM CA file"):
        ClientTls(cafile=str(junk)).context()
    with pytest.raises(TlsConfigError, match="--cert and --key go together"):
        ClientTls(certfile=pki.good[0]).context()
    with pytest.raises(TlsConfigError, match="not a PEM certificate and matching key"):
        ClientTls(certfile=pki.good[0], keyfile=str(junk)).context()


def test_the_node_refuses_a_certificate_without_its_key(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(Exception, match="--tls-cert and --tls-key go together"):
        NodeServer(NodeConfig(data_dir=tmp_path, no_auth=True, tls_cert=Path(pki.good[0])))


# -- over the wire ----------------------------------------------------------------------------


def test_a_verified_tls_session_uses_plain_and_is_told_the_tls_port(
    tmp_path: Path, pki: Pki
) -> None:
    async def scenario() -> None:
        async with tls_node(tmp_path, pki.good) as server:
            # a --no-auth node takes any password with PLAIN, SCRAM only the real one:
            # a wrong password that logs in proves PLAIN was used over TLS
            s = await connect(tls_uri(server, pki.cafile, password="any"))
            try:
                assert s.conn.name.startswith("uprs://")
                assert s.config["nodesExt"][0]["services"] == {
                    "kv": server.port, "kvSSL": server.tls_port}  # fmt: skip
                assert map_nodes(s.uri, s.config)[0] == [("127.0.0.1", server.tls_port)]
                assert await s.conn.stats("vbucket-seqno")
            finally:
                await s.conn.aclose()
            plain = SourceUri.parse(f"upr://admin:any@127.0.0.1:{server.port}/default")
            with pytest.raises(BootstrapError, match="authentication failed"):
                await connect(plain)  # SCRAM on the plain port: the real password only

    run(scenario(), SCENARIO_S)


@pytest.mark.parametrize(
    ("which", "trusted", "message"),
    [
        ("good", False, r"certificate verify failed: unable to get local issuer certificate "
                        r"\(use --cacert FILE\)$"),
        ("expired", True, r"certificate verify failed: certificate has expired$"),
        ("other_name", True, r"certificate verify failed: IP address mismatch, certificate "
                             r"is not valid for '127\.0\.0\.1'$"),
    ],
)  # fmt: skip
def test_a_certificate_that_does_not_verify_is_one_line(
    tmp_path: Path, pki: Pki, which: str, trusted: bool, message: str
) -> None:
    async def scenario() -> None:
        async with tls_node(tmp_path, getattr(pki, which)) as server:
            with pytest.raises(CertificateError, match=message) as info:
                await connect(tls_uri(server, pki.cafile if trusted else None))
            assert "\n" not in str(info.value)
            assert str(info.value).startswith(f"127.0.0.1:{server.tls_port}: ")

    run(scenario(), SCENARIO_S)


def test_no_verify_connects_to_any_certificate(tmp_path: Path, pki: Pki) -> None:
    async def scenario() -> None:
        async with tls_node(tmp_path, pki.expired) as server:
            uri = tls_uri(server, None).with_tls(ClientTls(verify=False))
            s = await connect(uri)
            await s.conn.aclose()

    run(scenario(), SCENARIO_S)


def test_wrong_ports_fail_fast_with_a_hint(tmp_path: Path, pki: Pki) -> None:
    async def scenario() -> None:
        async with tls_node(tmp_path, pki.good) as server:
            tls_on_plain = tls_uri(server, pki.cafile).at("127.0.0.1", server.port)
            with pytest.raises(TlsError, match=r"TLS handshake failed \(the peer closed the "
                               r"connection\): a plain data port\?"):  # fmt: skip
                await connect(tls_on_plain, timeout=5.0)
            plain_on_tls = SourceUri.parse(f"upr://admin:pw@127.0.0.1:{server.tls_port}/default")
            with pytest.raises(ConnectionClosed, match=r"during HELLO \(a TLS port\? it takes "
                               r"uprs://"):  # fmt: skip
                await connect(plain_on_tls, timeout=5.0)

    run(scenario(), SCENARIO_S)


def test_a_client_certificate_is_presented_to_a_server_that_asks(pki: Pki) -> None:
    client = pki.ca.issue_cert("upr-client")
    cert = pki._write("client.pem", client.cert_chain_pems[0].bytes())
    key = pki._write("client.key", client.private_key_pem.bytes())
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(*pki.good)
    server_ctx.load_verify_locations(pki.cafile)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    seen: list[object] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(writer.get_extra_info("peercert"))
        writer.close()

    async def scenario() -> None:
        listener = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
        port = listener.sockets[0].getsockname()[1]
        try:
            tls = ClientTls(cafile=pki.cafile, certfile=cert, keyfile=key)
            conn = await Connection.open("127.0.0.1", port, tls=tls.context())
            await conn.aclose()
        finally:
            listener.close()
            await listener.wait_closed()

    run(scenario(), SCENARIO_S)
    assert seen and "upr-client" in str(seen[0])


def test_a_bucketless_session_gets_the_global_config_with_the_tls_port(
    tmp_path: Path, pki: Pki
) -> None:
    async def scenario() -> None:
        async with tls_node(tmp_path, pki.good) as server:
            text = f"uprs://admin:pw@127.0.0.1:{server.tls_port}"
            uri = SourceUri.parse(text, bucket_optional=True).with_tls(ClientTls(pki.cafile))
            s = await connect(uri)
            await s.conn.aclose()
            assert "vBucketServerMap" not in s.config and "name" not in s.config
            assert s.config["nodesExt"] == [{"thisNode": True, "services": {
                "kv": server.port, "kvSSL": server.tls_port}}]  # fmt: skip

    run(scenario(), SCENARIO_S)
