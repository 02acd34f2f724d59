"""`upr salvage --node-data` reads a replica node's lost writes as the node stores them
(kv_engine's layout: the xattr blob before the body, datatype bit 0x04) and hands them
out as consumer records are: the report shows each version's xattrs, the body alone is
its value, and a version written back says its xattrs were left out."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import drain, run
from upr_cli.protocol import xattrs

BLOB = xattrs.encode({"_sync": '{"rev":"2-b"}', "meta": '{"by":"app"}'})
BODY = b'{"n":1}'


def lost_rows(db: Path, partitions: int) -> dict[str, int]:
    """Two lost writes in each of two keys' partitions (found by the node's own hash),
    rolled back to seq 1: k-x with xattrs, k-plain without."""
    from upr_cli.net.bootstrap import partition_of

    vbs = {key: partition_of(key.encode(), partitions) for key in ("k-x", "k-plain")}
    with sqlite3.connect(db) as conn:
        for key, value, datatype in (("k-x", BLOB + BODY, 0x05), ("k-plain", BODY, 0x01)):
            conn.execute(
                "INSERT INTO lost_writes (rolled_back_at, rolled_back_to, vbucket, key, seq,"
                " rev_seq, cas, flags, expiry, datatype, deleted, delete_time, value)"
                " VALUES (0, 1, ?, ?, 900, 3, 77, 9, 0, ?, 0, 0, ?)",
                (vbs[key], b"\x00" + key.encode(), datatype, value),
            )
    return vbs


def test_node_data_lost_writes_keep_their_xattrs(node_factory: type[Node]) -> None:
    replica = node_factory(partitions=4, name="replica").start()
    replica.stop()  # its database: the one `--node-data` reads
    vbs = lost_rows(replica.data / "default.sqlite3", 4)
    master = node_factory("--flush-interval", "0.02", partitions=4, name="master").start()
    upr("load", master.uri, "--docs", "40")  # every partition above the cut

    dry = upr("salvage", "--node-data", str(replica.data), "--into", master.uri, "--json",
              check=False)  # fmt: skip
    assert dry.returncode == 1, dry.stderr  # lost writes remain (would-write)
    items = {it["key"]: it for it in json.loads(dry.stdout)["writes"]}
    assert set(items) == set(vbs)
    x = items["k-x"]
    assert x["lost_version"]["xattrs"] == {"_sync": {"rev": "2-b"}, "meta": {"by": "app"}}
    assert x["lost_version"]["value"] == BODY.decode() and x["outcome"] == "would-write"
    assert items["k-plain"]["lost_version"]["xattrs"] == {}

    text = upr("salvage", "--node-data", str(replica.data), "--into", master.uri, check=False)
    assert "xattrs=_sync,meta" in text.stdout, text.stdout

    done = upr("salvage", "--node-data", str(replica.data), "--into", master.uri, "--apply",
               "--json")  # fmt: skip
    after = {it["key"]: (it["outcome"], it["reason"]) for it in json.loads(done.stdout)["writes"]}
    assert after == {"k-x": ("written", ""), "k-plain": ("written", "")}
    # the master holds the body, its flags and the xattrs (written by SUBDOC_MULTI_MUTATION
    # after the SET): read back through DCP with xattrs
    rows, _events, _consumer = run(drain(master.uri))
    got = {bytes(r.key): r for r in rows if bytes(r.key).startswith(b"k-")}
    assert (got[b"k-x"].value, got[b"k-x"].flags) == (BODY, 9)
    assert xattrs.to_json(got[b"k-x"].xattrs) == xattrs.to_json(BLOB)
    assert (got[b"k-plain"].value, got[b"k-plain"].xattrs) == (BODY, b"")
