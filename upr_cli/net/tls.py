"""TLS for the data port: the client's and the node's `ssl.SSLContext`, and one-line
errors for the ways a handshake fails (docs/protocol.md §13).

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


class TlsError(UprError):
    """A TLS handshake failed (certificate, protocol or a plain peer)."""


class CertificateError(TlsError):
    """The server certificate did not verify: unknown CA, expired, or another name."""


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


def server_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """The node's context: its certificate chain and key, TLS 1.2 or later."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _load_chain(ctx, certfile, keyfile, "--tls-cert/--tls-key")
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


def handshake_error(exc: OSError, where: str) -> TlsError:
    """The one-line error for a failed handshake with `where` (host:port)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = (exc.verify_message or _why(exc)).rstrip(".")
        why = why.replace("in certificate chain", "in chain")
        hint = " (use --cacert FILE)" if exc.verify_code in _UNTRUSTED else ""
        return CertificateError(f"{where}: certificate verify failed: {why}{hint}")
    why = "the peer closed the connection" if isinstance(exc, _CLOSED) else _why(exc)
    return TlsError(
        f"{where}: TLS handshake failed ({why}): a plain data port? "
        f"those take upr:// or couchbase://"
    )


def _why(exc: OSError) -> str:
    """OpenSSL's reason, without the library tag and the C source line it adds."""
    reason = getattr(exc, "reason", None)
    if isinstance(exc, ssl.SSLError) and reason:
        return str(reason).lower().replace("_", " ")
    text = exc.strerror or str(exc) or type(exc).__name__
    return re.sub(r"^\[\w+\] | \(_ssl\.c:\d+\)$", "", text)
