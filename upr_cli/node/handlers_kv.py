"""The node's KV commands that go through messages: GET, SET/ADD/REPLACE, DELETE, the
with-meta writes of the restore path, OBSERVE_SEQNO and GET_ALL_VB_SEQNOS, and the
commands the official SDK sends that upr's message layer does not model (TOUCH, GAT,
GET_META, answered from the raw request: formats/collections.md §5). Each handler
takes the session and the decoded request, as `node/dispatch.py` calls it, and none
awaits: the session's synchronous pass answers a read's KV requests without a coroutine
each. The classic SET/ADD/REPLACE of the load and restore path do not come here
(`ClientSession.fast_stores`).

A data request is refused with ETMPFAIL while front-end traffic is off
(`ClientSession.check_traffic`, formats/cluster.md §3); GET_ALL_VB_SEQNOS is not a data
request. Keys are qualified by the session (formats/collections.md §4).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from upr_cli.node.partition import ACTIVE, DEAD
from upr_cli.protocol import xattrs
from upr_cli.protocol.fast import encode_store_response
from upr_cli.protocol.header import Feature, Opcode
from upr_cli.protocol.messages import (
    Add,
    Delete,
    DelWithMeta,
    Get,
    GetAllVbSeqnos,
    GetAllVbSeqnosResponse,
    GetResponse,
    ObserveSeqno,
    ObserveSeqnoResponse,
    Replace,
    Request,
    Response,
    Set,
    SetWithMeta,
    UnknownRequest,
)
from upr_cli.protocol.status import InvalidArguments, KeyNotFound, NotMyVbucket

if TYPE_CHECKING:
    from upr_cli.node.bucket import Bucket
    from upr_cli.node.server import ClientSession
    from upr_cli.node.storage import DocRow

_U32 = struct.Struct(">I")
_META_V2 = struct.Struct(">IIIQB")  # deleted, flags, expiry, rev seq, datatype


def get(session: ClientSession, msg: Get) -> None:
    """GET: the key's live version."""
    session.check_traffic()
    bucket = session.need_bucket()
    doc = bucket.get(msg.vbucket, session.qualified(msg.key))
    session.send(
        GetResponse(
            opaque=msg.opaque,
            cas=doc.cas,
            flags=doc.flags,
            value=doc.value,
            datatype=doc.datatype,
        )
    )


def store(session: ClientSession, msg: Set) -> None:
    """SET, ADD and REPLACE as messages (extras other than the classic 8 bytes)."""
    session.check_traffic()
    bucket = session.need_bucket()
    session.check_datatype(msg.datatype)
    vb = msg.vbucket
    op = "add" if isinstance(msg, Add) else "replace" if isinstance(msg, Replace) else "set"
    doc = bucket.store(
        op,
        vb,
        session.qualified(msg.key),
        msg.value,
        flags=msg.flags,
        expiry=msg.expiration,
        datatype=msg.datatype,
        cas=msg.cas,
    )
    _stored(session, bucket, msg, vb, doc)


def store_with_meta(session: ClientSession, msg: SetWithMeta) -> None:
    """SET_WITH_META and DEL_WITH_META (a subclass): the restore path's writes."""
    session.check_traffic()
    bucket = session.need_bucket()
    session.check_datatype(msg.datatype, with_meta=True)
    vb = msg.vbucket
    doc = bucket.store_with_meta(
        vb,
        session.qualified(msg.key),
        msg.value,
        deleted=isinstance(msg, DelWithMeta),
        flags=msg.flags,
        expiry=msg.expiration,
        rev_seq=msg.rev_seqno,
        item_cas=msg.item_cas,
        datatype=msg.datatype,
        options=msg.options or 0,
        cas=msg.cas,
    )
    _stored(session, bucket, msg, vb, doc)


def delete(session: ClientSession, msg: Delete) -> None:
    """DELETE: a tombstone for the key's live version."""
    session.check_traffic()
    bucket = session.need_bucket()
    vb = msg.vbucket
    doc = bucket.delete(vb, session.qualified(msg.key), cas=msg.cas)
    _stored(session, bucket, msg, vb, doc)


def _stored(session: ClientSession, bucket: Bucket, msg: Request, vb: int, doc: DocRow) -> None:
    """StoreResponse's bytes, packed in one call (the restore path's answer), with the
    mutation token on a connection that negotiated MUTATION_SEQNO."""
    opcode = int(msg.SCHEMA.opcodes[0])
    if Feature.MUTATION_SEQNO in session.features:
        uuid = bucket.partitions[vb].uuid
        session.send(encode_store_response(opcode, msg.opaque, doc.cas, uuid, doc.seq))
    else:
        session.send(encode_store_response(opcode, msg.opaque, doc.cas))


