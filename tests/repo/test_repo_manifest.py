"""Manifests: JSON round trips, the checksum, and every malformed-field rejection."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from upr_cli.failover import FailoverLog
from upr_cli.repo import (
    BackupId,
    CutBack,
    Manifest,
    PartitionEntry,
    RepositoryError,
    RollbackRecord,
    SegmentEntry,
    Totals,
    checksum_hex,
    format_segment_name,
)
from upr_cli.repo.manifest import MAX_MANIFEST_BYTES, canonical_json

U64 = (1 << 64) - 1
T0 = datetime(2026, 11, 21, 6, 15, tzinfo=UTC)
B1 = BackupId(T0)
B2 = BackupId(T0 + timedelta(hours=1))
LOG = FailoverLog.of([(0xBEEF, 80), (0xCAFE, 0)])


def seg(p: int, first: int, last: int, records: int | None = None) -> SegmentEntry:
    name = format_segment_name(p, first, last)
    return SegmentEntry(name, first, last, records or last - first + 1, 4096, "ab" * 16)


def part(p: int = 0, start: int = 80, end: int = 150, **kw: Any) -> PartitionEntry:
    args: dict[str, Any] = {
        "uuid": 0xBEEF,
        "failover_log": LOG,
        "snap_start": end,
        "snap_end": end,
        "segments": (seg(p, start + 1, end),) if end > start else (),
        "rollback": None,
    }
    args.update(kw)
    return PartitionEntry(p, start_seq=start, end_seq=end, **args)


def manifest(parts: tuple[PartitionEntry, ...] | None = None, **kw: Any) -> Manifest:
    parts = parts if parts is not None else (part(0), part(1, 100, 100), part(7, 0, 5))
    args: dict[str, Any] = {
        "backup_id": B2,
        "bucket": "travel-sample",
        "source": "upr://admin:***@127.0.0.1:11210/travel-sample",
        "started": T0 + timedelta(hours=1),
        "finished": T0 + timedelta(hours=1, seconds=9),
        "full": False,
        "parent": B1,
        "partitions": parts,
        "totals": Totals.derive(parts, 12345),
    }
    args.update(kw)
    return Manifest(**args)


# -- round trips ---------------------------------------------------------------------

u64s = st.one_of(st.integers(0, 1000), st.integers(U64 - (1 << 30), U64 - (1 << 22)))


@st.composite
def failover_logs(draw: st.DrawFn, top: int) -> FailoverLog:
    uuids = draw(st.lists(st.integers(1, U64), min_size=1, max_size=5, unique=True))
    seqs = sorted(draw(st.lists(st.integers(0, top), min_size=len(uuids), max_size=len(uuids))))
    return FailoverLog.of(zip(uuids, reversed(seqs), strict=True))


@st.composite
def partition_entries(draw: st.DrawFn, p: int, full: bool) -> PartitionEntry:
    start = 0 if full else draw(u64s)
    points = sorted(draw(st.sets(st.integers(start + 1, start + 10_000), max_size=8)))
    pairs = [(points[i], points[i + 1]) for i in range(0, len(points) - 1, 2)]
    segments = tuple(
        with_bytes(seg(p, a, b, draw(st.integers(1, b - a + 1))), draw(st.integers(1, 1 << 40)))
        for a, b in pairs
    )
    end = max([start, *(b for _, b in pairs)]) + draw(st.integers(0, 100))
    log = draw(failover_logs(end))
    rollback = None
    if not full and draw(st.booleans()):
        rollback = RollbackRecord(
            start + draw(st.integers(0, 50)),
            start,
            draw(st.one_of(st.none(), st.integers(start, start + 50))),
            start + draw(st.integers(0, 50)),
        )
    cuts = []
    for _ in range(draw(st.integers(0, 2))):  # records mid-run rollbacks took back
        to = draw(st.integers(0, end))
        a = to + draw(st.integers(1, 50))
        b = a + draw(st.integers(0, 50))
        cuts.append(CutBack(b + draw(st.integers(0, 9)), to, (seg(p, a, b),)))
    return PartitionEntry(
        p,
        draw(st.sampled_from([e.uuid for e in log])),
        log,
        start,
        end,
        draw(st.integers(0, end)),
        end + draw(st.integers(0, 100)),
        segments,
        rollback,
        tuple(cuts),
    )


def with_bytes(s: SegmentEntry, n: int) -> SegmentEntry:
    return SegmentEntry(s.file, s.first_seq, s.last_seq, s.records, n, s.checksum)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    full = draw(st.booleans())
    ps = sorted(draw(st.sets(st.integers(0, 0xFFFF), max_size=4)))
    parts = tuple(draw(partition_entries(p, full)) for p in ps)
    started = draw(st.datetimes(min_value=datetime(2000, 1, 1))).replace(tzinfo=UTC)
    bid = BackupId(started)
    return Manifest(
        bid,
        draw(st.from_regex(r"[A-Za-z0-9_%-][A-Za-z0-9_.%-]{0,20}", fullmatch=True)),
        "upr://127.0.0.1:11210/b",
        started,
        started + draw(st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=3))),
        full,
        None if full else BackupId(started - timedelta(microseconds=1)),
        parts,
        Totals.derive(parts, draw(st.integers(0, U64))),
    )


@given(manifests())
def test_json_round_trip(m: Manifest) -> None:
    assert Manifest.from_json(m.to_json()) == m
    assert Manifest.loads(m.dumps()) == m
    assert Manifest.loads(m.dumps()).dumps() == m.dumps()


def test_example_fields_and_decimal_strings() -> None:
    m = manifest(parts=(part(3, 80, 150, rollback=RollbackRecord(100, 80, 80, 90)),))
    obj = json.loads(m.dumps())
    assert obj["backup_id"] == "20261121T071500.000000Z" and obj["parent"] == B1.format()
    assert obj["version"] == 2 and obj["format"] == "upr-backup-manifest"
    p = obj["partitions"][0]
    assert p["partition"] == 3 and p["uuid"] == str(0xBEEF)
    assert p["rollback"] == {"from": "100", "to": "80", "seed_rule_seq": "80", "producer_seq": "90"}
    assert p["segments"][0]["file"] == "p0003-s0000000000000051-e0000000000000096.seg"
    assert obj["totals"] == {"items": "70", "bytes_read": "12345", "bytes_written": "4096",
                             "rollbacks": "1"}  # fmt: skip
    body = {k: v for k, v in obj.items() if k != "checksum"}
    assert obj["checksum"] == checksum_hex(canonical_json(body))
    assert m.partition(3) is m.partitions[0] and m.partition(4) is None
    assert m.partition_ids == [3] and m.segment_files() == [p["segments"][0]["file"]]


# -- rejections ----------------------------------------------------------------------


CUT = {"from": "200", "to": "120", "segments": [seg(0, 151, 200).to_json()]}


def test_cut_back_round_trip_and_totals() -> None:
    """A cut-back record rides in the partition entry: its bytes count as written, the
    partition as rolled back, its records in no state."""
    cut = CutBack(200, 120, (seg(0, 151, 200),))
    m = manifest(parts=(part(0, cut_backs=(cut,)), part(1, 100, 100)))
    obj = m.to_json()
    assert obj["partitions"][0]["cut_back"] == [CUT] and "cut_back" not in obj["partitions"][1]
    assert Manifest.from_json(obj) == m
    assert m.partitions[0].cut_files() == [(f"cut-1/{seg(0, 151, 200).file}", cut.segments[0])]
    assert m.totals.items == sum(e.records for e in m.partitions)  # not the cut ones
    assert m.totals.bytes_written == sum(e.bytes for e in m.partitions) + 4096
    assert m.totals.rollbacks == 1


def base() -> dict[str, Any]:
    rb = RollbackRecord(100, 80, None, 80)
    return manifest(parts=(part(0, rollback=rb), part(1, 100, 100))).to_json()


def P0(o: dict[str, Any]) -> dict[str, Any]:
    p: dict[str, Any] = o["partitions"][0]
    return p


def S0(o: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = P0(o)["segments"][0]
    return s


def setter(where: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any) -> Any:
    def f(o: dict[str, Any]) -> None:
        where(o)[key] = value

    return f


def deleter(where: Callable[[dict[str, Any]], dict[str, Any]], key: str) -> Any:
    def f(o: dict[str, Any]) -> None:
        del where(o)[key]

    return f


def top(o: dict[str, Any]) -> dict[str, Any]:
    return o


def totals(o: dict[str, Any]) -> dict[str, Any]:
    t: dict[str, Any] = o["totals"]
    return t


def rollback(o: dict[str, Any]) -> dict[str, Any]:
    r: dict[str, Any] = P0(o)["rollback"]
    return r


def snap(o: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = P0(o)["last_snapshot"]
    return s


def fo0(o: dict[str, Any]) -> dict[str, Any]:
    e: dict[str, Any] = P0(o)["failover_log"][0]
    return e


BAD: list[tuple[str, Any, str]] = [
    # top level
    ("not an object", lambda o: o.clear(), "missing key"),
    ("unknown key", setter(top, "extra", 1), "unknown key 'extra'"),
    ("missing bucket", deleter(top, "bucket"), "missing key 'bucket'"),
    ("format", setter(top, "format", "other"), "format"),
    ("version string", setter(top, "version", "1"), "version"),
    ("version 5", setter(top, "version", 5), "version 5 is not supported"),
    ("version 3 without revision", setter(top, "version", 3), "missing key .revision."),
    ("version bool", setter(top, "version", True), "version"),
    ("backup id", setter(top, "backup_id", "2026-11-21"), "backup id"),
    ("bucket", setter(top, "bucket", ".x"), "bucket name"),
    ("bucket type", setter(top, "bucket", 5), "bucket 5 is not a string"),
    ("source empty", setter(top, "source", ""), "source"),
    ("source password", setter(top, "source", "upr://u:pw@h/b"), "password"),
    ("started", setter(top, "started", "yesterday"), "time"),
    ("finished before started", setter(top, "finished", "2000-01-01T00:00:00.000000Z"), "before"),
    ("full type", setter(top, "full", "false"), "full"),
    ("full with parent", setter(top, "full", True), "full backup has no parent"),
    ("incremental without parent", setter(top, "parent", None), "incremental backup has one"),
    ("parent not older", setter(top, "parent", "20991121T061500.000000Z"), "not older"),
    ("parent malformed", setter(top, "parent", "x"), "backup id"),
    ("partitions type", setter(top, "partitions", {}), "partitions is not an array"),
    ("partitions order", lambda o: o["partitions"].reverse(), "out of order"),
    ("partition repeated", lambda o: o["partitions"].append(o["partitions"][0]), "repeated"),
    ("totals items", setter(totals, "items", "1"), "disagree"),
    ("totals bytes_written", setter(totals, "bytes_written", "1"), "disagree"),
    ("totals rollbacks", setter(totals, "rollbacks", "0"), "disagree"),
    ("totals int", setter(totals, "bytes_read", 5), "decimal string"),
    ("totals key", deleter(totals, "bytes_read"), "missing key 'bytes_read'"),
    # partition
    ("partition string", setter(P0, "partition", "0"), "partition"),
    ("partition range", setter(P0, "partition", 70000), "partition"),
    ("uuid hex", setter(P0, "uuid", "0xbeef"), "uuid"),
    ("uuid not in log", setter(P0, "uuid", "5"), "not in the partition's failover log"),
    ("uuid too big", setter(P0, "uuid", str(1 << 64)), "uuid"),
    ("seq leading zero", setter(P0, "end_seq", "0150"), "end_seq"),
    ("seq negative", setter(P0, "start_seq", "-1"), "start_seq"),
    ("seq float", setter(P0, "end_seq", 150.0), "end_seq"),
    ("start above end", setter(P0, "start_seq", "151"), "start_seq"),
    ("snapshot excludes end", setter(snap, "start", "151"), "last snapshot"),
    ("snapshot end below end", setter(snap, "end", "149"), "last snapshot"),
    ("snapshot key", setter(snap, "middle", "1"), "unknown key"),
    ("log form", setter(P0, "failover_log", [["beef", "80"]]), "failover_log"),
    ("log int", setter(fo0, "seq", 80), "seq"),
    ("log order", lambda o: P0(o)["failover_log"].reverse(), "newest-first"),
    ("log empty", setter(P0, "failover_log", []), "empty failover log"),
    ("segments type", setter(P0, "segments", None), "segments is not an array"),
    # segment
    ("segment name", setter(S0, "file", "x.seg"), "segment file name"),
    ("segment other partition",
     setter(S0, "file", "p0001-s0000000000000051-e0000000000000096.seg"), "belongs to partition"),
    ("segment name mismatch",
     setter(S0, "file", "p0000-s0000000000000051-e0000000000000095.seg"), "does not match"),
    ("segment below start", setter(P0, "start_seq", "81"), "outside"),
    ("segment first zero", lambda o: (S0(o).update(first_seq="0", file=format_segment_name(
        0, 0, 150))), "first"),
    ("segment records zero", setter(S0, "records", "0"), "records"),
    ("segment records too many", setter(S0, "records", "71"), "records"),
    ("segment bytes zero", setter(S0, "bytes", "0"), "size 0"),
    ("segment checksum", setter(S0, "checksum", "AB" * 16), "checksum"),
    ("segment checksum short", setter(S0, "checksum", "ab"), "checksum"),
    ("segment key", setter(S0, "sha", "x"), "unknown key"),
    ("segments overlap", lambda o: P0(o)["segments"].append(S0(o)), "does not start after"),
    # rollback
    ("rollback to != start", setter(rollback, "to", "79"), "differs from start_seq"),
    ("rollback to above from", setter(rollback, "from", "79"), "above rollback from"),
    ("rollback above producer", setter(rollback, "producer_seq", "79"), "producer"),
    ("rollback above seed", setter(rollback, "seed_rule_seq", "79"), "seed rule"),
    ("rollback key", deleter(rollback, "producer_seq"), "missing key"),
    ("rollback type", setter(P0, "rollback", []), "expected a JSON object"),
    # cut-back records (formats/repository.md §5.6)
    ("cut_back type", setter(P0, "cut_back", {}), "cut_back is not an array"),
    ("cut_back not below", setter(P0, "cut_back", [CUT | {"to": "200"}]), "not below"),
    ("cut_back key", setter(P0, "cut_back", [CUT | {"k": "1"}]), "unknown key"),
    ("cut_back segment outside", setter(P0, "cut_back", [CUT | {"from": "190"}]), "outside"),
    ("cut_back empty", setter(P0, "cut_back", []), "only when not empty"),
    ("cut_back no segment", setter(P0, "cut_back", [CUT | {"segments": []}]), "lists no segment"),
    ("cut_back other partition", setter(P0, "cut_back", [
        CUT | {"segments": [seg(1, 151, 200).to_json()]}]), "another partition"),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "match"), [(m, x) for _, m, x in BAD], ids=[n for n, *_ in BAD])
def test_rejects(mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    obj = base()
    Manifest.from_json(copy.deepcopy(obj))  # the base is valid
    mutate(obj)
    with pytest.raises(RepositoryError, match=match) as info:
        Manifest.from_json(obj)
    assert "\n" not in str(info.value)


def test_full_backup_starts_at_zero() -> None:
    with pytest.raises(RepositoryError, match="full backup starts at seq 0"):
        manifest(full=True, parent=None)
    m = manifest(parts=(part(0, 0, 9),), full=True, parent=None)
    assert Manifest.loads(m.dumps()) == m


def test_empty_log_needs_uuid_zero_and_nothing_streamed() -> None:
    empty = FailoverLog()
    assert part(0, 0, 0, uuid=0, failover_log=empty).segments == ()
    with pytest.raises(RepositoryError, match="empty failover log"):
        part(0, 0, 5, uuid=0, failover_log=empty)


def test_top_not_object() -> None:
    with pytest.raises(RepositoryError, match="expected a JSON object"):
        Manifest.from_json([])


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xff", "not UTF-8"),
        (b"{", "not valid JSON"),
        (b"[]", "no checksum"),
        (b'{"a": 1, "a": 2}', "appears twice"),
        (b'{"a": NaN}', "NaN"),
        (b'{"checksum": 5}', "checksum"),
        (b"[" * 100000 + b"]" * 100000, "JSON"),
    ],
)
def test_loads_rejects(data: bytes, match: str) -> None:
    with pytest.raises(RepositoryError, match=match):
        Manifest.loads(data)


def test_loads_rejects_oversized() -> None:
    with pytest.raises(RepositoryError, match="exceed"):
        Manifest.loads(b" " * (MAX_MANIFEST_BYTES + 1))


def test_checksum_catches_a_changed_digit() -> None:
    data = manifest().dumps()
    changed = data.replace(b'"end_seq": "150"', b'"end_seq": "151"', 1)
    assert changed != data
    with pytest.raises(RepositoryError, match="checksum mismatch"):
        Manifest.loads(changed)
    obj = json.loads(data)
    obj["checksum"] = "0" * 32
    with pytest.raises(RepositoryError, match="checksum mismatch"):
        Manifest.loads(json.dumps(obj).encode())


def test_duplicate_key_in_nested_object() -> None:
    text = manifest().dumps().decode().replace('"records":', '"records": "1", "records":', 1)
    with pytest.raises(RepositoryError, match="'records' appears twice"):
        Manifest.loads(text.encode())


def test_constructor_type_checks() -> None:
    with pytest.raises(RepositoryError, match="Totals"):
        manifest(totals=None)
    with pytest.raises(RepositoryError, match="UTC"):
        manifest(started=datetime(2026, 1, 1))
    with pytest.raises(RepositoryError, match="failover_log"):
        part(failover_log=[])
    with pytest.raises(RepositoryError, match="uuid"):
        part(uuid=-1)
    with pytest.raises(RepositoryError, match="first_seq"):
        SegmentEntry("x", True, 1, 1, 1, "0" * 32)


def test_sequences_are_stored_as_tuples() -> None:
    m = manifest(parts=[part(0)])  # type: ignore[arg-type]
    assert m.partitions == (part(0),) and m == manifest(parts=(part(0),))
    assert isinstance(part(0, segments=[seg(0, 81, 150)]).segments, tuple)


def test_a_continuous_commit_is_version_4_and_round_trips() -> None:
    """A commit of `backup --follow` (formats/repository.md §5.11): `continuous` and
    per-partition `points` survive dumps/loads, and make the manifest version 4."""
    m = manifest()
    t = m.finished
    parts = []
    for e in m.partitions:
        pts = () if e.end_seq == e.start_seq else ((e.end_seq, t),)
        parts.append(replace(e, points=pts))
    c = replace(m, partitions=tuple(parts), continuous=m.started)
    assert c.version == 4
    back = Manifest.loads(c.dumps())
    assert back == c and back.continuous == m.started
    assert [e.points for e in back.partitions] == [e.points for e in c.partitions]
    assert json.loads(c.dumps())["continuous"] == {"since": json.loads(m.dumps())["started"]}


def test_points_are_checked() -> None:
    m = manifest()
    e = next(e for e in m.partitions if e.end_seq > e.start_seq)
    with pytest.raises(RepositoryError, match="outside"):
        replace(e, points=((e.end_seq + 1, m.finished),))
    with pytest.raises(RepositoryError, match="ascend"):
        replace(e, points=((e.end_seq, m.finished), (e.end_seq, m.finished)))
    parts = tuple(replace(x, points=((x.end_seq, m.finished),)) if x is e else x
                  for x in m.partitions)  # fmt: skip
    with pytest.raises(RepositoryError, match="only in a continuous commit"):
        replace(m, partitions=parts)


def test_points_are_compact_and_checked_when_read() -> None:
    """formats/repository.md §5.11's example, and damage found on first read."""
    from upr_cli.repo.manifest import Points

    t0 = datetime(2026, 12, 6, 14, 37, tzinfo=UTC)
    pts = Points([(81, t0), (90, t0 + timedelta(milliseconds=500))])
    assert pts.text(80) == "AYC259WAv5gDCaDCHg=="
    assert list(Points(text="AYC259WAv5gDCaDCHg==", check=("p", 80, 90))) == list(pts)
    lazy = Points(text="AYC259WAv5gDCaDCHg==", check=("partition 3", 80, 85))
    assert lazy  # not decoded yet: the manifest parsed without it
    with pytest.raises(RepositoryError, match="partition 3: point seq 90 lies outside"):
        list(lazy)
    with pytest.raises(RepositoryError, match="not base64"):
        list(Points(text="!!", check=("p", 0, 9)))
    # the oldest point alone (`upr info`'s restorable range), without decoding the rest
    assert Points(text="AYC259WAv5gDCaDCHg==", check=("p", 80, 90)).first_time() == t0
    assert pts.first_time() == t0 and Points().first_time() is None
    with pytest.raises(RepositoryError, match="not base64"):
        Points(text="!!", check=("p", 0, 9)).first_time()
    with pytest.raises(RepositoryError, match="odd count"):
        Points(text=base64.b64encode(b"\x01").decode(), check=("p", 0, 9)).first_time()


