"""Certificate validity dates read from the DER (upr_cli/net/certdates.py), checked
against what `cryptography` wrote."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from upr_cli.net.certdates import date_warning, file_validity

UTC = datetime.UTC
NOW = datetime.datetime(2026, 12, 6, 12, 0, 0, tzinfo=UTC)
DAY = datetime.timedelta(days=1)


def _pem(not_before: datetime.datetime, not_after: datetime.datetime) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        # a non-empty SAN: current `cryptography` refuses an empty one
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def _file(tmp: Path, *spans: tuple[datetime.datetime, datetime.datetime]) -> Path:
    path = tmp / "chain.pem"
    path.write_bytes(b"".join(_pem(a, b) for a, b in spans))
    return path


def test_dates_are_read_as_written_utctime_and_generalizedtime(tmp_path: Path) -> None:
    # RFC 5280: UTCTime through 2049, GeneralizedTime from 2050
    spans = [
        (datetime.datetime(1999, 3, 4, 5, 6, 7, tzinfo=UTC), NOW),
        (NOW - DAY, datetime.datetime(2051, 1, 2, 3, 4, 5, tzinfo=UTC)),
    ]
    assert file_validity(_file(tmp_path, *spans)) == spans


def test_a_valid_certificate_gets_no_warning(tmp_path: Path) -> None:
    assert date_warning(_file(tmp_path, (NOW - DAY, NOW + DAY)), "--tls-cert", NOW) is None


def test_an_expired_certificate_gets_one_line_naming_its_dates(tmp_path: Path) -> None:
    path = _file(tmp_path, (NOW - 10 * DAY, NOW - DAY))
    assert date_warning(path, "--tls-cert", NOW) == (
        f"--tls-cert {path}: the certificate expired on 2026-12-05 12:00:00 UTC (valid from "
        "2026-11-26 12:00:00 UTC to 2026-12-05 12:00:00 UTC); TLS clients will refuse it"
    )


def test_a_certificate_not_yet_valid_gets_one_line_naming_its_dates(tmp_path: Path) -> None:
    path = _file(tmp_path, (NOW + DAY, NOW + 10 * DAY))
    assert date_warning(path, "--tls-cert", NOW) == (
        f"--tls-cert {path}: the certificate is not valid until 2026-12-07 12:00:00 UTC (valid "
        "from 2026-12-07 12:00:00 UTC to 2026-12-16 12:00:00 UTC); TLS clients will refuse it"
    )


def test_an_expired_certificate_further_down_the_chain_is_named(tmp_path: Path) -> None:
    path = _file(tmp_path, (NOW - DAY, NOW + DAY), (NOW - 10 * DAY, NOW - DAY))
    warning = date_warning(path, "--tls-cert", NOW)
    assert warning is not None and "certificate 2 of the chain expired on 2026-12-05" in warning


@pytest.mark.parametrize("content", [b"", b"not a pem", b"-----BEGIN CERTIFICATE-----\nAAAA\n"
                                     b"-----END CERTIFICATE-----\n"])  # fmt: skip
def test_a_file_that_does_not_parse_gets_no_warning(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "odd.pem"
    path.write_bytes(content)
    assert date_warning(path, "--tls-cert", NOW) is None
