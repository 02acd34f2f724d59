"""Sans-IO SASL: SCRAM (RFC 5802, SHA-256 as in RFC 7677) and PLAIN (RFC 4616).

Couchbase names the SCRAM mechanisms SCRAM-SHA512, SCRAM-SHA256 and SCRAM-SHA1 and runs
them as three packets: SASL_AUTH, AuthContinue, SASL_STEP (docs/protocol.md §5.2). This
module only turns bytes into bytes; the connection layer carries them.

    client-first  n,,n=<user>,r=<client nonce>
    server-first  r=<client nonce><server nonce>,s=<salt, base64>,i=<iterations>
    client-final  c=biws,r=<both nonces>,p=<client proof, base64>
    server-final  v=<server signature, base64>        (or e=<error>)

Errors by fault: a malformed or unverifiable message from either peer, an unknown
mechanism or unusable credentials raise `AuthenticationFailed`; calling the methods out of
order, or giving an invalid nonce, salt or iteration count, raises `LocalProtocolError`.

Names and passwords go out as UTF-8 without SASLprep (RFC 4013); the two agree for the
printable ASCII names Couchbase accepts.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from upr_cli.errors import LocalProtocolError, UprError

MECHANISMS: dict[str, str] = {
    "SCRAM-SHA512": "sha512",
    "SCRAM-SHA256": "sha256",
    "SCRAM-SHA1": "sha1",
}
"""Couchbase SCRAM mechanism names, strongest first, and their hashlib names."""

DEFAULT_ITERATIONS = 4096
"""PBKDF2 iteration count for new credentials, as in the RFC 5802 and RFC 7677 examples."""

MAX_ITERATIONS = 10_000_000
"""Highest iteration count a client accepts (seconds of PBKDF2), so a server cannot stall it."""

# RFC 5802 §7: printable ASCII except ",".
_NONCE = re.compile(r"[\x21-\x2b\x2d-\x7e]+")
# What a server accepts from a client: the official Couchbase SDK's nonces hold spaces,
# which RFC 5802 does not allow and Couchbase Server accepts; so do we (any character but
# "," and control characters). What we send stays within _NONCE.
_PEER_NONCE = re.compile(r"[\x20-\x2b\x2d-\x7e]+")
_ITERATIONS = re.compile(r"[1-9][0-9]{0,9}")
# Process-wide, so an unknown user gets the same fake salt on every attempt (RFC 5802 §9).
_DUMMY_SECRET = secrets.token_bytes(32)


class AuthenticationFailed(UprError):
    """SASL authentication failed: a malformed message, a bad proof or a server error."""


@dataclass(frozen=True, slots=True)
class StoredCredential:
    """What a server keeps per user and mechanism instead of the password (RFC 5802 §3)."""

    salt: bytes
    iterations: int
    stored_key: bytes = field(repr=False)
    server_key: bytes = field(repr=False)


def make_credential(
    mechanism: str, password: str, salt: bytes | None = None, iterations: int = DEFAULT_ITERATIONS
) -> StoredCredential:
    """Derive the `StoredCredential` for `password` under `mechanism`."""
    hash_name = _hash_name(mechanism)
    if salt is None:
        salt = secrets.token_bytes(16)
    if not salt:
        raise LocalProtocolError("SCRAM salt must not be empty")
    _check_iterations(iterations)
    salted = _salted_password(hash_name, _utf8(password, "password"), salt, iterations)
    client_key = _hmac(hash_name, salted, b"Client Key")
    return StoredCredential(
        salt=salt,
        iterations=iterations,
        stored_key=hashlib.new(hash_name, client_key).digest(),
        server_key=_hmac(hash_name, salted, b"Server Key"),
    )


class ScramClient:
    """Client side of one SCRAM exchange: `first_message`, `final_message`, `verify`."""

    def __init__(self, mechanism: str, username: str, password: str, nonce: str | None = None):
        self.mechanism = mechanism
        self._hash = _hash_name(mechanism)
        if not username or "\0" in username:
            raise AuthenticationFailed("SCRAM user name must be non-empty and contain no NUL")
        _utf8(username, "user name")
        self._username = username
        self._password = _utf8(password, "password")
        self._nonce = _check_nonce(secrets.token_urlsafe(24) if nonce is None else nonce)
        self._bare: str | None = None
        self._server_signature: bytes | None = None
        self._verified = False

    def first_message(self) -> bytes:
        """The client-first-message: "n,,n=<user>,r=<nonce>" (no channel binding)."""
        if self._bare is not None:
            raise LocalProtocolError("first_message() was already called")
        self._bare = f"n={_escape(self._username)},r={self._nonce}"
        return f"n,,{self._bare}".encode()

    def final_message(self, server_first: bytes) -> bytes:
        """Answer the server-first-message with the client-final-message and its proof."""
        if self._bare is None or self._server_signature is not None:
            raise LocalProtocolError("final_message() must follow first_message(), once")
        what = "server-first-message"
        text = _text(server_first, what)
        attrs = _attributes(text, what)
        if attrs[0][0] == "m":
            raise AuthenticationFailed("server requires an unsupported SCRAM extension")
        if [key for key, _ in attrs[:3]] != ["r", "s", "i"]:
            raise AuthenticationFailed(f"{what} is malformed")
        nonce, salt_b64, iterations_text = (value for _, value in attrs[:3])
        # RFC 5802 §5.1: the server keeps our nonce as a prefix and appends its own.
        if (
            not _NONCE.fullmatch(nonce)
            or not nonce.startswith(self._nonce)
            or len(nonce) == len(self._nonce)
        ):
            raise AuthenticationFailed("server nonce does not extend the client nonce")
        salt = _b64decode(salt_b64, "salt")
        if not salt:
            raise AuthenticationFailed("server sent an empty salt")
        if not _ITERATIONS.fullmatch(iterations_text):
            raise AuthenticationFailed("server sent an invalid iteration count")
        iterations = int(iterations_text)
        if iterations > MAX_ITERATIONS:
            raise AuthenticationFailed(f"server asks for too many iterations ({iterations})")

        salted = _salted_password(self._hash, self._password, salt, iterations)
        self._password = b""  # no longer needed; do not keep the secret around
        client_key = _hmac(self._hash, salted, b"Client Key")
        stored_key = hashlib.new(self._hash, client_key).digest()
        without_proof = f"c=biws,r={nonce}"  # biws = base64("n,,")
        auth_message = f"{self._bare},{text},{without_proof}".encode()
        proof = _xor(client_key, _hmac(self._hash, stored_key, auth_message))
        server_key = _hmac(self._hash, salted, b"Server Key")
        self._server_signature = _hmac(self._hash, server_key, auth_message)
        return f"{without_proof},p={_b64encode(proof)}".encode()

    def verify(self, server_final: bytes) -> None:
        """Check the server-final-message's signature; raise on mismatch or a server error."""
        if self._server_signature is None or self._verified:
            raise LocalProtocolError("verify() must follow final_message(), once")
        what = "server-final-message"
        key, value = _attributes(_text(server_final, what), what)[0]
        if key == "e":
            raise AuthenticationFailed(f"server rejected the authentication: {_show(value)}")
        if key != "v":
            raise AuthenticationFailed(f"{what} is malformed")
        signature = _b64decode(value, "server signature")
        if not hmac.compare_digest(signature, self._server_signature):
            raise AuthenticationFailed("server signature does not match: the server is not genuine")
        self._verified = True


