"""SCRAM and PLAIN: RFC test vectors, client-server round trips, and garbage in every step.

The exact strings come from RFC 5802 §5 (SCRAM-SHA-1) and RFC 7677 §3 (SCRAM-SHA-256),
copied from the RFC text, not produced by our code.
"""

from __future__ import annotations

import base64
import contextlib
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from upr_cli.errors import LocalProtocolError
from upr_cli.net.scram import (
    MECHANISMS,
    AuthenticationFailed,
    ScramClient,
    ScramServer,
    StoredCredential,
    make_credential,
    parse_plain,
    plain_message,
)

NOBODY: dict[str, StoredCredential] = {}


class Vector(NamedTuple):
    """One RFC exchange: the inputs both sides are given and the four messages."""

    mech: str
    user: str
    password: str
    cnonce: str
    snonce: str  # the server's nonce suffix
    salt: str
    client_first: bytes
    server_first: bytes
    client_final: bytes
    server_final: bytes


RFC_VECTORS = [
    pytest.param(
        Vector(
            "SCRAM-SHA1",
            "user",
            "pencil",
            "fyko+d2lbbFgONRv9qkxdawL",
            "3rfcNHYJY1ZVvWVs7j",
            "QSXCR+Q6sek8bf92",
            b"n,,n=user,r=fyko+d2lbbFgONRv9qkxdawL",
            b"r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,s=QSXCR+Q6sek8bf92,i=4096",
            b"c=biws,r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,p=v0X8v3Bz2T0CJGbJQyF0X+HI4Ts=",
            b"v=rmF9pqV8S7suAoZWja4dJRkFsKQ=",
        ),
        id="rfc5802-sha1",
    ),
    pytest.param(
        Vector(
            "SCRAM-SHA256",
            "user",
            "pencil",
            "rOprNGfwEbeRWgbNEkqO",
            "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0",
            "W22ZaJ0SNY7soEsUEjb6gQ==",
            b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO",
            b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096",
            b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
            b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=",
            b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=",
        ),
        id="rfc7677-sha256",
    ),
]


@pytest.mark.parametrize("v", RFC_VECTORS)
def test_client_matches_rfc_vector(v: Vector) -> None:
    client = ScramClient(v.mech, v.user, v.password, nonce=v.cnonce)
    assert client.first_message() == v.client_first
    assert client.final_message(v.server_first) == v.client_final
    client.verify(v.server_final)


@pytest.mark.parametrize("v", RFC_VECTORS)
def test_server_matches_rfc_vector(v: Vector) -> None:
    cred = make_credential(v.mech, v.password, salt=base64.b64decode(v.salt), iterations=4096)
    server = ScramServer(v.mech, {v.user: cred}.get, nonce=v.snonce)
    assert server.username is None
    assert server.first(v.client_first) == v.server_first
    assert server.username == v.user
    assert server.final(v.client_final) == v.server_final


def converse(mech: str, client_password: str, users: dict[str, StoredCredential]) -> str:
    """Run a full exchange between ScramClient("alice") and ScramServer; return the user."""
    client = ScramClient(mech, "alice", client_password)
    server = ScramServer(mech, users.get)
    server_first = server.first(client.first_message())
    server_final = server.final(client.final_message(server_first))
    client.verify(server_final)
    assert server.username is not None
    return server.username


@pytest.mark.parametrize("mech", list(MECHANISMS))
def test_round_trip(mech: str) -> None:
    users = {"alice": make_credential(mech, "s3cret")}
    assert converse(mech, "s3cret", users) == "alice"


@pytest.mark.parametrize("mech", list(MECHANISMS))
def test_wrong_password_fails_at_the_server(mech: str) -> None:
    users = {"alice": make_credential(mech, "s3cret")}
    with pytest.raises(AuthenticationFailed, match="invalid user name or password"):
        converse(mech, "guess", users)


def test_unknown_user_fails_like_a_wrong_password() -> None:
    mech = "SCRAM-SHA512"
    with pytest.raises(AuthenticationFailed, match="invalid user name or password"):
        converse(mech, "s3cret", {})


def test_unknown_user_gets_a_stable_salt_and_the_usual_iterations() -> None:
    def server_first() -> bytes:
        server = ScramServer("SCRAM-SHA256", NOBODY.get, nonce="srv", iterations=15000)
        return server.first(b"n,,n=mallory,r=abc")

    first, second = server_first(), server_first()
    assert first == second
    assert first.endswith(b",i=15000")


def test_tampered_server_signature_fails() -> None:
    mech = "SCRAM-SHA512"
    client = ScramClient(mech, "alice", "s3cret")
    server = ScramServer(mech, {"alice": make_credential(mech, "s3cret")}.get)
    server_final = server.final(client.final_message(server.first(client.first_message())))
    signature = bytearray(base64.b64decode(server_final[2:]))
    signature[0] ^= 1
    with pytest.raises(AuthenticationFailed, match="signature does not match"):
        client.verify(b"v=" + base64.b64encode(bytes(signature)))


