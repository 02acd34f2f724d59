"""Client certificates on `upr serve`'s TLS port (docs/protocol.md §13.5): with
--tls-client-ca the node asks every TLS client for a certificate and logs a verified
one in as the user its subject CN names, as Couchbase does. The official SDK
(CertificateAuthenticator) and `upr tail`/`upr backup` with --cert/--key and no user in
the URI read and write without a password; every refused certificate is one line."""

from __future__ import annotations

import json
from pathlib import Path

import trustme

from tests.e2e.conftest import PASSWORD, USER, Node, upr
from tests.e2e.test_tls_e2e import one_line_error, start_tls

DOCS = 30


class ClientCerts:
    """A test CA with the node's certificate and client certificates by subject CN."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.ca = trustme.CA()
        self.cafile = tmp / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.cafile))
        cert, key = self.issue("node", self.ca, "127.0.0.1")
        self.node_args = ["--tls-cert", cert, "--tls-key", key, "--tls-port", "0",
                          "--tls-client-ca", str(self.cafile)]  # fmt: skip

    def issue(self, name: str, ca: trustme.CA, *names: str, cn: str | None = None) -> list[str]:
        """PEM files of a certificate from `ca`: [cert, key]."""
        leaf = ca.issue_cert(*names, common_name=cn)
        cert, key = self.dir / f"{name}.pem", self.dir / f"{name}.key"
        cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(str(key))
        return [str(cert), str(key)]

    def client(self, cn: str, ca: trustme.CA | None = None) -> list[str]:
        """--cert/--key options of a client certificate for subject CN `cn` (with a
        subjectAltName too: current `cryptography` refuses a certificate with none)."""
        cert, key = self.issue(f"client-{cn}-{id(ca)}", ca or self.ca, client_san(cn), cn=cn)
        return ["--cert", cert, "--key", key]


def client_san(cn: str) -> str:
    """The DNS subjectAltName of a test client certificate: the node maps the subject
    CN, never this name, to a user."""
    return f"{cn}.clients.upr.test"


def uri(port: int, login: str = "") -> str:
    """uprs:// to the TLS port; no user unless `login` ("user:password") is given."""
    return f"uprs://{login + '@' if login else ''}127.0.0.1:{port}/default"


def tail_keys(*args: str) -> set[str]:
    """The keys `upr tail --until-end --format json` prints."""
    out = upr("tail", *args, "--until-end", "--format", "json").stdout
    return {json.loads(line)["key"] for line in out.splitlines()}


def test_mandatory_client_certificates(node_factory: type[Node], tmp_path: Path) -> None:
    certs = ClientCerts(tmp_path)
    node = node_factory("--flush-interval", "0.02", *certs.node_args,
                        "--tls-client-auth", "mandatory")  # fmt: skip
    tls = start_tls(node)
    # the plain port is unchanged: a load with user and password
    upr("load", node.uri, "--docs", str(DOCS))
    ca = ["--cacert", str(certs.cafile)]
    admin = certs.client(USER)
    keys = tail_keys(uri(tls), *ca, *admin)  # no user in the URI: the certificate logs in
    assert len(keys) == DOCS

    repo = tmp_path / "repo"
    upr("backup", uri(tls), "--repo", str(repo), *ca, *admin)
    key = min(keys)
    shown = json.loads(upr("examine", "--repo", str(repo), "--json", key).stdout)
    assert [v["op"] for v in shown["versions"]] == ["mutation"], shown

    refused = "the server closed the connection after the TLS handshake"
    one_line_error(upr("tail", uri(tls), "--until-end", *ca, check=False),
                   refused, "it may require a client certificate",
                   "give --cert FILE --key FILE, or set UPR_CERT and UPR_KEY")  # fmt: skip
    # a certificate from a CA the node does not trust; one whose CN is no user of it
    for cn, issuer in ((USER, trustme.CA()), ("nobody", None)):
        proc = upr("tail", uri(tls), "--until-end", *ca, *certs.client(cn, issuer),
                   check=False)  # fmt: skip
        one_line_error(proc, refused, "it did not accept the client certificate")
    proc = upr("tail", uri(tls, f"{USER}:{PASSWORD}"), "--until-end", *ca, *admin, check=False)
    one_line_error(proc, "logged this connection in by its client certificate and refuses "
                   "SASL: leave the user name out of the URI")  # fmt: skip


def test_the_sdk_logs_in_with_a_certificate(node_factory: type[Node], tmp_path: Path) -> None:
    from couchbase.auth import CertificateAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.options import ClusterOptions

    certs = ClientCerts(tmp_path)
    node = node_factory("--flush-interval", "0.02", *certs.node_args,
                        "--tls-client-auth", "mandatory")  # fmt: skip
    tls = start_tls(node)
    cert, key = certs.issue("sdk", certs.ca, client_san(USER), cn=USER)
    auth = CertificateAuthenticator(cert_path=cert, key_path=key,
                                    trust_store_path=str(certs.cafile))  # fmt: skip
    cluster = Cluster(f"couchbases://127.0.0.1:{tls}=kv", ClusterOptions(auth))
    try:
        docs = cluster.bucket("default").default_collection()
        for i in range(DOCS):
            docs.upsert(f"sdk{i}", {"i": i})
        assert docs.get("sdk7").content_as[dict] == {"i": 7}
    finally:
        cluster.close()
    ca = ["--cacert", str(certs.cafile)]
    assert tail_keys(uri(tls), *ca, *certs.client(USER)) == {f"sdk{i}" for i in range(DOCS)}


def test_enable_mode_takes_a_password_or_a_certificate(
    node_factory: type[Node], tmp_path: Path
) -> None:
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.options import ClusterOptions

    certs = ClientCerts(tmp_path)
    node = node_factory("--flush-interval", "0.02", *certs.node_args)  # enable: the default
    tls = start_tls(node)
    # the SDK is asked for a certificate, has none, and logs in with its password
    auth = PasswordAuthenticator(USER, PASSWORD, cert_path=str(certs.cafile))
    cluster = Cluster(f"couchbases://127.0.0.1:{tls}=kv", ClusterOptions(auth))
    try:
        docs = cluster.bucket("default").default_collection()
        for i in range(DOCS):
            docs.upsert(f"pw{i}", {"i": i})
    finally:
        cluster.close()
    ca = ["--cacert", str(certs.cafile)]
    assert len(tail_keys(uri(tls, f"{USER}:{PASSWORD}"), *ca)) == DOCS  # no certificate
    assert len(tail_keys(uri(tls), *ca, *certs.client(USER))) == DOCS
    proc = upr("tail", uri(tls), "--until-end", *ca, *certs.client("nobody"), check=False)
    one_line_error(proc, "it did not accept the client certificate")


def test_client_auth_without_a_client_ca_is_a_usage_error(tmp_path: Path) -> None:
    proc = upr("serve", "--data", str(tmp_path / "node"), "--no-auth", "--port", "0",
               "--tls-client-auth", "mandatory", check=False)  # fmt: skip
    assert proc.returncode == 2, proc
    assert proc.stderr == "upr: error: --tls-client-auth needs --tls-client-ca FILE\n"
