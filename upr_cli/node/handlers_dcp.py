"""The node's DCP commands on a producer connection (docs/protocol.md §2): DCP_OPEN,
CONTROL, STREAM_REQ, CLOSE_STREAM, GET_FAILOVER_LOG (also on a plain connection),
BUFFER_ACK, NOOP, and the barrier cookies (a CONTROL-negotiated extension,
formats/barrier.md). Each handler takes the session and the decoded request, as
`node/dispatch.py` calls it; the streams themselves are `node/producer.py`'s.

DCP_OPEN needs an authenticated session (EACCESS before); the other DCP commands but
the plain GET_FAILOVER_LOG need DCP_OPEN first (EINVAL), and a barrier its control
(UNKNOWN_COMMAND). upr serve takes producer connections only: ADD_STREAM, which a
consumer connection serves, is NOT_SUPPORTED.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from upr_cli.node.producer import DcpProducer, open_flags_problem
from upr_cli.protocol.dcp import OPEN_PRODUCER
from upr_cli.protocol.header import Feature, Opcode
from upr_cli.protocol.messages import (
    AddStream,
    Barrier,
    BufferAck,
    CloseStream,
    Control,
    DcpOpen,
    FailoverLogResponse,
    GetFailoverLog,
    Noop,
    Response,
    StreamRequest,
    StreamRequestOk,
)
from upr_cli.protocol.status import (
    AccessDenied,
    InvalidArguments,
    KeyNotFound,
    NotSupported,
    UnknownCommand,
)

if TYPE_CHECKING:
    from upr_cli.node.server import ClientSession


def _producer(session: ClientSession) -> DcpProducer:
    """The connection's producer, or EINVAL before DCP_OPEN."""
    if session.dcp is None:
        raise InvalidArguments("send DCP_OPEN first")
    return session.dcp


def dcp_open(session: ClientSession, msg: DcpOpen) -> None:
    """DCP_OPEN (docs/protocol.md §2.1): a producer for this connection, once."""
    if not session.authenticated:
        raise AccessDenied("authenticate before DCP_OPEN")
    bucket = session.need_bucket()
    if session.dcp is not None:
        raise InvalidArguments("DCP_OPEN was already sent on this connection")
    problem = open_flags_problem(msg.flags)
    if problem:
        raise InvalidArguments(problem)
    if not msg.flags & OPEN_PRODUCER:
        raise NotSupported("upr serve accepts producer (client) DCP connections only")
    if msg.value:
        raise InvalidArguments("a producer DCP_OPEN takes no value")
    server = session.server
    session.dcp = DcpProducer(
        bucket,
        msg.name,
        msg.flags,
        session.sender,
        server.backfill_pool,
        server.backfill_slots,
        session.fatal,
        server.config.idle_timeout,
        collections=session.collections,
        snappy=Feature.SNAPPY in session.features,
        batch_bytes=server.backfill_batch_bytes,
    )
    session.send(Response(opcode=Opcode.DCP_OPEN, opaque=msg.opaque))


def get_failover_log(session: ClientSession, msg: GetFailoverLog) -> None:
    """GET_FAILOVER_LOG on a plain connection, DCP_GET_FAILOVER_LOG after DCP_OPEN."""
    if msg.opcode == Opcode.GET_FAILOVER_LOG:
        part = session.need_bucket().partition(msg.vbucket, active=False)
        session.send(
            FailoverLogResponse(
                opaque=msg.opaque, opcode=msg.opcode, failover_log=part.failover.pairs()
            )
        )
        return
    part = _producer(session).bucket.partition(msg.vbucket, active=False)
    session.send(FailoverLogResponse(opaque=msg.opaque, failover_log=part.failover.pairs()))


async def barrier(session: ClientSession, msg: Barrier) -> None:
    """UPR_BARRIER: answered at once, its cookie echoed once the streams have passed it
    (negotiated with the upr_barrier_cookies control; formats/barrier.md)."""
    dcp = session.dcp
    if dcp is None or not dcp.barriers_enabled:
        raise UnknownCommand("barrier cookies need the upr_barrier_cookies control")
    dcp.register_barrier(msg.cookie, msg.opaque)
    session.send(Response(opcode=Opcode.UPR_BARRIER, opaque=msg.opaque))
    session.flush_out()
    await dcp.check_barriers()


def buffer_ack(session: ClientSession, msg: BufferAck) -> None:
    """BUFFER_ACK: no response on success (docs/protocol.md §2.13)."""
    _producer(session).sender.ack(msg.acked)


def control(session: ClientSession, msg: Control) -> None:
    """DCP_CONTROL: one setting of the producer."""
    _producer(session).control(msg.name, msg.value)
    session.send(Response(opcode=Opcode.DCP_CONTROL, opaque=msg.opaque))


def stream_request(session: ClientSession, msg: StreamRequest) -> None:
    """DCP_STREAM_REQ: the answer (with the failover log) precedes the stream's data; a
    rollback answer is the session's (`RollbackTo`)."""
    dcp = _producer(session)
    session.check_traffic()
    spec, log_pairs = dcp.stream_request(msg)
    session.send(StreamRequestOk(opaque=msg.opaque, failover_log=log_pairs))
    dcp.start_stream(spec)


async def close_stream(session: ClientSession, msg: CloseStream) -> None:
    """DCP_CLOSE_STREAM: answered, then the stream stopped."""
    dcp = _producer(session)
    if not dcp.has_stream(msg.vbucket):
        raise KeyNotFound(f"no stream for partition {msg.vbucket}")
    session.send(Response(opcode=Opcode.DCP_CLOSE_STREAM, opaque=msg.opaque))
    session.flush_out()
    await dcp.close_stream(msg.vbucket)


def noop(session: ClientSession, msg: Noop) -> None:
    """DCP_NOOP from the client: answered."""
    _producer(session)
    session.send(Response(opcode=Opcode.DCP_NOOP, opaque=msg.opaque))


def add_stream(session: ClientSession, msg: AddStream) -> None:
    """DCP_ADD_STREAM: for consumer connections, which upr serve lacks."""
    _producer(session)
    raise NotSupported("ADD_STREAM is for consumer connections, which upr serve lacks")
