"""Sans-IO memcached binary protocol + DCP codec: bytes in, frames and messages out.

No socket, asyncio or file API is imported here (a test checks); the client, the node,
replay and the tests all drive this same code.
"""

from upr_cli.protocol.decoder import DEFAULT_MAX_BODY, Frame, FrameDecoder
from upr_cli.protocol.fast import DcpRecord, encode_mutation, record_from_frame
from upr_cli.protocol.header import Datatype, Feature, Magic, Opcode
from upr_cli.protocol.messages import (
    MESSAGE_CLASSES,
    STREAM_FOREVER,
    Message,
    Request,
    Response,
    ResponseMessage,
    decode_message,
    decode_one,
)
from upr_cli.protocol.status import Status, StatusError, error_for_status, status_error

__all__ = [
    "DEFAULT_MAX_BODY",
    "MESSAGE_CLASSES",
    "STREAM_FOREVER",
    "Datatype",
    "DcpRecord",
    "Feature",
    "Frame",
    "FrameDecoder",
    "Magic",
    "Message",
    "Opcode",
    "Request",
    "Response",
    "ResponseMessage",
    "Status",
    "StatusError",
    "decode_message",
    "decode_one",
    "encode_mutation",
    "error_for_status",
    "record_from_frame",
    "status_error",
]
