"""Source URIs: parse/format pairs, defaults, IPv6, percent-encoding, and no leaked password."""

from __future__ import annotations

import dataclasses
from urllib.parse import quote

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from upr_cli.errors import UsageError
from upr_cli.net.uri import DEFAULT_PORT, SourceUri

NO_ENV: dict[str, str] = {}


def parse(text: str, *, env: dict[str, str] = NO_ENV, bucket_optional: bool = False) -> SourceUri:
    """SourceUri.parse with an empty environment unless one is given."""
    return SourceUri.parse(text, env=env, bucket_optional=bucket_optional)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("upr://127.0.0.1/default", SourceUri("upr", "127.0.0.1", 11210, "default")),
        ("upr://localhost:12000/travel-sample", SourceUri(
            "upr", "localhost", 12000, "travel-sample")),
        ("couchbase://127.0.0.1/b", SourceUri("couchbase", "127.0.0.1", 11210, "b")),
        ("UPR://127.0.0.1/b", SourceUri("upr", "127.0.0.1", 11210, "b")),
        ("upr://alice@127.0.0.1/b", SourceUri("upr", "127.0.0.1", 11210, "b", "alice", None)),
        ("upr://alice:pw@127.0.0.1/b", SourceUri("upr", "127.0.0.1", 11210, "b", "alice", "pw")),
        ("upr://alice:@127.0.0.1/b", SourceUri("upr", "127.0.0.1", 11210, "b", "alice", "")),
        ("upr://[::1]/b", SourceUri("upr", "::1", 11210, "b")),
        ("upr://[::1]:11999/b", SourceUri("upr", "::1", 11999, "b")),
        ("upr://[fe80::1%25eth0]:1/b", SourceUri("upr", "fe80::1%eth0", 1, "b")),
        ("upr://a%40b:p%3Aw%2F@127.0.0.1/my%25bucket", SourceUri(
            "upr", "127.0.0.1", 11210, "my%bucket", "a@b", "p:w/")),
        ("upr://alice:p@ss/w?rd#@127.0.0.1/b", SourceUri(
            "upr", "127.0.0.1", 11210, "b", "alice", "p@ss/w?rd#")),
        ("upr://alice:%C3%A9t%C3%A9@127.0.0.1/b", SourceUri(
            "upr", "127.0.0.1", 11210, "b", "alice", "été")),
        ("  upr://127.0.0.1/b\n", SourceUri("upr", "127.0.0.1", 11210, "b")),
    ],
)  # fmt: skip
def test_parse(text: str, expected: SourceUri) -> None:
    assert parse(text) == expected


def test_defaults() -> None:
    uri = parse("upr://127.0.0.1/default")
    assert uri.port == DEFAULT_PORT == 11210
    assert uri.username is None
    assert uri.password is None
    assert uri.address == ("127.0.0.1", 11210)


def test_ipv6_address_has_no_brackets() -> None:
    assert parse("upr://[::1]:12000/b").address == ("::1", 12000)


def test_bucket_optional() -> None:
    assert parse("upr://127.0.0.1", bucket_optional=True).bucket is None
    assert parse("upr://127.0.0.1/", bucket_optional=True).bucket is None
    assert parse("upr://127.0.0.1/b", bucket_optional=True).bucket == "b"


def test_password_from_environment() -> None:
    env = {"UPR_PASSWORD": "from-env"}
    assert parse("upr://alice@127.0.0.1/b", env=env).password == "from-env"
    assert parse("upr://alice:given@127.0.0.1/b", env=env).password == "given"
    assert parse("upr://alice:@127.0.0.1/b", env=env).password == ""
    assert parse("upr://127.0.0.1/b", env=env).password is None
    assert parse("upr://alice@127.0.0.1/b").password is None