def test_server_error_is_reported() -> None:
    client = ScramClient("SCRAM-SHA1", "user", "pencil", nonce="fyko+d2lbbFgONRv9qkxdawL")
    client.first_message()
    client.final_message(b"r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,s=QSXCR+Q6sek8bf92,i=4096")
    with pytest.raises(AuthenticationFailed, match="other-error"):
        client.verify(b"e=other-error")


def test_user_name_is_escaped_and_unescaped() -> None:
    mech = "SCRAM-SHA256"
    client = ScramClient(mech, "a=b,c", "pw", nonce="xyz")
    assert client.first_message() == b"n,,n=a=3Db=2Cc,r=xyz"
    server = ScramServer(mech, {"a=b,c": make_credential(mech, "pw")}.get)
    server.first(b"n,,n=a=3Db=2Cc,r=xyz")
    assert server.username == "a=b,c"


@pytest.mark.parametrize(
    "server_first",
    [
        b"r=abXdef,s=QSXCR+Q6sek8bf92,i=4096",  # server nonce does not extend ours
        b"r=abc,s=QSXCR+Q6sek8bf92,i=4096",  # server added nothing
        b"r=abcX,s=QSXCR+Q6sek8bf92,i=0",
        b"r=abcX,s=QSXCR+Q6sek8bf92,i=04096",
        b"r=abcX,s=QSXCR+Q6sek8bf92,i=99999999999",
        b"r=abcX,s=not base64!,i=4096",
        b"r=abcX,s=,i=4096",
        b"m=ext,r=abcX,s=QSXCR+Q6sek8bf92,i=4096",
        b"s=QSXCR+Q6sek8bf92,r=abcX,i=4096",
        b"r=abcX,s=QSXCR+Q6sek8bf92",
        b"",
        b"\xff\xfe",
    ],
)
def test_client_rejects_bad_server_first(server_first: bytes) -> None:
    client = ScramClient("SCRAM-SHA1", "user", "pencil", nonce="abc")
    client.first_message()
    with pytest.raises(AuthenticationFailed):
        client.final_message(server_first)


@pytest.mark.parametrize(
    "client_first",
    [
        b"p=tls-unique,,n=user,r=abc",
        b"n,a=admin,n=user,r=abc",
        b"n,,n=,r=abc",
        b"n,,n=us=41er,r=abc",
        b"n,,m=ext,n=user,r=abc",
        b"n,,r=abc,n=user",
        b"n,,n=user,r=a,c",
        b"n,,n=user",
        b"x,,n=user,r=abc",
        b"n,n=user,r=abc",
    ],
)
def test_server_rejects_bad_client_first(client_first: bytes) -> None:
    server = ScramServer("SCRAM-SHA1", NOBODY.get)
    with pytest.raises(AuthenticationFailed):
        server.first(client_first)


@pytest.mark.parametrize(
    "client_final",
    [
        b"c=eSws,r=abcsrv,p=AAAA",  # channel binding for "y,," after "n,,"
        b"c=biws,r=abcother,p=AAAA",
        b"c=biws,r=abcsrv,p=AAAA",  # proof too short
        b"c=biws,r=abcsrv,p=AAAA,x=1",
        b"c=biws,r=abcsrv",
        b"r=abcsrv,c=biws,p=AAAA",
    ],
)
def test_server_rejects_bad_client_final(client_final: bytes) -> None:
    mech = "SCRAM-SHA1"
    server = ScramServer(mech, {"user": make_credential(mech, "pencil")}.get, nonce="srv")
    server.first(b"n,,n=user,r=abc")
    with pytest.raises(AuthenticationFailed):
        server.final(client_final)


def test_unsupported_mechanism() -> None:
    with pytest.raises(AuthenticationFailed, match="unsupported SASL mechanism"):
        ScramClient("SCRAM-MD5", "user", "pw")
    with pytest.raises(AuthenticationFailed, match="unsupported SASL mechanism"):
        ScramServer("PLAIN", NOBODY.get)


def test_methods_out_of_order_are_local_errors() -> None:
    client = ScramClient("SCRAM-SHA1", "user", "pencil")
    with pytest.raises(LocalProtocolError):
        client.final_message(b"r=x,s=QSXCR+Q6sek8bf92,i=1")
    with pytest.raises(LocalProtocolError):
        client.verify(b"v=AAAA")
    server = ScramServer("SCRAM-SHA1", NOBODY.get)
    with pytest.raises(LocalProtocolError):
        server.final(b"c=biws,r=x,p=AAAA")
    with pytest.raises(LocalProtocolError):
        ScramClient("SCRAM-SHA1", "user", "pencil", nonce="has,comma")


def test_credential_for_another_hash_is_a_local_error() -> None:
    server = ScramServer("SCRAM-SHA512", {"user": make_credential("SCRAM-SHA1", "pw")}.get)
    with pytest.raises(LocalProtocolError):
        server.first(b"n,,n=user,r=abc")


