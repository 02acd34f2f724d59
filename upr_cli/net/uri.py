"""Source URIs: upr://[user[:password]@]host[:port][,host[:port]...]/bucket, with
couchbase:// as a synonym; uprs:// and couchbases:// are the same over TLS
(docs/protocol.md §13).

More hosts after the first are further bootstrap nodes of the same cluster, tried in
order when the ones before cannot be reached (a node removed or down); the cluster map
names every other node, so one reachable host is enough (formats/cluster.md §4).

The password is a secret: `str`, `repr` and every error message show at most "***", so a
`SourceUri` can be logged or echoed as it is. Error messages quote nothing the user typed
except a well-formed scheme, because a mistyped URI can put the password anywhere.

User name, password and bucket are percent-decoded. The userinfo ends at the last "@", so
a password with a raw "@", "/" or "?" still parses. A user given without a password takes
it from $UPR_PASSWORD (which `--password-file FILE` sets from the file, so it keeps the
password out of `ps` and of the shell's environment; `read_password_file`); "user:@"
means an explicitly empty password. When neither gives one and stdin is a terminal, the
password is asked for there (`getpass`, without echo), once: the answer is kept in
$UPR_PASSWORD for the command's other URIs and the processes it starts. Without a
terminal nothing is asked (a cron job must not hang): the node's refusal says what to
set. The port defaults to 11210, the memcached data port (docs/protocol.md §5), or
11207, the TLS data port.
"""

from __future__ import annotations

import getpass
import ipaddress
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import quote, unquote

from upr_cli.errors import PathError, UsageError
from upr_cli.net.tls import DEFAULT_TLS_PORT, ClientTls

SCHEMES = ("upr", "couchbase", "uprs", "couchbases")
"""Accepted URI schemes: upr and couchbase mean the same, uprs and couchbases too (TLS)."""
TLS_SCHEMES = ("uprs", "couchbases")
"""The schemes that connect with TLS."""
DEFAULT_PORT = 11210
"""The memcached data port, used when the URI gives none."""
PASSWORD_ENV = "UPR_PASSWORD"
"""Environment variable holding the password for a URI that names a user but no password."""
FORM = "upr[s]://[user[:password]@]host[:port][,host[:port]...]/bucket"
"""The URI syntax, as shown in error messages."""

_SCHEME_TOKEN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,19}")
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}")
_PORT = re.compile(r"[0-9]{1,5}")
_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
# Couchbase bucket names: letters, digits, "_", "-", ".", "%"; at most 100; no leading ".".
_BUCKET = re.compile(r"[A-Za-z0-9_%-][A-Za-z0-9_.%-]{0,99}")