def test_points_are_joined_without_decoding_times() -> None:
    """A rollup's entry: the points of consecutive entries as one (jobs/rollup.py), the
    same as their decoded concatenation; a join that would step back is refused."""
    from upr_cli.repo.manifest import Points

    t0 = datetime(2026, 12, 6, 14, 37, tzinfo=UTC)
    us = timedelta(microseconds=1)
    a = [(81, t0), (90, t0 + 500_000 * us)]
    b = [(95, t0 + 700_000 * us), (200, t0 + 10**9 * us), (201, t0 + 10**9 * us)]
    c = [(300, t0 + 2 * 10**9 * us)]
    lazy_b = Points(text=Points(b).text(90), check=("p", 90, 201))
    joined = Points.joined([(a, 80), ((), 90), (lazy_b, 90), (Points(c), 201)], 80, 300, "p")
    assert list(joined) == a + b + c
    assert Points(text=joined.text(80), check=("p", 80, 300)) == tuple(a + b + c)
    assert not Points.joined([((), 80)], 80, 90)
    with pytest.raises(RepositoryError, match="p: points must ascend"):
        Points.joined([(b, 90), (a, 80)], 80, 300, "p")
    with pytest.raises(RepositoryError, match="p: point seq 300 lies outside"):
        Points.joined([(a, 80), (c, 201)], 80, 299, "p")
    # encoded once, a point list keeps the compact form only
    kept = Points(a)
    assert kept.text(80) == kept.text(80) and kept._items is None and list(kept) == a


