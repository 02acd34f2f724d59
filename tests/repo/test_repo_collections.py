"""Collections in backup manifests (formats/repository.md §5.9): round trips, version 1
manifests read as the default collection, rejections, and the names over a chain."""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.repo.test_repo_manifest import B1, B2, T0, manifest, part
from upr_cli.collections import CollectionsManifest, ManifestChange, Path
from upr_cli.repo import BackupId, Manifest, RepositoryError, checksum_hex
from upr_cli.repo.manifest import (
    BackupManifest,
    CollectionCount,
    CollectionFilter,
    canonical_json,
    chain_manifest,
    collection_history,
)

APP = CollectionsManifest().with_scope("app").with_collection("app", "users")  # scope 8, users 9
USERS = APP.lookup(Path("app", "users"))
assert USERS is not None


def created(p: int, seq: int, uid: int, cid: int, name: str, sid: int = 8) -> ManifestChange:
    return ManifestChange(p, seq, "collection-created", uid, sid, cid, name)


def dropped(p: int, seq: int, uid: int, cid: int, sid: int = 8) -> ManifestChange:
    return ManifestChange(p, seq, "collection-dropped", uid, sid, cid)


def with_collections(**kw: Any) -> Manifest:
    args: dict[str, Any] = {
        "collections": APP,
        "manifest_changes": (created(0, 120, 3, 10, "orders"), created(1, 100, 3, 10, "orders")),
        "collection_filter": CollectionFilter("exclude", ("app.logs",)),
        "collection_items": (CollectionCount(0, 5, 1), CollectionCount(9, 60, 4)),
    }
    args.update(kw)
    return manifest(parts=(part(0), part(1, 90, 100)), **args)


def test_round_trip_and_json_form() -> None:
    m = with_collections()
    assert BackupManifest is Manifest
    assert Manifest.loads(m.dumps()) == m
    obj = json.loads(m.dumps())
    assert obj["version"] == 2
    assert obj["collections"] == APP.to_json()
    assert obj["manifest_changes"][0] == {
        "partition": 0, "seq": "120", "kind": "collection-created", "manifest_uid": "3",
        "scope_id": 8, "collection_id": 10, "name": "orders", "max_ttl": None,
    }  # fmt: skip
    assert obj["collection_filter"] == {"exclude": ["app.logs"]}
    assert obj["collection_items"][1] == {"id": 9, "items": "60", "deleted": "4"}
    assert m.filtered and not m.backed_up("app", "logs") and m.backed_up("app", "users")
    assert not manifest().filtered and manifest().backed_up("any", "thing")


@given(
    st.lists(st.sampled_from(["app", "app.users", ".", "_default", "s1.c-2"]), min_size=1),
    st.booleans(),
    st.lists(st.tuples(st.integers(0, (1 << 32) - 1), st.integers(0, 1 << 63),
                       st.integers(0, 1 << 63)), unique_by=lambda t: t[0]),
)  # fmt: skip
def test_collection_fields_round_trip(paths: list[str], include: bool, counts: Any) -> None:
    f = CollectionFilter("include" if include else "exclude", tuple(paths))
    items = tuple(CollectionCount(*c) for c in sorted(counts))
    m = with_collections(collection_filter=f, collection_items=items)
    assert Manifest.loads(m.dumps()) == m


def v1(m: Manifest) -> bytes:
    """`m` as a version 1 writer wrote it (no collection keys)."""
    obj = m.to_json()
    obj["version"] = 1
    for k in ("collections", "manifest_changes", "collection_filter", "collection_items"):
        del obj[k]
    obj["checksum"] = checksum_hex(canonical_json(obj))
    return json.dumps(obj, indent=2).encode()


def test_a_version_1_manifest_reads_as_the_default_collection() -> None:
    m = manifest()
    old = Manifest.loads(v1(m))
    assert old == m and old.collections is None and not old.manifest_changes
    assert old.collection_filter is None and not old.filtered
    assert chain_manifest([old]) == CollectionsManifest()  # _default._default holds everything
    assert collection_history([old]) == {0: (Path("_default", "_default"), False)}
    obj = json.loads(v1(m))
    obj["collections"] = None  # a version 1 manifest has no collection keys
    del obj["checksum"]
    with pytest.raises(RepositoryError, match="unknown key 'collections'"):
        Manifest.from_json(obj)


