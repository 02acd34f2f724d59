"""The node's administration commands: the cluster config (docs/protocol.md §5.5), STAT
(docs/protocol.md §5.7), and what an orchestrator sends (formats/cluster.md): partition
states, the cluster map, front-end traffic and replication pauses. Each handler takes
the session and the decoded request, as `node/dispatch.py` calls it.

The commands that change the node's state need an authenticated session
(`ClientSession.need_admin_bucket`); the state and map changes are checked against the
bucket CAS (formats/cluster.md §1).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from upr_cli.node.partition import STATE_CODES
from upr_cli.protocol.header import DATATYPE_JSON, Opcode
from upr_cli.protocol.messages import (
    DisableTraffic,
    EnableTraffic,
    GetClusterConfig,
    Response,
    SetClusterConfig,
    SetParam,
    SetVbucket,
    Stat,
    StatResponse,
)
from upr_cli.protocol.status import InvalidArguments, KeyNotFound

if TYPE_CHECKING:
    from upr_cli.node.server import ClientSession

# the parts of a bucket config that describe the cluster rather than the bucket
GLOBAL_CONFIG_KEYS = ("rev", "revEpoch", "nodesExt", "clusterCapabilitiesVer",
                      "clusterCapabilities")  # fmt: skip


def cluster_config(session: ClientSession) -> dict[str, Any]:
    """The selected bucket's config; without one, once authenticated, the global
    config (GCCCP): without it the SDK takes the plain port for the TLS one and
    cannot open a bucket over TLS (docs/protocol.md §13.2)."""
    server = session.server
    if session.bucket is not None or not session.authenticated:
        return server.cluster_config(session.need_bucket())
    bucket = next(iter(server.buckets.values()))
    full = server.cluster_config(bucket)
    return {k: full[k] for k in GLOBAL_CONFIG_KEYS if k in full}


def get_cluster_config(session: ClientSession, msg: GetClusterConfig) -> None:
    """GET_CLUSTER_CONFIG: `cluster_config` as JSON."""
    body = json.dumps(cluster_config(session)).encode()
    session.send(
        Response(
            opcode=Opcode.GET_CLUSTER_CONFIG, opaque=msg.opaque, value=body, datatype=DATATYPE_JSON
        )
    )


def stat(session: ClientSession, msg: Stat) -> None:
    """STAT groups `""`, `vbucket [vb]`, `vbucket-seqno [vb]` and `failovers [vb]`.

    As docs/protocol.md §5.7 lists them.
    """
    bucket = session.need_bucket()
    group, _, arg = msg.group.partition(" ")
    parts = sorted(bucket.partitions.items())
    if arg:
        if not arg.isdigit() or int(arg) not in bucket.partitions:
            raise InvalidArguments(f"no partition {arg!r}")
        parts = [(int(arg), bucket.partitions[int(arg)])]
    pairs: list[tuple[str, str]] = []
    if group == "":
        pairs = [
            ("pid", str(os.getpid())),
            ("curr_connections", str(len(session.server.sessions))),
            ("ep_num_vbuckets", str(len(bucket.partitions))),
            ("bucket", bucket.name),
            ("ep_traffic_enabled", "true" if bucket.traffic else "false"),
        ]
    elif group == "vbucket":  # each partition's state, as Couchbase Server names it
        pairs = [(f"vb_{vb}", p.state) for vb, p in parts]
    elif group == "vbucket-seqno":
        for vb, p in parts:
            pairs += [
                (f"vb_{vb}:high_seqno", str(p.high_seq)),
                (f"vb_{vb}:abs_high_seqno", str(p.high_seq)),
                (f"vb_{vb}:last_persisted_seqno", str(p.persisted_seq)),
                (f"vb_{vb}:uuid", str(p.uuid)),
                (f"vb_{vb}:purge_seqno", str(p.purge_seq)),
                (f"vb_{vb}:last_persisted_snap_start", str(p.snap_start)),
                (f"vb_{vb}:last_persisted_snap_end", str(p.snap_end)),
            ]
    elif group == "replication":  # formats/cluster.md §5: links, pauses, errors
        rep = session.server.replicator
        status = rep.status() if rep is not None else {}
        pairs = [(k, json.dumps(v)) for k, v in status.items()]
        pairs += [(f"vb_{vb}:complete_seqno", str(p.complete_seq)) for vb, p in parts]
    elif group == "failovers":
        for vb, p in parts:
            pairs.append((f"vb_{vb}:num_entries", str(len(p.failover))))
            for i, e in enumerate(p.failover.entries):
                pairs += [(f"vb_{vb}:{i}:id", str(e.uuid)), (f"vb_{vb}:{i}:seq", str(e.seq))]
    else:
        raise KeyNotFound(f"unknown stat group {group!r}")
    out = [StatResponse(opaque=msg.opaque, name=k, value=v).encode() for k, v in pairs]
    out.append(StatResponse(opaque=msg.opaque).encode())
    session.send(b"".join(out))


async def set_vbucket(session: ClientSession, msg: SetVbucket) -> None:
    """SET_VBUCKET (formats/cluster.md): bucket CAS and map revision checked, the state
    persisted before the answer, whose header carries the new bucket CAS."""
    bucket = session.need_admin_bucket()
    states = {code: name for name, code in STATE_CODES.items()}
    if msg.state not in states:
        raise InvalidArguments(f"partition state {msg.state} is not 1..4")
    try:
        args = json.loads(msg.value) if msg.value else {}
        rev = int(args.get("rev", 0))
        failover = bool(args.get("failover", False))
    except (ValueError, TypeError, AttributeError):
        raise InvalidArguments('SET_VBUCKET value: {"rev": N, "failover": bool}') from None
    cas = await bucket.set_partition_state(msg.vbucket, states[msg.state], cas=msg.cas,
                                           rev=rev, failover=failover)  # fmt: skip
    session.send(Response(opcode=Opcode.SET_VBUCKET, opaque=msg.opaque, cas=cas))


def set_param(session: ClientSession, msg: SetParam) -> None:
    """SET_PARAM (formats/cluster.md §6): replication_pause / replication_resume with
    a JSON value {"partitions": [..] | null, "after": seq | null}; the answer lists
    the partitions affected."""
    session.need_admin_bucket()
    rep = session.server.replicator
    if msg.name not in ("replication_pause", "replication_resume") or rep is None:
        raise InvalidArguments(f"unknown parameter {msg.name!r}")
    try:
        args = json.loads(msg.value) if msg.value else {}
        vbs = args.get("partitions")
        vbs = None if vbs is None else [int(v) for v in vbs]
        after = args.get("after")
        after = None if after is None else int(after)
    except (ValueError, TypeError, AttributeError):
        raise InvalidArguments('value: {"partitions": [..], "after": N}') from None
    done = rep.pause(vbs, after) if msg.name == "replication_pause" else rep.resume(vbs)
    session.send(Response(opcode=Opcode.SET_PARAM, opaque=msg.opaque,
                          value=json.dumps(done).encode(), datatype=DATATYPE_JSON))  # fmt: skip


def enable_traffic(session: ClientSession, msg: EnableTraffic) -> None:
    """ENABLE_TRAFFIC: the bucket serves data again (formats/cluster.md §3)."""
    session.need_admin_bucket().traffic = True
    session.send(Response(opcode=Opcode.ENABLE_TRAFFIC, opaque=msg.opaque))


def disable_traffic(session: ClientSession, msg: DisableTraffic) -> None:
    """DISABLE_TRAFFIC: data requests get ETMPFAIL until traffic is on (formats/cluster.md §3)."""
    session.need_admin_bucket().traffic = False
    session.send(Response(opcode=Opcode.DISABLE_TRAFFIC, opaque=msg.opaque))


def set_cluster_config(session: ClientSession, msg: SetClusterConfig) -> None:
    """SET_CLUSTER_CONFIG: the cluster map an orchestrator pushes, under the bucket CAS
    (formats/cluster.md); the node's config revision follows the map's."""
    bucket = session.need_admin_bucket()
    try:
        config = json.loads(msg.value)
    except ValueError:
        raise InvalidArguments("the cluster map is not JSON") from None
    if not isinstance(config, dict):
        raise InvalidArguments("the cluster map is not a JSON object")
    cas = bucket.set_cluster_map(msg.cas, config)
    server = session.server
    server.rev = max(server.rev, bucket.map_rev)
    session.send(Response(opcode=Opcode.SET_CLUSTER_CONFIG, opaque=msg.opaque, cas=cas))
