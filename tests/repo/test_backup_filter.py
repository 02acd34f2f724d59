"""`upr backup --include-data / --exclude-data`: what the filter streams, resolved
against the source's manifest before anything is streamed."""

from __future__ import annotations

import pytest

from upr_cli.collections import CollectionsError, Manifest, Path, parse_paths
from upr_cli.errors import UsageError
from upr_cli.jobs.backup import collection_filter, stream_paths

M = (Manifest().with_scope("app").with_collection("app", "users")
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
