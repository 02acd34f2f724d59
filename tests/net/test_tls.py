"""TLS on the data port (docs/protocol.md §13): URIs, the cluster map's kvSSL ports,
the client's certificate checks and their one-line errors, PLAIN over TLS, and client
certificates that log a connection in (docs/protocol.md §13.5), against an
in-process `NodeServer` listening on both ports; the TLS alerts a server sends about a
client certificate come from an OpenSSL peer that sends them (as Couchbase does)."""

from __future__ import annotations

import datetime
import logging
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.dcp.inprocess import run
from upr_cli.net.bootstrap import BootstrapError, connect, map_nodes
from upr_cli.net.connection import ConnectionClosed
from upr_cli.net.tls import (
    CertificateError,
    ClientCertificateError,
    ClientTls,
    TlsConfigError,
    TlsError,
    server_context,
)
from upr_cli.net.uri import SourceUri
from upr_cli.node.server import NodeConfig, NodeServer, ServeUsageError

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

    def client(self, cn: str, ca: trustme.CA | None = None, **kw: datetime.datetime) -> ClientTls:
        """Settings with a client certificate whose subject CN is `cn`, from `ca` (by
        default the test CA, which the node trusts for clients too), and a DNS
        subjectAltName: current `cryptography` refuses a certificate with none."""
        leaf = (ca or self.ca).issue_cert(f"{cn}.clients.upr.test", common_name=cn, **kw)  # type: ignore[arg-type]
        name = f"client-{cn}-{id(leaf)}"
        cert = self._write(f"{name}.pem", b"".join(p.bytes() for p in leaf.cert_chain_pems))
        key = self._write(f"{name}.key", leaf.private_key_pem.bytes())
        return ClientTls(cafile=self.cafile, certfile=cert, keyfile=key)

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
async def tls_node(tmp: Path, cert: tuple[str, str], **options: Any) -> AsyncIterator[NodeServer]:
    """A node on free ports, plain and TLS; admin/pw, and (--no-auth) PLAIN for anyone;
    `options` change its NodeConfig."""
    config = NodeConfig(data_dir=tmp / "node", port=0, partitions=4, users={"admin": "pw"},
                        no_auth=True, tls_cert=Path(cert[0]), tls_key=Path(cert[1]),
                        tls_port=0)  # fmt: skip
    for name, value in options.items():
        setattr(config, name, value)
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


def test_a_ca_file_that_does_not_verify_the_node_is_named(tmp_path: Path, pki: Pki) -> None:
    """--cacert (or UPR_CACERT) given: "use --cacert" would not help; the error names
    the file that did not verify the node's certificate."""
    other = str(tmp_path / "other-ca.pem")
    trustme.CA().cert_pem.write_to_path(other)

    async def scenario() -> None:
        async with tls_node(tmp_path, pki.good) as server:
            with pytest.raises(CertificateError) as info:
                await connect(tls_uri(server, other))
            assert str(info.value) == (
                f"127.0.0.1:{server.tls_port}: certificate verify failed: unable to get "
                f"local issuer certificate (the CA file {other} does not verify the node's "
                "certificate)"
            )

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


# -- client certificates (docs/protocol.md §13.5) -------------------------------------------


def cert_node(tmp: Path, pki: Pki, mode: str | None = "mandatory") -> Any:
    """A node that logs users in (no --no-auth) and checks client certificates."""
    return tls_node(tmp, pki.good, no_auth=False, tls_client_ca=Path(pki.cafile),
                    tls_client_auth=mode)  # fmt: skip


def cert_uri(server: NodeServer, tls: ClientTls, login: str = "") -> SourceUri:
    """uprs:// to the node's TLS port with `tls`; no user unless `login` ("user:pw")."""
    at = f"{login}@" if login else ""
    return SourceUri.parse(f"uprs://{at}127.0.0.1:{server.tls_port}/default").with_tls(tls)