def observe_seqno(session: ClientSession, msg: ObserveSeqno) -> None:
    """OBSERVE_SEQNO. A replica answers too, so a client can wait for replica persistence
    (the UPR design specification, "How front end clients ensure mutations are replicated
    or persisted on a replica"; formats/cluster.md §5)."""
    session.check_traffic()
    bucket = session.need_bucket()
    vb = msg.vbucket
    part = bucket.partition(vb, active=False)
    if part.state == DEAD:
        raise NotMyVbucket(f"partition {vb} is dead here")
    idx = part.failover.find(msg.vbucket_uuid)
    if idx is None:
        raise KeyNotFound(f"uuid {msg.vbucket_uuid:x} is not in partition {vb}'s history")
    hard = idx > 0  # a hard failover happened since: format 1
    # formats/cluster.md §5 "What OBSERVE_SEQNO tells a client": a replica (or
    # pending) copy reports as persisted the end of its last complete snapshot
    # persisted. Mid-snapshot, the seqs it persisted are not a state the active
    # had: a version deduplicated away (a key written again later in the same
    # snapshot) is on neither copy, and the copy's promotion would not hold it.
    # The current seqno stays the high seqno, as kv_engine reports it.
    persisted = part.persisted_seq if part.state == ACTIVE else part.complete_seq
    session.send(
        ObserveSeqnoResponse(
            opaque=msg.opaque,
            format=1 if hard else 0,
            observed_vbucket=vb,
            vbucket_uuid=part.uuid,
            persisted_seqno=persisted,
            current_seqno=part.high_seq,
            old_vbucket_uuid=msg.vbucket_uuid if hard else None,
            last_received_seqno=part.failover.entries[idx - 1].seq if hard else None,
        )
    )


def get_all_vb_seqnos(session: ClientSession, msg: GetAllVbSeqnos) -> None:
    """GET_ALL_VB_SEQNOS: each partition's high seq, of one state or of every live one."""
    bucket = session.need_bucket()
    want = {1: "active", 2: "replica", 3: "pending", 4: "dead"}.get(msg.state or 0)
    seqnos = tuple(
        (vb, p.high_seq)
        for vb, p in sorted(bucket.partitions.items())
        if (p.state == want if want else p.state != "dead")
    )
    session.send(GetAllVbSeqnosResponse(opaque=msg.opaque, seqnos=seqnos))


def get_meta(session: ClientSession, msg: UnknownRequest) -> None:
    """GET_META (extras: none, or u8 version 1 or 2), as the official SDK sends it."""
    session.check_traffic()
    bucket = session.need_bucket()
    key = session.qualified(msg.key)
    if len(msg.extras) > 1 or (msg.extras and msg.extras[0] not in (1, 2)):
        raise InvalidArguments("GET_META extras: none, or a u8 version 1 or 2")
    doc = bucket.get_meta(msg.vbucket, key)
    # the XATTR bit to a connection that negotiated it (formats/wire.md "Xattrs")
    shown = doc.datatype if Feature.XATTR in session.features else doc.datatype & ~xattrs.XATTR
    extras = _META_V2.pack(int(doc.deleted), doc.flags, doc.expiry, doc.rev_seq,
                           shown)  # fmt: skip
    if msg.extras != b"\x02":
        extras = extras[:-1]  # the datatype only for version 2
    session.send(Response(opcode=msg.opcode, opaque=msg.opaque, cas=doc.cas, extras=extras))


def touch(session: ClientSession, msg: UnknownRequest) -> None:
    """TOUCH and GAT (extras u32 expiry), as the official SDK sends them; GAT answers as
    GET does."""
    session.check_traffic()
    bucket = session.need_bucket()
    key = session.qualified(msg.key)
    if len(msg.extras) != 4 or msg.value:
        raise InvalidArguments("TOUCH/GAT: extras are a u32 expiry, and no value")
    (expiry,) = _U32.unpack(msg.extras)
    doc = bucket.touch(msg.vbucket, key, expiry)
    if msg.opcode == Opcode.TOUCH:
        session.send(Response(opcode=Opcode.TOUCH, opaque=msg.opaque, cas=doc.cas))
    else:
        session.send(Response(opcode=Opcode.GAT, opaque=msg.opaque, cas=doc.cas,
                              extras=_U32.pack(doc.flags), value=doc.value,
                              datatype=doc.datatype))  # fmt: skip
