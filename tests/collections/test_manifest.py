"""The collections manifest model: kv_engine's JSON, validation, ids never reused, and
system events (upr_cli/collections.py)."""

from __future__ import annotations

import re

import pytest

from upr_cli.collections import (
    DEFAULT,
    CollectionsError,
    CollectionsManifest,
    Path,
    apply_change,
    changes_between,
    creatable,
    decode_event,
    encode_event,
    parse_paths,
)
from upr_cli.errors import UsageError


def test_the_default_manifest_has_the_default_collection_only() -> None:
    m = CollectionsManifest()
    default = {"name": "_default", "uid": "0", "collections": [{"name": "_default", "uid": "0"}]}
    assert m.to_json() == {"uid": "0", "scopes": [default]}
    assert CollectionsManifest.from_json(m.dumps()) == m


def test_ids_start_at_8_and_a_dropped_id_is_never_given_again() -> None:
    m = CollectionsManifest().with_scope("app").with_collection("app", "users", max_ttl=60)
    users = m.lookup(Path("app", "users"))
    assert users is not None and users.id == 9 and users.max_ttl == 60
    assert m.scope("app") is not None and m.scope("app").id == 8  # type: ignore[union-attr]
    again = m.without(Path("app", "users")).with_collection("app", "users")
    new = again.lookup(Path("app", "users"))
    assert new is not None and new.id > users.id
    assert again.uid > m.uid
    assert CollectionsManifest.from_json(again.dumps()) == again


@pytest.mark.parametrize(
    "doc",
    [
        b"not json",
        b'{"uid": "1"}',
        b'{"uid": "1", "scopes": []}',  # no _default scope
        b'{"uid": "x", "scopes": [{"name": "_default", "uid": "0"}]}',
        b'{"uid": "1", "scopes": [{"name": "_default", "uid": "0", "collections": '
        b'[{"name": "a", "uid": "3"}]}]}',  # a reserved id
        b'{"uid": "1", "scopes": [{"name": "_default", "uid": "0", "collections": '
        b'[{"name": "a", "uid": "8"}, {"name": "b", "uid": "8"}]}]}',  # an id twice
        b'{"uid": "1", "scopes": [{"name": "$x", "uid": "8"}, {"name": "_default", "uid": "0"}]}',
    ],
)
def test_invalid_manifests_are_refused(doc: bytes) -> None:
    with pytest.raises(CollectionsError):
        CollectionsManifest.from_json(doc)


def test_paths() -> None:
    assert Path.parse("app.users") == Path("app", "users")
    assert Path.parse("app") == Path("app", None)
    assert Path.parse(".users") == Path(DEFAULT, "users")
    assert Path.parse(".") == Path(DEFAULT, DEFAULT)
    assert parse_paths("a.b, a ,a.b") == [Path("a", "b"), Path("a")]
    for bad in ("a.b.c", "a.", "$x", ""):
        with pytest.raises(UsageError):
            Path.parse(bad)


def test_changes_become_system_events_and_back() -> None:
    old = CollectionsManifest().with_scope("app")
    new = old.with_collection("app", "users", max_ttl=5).with_collection("app", "orders")
    new = new.without(Path(DEFAULT, DEFAULT))
    changes = changes_between(old, new)
    assert [c.kind for c in changes] == ["collection-dropped", "collection-created",
                                         "collection-created"]  # fmt: skip
    seen = CollectionsManifest()
    seen = apply_change(seen, changes_between(CollectionsManifest(), old)[0])
    for i, c in enumerate(changes):
        event, version, key, value = encode_event(c)
        back = decode_event(3, 10 + i, event, version, key, value)
        assert back is not None
        assert (back.kind, back.collection_id, back.name, back.max_ttl) == (
            c.kind, c.collection_id, c.name, c.max_ttl)  # fmt: skip
        seen = apply_change(seen, back)
    assert {str(seen.path_of(c.id)) for _, c in seen.collections()} == {"app.users", "app.orders"}


def test_a_name_that_cannot_be_created_is_a_usage_error_with_one_message() -> None:
    # exit 2 for every one of them, found before any network call (some were 1, found
    # by the manifest after connecting)
    rule = "letters, digits and _ - % only, not starting with _ or %"
    for text, name in [("bad name.x", "'bad name'"), ("app.é", "'é'"), ("_system.x", "'_system'"),
                       ("app._x", "'_x'"), ("app.%x", "'%x'"), ("app.a$b", "'a$b'")]:  # fmt: skip
        with pytest.raises(UsageError, match=re.escape(f"name {name}: {rule}")) as err:
            creatable(text)
        assert not isinstance(err.value, CollectionsError)
    for text in (".", "_default._default", "app._default"):
        with pytest.raises(UsageError, match="the _default collection cannot be created"):
            creatable(text)
    with pytest.raises(UsageError, match="the _default scope always exists"):
        creatable("_default")
    assert creatable(".orders") == Path(DEFAULT, "orders")
    assert creatable("app") == Path("app") and creatable("a-1.b%2") == Path("a-1", "b%2")