class ScramServer:
    """Server side of one SCRAM exchange: `first`, then `final`; `username` once known."""

    def __init__(
        self,
        mechanism: str,
        lookup: Callable[[str], StoredCredential | None],
        nonce: str | None = None,
        iterations: int = DEFAULT_ITERATIONS,
    ):
        self.mechanism = mechanism
        self._hash = _hash_name(mechanism)
        self._lookup = lookup
        self._nonce = _check_nonce(secrets.token_urlsafe(24) if nonce is None else nonce)
        _check_iterations(iterations)
        self._iterations = iterations  # used for unknown users, to look like real ones
        self._username: str | None = None
        self._credential: StoredCredential | None = None
        self._known = False
        self._combined_nonce = ""
        self._channel_binding = ""
        self._auth_prefix: str | None = None
        self._done = False

    @property
    def username(self) -> str | None:
        """The user name the client claims, once `first` has parsed it (not yet verified)."""
        return self._username

    def first(self, client_first: bytes) -> bytes:
        """Parse the client-first-message and return the server-first-message."""
        if self._auth_prefix is not None:
            raise LocalProtocolError("first() was already called")
        what = "client-first-message"
        text = _text(client_first, what)
        parts = text.split(",", 2)
        if len(parts) != 3:
            raise AuthenticationFailed(f"{what} is malformed")
        cbind, authzid, bare = parts
        if cbind.startswith("p="):
            raise AuthenticationFailed("SCRAM channel binding is not supported")
        if cbind not in ("n", "y"):
            raise AuthenticationFailed(f"{what} is malformed")
        if authzid.startswith("a="):
            raise AuthenticationFailed("SCRAM authorization identities are not supported")
        if authzid:
            raise AuthenticationFailed(f"{what} is malformed")
        attrs = _attributes(bare, what)
        if attrs[0][0] == "m":
            raise AuthenticationFailed("client requires an unsupported SCRAM extension")
        if [key for key, _ in attrs[:2]] != ["n", "r"]:
            raise AuthenticationFailed(f"{what} is malformed")
        username = _unescape(attrs[0][1])
        client_nonce = attrs[1][1]
        if not _PEER_NONCE.fullmatch(client_nonce):
            raise AuthenticationFailed("client nonce is malformed")

        credential = self._lookup(username)
        self._known = credential is not None
        if credential is None:
            credential = self._dummy_credential(username)
        if len(credential.stored_key) != hashlib.new(self._hash).digest_size:
            raise LocalProtocolError(f"stored credential was not made for {self.mechanism}")
        self._username = username
        self._credential = credential
        self._combined_nonce = client_nonce + self._nonce
        self._channel_binding = _b64encode(f"{cbind},{authzid},".encode())
        server_first = (
            f"r={self._combined_nonce},s={_b64encode(credential.salt)},i={credential.iterations}"
        )
        self._auth_prefix = f"{bare},{server_first}"
        return server_first.encode()

    def final(self, client_final: bytes) -> bytes:
        """Verify the client-final-message's proof and return the server-final-message."""
        if self._auth_prefix is None or self._credential is None or self._done:
            raise LocalProtocolError("final() must follow first(), once")
        self._done = True  # one attempt per exchange, whatever the outcome
        what = "client-final-message"
        text = _text(client_final, what)
        # RFC 5802 §7: the proof is the last attribute; the AuthMessage ends before it.
        without_proof, sep, proof_b64 = text.rpartition(",p=")
        if not sep or "," in proof_b64:
            raise AuthenticationFailed(f"{what} is malformed")
        attrs = _attributes(without_proof, what)
        if [key for key, _ in attrs[:2]] != ["c", "r"]:
            raise AuthenticationFailed(f"{what} is malformed")
        if attrs[0][1] != self._channel_binding:
            raise AuthenticationFailed("SCRAM channel binding data does not match")
        if attrs[1][1] != self._combined_nonce:
            raise AuthenticationFailed("SCRAM nonce does not match")
        proof = _b64decode(proof_b64, "client proof")
        credential = self._credential
        if len(proof) != len(credential.stored_key):
            raise AuthenticationFailed("client proof has the wrong length")

        auth_message = f"{self._auth_prefix},{without_proof}".encode()
        client_key = _xor(proof, _hmac(self._hash, credential.stored_key, auth_message))
        candidate = hashlib.new(self._hash, client_key).digest()
        matches = hmac.compare_digest(candidate, credential.stored_key)
        if not (matches and self._known):
            # Same message for an unknown user and a wrong password.
            raise AuthenticationFailed("invalid user name or password")
        signature = _hmac(self._hash, credential.server_key, auth_message)
        return f"v={_b64encode(signature)}".encode()

    def _dummy_credential(self, username: str) -> StoredCredential:
        """A credential no proof can match, with a salt stable per name within this process."""
        size = hashlib.new(self._hash).digest_size
        salt = hmac.digest(_DUMMY_SECRET, username.encode(), "sha256")[:16]
        return StoredCredential(
            salt=salt,
            iterations=self._iterations,
            stored_key=secrets.token_bytes(size),
            server_key=secrets.token_bytes(size),
        )


