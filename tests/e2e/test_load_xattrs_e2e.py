"""`upr load --xattrs` (formats/subdoc.md): every write is one SUBDOC_MULTI_MUTATION
carrying a system xattr `_sync` (the new CAS, expanded by the node) and a user xattr
`meta`; updates rewrite both, deletes leave `_sync` alone in the tombstone."""

from __future__ import annotations

import json

from tests.e2e.conftest import Node, upr


def test_load_with_xattrs_updates_and_deletes(node: Node) -> None:
    args = ("--docs", "400", "--xattrs", "--update-ratio", "0.3", "--delete-ratio", "0.1")
    out = json.loads(upr("load", node.uri, *args, "--seed", "5", "--json").stdout)
    assert out["errors"] == 0 and out["updates"] > 0 and out["deletes"] > 0
    rows = [json.loads(x) for x in upr("tail", node.uri, "--until-end", "--format",
                                       "json").stdout.splitlines()]  # fmt: skip
    live = [r for r in rows if r["op"] == "mutation"]
    gone = [r for r in rows if r["op"] != "mutation"]
    assert len(live) == out["created"] - out["deletes"] and len(gone) == out["deletes"]
    for r in live:
        sync = r["xattrs"]["_sync"]
        # ${Mutation.CAS}: the CAS the write got, its 8 bytes little-endian, in hex
        assert sync["cas"] == "0x" + int(r["cas"]).to_bytes(8, "little").hex()
        assert r["xattrs"]["meta"] == {"op": sync["op"]}
        assert r["value"]["id"] == sync["op"]  # the body of the same operation
    for r in gone:
        assert set(r["xattrs"]) == {"_sync"} and "value" not in r
