"""Format/parse pairs of every repository name: round trips, fixed width, sort order."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from upr_cli.repo import (
    BackupId,
    RepositoryError,
    SegmentName,
    check_bucket,
    format_cut_path,
    format_segment_name,
    format_time,
    is_temp_name,
    parse_cut_path,
    parse_segment_name,
    parse_temp_name,
    parse_time,
    temp_name,
)

U64 = (1 << 64) - 1
times = st.datetimes(
    min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59, 999999)
).map(lambda t: t.replace(tzinfo=UTC))
seqs = st.integers(0, U64)
segment_names = st.builds(
    lambda p, a, b: SegmentName(p, min(a, b), max(a, b)), st.integers(0, 0xFFFF), seqs, seqs
)


@given(times)
def test_backup_id_round_trip_and_width(t: datetime) -> None:
    bid = BackupId(t)
    text = bid.format()
    assert len(text) == 23 and str(bid) == text
    assert BackupId.parse(text) == bid


@given(st.lists(times, min_size=2, max_size=20))
def test_backup_id_text_order_is_time_order(ts: list[datetime]) -> None:
    ids = [BackupId(t) for t in ts]
    assert sorted(ids) == sorted(ids, key=lambda b: b.format())
    assert [b.time for b in sorted(ids)] == sorted(ts)


def test_backup_id_example() -> None:
    bid = BackupId.parse("20261121T061500.123456Z")
    assert bid.time == datetime(2026, 11, 21, 6, 15, 0, 123456, tzinfo=UTC)
    assert BackupId(datetime(5, 1, 2, tzinfo=UTC)).format() == "00050102T000000.000000Z"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "20261121T061500Z",
        "20261121T061500.12345Z",
        "20261121t061500.123456Z",
        "20261121T061500.123456z",
        "20261121T061500.123456",
        "20260230T061500.123456Z",  # no 30 February
        "20261121T246000.123456Z",
        "00001121T061500.123456Z",  # year 0
        " 20261121T061500.123456Z",
        "2026-11-21T06:15:00.123456Z",
        "\uff120261121T061500.123456Z",  # a non-ASCII digit
    ],
)
def test_backup_id_rejects(text: str) -> None:
    with pytest.raises(RepositoryError, match="backup id"):
        BackupId.parse(text)
    assert not BackupId.is_valid(text)


def test_backup_id_needs_utc() -> None:
    with pytest.raises(RepositoryError, match="UTC"):
        BackupId(datetime(2026, 1, 1))
    with pytest.raises(RepositoryError, match="UTC"):
        BackupId(datetime(2026, 1, 1, tzinfo=timezone(timedelta(hours=1))))


def test_backup_id_now_is_after_a_future_id() -> None:
    future = BackupId(datetime(9000, 1, 1, tzinfo=UTC))
    assert BackupId.now(after=future) == future.next() > future
    assert BackupId.now() > BackupId(datetime(2020, 1, 1, tzinfo=UTC))


@given(times)
def test_time_round_trip(t: datetime) -> None:
    text = format_time(t)
    assert len(text) == 27 and parse_time(text) == t


@pytest.mark.parametrize("text", ["2026-11-21T06:15:00Z", "2026-11-21 06:15:00.000000Z", "x"])
def test_time_rejects(text: str) -> None:
    with pytest.raises(RepositoryError, match="time"):
        parse_time(text)


@given(segment_names)
def test_segment_name_round_trip_and_width(n: SegmentName) -> None:
    text = n.format()
    assert len(text) == 45 and text == format_segment_name(n.partition, n.first_seq, n.last_seq)
    assert parse_segment_name(text) == n == SegmentName.parse(text)


@given(st.lists(segment_names, min_size=2, max_size=30))
def test_segment_name_order_is_partition_seq_order(names: list[SegmentName]) -> None:
    assert sorted(n.format() for n in names) == [n.format() for n in sorted(names)]


def test_segment_name_example() -> None:
    text = "p03ff-s0000000000000001-e00000000000004d2.seg"
    assert parse_segment_name(text) == SegmentName(0x3FF, 1, 0x4D2)
    assert format_segment_name(1023, 1, 1234) == text


@pytest.mark.parametrize(
    "text",
    [
        "p03FF-s0000000000000001-e00000000000004d2.seg",  # uppercase
        "p3ff-s0000000000000001-e00000000000004d2.seg",
        "p03ff-s000000000000001-e00000000000004d2.seg",
        "p03ff-s0000000000000001-e00000000000004d2.zst",
        "p03ff-s0000000000000002-e0000000000000001.seg",  # first > last
        "p03ff_s0000000000000001_e00000000000004d2.seg",
        "p03ff-s0000000000000001-e00000000000004d2.seg.tmp",
    ],
)
def test_segment_name_rejects(text: str) -> None:
    with pytest.raises(RepositoryError):
        parse_segment_name(text)


@given(st.integers(1, 9999), segment_names)
def test_cut_path_round_trip(k: int, n: SegmentName) -> None:
    text = format_cut_path(k, n.format())
    assert text == f"cut-{k}/{n.format()}" and parse_cut_path(text) == (k, n)


@pytest.mark.parametrize(
    "text",
    [
        "cut-0/p03ff-s0000000000000001-e00000000000004d2.seg",  # K starts at 1
        "cut-01/p03ff-s0000000000000001-e00000000000004d2.seg",  # no leading zero
        "cut-10000/p03ff-s0000000000000001-e00000000000004d2.seg",
        "cut-1/../p03ff-s0000000000000001-e00000000000004d2.seg",
        "cut-1/p03FF-s0000000000000001-e00000000000004d2.seg",
        "cut-1/x.seg",
        "cut-1",
        "p03ff-s0000000000000001-e00000000000004d2.seg",
    ],
)
def test_cut_path_rejects(text: str) -> None:
    with pytest.raises(RepositoryError):
        parse_cut_path(text)
    with pytest.raises(RepositoryError):
        format_cut_path(0, "p03ff-s0000000000000001-e00000000000004d2.seg")


def test_segment_name_bounds() -> None:
    with pytest.raises(RepositoryError, match="partition"):
        SegmentName(0x10000, 1, 1)
    with pytest.raises(RepositoryError):
        SegmentName(0, 1, 1 << 64)


@given(
    st.sampled_from(["manifest.json", "manifest.json.copy", "repo.json"]),
    st.binary(min_size=4, max_size=4),
)
def test_temp_name_round_trip(final: str, token: bytes) -> None:
    name = temp_name(final, token.hex())
    assert parse_temp_name(name) == final and is_temp_name(name)
    assert parse_temp_name(name + "-body") == final  # the segment writer's body file


def test_temp_names() -> None:
    seg = "p0000-s0000000000000001-e0000000000000002.seg"
    assert parse_temp_name(temp_name(seg)) == seg
    assert temp_name(seg) != temp_name(seg)  # random token
    for name in ["manifest.json", seg, "lock", ".manifest.json", ".x.tmp-XYZ", ".x.tmp-1234"]:
        assert not is_temp_name(name)
    with pytest.raises(RepositoryError):
        temp_name("a/b")
    with pytest.raises(RepositoryError):
        temp_name("x", "nothex!!")


def test_bucket_names() -> None:
    for ok in ["default", "travel-sample", "a", "b_1.2%", "x" * 100]:
        assert check_bucket(ok) == ok
    for bad in ["", ".hidden", "a/b", "..", "x" * 101, "sp ace", "repo.json", "ü"]:
        with pytest.raises(RepositoryError, match="bucket name"):
            check_bucket(bad)