def plain_message(username: str, password: str) -> bytes:
    """The PLAIN message (RFC 4616): empty authzid, NUL, user, NUL, password."""
    if not username or "\0" in username or "\0" in password:
        raise AuthenticationFailed("PLAIN user name must be non-empty; no NUL in name or password")
    return b"\0" + _utf8(username, "user name") + b"\0" + _utf8(password, "password")


def parse_plain(payload: bytes) -> tuple[str, str]:
    """Split a PLAIN message into (user, password); an authzid must be empty or the user."""
    parts = _text(payload, "PLAIN message", allow_nul=True).split("\0")
    if len(parts) != 3:
        raise AuthenticationFailed("PLAIN message is malformed")
    authzid, username, password = parts
    if not username:
        raise AuthenticationFailed("PLAIN message has an empty user name")
    if authzid and authzid != username:
        raise AuthenticationFailed("PLAIN authorization identities are not supported")
    # An empty password is allowed: old Couchbase buckets authenticated that way.
    return username, password


def _hash_name(mechanism: str) -> str:
    try:
        return MECHANISMS[mechanism]
    except KeyError:
        raise AuthenticationFailed(f"unsupported SASL mechanism {_show(mechanism)}") from None


def _check_nonce(nonce: str) -> str:
    if not _NONCE.fullmatch(nonce):
        raise LocalProtocolError("SCRAM nonce must be printable ASCII without ','")
    return nonce