def test_the_node_asks_for_client_certificates_only_with_a_client_ca(pki: Pki) -> None:
    assert server_context(*pki.good).verify_mode == ssl.CERT_NONE
    enable = server_context(*pki.good, pki.cafile)
    assert enable.verify_mode == ssl.CERT_OPTIONAL
    assert len(enable.get_ca_certs()) == 1  # that CA alone, not the system store
    assert server_context(*pki.good, pki.cafile, mandatory=True).verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tls_client_auth": "mandatory"}, r"^--tls-client-auth needs --tls-client-ca FILE$"),
        ({"tls_client_ca": "CA", "tls_client_auth": "required"},
         r"^--tls-client-auth: enable or mandatory, not 'required'$"),
        ({"tls_client_ca": "CA", "tls_cert": None, "tls_key": None},
         r"^--tls-client-ca needs --tls-cert and --tls-key \(the TLS port\)$"),
        ({"tls_client_ca": "missing.pem"}, r"^--tls-client-ca: cannot read .*missing\.pem: no "
                                           r"such file$"),
        ({"tls_client_ca": "KEY"}, r"^--tls-client-ca: .*\.key is not a PEM CA file \("),
    ],
)  # fmt: skip
def test_client_certificate_options_that_cannot_work_are_usage_errors(
    tmp_path: Path, pki: Pki, options: dict[str, Any], message: str
) -> None:
    config = NodeConfig(data_dir=tmp_path, no_auth=True, tls_cert=Path(pki.good[0]),
                        tls_key=Path(pki.good[1]))  # fmt: skip
    files = {"CA": pki.cafile, "KEY": pki.good[1], "missing.pem": str(tmp_path / "missing.pem")}
    for name, value in options.items():
        setattr(config, name, Path(files[value]) if name == "tls_client_ca" else value)
    with pytest.raises(ServeUsageError, match=message) as info:
        NodeServer(config)
    assert info.value.exit_code == 2


def test_a_mandatory_certificate_logs_in_as_the_user_its_cn_names(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with cert_node(tmp_path, pki) as server:
            # no user in the URI: no SASL, and SELECT_BUCKET (which needs a login) works
            s = await connect(cert_uri(server, pki.client("admin")))
            try:
                assert s.config["vBucketServerMap"]["vBucketMap"]
                assert await s.conn.stats("vbucket-seqno")
            finally:
                await s.conn.aclose()
            # the node refuses these in the handshake, or (a CN that names no user) right
            # after it, and closes without a TLS alert: the client says what it can tell
            with pytest.raises(ClientCertificateError, match=r"after the TLS handshake: it "
                               r"may require a client certificate \(give --cert FILE --key "
                               r"FILE, or set UPR_CERT and UPR_KEY\)$"):  # fmt: skip
                await connect(cert_uri(server, ClientTls(cafile=pki.cafile)))
            for tls in (pki.client("admin", trustme.CA()), pki.client("nobody")):
                with pytest.raises(ClientCertificateError, match=r"after the TLS handshake: "
                                   r"it did not accept the client certificate \(a CA it "
                                   r"does not trust, or a subject CN that names none of "
                                   r"its users\)$"):  # fmt: skip
                    await connect(cert_uri(server, tls))
            # a certificate's login is final: SASL is refused (as kv_engine refuses it)
            with pytest.raises(BootstrapError, match=r"logged this connection in by its "
                               r"client certificate and refuses SASL: leave the user name "
                               r"out of the URI$"):  # fmt: skip
                await connect(cert_uri(server, pki.client("admin"), "admin:pw"))
            plain = SourceUri.parse(f"upr://admin:pw@127.0.0.1:{server.port}/default")
            s = await connect(plain)  # the plain port: SCRAM, as before
            await s.conn.aclose()

    with caplog.at_level(logging.WARNING, logger="upr_cli.node.server"):
        run(scenario(), SCENARIO_S)
    assert "the client certificate's subject CN 'nobody' names no user of this node" in (
        caplog.text
    )


def test_enable_mode_takes_a_certificate_or_a_password(tmp_path: Path, pki: Pki) -> None:
    async def scenario() -> None:
        async with cert_node(tmp_path, pki, None) as server:  # enable: the default
            assert server.tls is not None and server.tls.verify_mode == ssl.CERT_OPTIONAL
            for uri in (tls_uri(server, pki.cafile), cert_uri(server, pki.client("admin"))):
                s = await connect(uri)
                await s.conn.aclose()
            with pytest.raises(BootstrapError, match="authentication failed"):
                await connect(tls_uri(server, pki.cafile, password="wrong"))
            # a certificate that is given must verify, and name a user
            for cn, ca in (("admin", trustme.CA()), ("nobody", None)):
                with pytest.raises(ClientCertificateError, match="did not accept the client"):
                    await connect(cert_uri(server, pki.client(cn, ca)))

    run(scenario(), SCENARIO_S)


def test_with_no_auth_the_cn_does_not_matter(tmp_path: Path, pki: Pki) -> None:
    async def scenario() -> None:
        async with tls_node(tmp_path, pki.good, tls_client_ca=Path(pki.cafile),
                            tls_client_auth="mandatory") as server:  # fmt: skip
            s = await connect(cert_uri(server, pki.client("nobody")))
            await s.conn.aclose()

    run(scenario(), SCENARIO_S)


@contextmanager
def alerting_peer(pki: Pki, *, tls12: bool) -> Iterator[int]:
    """A TLS server on a thread that requires a certificate from the test CA and, when
    the handshake fails, sends OpenSSL's alert and then a FIN (as kv_engine does; an
    asyncio server closes without the alert). Its port."""
    ctx = server_context(*pki.good, pki.cafile, mandatory=True)
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(5.0)
            with ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False) as tls:
                try:
                    tls.do_handshake()
                except OSError:  # the alert is out; a FIN, not a reset that could pass it
                    tls.shutdown(socket.SHUT_WR)
                    while tls.recv(4096):
                        pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        thread.join(10)
        listener.close()


