"""TLS for the data port: the client's and the node's `ssl.SSLContext`, and one-line
errors for the ways a handshake fails (docs/protocol.md §13; the client certificate's in
docs/protocol.md §13.5).

A client verifies the server certificate against the system trust store, or against
the CA file it is given (`--cacert`, else $UPR_CACERT); turning verification off is an
explicit choice (`--no-verify`) that the CLI warns about. Contexts are built once per
settings value: loading a CA bundle costs milliseconds, and a command opens a connection
per node.
"""

from __future__ import annotations

import functools
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

from upr_cli.errors import UprError, UsageError

DEFAULT_TLS_PORT = 11207
"""Couchbase's TLS data port, used when a uprs:// or couchbases:// URI gives none."""
CACERT_ENV = "UPR_CACERT"
"""Environment variable naming a PEM CA file that clients trust (like --cacert)."""
CERT_ENV = "UPR_CERT"
"""Environment variable naming a PEM client certificate (like --cert)."""
KEY_ENV = "UPR_KEY"
"""Environment variable naming the client certificate's PEM private key (like --key)."""
NO_VERIFY_WARNING = (
    "--no-verify: the server certificate is not checked; anyone on the path can read "
    "and change this connection"
)
"""The warning every run with verification off prints."""

# OpenSSL verify codes (x509_vfy.h) that a --cacert fixes: the chain ends at a CA the
# client does not trust.
_UNTRUSTED = {18, 19, 20, 21}
_CA = "--cacert (or UPR_CACERT)"
# How a peer that does not speak TLS ends a handshake (it drops the connection).
_CLOSED = (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError)
_CERT_FIX = "give --cert FILE --key FILE, or set UPR_CERT and UPR_KEY"
_REFUSED = "the server refused the client certificate"
# TLS alerts (RFC 8446 §6.2) in which a server refuses the client's certificate, by the
# names OpenSSL gives them (ssl.SSLError.reason). A TLS 1.2 server that requires a
# certificate and gets none sends handshake_failure, which other mismatches send too.
_CLIENT_CERT_ALERTS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": f"the server requires a client certificate: {_CERT_FIX}",
    "TLSV1_ALERT_UNKNOWN_CA": "the server does not trust the CA of the client certificate",
    "SSLV3_ALERT_BAD_CERTIFICATE": _REFUSED,
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE": _REFUSED,
    "SSLV3_ALERT_CERTIFICATE_REVOKED": _REFUSED,
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": _REFUSED,
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": _REFUSED,
    "TLSV1_ALERT_ACCESS_DENIED": _REFUSED,
    "SSLV3_ALERT_HANDSHAKE_FAILURE": "the server refused the TLS handshake; if it requires "
    f"a client certificate, {_CERT_FIX}",
}


class TlsError(UprError):
    """A TLS handshake failed (certificate, protocol or a plain peer)."""


class CertificateError(TlsError):
    """The server certificate did not verify: unknown CA, expired, or another name."""


class ClientCertificateError(TlsError):
    """The server refused the client's certificate, or wanted one and got none."""


class TlsConfigError(UsageError):
    """A CA, certificate or key file cannot be read or is not PEM."""


@dataclass(frozen=True, slots=True)
class ClientTls:
    """How a client checks the server and proves itself: CA file, client cert, verify."""

    cafile: str | None = None  # None: the system trust store
    certfile: str | None = None
    keyfile: str | None = None
    verify: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ClientTls:
        """Settings from $UPR_CACERT, $UPR_CERT and $UPR_KEY (each optional)."""
        return cls(env.get(CACERT_ENV) or None, env.get(CERT_ENV) or None,
                   env.get(KEY_ENV) or None)  # fmt: skip

    def context(self) -> ssl.SSLContext:
        """The client context for these settings (built once per value)."""
        return _client_context(self)


@functools.lru_cache(maxsize=8)
def _client_context(tls: ClientTls) -> ssl.SSLContext:
    if (tls.certfile is None) != (tls.keyfile is None):
        raise TlsConfigError("--cert and --key go together")
    try:
        ctx = ssl.create_default_context(cafile=tls.cafile)
    except FileNotFoundError:
        raise TlsConfigError(f"{_CA}: cannot read {tls.cafile}: no such file") from None
    except OSError as exc:  # ssl.SSLError is one: not PEM
        raise TlsConfigError(f"{_CA}: {tls.cafile} is not a PEM CA file ({_why(exc)})") from None
    if not tls.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if tls.certfile is not None:
        _load_chain(ctx, tls.certfile, tls.keyfile, "--cert/--key")
    return ctx


