"""The node's dispatch table: a decoded request's message type → its handler, built
once at import, as kv_engine's front end maps each opcode to an executor of its
command family. The families each have a module: `handlers_auth` (the connection's
bootstrap: HELLO, SASL, SELECT_BUCKET), `handlers_admin` (stats, configs, partition
states), `handlers_kv`, `handlers_subdoc`, `handlers_collections` and `handlers_dcp`.

A handler is called with the session and the request; it answers through
`ClientSession.send` or raises a `StatusError`, which the session turns into the
response (docs/protocol.md §1.5). A handler that awaits (a state persisted, a stream
closed) returns its coroutine for the session to await; the others return None, so a
read's KV requests are answered without a coroutine each (`KV`, the session's
synchronous pass). Requests that upr's message layer does not model arrive as
`UnknownRequest` and are routed by opcode (`RAW`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from upr_cli.node import (
    handlers_admin,
    handlers_auth,
    handlers_collections,
    handlers_dcp,
    handlers_kv,
    handlers_subdoc,
)
from upr_cli.protocol.header import Opcode
from upr_cli.protocol.messages import (
    Add,
    AddStream,
    Barrier,
    BufferAck,
    CloseStream,
    CollectionsGetId,
    CollectionsGetManifest,
    CollectionsGetScopeId,
    CollectionsSetManifest,
    Control,
    DcpOpen,
    Delete,
    DelWithMeta,
    DisableTraffic,
    EnableTraffic,
    Get,
    GetAllVbSeqnos,
    GetClusterConfig,
    GetErrorMap,
    GetFailoverLog,
    Hello,
    Message,
    Noop,
    ObserveSeqno,
    Replace,
    SaslAuth,
    SaslListMechs,
    SaslStep,
    SelectBucket,
    Set,
    SetClusterConfig,
    SetParam,
    SetVbucket,
    SetWithMeta,
    Stat,
    StreamRequest,
    UnknownRequest,
)
from upr_cli.protocol.status import UnknownCommand

if TYPE_CHECKING:
    from upr_cli.node.server import ClientSession

Handler: TypeAlias = "Callable[[ClientSession, Any], Awaitable[None] | None]"
SyncHandler: TypeAlias = "Callable[[ClientSession, Any], None]"


def unknown(session: ClientSession, msg: Message) -> None:
    """UNKNOWN_COMMAND for a request the node does not serve."""
    raise UnknownCommand(f"opcode 0x{getattr(msg, 'opcode', 0):02x} is not supported")


# KV commands the official SDK sends that upr's message layer does not model, answered
# from the raw request (formats/collections.md §5, formats/subdoc.md)
RAW: dict[int, SyncHandler] = {
    Opcode.TOUCH: handlers_kv.touch,
    Opcode.GAT: handlers_kv.touch,
    Opcode.GET_META: handlers_kv.get_meta,
    Opcode.SUBDOC_MULTI_LOOKUP: handlers_subdoc.multi,
    Opcode.SUBDOC_MULTI_MUTATION: handlers_subdoc.multi,
}


def raw(session: ClientSession, msg: UnknownRequest) -> None:
    """An `UnknownRequest`, by its opcode."""
    RAW.get(msg.opcode, unknown)(session, msg)


# the KV requests as messages; the session's synchronous pass calls them directly
KV: dict[type[Message], SyncHandler] = {
    Get: handlers_kv.get,
    Set: handlers_kv.store,
    Add: handlers_kv.store,
    Replace: handlers_kv.store,
    Delete: handlers_kv.delete,
    SetWithMeta: handlers_kv.store_with_meta,
    DelWithMeta: handlers_kv.store_with_meta,
    ObserveSeqno: handlers_kv.observe_seqno,
    GetAllVbSeqnos: handlers_kv.get_all_vb_seqnos,
}

# by exact type: a subclass (Add of Set, DelWithMeta of SetWithMeta) has its own entry
HANDLERS: dict[type[Message], Handler] = {
    Hello: handlers_auth.hello,
    SaslListMechs: handlers_auth.sasl_list_mechs,
    SaslAuth: handlers_auth.sasl,
    SaslStep: handlers_auth.sasl,
    GetErrorMap: handlers_auth.get_error_map,
    SelectBucket: handlers_auth.select_bucket,
    GetClusterConfig: handlers_admin.get_cluster_config,
    Stat: handlers_admin.stat,
    SetVbucket: handlers_admin.set_vbucket,
    SetParam: handlers_admin.set_param,
    EnableTraffic: handlers_admin.enable_traffic,
    DisableTraffic: handlers_admin.disable_traffic,
    SetClusterConfig: handlers_admin.set_cluster_config,
    **KV,
    UnknownRequest: raw,
    CollectionsSetManifest: handlers_collections.set_manifest,
    CollectionsGetManifest: handlers_collections.get_manifest,
    CollectionsGetId: handlers_collections.get_id,
    CollectionsGetScopeId: handlers_collections.get_id,
    DcpOpen: handlers_dcp.dcp_open,
    Control: handlers_dcp.control,
    StreamRequest: handlers_dcp.stream_request,
    CloseStream: handlers_dcp.close_stream,
    GetFailoverLog: handlers_dcp.get_failover_log,
    BufferAck: handlers_dcp.buffer_ack,
    AddStream: handlers_dcp.add_stream,
    Noop: handlers_dcp.noop,
    Barrier: handlers_dcp.barrier,
}
