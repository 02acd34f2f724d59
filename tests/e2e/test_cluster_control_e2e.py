"""Partition-state control on a node: the bucket CAS (formats/cluster.md §1), map
revisions as fences, the cluster map served and attached to NOT_MY_VBUCKET."""

from __future__ import annotations

import json
from typing import Any

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import failover_logs, run, wait_persisted
from upr_cli.net.bootstrap import connect, partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.messages import (
    STREAM_FOREVER,
    DcpOpen,
    DisableTraffic,
    EnableTraffic,
    GetClusterConfig,
    Set,
    SetClusterConfig,
    SetVbucket,
    StreamRequest,
)
from upr_cli.protocol.status import Status

ACTIVE, REPLICA = 1, 2


def _map(rev: int, port: int, n: int) -> dict[str, Any]:
    return {"rev": rev, "revEpoch": 1, "name": "default", "nodeLocator": "vbucket",
            "vBucketServerMap": {"hashAlgorithm": "CRC", "numReplicas": 0,
                                 "serverList": [f"127.0.0.1:{port}"],
                                 "vBucketMap": [[0] for _ in range(n)]},
            "nodesExt": [{"hostname": "127.0.0.1", "services": {"kv": port}}]}  # fmt: skip


async def _scenario(uri: str, port: int) -> dict[str, Any]:
    s = await connect(SourceUri.parse(uri))
    conn = s.conn
    out: dict[str, Any] = {}
    try:

        async def call(msg: Any) -> Any:
            return await conn.request(msg, check=False)

        # discover the CAS from a refused command, then use it (the UPR design
        # specification, "How ns_server and ep-engine guarantee ordering of partition state
        # transitions", steps 2-6)
        r = await call(SetVbucket(vbucket=3, state=REPLICA, cas=0, value=b'{"rev": 1}',
                                  opaque=conn.next_opaque()))  # fmt: skip
        out["no_cas"] = r.status
        cas = r.cas
        r = await call(SetVbucket(vbucket=3, state=REPLICA, cas=cas, value=b'{"rev": 1}',
                                  opaque=conn.next_opaque()))  # fmt: skip
        out["with_cas"] = r.status
        out["cas_changed"] = r.cas not in (0, cas)
        stale = await call(SetVbucket(vbucket=3, state=ACTIVE, cas=cas, value=b'{"rev": 1}',
                                      opaque=conn.next_opaque()))  # fmt: skip
        out["stale_cas"] = stale.status
        cas = r.cas
        # a newer map is taken, an older one (or a command of an older revision) refused
        m2 = json.dumps(_map(2, port, s.num_partitions)).encode()
        r = await call(SetClusterConfig(value=m2, cas=cas, opaque=conn.next_opaque()))
        out["map2"] = r.status
        cas = r.cas
        m1 = json.dumps(_map(1, port, s.num_partitions)).encode()
        r = await call(SetClusterConfig(value=m1, cas=cas, opaque=conn.next_opaque()))
        out["map1"] = r.status
        r = await call(SetVbucket(vbucket=4, state=REPLICA, cas=cas, value=b'{"rev": 1}',
                                  opaque=conn.next_opaque()))  # fmt: skip
        out["old_rev_command"] = r.status
        r = await conn.request(GetClusterConfig(opaque=conn.next_opaque()))
        out["served_rev"] = json.loads(r.value)["rev"]
        # writes to a replica partition: NOT_MY_VBUCKET, with the map attached
        key = next(k for k in (b"k%d" % i for i in range(1000))
                   if partition_of(k, s.num_partitions) == 3)  # fmt: skip
        r = await call(Set(vbucket=3, key=s.qualify(key), value=b"{}", opaque=conn.next_opaque()))
        out["write_to_replica"] = r.status
        out["nmvb_map_rev"] = json.loads(r.value)["rev"]
        # promotion with a failover entry (the UPR design specification, "How ns_server
        # performs failover")
        r = await call(SetVbucket(vbucket=3, state=ACTIVE, cas=cas,
                                  value=b'{"rev": 2, "failover": true}',
                                  opaque=conn.next_opaque()))  # fmt: skip
        out["promote"] = r.status
        r = await call(Set(vbucket=3, key=s.qualify(key), value=b"{}", opaque=conn.next_opaque()))
        out["write_after_promote"] = r.status
    finally:
        await conn.aclose()
    return out