@dataclass(frozen=True, slots=True, repr=False)
class SourceUri:
    """Where to read from: a node address, a bucket and optional credentials."""

    scheme: str
    host: str
    port: int = DEFAULT_PORT
    bucket: str | None = None
    username: str | None = None
    password: str | None = None
    seeds: tuple[tuple[str, int], ...] = ()  # more bootstrap nodes, tried in order
    tls: ClientTls | None = None  # TLS settings; None: from the environment

    @classmethod
    def parse(
        cls, text: str, *, env: Mapping[str, str] = os.environ, bucket_optional: bool = False
    ) -> SourceUri:
        """Parse `text`; raise `UsageError` (without the password) when it is invalid."""
        scheme, sep, rest = text.strip().partition("://")
        if not sep:
            raise UsageError(f"source URI must look like {FORM}")
        if scheme.lower() not in SCHEMES:
            shown = f" {scheme!r}" if _SCHEME_TOKEN.fullmatch(scheme) else ""
            raise UsageError(
                f"unknown source URI scheme{shown}: use upr://, couchbase:// or, over TLS, "
                "uprs://, couchbases://"
            )
        scheme = scheme.lower()
        default_port = DEFAULT_TLS_PORT if scheme in TLS_SCHEMES else DEFAULT_PORT

        userinfo, at, location = rest.rpartition("@")
        username = password = None
        if at:
            user_text, colon, password_text = userinfo.partition(":")
            username = _decode(user_text, "user name")
            if not username:
                raise UsageError("source URI has an empty user name")
            password = _decode(password_text, "password") if colon else env.get(PASSWORD_ENV)

        if "?" in location or "#" in location:
            raise UsageError("source URI cannot have a query or a fragment")
        hostport, _, path = location.partition("/")
        hosts = [_host_port(h, default_port) for h in hostport.split(",")]
        if len(hosts) > 16:
            raise UsageError("source URI lists more than 16 hosts")
        (host, port), seeds = hosts[0], tuple(h for h in dict.fromkeys(hosts[1:]) if h != hosts[0])
        bucket = _bucket(path, bucket_optional)
        if username is not None and password is None and env is os.environ:
            password = _ask_password(username, _show_host(host), port)
        return cls(scheme, host, port, bucket, username, password, seeds)

    @property
    def secure(self) -> bool:
        """True for uprs:// and couchbases://: the connection is TLS."""
        return self.scheme in TLS_SCHEMES

    def with_tls(self, tls: ClientTls) -> SourceUri:
        """The same URI with these TLS settings (used by TLS schemes only)."""
        return replace(self, tls=tls)

    def rebase(self, host: str, port: int) -> SourceUri:
        """The same URI with (host, port) first, the other bootstrap hosts kept after it."""
        rest = tuple(h for h in self.hosts if h != (host, port))
        return replace(self, host=host, port=port, seeds=rest)

    def at(self, host: str, port: int) -> SourceUri:
        """The same credentials and bucket on one node, with no other bootstrap hosts."""
        return replace(self, host=host, port=port, seeds=())

    @property
    def hosts(self) -> list[tuple[str, int]]:
        """Every bootstrap node, the first one first."""
        return [(self.host, self.port), *(h for h in self.seeds if h != self.address)]

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) for `asyncio.open_connection`; IPv6 hosts without brackets."""
        return (self.host, self.port)

    def redacted(self) -> str:
        """The URI with the password shown as "***" (if one is set)."""
        userinfo = ""
        if self.username is not None:
            secret = "" if self.password is None else ":***"
            userinfo = f"{quote(self.username, safe='')}{secret}@"
        hosts = ",".join(f"{_show_host(h)}:{p}" for h, p in self.hosts)
        path = "" if self.bucket is None else "/" + quote(self.bucket, safe="")
        return f"{self.scheme}://{userinfo}{hosts}{path}"

    def __str__(self) -> str:
        """The redacted URI."""
        return self.redacted()

    def __repr__(self) -> str:
        """Field by field, with the password redacted."""
        secret = None if self.password is None else "***"
        seeds = f", seeds={self.seeds!r}" if self.seeds else ""
        return (
            f"SourceUri(scheme={self.scheme!r}, host={self.host!r}, port={self.port!r}, "
            f"bucket={self.bucket!r}, username={self.username!r}, password={secret!r}{seeds})"
        )


def read_password_file(path: str | os.PathLike[str]) -> str:
    """`--password-file FILE`: the file's text, one trailing newline removed. A file that
    cannot be read, is not UTF-8 or holds no password is a `UsageError` (exit 2) naming
    the file, never its content."""
    where = f"--password-file {os.fspath(path)}"
    try:
        data = Path(path).read_bytes()
    except IsADirectoryError:
        raise PathError(f"{where}: is a directory, not a file") from None
    except OSError as exc:
        raise PathError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise UsageError(f"{where}: not UTF-8 text") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise UsageError(f"{where}: the file is empty: it must hold the password")
    if "\0" in text:
        raise UsageError(f"{where}: the password contains a NUL")
    return text


def _ask_password(username: str, host: str, port: int) -> str | None:
    """The password asked for on the terminal (module docstring), or None without one."""
    try:
        if not sys.stdin.isatty():
            return None
    except (AttributeError, ValueError):  # no stdin at all, or a closed one
        return None
    try:
        password = getpass.getpass(f"Password for {username}@{host}:{port}: ")
    except EOFError:
        raise UsageError(f"no password given for {username} (Ctrl-D at the prompt)") from None
    os.environ[PASSWORD_ENV] = password
    return password


def _show_host(host: str) -> str:
    return f"[{host.replace('%', '%25')}]" if ":" in host else host


def _decode(text: str, what: str) -> str:
    """Percent-decode one URI component, strictly (bad escapes and bad UTF-8 are errors)."""
    if _BAD_PERCENT.search(text):
        raise UsageError(f"source URI {what} has an invalid percent-escape")
    try:
        value = unquote(text, errors="strict")
    except UnicodeDecodeError:
        raise UsageError(f"source URI {what} is not UTF-8 once percent-decoded") from None
    if "\0" in value:
        raise UsageError(f"source URI {what} contains a NUL")
    return value


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise UsageError("source URI has an unclosed '[' in its host")
        host = text[1:end].replace("%25", "%")  # RFC 6874 zone id: [fe80::1%25eth0]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UsageError("source URI has an invalid IPv6 address in brackets") from None
        after = text[end + 1 :]
        if after and not after.startswith(":"):
            raise UsageError("source URI has unexpected text after the ']' of its host")
        port_text = after[1:] if after else None
    else:
        host, colon, port_text_or_empty = text.partition(":")
        if ":" in port_text_or_empty:
            raise UsageError("IPv6 hosts go in brackets, e.g. upr://[::1]:11210/bucket")
        if not host:
            raise UsageError("source URI has an empty host")
        if not _HOST.fullmatch(host):
            raise UsageError("source URI has an invalid host name")
        port_text = port_text_or_empty if colon else None
    return host, _port(port_text, default_port)


def _port(text: str | None, default: int) -> int:
    if text is None:
        return default
    if not _PORT.fullmatch(text) or not 1 <= int(text) <= 65535:
        raise UsageError("source URI port must be a number from 1 to 65535")
    return int(text)


def _bucket(path: str, optional: bool) -> str | None:
    if "/" in path:
        raise UsageError("source URI path must be a single bucket name")
    bucket = _decode(path, "bucket")
    if not bucket:
        if optional:
            return None
        raise UsageError(f"source URI needs a bucket: {FORM}")
    if not _BUCKET.fullmatch(bucket):
        raise UsageError(
            "bucket names use letters, digits, '_', '-', '.', '%' (at most 100, no leading '.')"
        )
    return bucket