@pytest.mark.parametrize(
    ("uri", "text"),
    [
        (SourceUri("upr", "127.0.0.1", 11210, "default"), "upr://127.0.0.1:11210/default"),
        (SourceUri("couchbase", "::1", 12000, "b"), "couchbase://[::1]:12000/b"),
        (SourceUri("upr", "h", 1, None, "al,ice@x"), "upr://al%2Cice%40x@h:1"),
        (SourceUri("upr", "h", 1, "b%", "alice", "secret"), "upr://alice:***@h:1/b%25"),
        (SourceUri("upr", "h", 1, "b", "alice", ""), "upr://alice:***@h:1/b"),
        (SourceUri("upr", "fe80::1%eth0", 1, "b"), "upr://[fe80::1%25eth0]:1/b"),
    ],
)
def test_str_is_redacted_and_canonical(uri: SourceUri, text: str) -> None:
    assert str(uri) == uri.redacted() == text


def test_repr_is_redacted() -> None:
    uri = SourceUri("upr", "127.0.0.1", 11210, "b", "alice", "hunter2")
    assert "hunter2" not in repr(uri)
    assert repr(uri) == (
        "SourceUri(scheme='upr', host='127.0.0.1', port=11210, bucket='b', "
        "username='alice', password='***')"
    )
    assert "hunter2" not in f"{uri} {uri!r} {[uri]}"
    assert "hunter2" not in str({"k": uri})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("127.0.0.1/b", "must look like"),
        ("http://127.0.0.1/b", "unknown source URI scheme 'http'"),
        ("https://127.0.0.1/b", "unknown source URI scheme 'https'"),
        ("upr://127.0.0.1", "needs a bucket"),
        ("upr://127.0.0.1/", "needs a bucket"),
        ("upr:///b", "empty host"),
        ("upr://:11210/b", "empty host"),
        ("upr://127.0.0.1:/b", "port must be"),
        ("upr://127.0.0.1:0/b", "port must be"),
        ("upr://127.0.0.1:65536/b", "port must be"),
        ("upr://127.0.0.1:http/b", "port must be"),
        ("upr://127.0.0.1:١٢/b", "port must be"),
        ("upr://::1/b", "brackets"),
        ("upr://[::1/b", "unclosed"),
        ("upr://[not-ipv6]/b", "invalid IPv6"),
        ("upr://[::1]x/b", "after the ']'"),
        ("upr://bad host/b", "invalid host name"),
        ("upr://127.0.0.1/a/b", "single bucket"),
        ("upr://127.0.0.1/b?x=1", "query"),
        ("upr://127.0.0.1/.hidden", "bucket names"),
        ("upr://127.0.0.1/b%zz", "percent-escape"),
        ("upr://127.0.0.1/" + "b" * 101, "bucket names"),
        ("upr://@127.0.0.1/b", "empty user name"),
        ("upr://:pw@127.0.0.1/b", "empty user name"),
        ("upr://alice:%ff@127.0.0.1/b", "not UTF-8"),
        ("upr://alice:a%00b@127.0.0.1/b", "NUL"),
    ],
)
def test_errors(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        parse(text)
    assert "\n" not in str(info.value)


uris = st.builds(
    SourceUri,
    scheme=st.sampled_from(["upr", "couchbase"]),
    host=st.sampled_from(["127.0.0.1", "localhost", "::1", "node-1.example"]),
    port=st.integers(1, 65535),
    bucket=st.from_regex(r"[A-Za-z0-9_%-][A-Za-z0-9_.%-]{0,20}", fullmatch=True),
    username=st.none() | st.text(min_size=1).filter(lambda s: "\0" not in s),
)


@given(uris)
def test_format_then_parse_round_trips(uri: SourceUri) -> None:
    assert parse(str(uri)) == uri


@given(uris, st.text().filter(lambda s: "\0" not in s))
def test_password_round_trips_through_percent_encoding(uri: SourceUri, password: str) -> None:
    uri = dataclasses.replace(uri, username=uri.username or "alice", password=password)
    text = str(uri).replace(":***@", ":" + quote(password, safe="") + "@")
    assert parse(text) == uri


# The password never shows: str, repr and errors are the same whatever it is.

passwords = st.text(min_size=10).filter(lambda s: "\0" not in s)
OTHER = "Zz9-placeholder-Zz9"


def error_for(text: str) -> str:
    with pytest.raises(UsageError) as info:
        parse(text)
    return str(info.value)


@given(passwords)
def test_password_absent_from_str_and_repr(password: str) -> None:
    template = "upr://alice:{}@127.0.0.1:11210/default"
    uri = parse(template.format(quote(password, safe="")))
    assert uri.password == password
    other = parse(template.format(OTHER))
    assert (str(uri), repr(uri)) == (str(other), repr(other))  # the password changes nothing
    assume(password not in str(other) + repr(other))  # e.g. "127.0.0.1:" is in the text
    assert password not in str(uri) + repr(uri)


@pytest.mark.parametrize(
    "template",
    [
        "upr://alice:{}@127.0.0.1:99999/default",
        "upr://alice:{}@127.0.0.1/",
        "upr://alice:{}@[::1/default",
        "upr://alice:{}@127.0.0.1/bad/bucket",
        "http://alice:{}@127.0.0.1/default",
        "upr://:{}@127.0.0.1/default",
    ],
)
@given(password=passwords)
def test_password_absent_from_errors(template: str, password: str) -> None:
    encoded = quote(password, safe="")
    message = error_for(template.format(encoded))
    neutral = error_for(template.format(OTHER))
    assert message == neutral  # the password changes nothing in the message
    assume(password not in neutral and encoded not in neutral)  # e.g. "couchbase:" is
    assert password not in message
    assert encoded not in message


@given(password=passwords, at=st.booleans())
def test_raw_password_absent_from_errors(password: str, at: bool) -> None:
    """Unencoded passwords, or a forgotten "@", still never reach the message."""
    text = f"upr://alice:{password}{'@' if at else '/'}127.0.0.1:0/b"
    with pytest.raises(UsageError) as info:
        parse(text)
    assert password not in str(info.value)


def test_more_bootstrap_hosts() -> None:
    """`host[:port][,host[:port]...]`: further bootstrap nodes of the same cluster, tried
    in order; duplicates (and the first host again) are dropped."""
    uri = parse("upr://alice:pw@n1:1,n2,[::1]:3,n2:11210,n1:1/b")
    assert (uri.host, uri.port, uri.seeds) == ("n1", 1, (("n2", 11210), ("::1", 3)))
    assert uri.hosts == [("n1", 1), ("n2", 11210), ("::1", 3)]
    assert str(uri) == "upr://alice:***@n1:1,n2:11210,[::1]:3/b"
    assert "seeds=(('n2', 11210), ('::1', 3))" in repr(uri) and "pw" not in repr(uri)
    assert parse(str(uri).replace("***", "pw")) == uri
    at = uri.at("n2", 11210)
    assert (at.host, at.port, at.seeds, at.password) == ("n2", 11210, (), "pw")
    moved = uri.rebase("::1", 3)
    assert moved.hosts == [("::1", 3), ("n1", 1), ("n2", 11210)]
    with pytest.raises(UsageError, match="empty host"):
        parse("upr://n1,,n2/b")
    with pytest.raises(UsageError, match="port must be"):
        parse("upr://n1,n2:0/b")
    with pytest.raises(UsageError, match="more than 16 hosts"):
        parse("upr://" + ",".join(f"n{i}" for i in range(17)) + "/b")


@given(uris, st.lists(st.tuples(st.sampled_from(["n1", "n2", "::1"]), st.integers(1, 65535)),
                      max_size=4))  # fmt: skip
def test_hosts_round_trip(uri: SourceUri, more: list[tuple[str, int]]) -> None:
    seeds = tuple(h for h in dict.fromkeys(more) if h != uri.address)
    uri = dataclasses.replace(uri, seeds=seeds)
    assert parse(str(uri)) == uri