def test_stored_credential_repr_hides_keys() -> None:
    cred = make_credential("SCRAM-SHA256", "pw", salt=b"salt")
    assert cred.stored_key.hex() not in repr(cred)
    assert cred.server_key.hex() not in repr(cred)
    assert str(cred.stored_key) not in repr(cred)


def test_plain_round_trip() -> None:
    assert plain_message("alice", "secret") == b"\0alice\0secret"
    assert parse_plain(b"\0alice\0secret") == ("alice", "secret")
    assert parse_plain(b"alice\0alice\0secret") == ("alice", "secret")
    assert parse_plain(b"\0default\0") == ("default", "")


@pytest.mark.parametrize(
    "payload", [b"", b"alice", b"\0alice", b"\0\0pw", b"bob\0alice\0pw", b"\0a\0b\0c", b"\0\xff\0x"]
)
def test_parse_plain_rejects(payload: bytes) -> None:
    with pytest.raises(AuthenticationFailed):
        parse_plain(payload)


def test_plain_message_rejects_nul() -> None:
    with pytest.raises(AuthenticationFailed):
        plain_message("al\0ice", "pw")
    with pytest.raises(AuthenticationFailed):
        plain_message("", "pw")


@given(st.text(), st.text())
def test_plain_round_trips_any_text(user: str, password: str) -> None:
    try:
        message = plain_message(user, password)
    except AuthenticationFailed:
        assert not user or "\0" in user + password
        return
    assert parse_plain(message) == (user, password)


# Garbage in every parse step: only AuthenticationFailed may come out.

MECH = "SCRAM-SHA256"
CRED = make_credential(MECH, "pencil", salt=b"0123456789abcdef", iterations=16)


def valid_transcript() -> tuple[bytes, bytes, bytes, bytes]:
    """One good exchange with a cheap iteration count: the four messages in order."""
    client = ScramClient(MECH, "user", "pencil", nonce="cnonce")
    server = ScramServer(MECH, {"user": CRED}.get, nonce="snonce")
    m1 = client.first_message()
    m2 = server.first(m1)
    m3 = client.final_message(m2)
    m4 = server.final(m3)
    client.verify(m4)
    return m1, m2, m3, m4


TRANSCRIPT = valid_transcript()


@st.composite
def damaged(draw: st.DrawFn, good: bytes) -> bytes:
    """Arbitrary bytes, or a valid message with bytes flipped, cut or spliced in."""
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return draw(st.binary(max_size=200))
    data = bytearray(good)
    if choice == 1:
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    elif choice == 2:
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] if draw(st.booleans()) else data[cut:]
    else:
        i = draw(st.integers(0, len(data)))
        data[i:i] = draw(st.binary(min_size=1, max_size=8).filter(lambda b: not b.isdigit()))
    return bytes(data)


def only_auth_failed(step: object, payload: bytes) -> None:
    assert callable(step)
    with contextlib.suppress(AuthenticationFailed):
        step(payload)


@given(damaged(TRANSCRIPT[0]))
def test_server_first_takes_garbage(payload: bytes) -> None:
    only_auth_failed(ScramServer(MECH, {"user": CRED}.get).first, payload)


@given(damaged(TRANSCRIPT[1]))
@settings(deadline=None)
def test_client_final_message_takes_garbage(payload: bytes) -> None:
    client = ScramClient(MECH, "user", "pencil", nonce="cnonce")
    client.first_message()
    only_auth_failed(client.final_message, payload)


@given(damaged(TRANSCRIPT[2]))
def test_server_final_takes_garbage(payload: bytes) -> None:
    server = ScramServer(MECH, {"user": CRED}.get, nonce="snonce")
    server.first(TRANSCRIPT[0])
    only_auth_failed(server.final, payload)


@given(damaged(TRANSCRIPT[3]))
def test_client_verify_takes_garbage(payload: bytes) -> None:
    client = ScramClient(MECH, "user", "pencil", nonce="cnonce")
    client.first_message()
    client.final_message(TRANSCRIPT[1])
    only_auth_failed(client.verify, payload)


@given(st.binary(max_size=100))
def test_parse_plain_takes_garbage(payload: bytes) -> None:
    only_auth_failed(parse_plain, payload)


@given(st.text(max_size=30))
def test_unknown_mechanism_names_raise_auth_failed(name: str) -> None:
    if name in MECHANISMS:
        ScramServer(name, NOBODY.get)
    else:
        with pytest.raises(AuthenticationFailed):
            ScramServer(name, NOBODY.get)


def test_server_accepts_a_client_nonce_with_spaces() -> None:
    """The official Couchbase SDK's nonces hold spaces, which RFC 5802 does not allow and
    Couchbase Server accepts: so does ours (what we send stays strict)."""
    server = ScramServer("SCRAM-SHA512", {"alice": make_credential("SCRAM-SHA512", "pw")}.get)
    server_first = server.first(b"n,,n=alice,r=a b+c d")
    assert server_first.startswith(b"r=a b+c d") and len(server_first.split(b",")[0]) > 11
    with pytest.raises(LocalProtocolError):
        ScramClient("SCRAM-SHA512", "alice", "pw", nonce="a b")
