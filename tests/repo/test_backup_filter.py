"""`upr backup --include-data / --exclude-data`: what the filter streams, resolved
against the source's manifest before anything is streamed, and the collection ids an
incremental backup says its chain followed (docs/protocol.md §12.4)."""

from __future__ import annotations

import pytest

from tests.repo.test_repo_collections import APP, backup, created, dropped
from upr_cli.collections import CollectionsError, CollectionsManifest, Path, parse_paths
from upr_cli.errors import UsageError
from upr_cli.jobs.backup import collection_filter, followed_ids, stream_paths
from upr_cli.position import StreamPosition
from upr_cli.segments import SegmentInfo

M = (CollectionsManifest().with_scope("app").with_collection("app", "users")
     .with_collection("app", "logs").with_scope("other").with_collection("other", "x"))  # fmt: skip


def test_include_streams_the_paths_given() -> None:
    f = collection_filter(parse_paths("app.users,other"), [])
    assert f is not None and f.to_json() == {"include": ["app.users", "other"]}
    assert stream_paths(f, M) == [Path("app", "users"), Path("other")]


def test_exclude_streams_the_complement_of_the_start_manifest() -> None:
    f = collection_filter([], parse_paths(["app.logs", "other"]))
    assert f is not None and f.covers("app", "users") and not f.covers("other", "x")
    assert stream_paths(f, M) == [Path("_default", "_default"), Path("app", "users")]
    assert stream_paths(None, M) is None  # no filter: every collection, no stream filter


def test_bad_filters_are_refused_before_streaming() -> None:
    with pytest.raises(UsageError, match="cannot be used together"):
        collection_filter([Path("app")], [Path("other")])
    f = collection_filter([Path("app", "nope")], [])
    with pytest.raises(CollectionsError, match=r"unknown collection app\.nope"):
        stream_paths(f, M)
    with pytest.raises(CollectionsError, match="the source has no collections"):
        stream_paths(f, None)
    everything = collection_filter([], [Path("_default"), Path("app"), Path("other")])
    with pytest.raises(CollectionsError, match="leaves no collection"):
        stream_paths(everything, M)
    # a source without collections: only _default._default, and excluding nothing of it
    only_default = collection_filter([], [Path("app")])
    with pytest.raises(CollectionsError, match="unknown collection app"):
        stream_paths(only_default, None)
    assert stream_paths(collection_filter([Path("_default", "_default")], []), None) == [
        Path("_default", "_default")]  # fmt: skip


def test_a_path_the_chain_had_is_no_error_for_an_incremental() -> None:
    gone = M.without(Path("app", "users"))  # dropped for good since the chain began
    f = collection_filter([Path("app", "users")], [])
    with pytest.raises(CollectionsError, match=r"unknown collection app\.users"):
        stream_paths(f, gone)
    assert stream_paths(f, gone, [M]) == [Path("app", "users")]  # the consumer resolves it
    nope = collection_filter([Path("app", "nope")], [])
    with pytest.raises(CollectionsError, match=r"unknown collection app\.nope"):
        stream_paths(nope, gone, [M])
    # an exclude list that now leaves nothing: the collections the chain followed, gone
    f = collection_filter([], [Path("_default"), Path("other")])
    empty = gone.without(Path("app", "logs"))
    assert stream_paths(f, empty, [M]) == [Path("app", "logs"), Path("app", "users")]
    with pytest.raises(CollectionsError, match="leaves no collection"):
        stream_paths(f, empty)


def at(p: int, seq: int) -> StreamPosition:
    return StreamPosition(p, 0xBEEF, seq, seq, seq)


def test_followed_ids_are_the_filters_less_the_drops_the_chain_recorded() -> None:
    """users (9) and logs (0xa) at the chain's start; backup 2 met users dropped and
    created again (0xb) on partition 0 only, and app.tmp (0xc) created there."""
    start = APP.with_collection("app", "logs")
    chain = [
        backup(1, start),
        backup(2, start, dropped(0, 150, 3, 9), created(0, 160, 4, 0xB, "users"),
               created(0, 170, 5, 0xC, "tmp")),
    ]  # fmt: skip
    users = collection_filter([Path("app", "users")], [])
    positions = {0: at(0, 200), 1: at(1, 200), 2: at(2, 0)}
    # partition 1 never met the drop: 9 is still owed there
    assert followed_ids(chain, users, positions) == {0: {0xB}, 1: {9}, 2: {9}}
    # a rollback below the recorded drop: it comes again, so 9 is followed
    assert followed_ids(chain, users, {0: at(0, 120)}) == {0: {9, 0xB}}
    # an exclude filter follows the default collection and the others it leaves
    no_logs = collection_filter([], [Path("app", "logs")])
    assert followed_ids(chain, no_logs, {0: at(0, 200), 1: at(1, 200)}) == {
        0: {0, 0xB, 0xC}, 1: {0, 9}}  # fmt: skip
    # an interrupted run's reused segments recorded partition 1's drop
    seg = SegmentInfo("p1.seg", 1, 200, 260, 201, 250, 1, 10, 10, "00",
                      changes=(dropped(1, 210, 3, 9),))  # fmt: skip
    assert followed_ids(chain, users, {1: at(1, 260)}, {1: [seg]}) == {1: set()}
    assert followed_ids([], users, positions) == {}
