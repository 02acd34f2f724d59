"""The validity dates of the certificates in a PEM file, and the warning a node gives at
start when its own certificate is outside them.

`ssl` loads an expired or not-yet-valid certificate without a word, and the node would
then fail every handshake of a client that checks dates (all of them) with nothing in
its own log. The standard library does not expose a loaded certificate's dates, so this
module reads them from the DER itself: Certificate → tbsCertificate → validity
(RFC 5280 §4.1: version [0], serialNumber, signature, issuer, validity), each time a
UTCTime (years 1950-2049) or a GeneralizedTime (RFC 5280 §4.1.2.5).
"""

from __future__ import annotations

import re
import ssl
from datetime import UTC, datetime
from pathlib import Path

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.DOTALL)
_SEQUENCE, _CONTEXT_0, _UTC_TIME, _GENERALIZED_TIME = 0x30, 0xA0, 0x17, 0x18


def _tlv(der: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of the content, end of the content) of the DER element at `pos`."""
    if pos + 2 > len(der):
        raise ValueError("truncated element")
    tag, length = der[pos], der[pos + 1]
    pos += 2
    if length & 0x80:
        n = length & 0x7F
        if not 1 <= n <= 4 or pos + n > len(der):
            raise ValueError("bad length")
        length = int.from_bytes(der[pos : pos + n], "big")
        pos += n
    if pos + length > len(der):
        raise ValueError("truncated element")
    return tag, pos, pos + length


def _time(tag: int, text: bytes) -> datetime:
    s = text.decode("ascii")
    if tag == _UTC_TIME:  # YYMMDDHHMMSSZ
        t = datetime.strptime(s, "%y%m%d%H%M%SZ")
        year = t.year % 100
        t = t.replace(year=(1900 if year >= 50 else 2000) + year)
    elif tag == _GENERALIZED_TIME:  # YYYYMMDDHHMMSSZ
        t = datetime.strptime(s, "%Y%m%d%H%M%SZ")
    else:
        raise ValueError(f"tag {tag:#x} is not a time")
    return t.replace(tzinfo=UTC)


def validity(der: bytes) -> tuple[datetime, datetime]:
    """(notBefore, notAfter) of a DER certificate; ValueError if it does not parse."""
    tag, start, _ = _tlv(der, 0)
    if tag != _SEQUENCE:
        raise ValueError("not a certificate")
    tag, pos, _ = _tlv(der, start)  # tbsCertificate
    if tag != _SEQUENCE:
        raise ValueError("no tbsCertificate")
    tag, _, after = _tlv(der, pos)
    if tag == _CONTEXT_0:  # version
        pos = after
    for _field in ("serialNumber", "signature", "issuer"):
        _, _, pos = _tlv(der, pos)
    tag, pos, _ = _tlv(der, pos)
    if tag != _SEQUENCE:
        raise ValueError("no validity")
    tag, start, pos = _tlv(der, pos)
    not_before = _time(tag, der[start:pos])
    tag, start, pos = _tlv(der, pos)
    return not_before, _time(tag, der[start:pos])


def file_validity(path: Path) -> list[tuple[datetime, datetime]]:
    """The validity of every certificate in a PEM file, in file order (leaf first)."""
    out = []
    for block in _PEM.findall(path.read_bytes()):
        out.append(validity(ssl.PEM_cert_to_DER_cert(block.decode("ascii"))))
    return out


def _date(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def date_warning(path: Path, label: str, now: datetime | None = None) -> str | None:
    """One line when a certificate in the PEM file `path` is expired or not yet valid
    (`label` names the option, e.g. "--tls-cert"), else None. A file this cannot read
    gets None: `ssl` has accepted it, and the check is only a warning."""
    now = now or datetime.now(UTC)
    try:
        dates = file_validity(path)
    except (OSError, ValueError):
        return None
    for i, (not_before, not_after) in enumerate(dates):
        which = "the certificate" if i == 0 else f"certificate {i + 1} of the chain"
        span = f"valid from {_date(not_before)} to {_date(not_after)}"
        if now > not_after:
            what = f"{which} expired on {_date(not_after)} ({span})"
        elif now < not_before:
            what = f"{which} is not valid until {_date(not_before)} ({span})"
        else:
            continue
        return f"{label} {path}: {what}; TLS clients will refuse it"
    return None