def test_state_commands_are_fenced_by_cas_and_revision(node_factory: type[Node]) -> None:
    node = node_factory("--flush-interval", "0.02", partitions=8).start()
    upr("load", node.uri, "--docs", "200")
    persisted = {p: h for p, (_u, h, _p) in wait_persisted(node.uri).items()}
    before = run(failover_logs(node.uri))
    out = run(_scenario(node.uri, node.port))
    assert out == {
        "no_cas": Status.KEY_EEXISTS, "with_cas": Status.SUCCESS, "cas_changed": True,
        "stale_cas": Status.KEY_EEXISTS, "map2": Status.SUCCESS, "map1": Status.EINVAL,
        "old_rev_command": Status.EINVAL, "served_rev": 2,
        "write_to_replica": Status.NOT_MY_VBUCKET, "nmvb_map_rev": 2,
        "promote": Status.SUCCESS, "write_after_promote": Status.SUCCESS,
    }  # fmt: skip
    after = run(failover_logs(node.uri))
    assert after[3][0][1] == persisted[3] and after[3][1:] == before[3]  # a new entry
    assert after[4] == before[4]
    # the map and the states survive a restart; the bucket CAS is new; front-end traffic
    # stays off until ENABLE_TRAFFIC (formats/cluster.md §3; the UPR design specification's
    # state transitions, steps 1-3)
    node.stop()
    node.start()
    assert run(_served_rev(node.uri)) == 2
    assert run(_traffic(node.uri)) == {
        "stat_before": "false", "write_before": Status.ETMPFAIL,
        "stream_before": Status.ETMPFAIL, "enable": Status.SUCCESS, "stat_after": "true",
        "write_after": Status.SUCCESS, "disable": Status.SUCCESS,
        "write_disabled": Status.ETMPFAIL,
    }  # fmt: skip


async def _traffic(uri: str) -> dict[str, Any]:
    s = await connect(SourceUri.parse(uri))
    conn = s.conn
    out: dict[str, Any] = {}

    def write() -> Set:
        return Set(vbucket=0, key=s.qualify(b"k"), value=b"{}", opaque=conn.next_opaque())

    try:
        out["stat_before"] = (await conn.stats(""))["ep_traffic_enabled"]
        out["write_before"] = (await conn.request(write(), check=False)).status
        await conn.request(DcpOpen(name="t", flags=1, opaque=conn.next_opaque()))
        req = StreamRequest(vbucket=0, opaque=conn.next_opaque(), start_seqno=0,
                            end_seqno=STREAM_FOREVER, vbucket_uuid=0)  # fmt: skip
        out["stream_before"] = (await conn.request(req, check=False)).status
    finally:
        await conn.aclose()
    s = await connect(SourceUri.parse(uri))
    conn = s.conn
    try:
        r = await conn.request(EnableTraffic(opaque=conn.next_opaque()), check=False)
        out["enable"] = r.status
        out["stat_after"] = (await conn.stats(""))["ep_traffic_enabled"]
        out["write_after"] = (await conn.request(write(), check=False)).status
        r = await conn.request(DisableTraffic(opaque=conn.next_opaque()), check=False)
        out["disable"] = r.status
        out["write_disabled"] = (await conn.request(write(), check=False)).status
        await conn.request(EnableTraffic(opaque=conn.next_opaque()))
    finally:
        await conn.aclose()
    return out


async def _served_rev(uri: str) -> int:
    s = await connect(SourceUri.parse(uri))
    try:
        r = await s.conn.request(GetClusterConfig(opaque=s.conn.next_opaque()))
        return int(json.loads(r.value)["rev"])
    finally:
        await s.conn.aclose()