@pytest.mark.parametrize(
    ("tls12", "client", "message"),
    [
        (False, None, r"the server requires a client certificate: give --cert FILE --key "
                      r"FILE, or set UPR_CERT and UPR_KEY \(TLS alert: certificate required\)"),
        (False, "other-ca", r"the server does not trust the CA of the client certificate "
                            r"\(TLS alert: unknown ca\)"),
        (False, "expired", r"the server refused the client certificate \(TLS alert: "
                           r"certificate expired\)"),
        (True, None, r"the server refused the TLS handshake; if it requires a client "
                     r"certificate, give --cert FILE --key FILE, or set UPR_CERT and "
                     r"UPR_KEY \(TLS alert: handshake failure\)"),
        (True, "other-ca", r"the server does not trust the CA of the client certificate "
                           r"\(TLS alert: unknown ca\)"),
    ],
)  # fmt: skip
def test_a_tls_alert_about_the_client_certificate_is_one_line(
    pki: Pki, tls12: bool, client: str | None, message: str
) -> None:
    """Over TLS 1.3 the alert comes with the answer to HELLO (the client's handshake was
    over), over TLS 1.2 it ends the handshake: the same one line either way."""
    now = datetime.datetime.now(datetime.UTC)
    tls = {
        None: ClientTls(cafile=pki.cafile),
        "other-ca": pki.client("admin", trustme.CA()),
        "expired": pki.client("admin", not_before=now - _DAYS * 10, not_after=now - _DAYS),
    }[client]

    async def scenario() -> None:
        with alerting_peer(pki, tls12=tls12) as port:
            uri = SourceUri.parse(f"uprs://127.0.0.1:{port}/default").with_tls(tls)
            with pytest.raises(ClientCertificateError) as info:
                await connect(uri, timeout=5.0)
        assert str(info.value) == f"127.0.0.1:{port}: " + message.replace("\\", "")

    run(scenario(), SCENARIO_S)