def test_a_manifest_no_reader_would_take_is_never_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers refuse a manifest over MAX_MANIFEST_BYTES, so the writer refuses to make
    one (a rollup of a busy bucket's high level would, jobs/rollup.py `largest`)."""
    import upr_cli.repo.manifest as mf

    m = manifest()
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(m.dumps()) - 1)
    with pytest.raises(RepositoryError, match="exceed the"):
        m.dumps()


def test_a_followers_own_points_are_checked_cheaply() -> None:
    """`Points.checked`: the range and the order, as for points read from elsewhere."""
    from upr_cli.repo.manifest import Points

    t0 = datetime(2026, 12, 6, tzinfo=UTC)
    ok = [(5, t0), (9, t0 + timedelta(seconds=1))]
    assert list(Points.checked(ok, "partition 3", 4, 9)) == ok
    with pytest.raises(RepositoryError, match="partition 3: point seq 9 lies outside"):
        Points.checked(ok, "partition 3", 4, 8)
    with pytest.raises(RepositoryError, match="partition 3: points must ascend"):
        Points.checked(ok[::-1], "partition 3", 4, 9)


def test_what_a_writer_remembers_is_bounded() -> None:
    """`ManifestStore.remember` keeps the revision and absorbed backups of what this
    process committed (a follower's rollups check them without parsing), the newest
    only: a session of weeks does not add them up."""
    from typing import cast

    from upr_cli.repo.manifests import _REMEMBERED, ManifestStore

    t0 = datetime(2026, 12, 6, tzinfo=UTC)
    store = ManifestStore(cast(Any, None))
    made = []
    for i in range(_REMEMBERED + 10):
        at = t0 + timedelta(seconds=i + 1)
        made.append(Manifest(backup_id=BackupId(at), bucket="b", source="upr://h/b",
                             started=at, finished=at, full=False, parent=BackupId(t0),
                             partitions=(), totals=Totals.derive((), 0)))  # fmt: skip
        store.remember(made[-1])
    assert len(store._written) == _REMEMBERED
    assert ("b", made[-1].backup_id) in store._written
    assert ("b", made[0].backup_id) not in store._written