def _check_iterations(iterations: int) -> None:
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise LocalProtocolError(f"SCRAM iteration count must be 1..{MAX_ITERATIONS}")


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise AuthenticationFailed(f"{what} cannot be encoded as UTF-8") from None


def _text(message: bytes, what: str, *, allow_nul: bool = False) -> str:
    try:
        text = bytes(message).decode("utf-8")
    except UnicodeDecodeError:
        raise AuthenticationFailed(f"{what} is not valid UTF-8") from None
    if not allow_nul and "\0" in text:
        raise AuthenticationFailed(f"{what} contains a NUL")
    return text


def _attributes(text: str, what: str) -> list[tuple[str, str]]:
    """Split "a=x,b=y" into [(a, x), (b, y)]; never empty (RFC 5802 §7 attr-val)."""
    out: list[tuple[str, str]] = []
    for part in text.split(","):
        if len(part) < 2 or part[1] != "=" or not (part[0].isascii() and part[0].isalpha()):
            raise AuthenticationFailed(f"{what} is malformed")
        out.append((part[0], part[2:]))
    return out


def _escape(username: str) -> str:
    """RFC 5802 §5.1 saslname: "=" becomes "=3D" and "," becomes "=2C"."""
    return username.replace("=", "=3D").replace(",", "=2C")


def _unescape(saslname: str) -> str:
    head, *rest = saslname.split("=")
    out = [head]
    for chunk in rest:
        code = chunk[:2].upper()
        if code == "2C":
            out.append(",")
        elif code == "3D":
            out.append("=")
        else:
            raise AuthenticationFailed("user name has an invalid '=' escape")
        out.append(chunk[2:])
    username = "".join(out)
    if not username:
        raise AuthenticationFailed("user name is empty")
    return username


def _b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, ValueError):  # binascii.Error is a ValueError
        raise AuthenticationFailed(f"{what} is not valid base64") from None


def _salted_password(hash_name: str, password: bytes, salt: bytes, iterations: int) -> bytes:
    """Hi() of RFC 5802 §2.2 is PBKDF2 with HMAC and one output block."""
    return hashlib.pbkdf2_hmac(hash_name, password, salt, iterations)


def _hmac(hash_name: str, key: bytes, message: bytes) -> bytes:
    return hmac.digest(key, message, hash_name)


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def _show(text: str) -> str:
    """Peer-supplied text, quoted and cut short for an error message."""
    return repr(text[:60] + ("…" if len(text) > 60 else ""))
