"""The node's sub-document commands on the wire: SUBDOC_MULTI_LOOKUP and
SUBDOC_MULTI_MUTATION as the official SDK sends them (formats/subdoc.md), validated as
kv_engine validates them. The request is parsed by `node/subdoc.py` and run against the
bucket by `node/subdoc_kv.py`; this module turns the outcome into the response: a
spec's failure is in the body, a request's in the header status. The handler takes the
session and the raw request, as `node/dispatch.py` calls it.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from upr_cli.node import subdoc, subdoc_kv
from upr_cli.protocol.header import Feature, FrameId, Opcode
from upr_cli.protocol.messages import Response, UnknownRequest
from upr_cli.protocol.status import InvalidArguments

if TYPE_CHECKING:
    from upr_cli.node.server import ClientSession

_MUTATION_TOKEN = struct.Struct(">QQ")  # vbucket uuid, seqno


def multi(session: ClientSession, msg: UnknownRequest) -> None:
    """SUBDOC_MULTI_LOOKUP and SUBDOC_MULTI_MUTATION."""
    session.check_traffic()
    bucket = session.need_bucket()
    mutation = msg.opcode == Opcode.SUBDOC_MULTI_MUTATION
    if msg.datatype or not msg.key:
        raise InvalidArguments("a sub-document request has a key and datatype RAW")
    preserve = [data for fid, data in msg.frame_infos if fid == FrameId.PRESERVE_TTL]
    if preserve and (preserve[0] or not mutation):
        raise InvalidArguments("PreserveTTL takes no value, on a mutation only")
    xattr = Feature.XATTR in session.features
    req = subdoc.parse_request(mutation=mutation, extras=msg.extras, value=msg.value,
                               cas=msg.cas, xattrs_enabled=xattr)  # fmt: skip
    key, vb = session.qualified(msg.key), msg.vbucket
    if not mutation:
        status, cas, body = subdoc_kv.lookup_in(bucket, vb, key, req, msg.cas)
        session.send(Response(opcode=msg.opcode, opaque=msg.opaque, status=status, cas=cas,
                              value=body))  # fmt: skip
        return
    try:
        status, doc, body = subdoc_kv.mutate_in(bucket, vb, key, req, cas=msg.cas,
                                                preserve_ttl=bool(preserve))  # fmt: skip
    except subdoc.SpecFailed as failed:
        session.send(Response(opcode=msg.opcode, opaque=msg.opaque,
                              status=subdoc.Code.MULTI_PATH_FAILURE,
                              value=subdoc.failure_body(failed)))  # fmt: skip
        return
    extras = b""
    if Feature.MUTATION_SEQNO in session.features:
        extras = _MUTATION_TOKEN.pack(bucket.partitions[vb].uuid, doc.seq)
    session.send(Response(opcode=msg.opcode, opaque=msg.opaque, status=status, cas=doc.cas,
                          extras=extras, value=body))  # fmt: skip