def _bad(mutate: Any) -> dict[str, Any]:
    obj = copy.deepcopy(with_collections().to_json())
    mutate(obj)
    return obj


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda o: o.pop("manifest_changes"), "missing key 'manifest_changes'"),
        (lambda o: o["collections"].update(uid="x"), "collections: manifest: manifest uid"),
        (lambda o: o["collections"]["scopes"].pop(0), "_default scope is missing"),
        (lambda o: o["manifest_changes"][0].update(seq="151"), "outside that partition's range"),
        (lambda o: o["manifest_changes"][0].update(partition=5), "outside that partition"),
        (lambda o: o["manifest_changes"][0].update(kind="collection-modified"), "kind"),
        (lambda o: o["manifest_changes"][0].update(collection_id=None), "collection_id"),
        (lambda o: o["manifest_changes"][0].update(seq=120), "decimal string"),
        (lambda o: o["manifest_changes"][0].update(name=5), "name 5"),
        (lambda o: o["manifest_changes"][0].update(extra=1), "unknown key 'extra'"),
        (lambda o: o.update(collection_filter={"only": ["a"]}), "'only' is not include"),
        (lambda o: o.update(collection_filter={"include": []}), "lists no path"),
        (lambda o: o.update(collection_filter={"include": ["a.b.c"]}), "at most one dot"),
        (lambda o: o.update(collection_filter={"include": ["a"], "exclude": ["b"]}), "one of"),
        (lambda o: o["collection_items"].reverse(), "ascending"),
        (lambda o: o["collection_items"][0].update(id=1 << 32), "id"),
        (lambda o: o["collection_items"][0].update(items=5), "decimal string"),
    ],
)
def test_rejects(mutate: Any, match: str) -> None:
    with pytest.raises(RepositoryError, match=match) as info:
        Manifest.from_json(_bad(mutate))
    assert "\n" not in str(info.value)


def backup(n: int, start: CollectionsManifest | None, *changes: ManifestChange) -> Manifest:
    """Backup n of a chain holding partitions 0 and 1 over seqs (100(n-1), 100n]."""
    bid = BackupId(T0 + timedelta(hours=n))
    parent = None if n == 1 else BackupId(T0 + timedelta(hours=n - 1))
    lo = 100 * (n - 1)
    parts = (part(0, lo, lo + 100), part(1, lo, lo + 100))
    return manifest(parts=parts, backup_id=bid, parent=parent, full=n == 1,
                    started=bid.time, finished=bid.time, collections=start,
                    manifest_changes=changes)  # fmt: skip


def test_a_drop_between_two_backups_and_a_re_create_under_the_same_name() -> None:
    """users (9) dropped between backups 1 and 2 (backup 2's stream meets the drop, its
    start manifest lacks it), then created again: a new id (10), a new history."""
    gone = APP.without(Path("app", "users"))
    again = gone.with_collection("app", "users")
    new = again.lookup(Path("app", "users"))
    assert new is not None and new.id != USERS.id
    b1 = backup(1, APP)
    b2 = backup(2, gone, dropped(0, 150, gone.uid, USERS.id), dropped(1, 140, gone.uid, 9))
    b3 = backup(3, gone, created(0, 210, again.uid, new.id, "users"),
                created(1, 220, again.uid, new.id, "users"))  # fmt: skip
    assert chain_manifest([b1]) == APP
    assert chain_manifest([b1, b2]).lookup(Path("app", "users")) is None
    assert chain_manifest([b1, b2, b3]) == again
    hist = collection_history([b1, b2, b3])
    assert hist[USERS.id] == (Path("app", "users"), True)
    assert hist[new.id] == (Path("app", "users"), False)
    assert hist[0] == (Path("_default", "_default"), False)


def test_a_collection_created_and_dropped_within_one_backup_is_named() -> None:
    """Neither start manifest lists it: its name comes from the create event."""
    m1 = APP.with_collection("app", "tmp")
    tmp = m1.lookup(Path("app", "tmp"))
    assert tmp is not None
    m2 = m1.without(Path("app", "tmp"))
    b1 = backup(1, APP, created(0, 10, m1.uid, tmp.id, "tmp"), dropped(0, 20, m2.uid, tmp.id))
    b2 = backup(2, m2)
    assert chain_manifest([b1, b2]) == m2 == chain_manifest([b1])
    assert collection_history([b1, b2])[tmp.id] == (Path("app", "tmp"), True)


def test_a_full_stream_repeats_old_creates_without_changing_the_end() -> None:
    """A stream from seq 0 meets the create events of collections the start manifest
    already has (uid ≤ its uid): they name, they do not resurrect."""
    m1 = APP.with_collection("app", "old")
    old = m1.lookup(Path("app", "old"))
    assert old is not None
    m2 = m1.without(Path("app", "old"))
    b1 = backup(1, m2, created(0, 5, m1.uid, old.id, "old"))
    assert chain_manifest([b1]) == m2
    assert collection_history([b1])[old.id] == (Path("app", "old"), True)


def test_chain_of_old_then_new_backups() -> None:
    """A repository written before collections, then continued: the old backups hold the
    default collection, the new ones name theirs."""
    old = Manifest.loads(v1(backup(1, None)))
    new = backup(2, APP)
    assert chain_manifest([old, new]) == APP
    assert set(collection_history([old, new])) == {0, USERS.id}
    assert B1 < B2