def server_context(
    certfile: str, keyfile: str, client_ca: str | None = None, *, mandatory: bool = False
) -> ssl.SSLContext:
    """The node's context: its certificate chain and key, TLS 1.2 or later. With
    `client_ca` it asks every client for a certificate and verifies the one it gets
    against that CA file alone (not the system store): a client without one is refused
    in the handshake if `mandatory`, else let in to authenticate with SASL."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # loads no CA: verify is off
    _load_chain(ctx, certfile, keyfile, "--tls-cert/--tls-key")
    if client_ca is not None:
        what = "--tls-client-ca"
        try:
            ctx.load_verify_locations(client_ca)
        except FileNotFoundError:
            raise TlsConfigError(f"{what}: cannot read {client_ca}: no such file") from None
        except OSError as exc:  # ssl.SSLError is one: not PEM
            raise TlsConfigError(
                f"{what}: {client_ca} is not a PEM CA file ({_why(exc)})"
            ) from None
        ctx.verify_mode = ssl.CERT_REQUIRED if mandatory else ssl.CERT_OPTIONAL
    return ctx


def _load_chain(ctx: ssl.SSLContext, certfile: str, keyfile: str | None, what: str) -> None:
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except FileNotFoundError as exc:
        missing = exc.filename or certfile
        raise TlsConfigError(f"{what}: cannot read {missing}: no such file") from None
    except OSError as exc:
        raise TlsConfigError(
            f"{what}: {certfile} and its key are not a PEM certificate and matching key "
            f"({_why(exc)})"
        ) from None


def handshake_error(
    exc: OSError, where: str, *, cafile: str | None = None, plain: bool = True
) -> TlsError:
    """The one-line error for a failed handshake with `where` (host:port), the client
    trusting `cafile` (None: the system store). A peer that closed the connection gets
    the plain-port hint only when the port answers plain memcached (`plain`, from
    `probe.answers_plain`): otherwise the node went away during the handshake."""
    alert = client_certificate_alert(exc, where)
    if alert is not None:
        return alert
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = (exc.verify_message or _why(exc)).rstrip(".")
        why = why.replace("in certificate chain", "in chain")
        hint = ""
        if exc.verify_code in _UNTRUSTED:
            hint = (f" (the CA file {cafile} does not verify the node's certificate)"
                    if cafile is not None else " (use --cacert FILE)")  # fmt: skip
        return CertificateError(f"{where}: certificate verify failed: {why}{hint}")
    closed = closed_by_peer(exc)
    if closed and not plain:
        return TlsError(f"{where}: the connection was closed during the TLS handshake")
    why = "the peer closed the connection" if closed else _why(exc)
    return TlsError(
        f"{where}: TLS handshake failed ({why}): a plain data port? "
        f"those take upr:// or couchbase://"
    )


def closed_by_peer(exc: BaseException) -> bool:
    """True when a handshake failed because the peer closed the connection (no answer)."""
    return isinstance(exc, _CLOSED)


def client_certificate_alert(exc: BaseException | None, where: str) -> TlsError | None:
    """The one-line error for a TLS alert in which the server refuses the client's
    certificate (or its lack of one), else None. Over TLS 1.2 the alert ends the
    handshake; over TLS 1.3 the client's handshake is over before the server has checked
    the certificate, so the alert comes with the first read."""
    if not isinstance(exc, ssl.SSLError) or exc.reason not in _CLIENT_CERT_ALERTS:
        return None
    alert = _why(exc).partition(" alert ")[2]  # "tlsv1 alert unknown ca": "unknown ca"
    return ClientCertificateError(
        f"{where}: {_CLIENT_CERT_ALERTS[exc.reason]} (TLS alert: {alert})"
    )


def closed_after_handshake(where: str, *, sent_certificate: bool) -> TlsError:
    """The one-line error for a TLS server that closed the connection, without an alert,
    before it answered the first request: what a server does that refuses the client's
    certificate but does not say so, and what Couchbase does with a certificate that
    maps to none of its users (docs/protocol.md §13.5)."""
    if sent_certificate:
        return ClientCertificateError(
            f"{where}: the server closed the connection after the TLS handshake: it did "
            "not accept the client certificate (a CA it does not trust, or a subject CN "
            "that names none of its users)"
        )
    return ClientCertificateError(
        f"{where}: the server closed the connection after the TLS handshake: it may "
        f"require a client certificate ({_CERT_FIX})"
    )


def _why(exc: OSError) -> str:
    """OpenSSL's reason, without the library tag and the C source line it adds."""
    reason = getattr(exc, "reason", None)
    if isinstance(exc, ssl.SSLError) and reason:
        return str(reason).lower().replace("_", " ")
    text = exc.strerror or str(exc) or type(exc).__name__
    return re.sub(r"^\[\w+\] | \(_ssl\.c:\d+\)$", "", text)
