"""Every message upr speaks, as frozen slotted dataclasses; one schema each.

Requests carry `vbucket` (header bytes 6-7), responses `status`. All carry `opaque`,
`cas`, `datatype`, an optional DCP `stream_id` (frame info 2, docs/protocol.md §1.3) and
any other frame infos verbatim. `decode_message(frame)` picks the class by magic, opcode,
status and extras length; unknown requests become `UnknownRequest`, responses without a
structured body `Response`. Layouts cite docs/protocol.md sections; offsets live only
there.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Self, cast

from upr_cli.errors import LocalProtocolError, RemoteProtocolError
from upr_cli.protocol.decoder import Frame, FrameDecoder
from upr_cli.protocol.header import (
    ALT_HEADER,
    HEADER,
    RESPONSE_MAGICS,
    FrameId,
    Magic,
    Opcode,
    decode_frame_infos,
    encode_frame_infos,
)
from upr_cli.protocol.schema import (
    FAILOVER_LOG,
    RAW,
    TEXT,
    U16,
    U16_LIST,
    U64,
    VB_SEQNOS,
    Layout,
    Schema,
    layout,
    pick_layout,
    unpack_variant,
)
from upr_cli.protocol.status import Status

_SID = struct.Struct(">H")
# The alternate magics only say that frame infos follow; generic messages keep the classic one.
_CLASSIC_MAGIC: dict[int, int] = {
    Magic.ALT_REQUEST: Magic.REQUEST,
    Magic.ALT_RESPONSE: Magic.RESPONSE,
}
SUCCESS_ONLY = frozenset({Status.SUCCESS})


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of all messages: the header fields every packet has."""

    SCHEMA: ClassVar[Schema]
    _FIELD_NAMES: ClassVar[tuple[str, ...]] = ()
    _HEADER_WORD: ClassVar[str]  # "vbucket" (requests) or "status" (responses): bytes 6-7

    opaque: int = 0
    cas: int = 0
    datatype: int = 0
    stream_id: int | None = None
    frame_infos: tuple[tuple[int, bytes], ...] = ()

    def _header_word(self) -> int:
        return int(getattr(self, self._HEADER_WORD))

    def _opcode(self) -> int:
        if "opcode" in self._FIELD_NAMES:
            return int(cast(Any, self).opcode)
        return self.SCHEMA.opcodes[0]

    def _magic(self, framed: bool) -> int:
        if framed:
            return Magic.ALT_RESPONSE if self.SCHEMA.response else Magic.ALT_REQUEST
        return Magic.RESPONSE if self.SCHEMA.response else Magic.REQUEST

    def _field_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def encode_parts(self) -> tuple[bytes, bytes, bytes]:
        """The (extras, key, value) bytes of this message."""
        sch = self.SCHEMA
        values = self._field_dict()
        extras = b""
        if sch.extras:
            lay = (
                sch.extras[0] if len(sch.extras) == 1 else pick_layout(sch.extras, values, "extras")
            )
            extras = _pack(lay, values)
        key = b""
        if sch.key is not None:
            key = sch.key[1].encode(values[sch.key[0]])
        value = b""
        if sch.value is not None:
            if isinstance(sch.value[0], Layout):
                variants: tuple[Layout, ...] = sch.value
                lay = variants[0] if len(variants) == 1 else pick_layout(variants, values, "value")
                value = _pack(lay, values)
            else:
                name, codec = sch.value
                value = codec.encode(values[name])
        return extras, key, value

    def encode(self) -> bytes:
        """The packet's exact bytes."""
        extras, key, value = self.encode_parts()
        infos = self.frame_infos
        if self.stream_id is not None:
            infos = ((FrameId.DCP_STREAM_ID, _SID.pack(self.stream_id)), *infos)
        framing = encode_frame_infos(infos) if infos else b""
        body = len(framing) + len(extras) + len(key) + len(value)
        try:
            if framing:
                if len(key) > 255 or len(framing) > 255:
                    raise LocalProtocolError(
                        "flexible framing allows at most 255 bytes of key/frames"
                    )
                header = ALT_HEADER.pack(
                    self._magic(True),
                    self._opcode(),
                    len(framing),
                    len(key),
                    len(extras),
                    self.datatype,
                    self._header_word(),
                    body,
                    self.opaque,
                    self.cas,
                )
            else:
                header = HEADER.pack(
                    self._magic(False),
                    self._opcode(),
                    len(key),
                    len(extras),
                    self.datatype,
                    self._header_word(),
                    body,
                    self.opaque,
                    self.cas,
                )
        except struct.error as exc:
            raise LocalProtocolError(
                f"{type(self).__name__}: header field out of range: {exc}"
            ) from None
        return b"".join((header, framing, extras, key, value))

    @classmethod
    def from_frame(cls, frame: Frame) -> Self:
        """Decode a frame known to be of this class; bad bytes raise RemoteProtocolError."""
        sch = cls.SCHEMA
        kw: dict[str, Any] = {"opaque": frame.opaque, "cas": frame.cas, "datatype": frame.datatype}
        kw["status" if sch.response else "vbucket"] = frame.vbucket_or_status
        if frame.framing:
            infos = decode_frame_infos(frame.framing)
            rest = []
            for fid, data in infos:
                if fid == FrameId.DCP_STREAM_ID and not sch.response and "stream_id" not in kw:
                    if len(data) != 2:
                        raise RemoteProtocolError(
                            f"stream-id frame of {len(data)} bytes, expected 2"
                        )
                    kw["stream_id"] = _SID.unpack(data)[0]
                else:
                    rest.append((fid, data))
            kw["frame_infos"] = tuple(rest)
        what = f"{cls.__name__} extras"
        if sch.extras:
            unpack_variant(sch.extras, frame.extras, what, kw)
        elif "extras" in cls._FIELD_NAMES:
            kw["extras"] = bytes(frame.extras)
        elif frame.extras:
            raise RemoteProtocolError(f"{what} length {len(frame.extras)}, expected 0")
        if sch.key is not None:
            kw[sch.key[0]] = sch.key[1].decode(frame.key)
        elif frame.key:
            raise RemoteProtocolError(f"{cls.__name__} must not carry a key")
        if sch.value is not None:
            if isinstance(sch.value[0], Layout):
                unpack_variant(sch.value, frame.value, f"{cls.__name__} value", kw)
            else:
                name, codec = sch.value
                kw[name] = codec.decode(frame.value)
        elif frame.value:
            raise RemoteProtocolError(f"{cls.__name__} must not carry a value")
        if "opcode" in cls._FIELD_NAMES:
            kw["opcode"] = frame.opcode
        if "magic" in cls._FIELD_NAMES:
            kw["magic"] = _CLASSIC_MAGIC.get(frame.magic, frame.magic)
        if sch.check is not None:
            problem = sch.check(kw)
            if problem:
                raise RemoteProtocolError(f"{cls.__name__}: {problem}")
        return cls(**kw)

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        """Decode exactly one packet of this class from `data`."""
        msg = decode_one(data)
        if not isinstance(msg, cls):
            raise RemoteProtocolError(f"expected {cls.__name__}, got {type(msg).__name__}")
        return msg


def _pack(lay: Layout, values: dict[str, Any]) -> bytes:
    try:
        return lay.struct.pack(*(values[n] for n in lay.names))
    except struct.error as exc:
        raise LocalProtocolError(f"field out of range in {lay.names}: {exc}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Request(Message):
    """A request packet (magic 0x80/0x08): header bytes 6-7 are the vbucket."""

    _HEADER_WORD = "vbucket"
    vbucket: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseMessage(Message):
    """A response packet (magic 0x81/0x18): header bytes 6-7 are the status."""

    _HEADER_WORD = "status"
    status: int = 0


# ---------------------------------------------------------------- generic fallbacks


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownRequest(Request):
    """A request upr has no schema for, kept raw (the node answers UNKNOWN_COMMAND)."""

    SCHEMA = Schema(opcodes=(), key=("key", RAW), value=("value", RAW))
    magic: int = Magic.REQUEST
    opcode: int
    extras: bytes = b""
    key: bytes = b""
    value: bytes = b""

    def _magic(self, framed: bool) -> int:
        return Magic.ALT_REQUEST if framed and self.magic == Magic.REQUEST else self.magic

    def encode_parts(self) -> tuple[bytes, bytes, bytes]:
        """The (extras, key, value) bytes of this message."""
        return self.extras, self.key, self.value


@dataclass(frozen=True, slots=True, kw_only=True)
class Response(ResponseMessage):
    """Any response without a structured body: status plus raw extras, key, value.

    Error responses land here; their value may be an XERROR JSON body or, for
    NOT_MY_VBUCKET, a cluster config (docs/protocol.md §1.5, §3).
    """

    SCHEMA = Schema(opcodes=(), response=True, key=("key", RAW), value=("value", RAW))
    magic: int = Magic.RESPONSE
    opcode: int
    extras: bytes = b""
    key: bytes = b""
    value: bytes = b""

    def _magic(self, framed: bool) -> int:
        return Magic.ALT_RESPONSE if framed and self.magic == Magic.RESPONSE else self.magic

    def encode_parts(self) -> tuple[bytes, bytes, bytes]:
        """The (extras, key, value) bytes of this message."""
        return self.extras, self.key, self.value


# ---------------------------------------------------------------- bootstrap (docs/protocol.md §5)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Request):
    """HELLO 0x1f: key = user agent, value = u16 feature codes (docs/protocol.md §5.1)."""

    SCHEMA = Schema(opcodes=(Opcode.HELLO,), key=("agent", TEXT), value=("features", U16_LIST))
    agent: str = ""
    features: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloResponse(ResponseMessage):
    """HELLO reply: the u16 features the server granted."""

    SCHEMA = Schema(
        opcodes=(Opcode.HELLO,), response=True, value=("features", U16_LIST), statuses=SUCCESS_ONLY
    )
    features: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SaslListMechs(Request):
    """SASL_LIST_MECHS 0x20: empty request (docs/protocol.md §5.2)."""

    SCHEMA = Schema(opcodes=(Opcode.SASL_LIST_MECHS,))


@dataclass(frozen=True, slots=True, kw_only=True)
class SaslListMechsResponse(ResponseMessage):
    """SASL_LIST_MECHS reply: space-separated mechanism names."""

    SCHEMA = Schema(
        opcodes=(Opcode.SASL_LIST_MECHS,),
        response=True,
        value=("mechanisms", TEXT),
        statuses=SUCCESS_ONLY,
    )
    mechanisms: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        """The mechanisms as a tuple."""
        return tuple(self.mechanisms.split())


@dataclass(frozen=True, slots=True, kw_only=True)
class SaslAuth(Request):
    """SASL_AUTH 0x21: key = mechanism, value = first client message (docs/protocol.md §5.2)."""

    SCHEMA = Schema(opcodes=(Opcode.SASL_AUTH,), key=("mechanism", TEXT), value=("payload", RAW))
    mechanism: str
    payload: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class SaslStep(Request):
    """SASL_STEP 0x22: key = mechanism, value = next client message (docs/protocol.md §5.2)."""

    SCHEMA = Schema(opcodes=(Opcode.SASL_STEP,), key=("mechanism", TEXT), value=("payload", RAW))
    mechanism: str
    payload: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class SelectBucket(Request):
    """SELECT_BUCKET 0x89: key = bucket name (docs/protocol.md §5.3)."""

    SCHEMA = Schema(opcodes=(Opcode.SELECT_BUCKET,), key=("bucket", TEXT))
    bucket: str


@dataclass(frozen=True, slots=True, kw_only=True)
class GetErrorMap(Request):
    """GET_ERROR_MAP 0xfe: value = u16 highest map version understood (docs/protocol.md §5.4)."""

    SCHEMA = Schema(opcodes=(Opcode.GET_ERROR_MAP,), value=("version", U16))
    version: int = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class GetClusterConfig(Request):
    """GET_CLUSTER_CONFIG 0xb5: extras empty or i64 epoch + revision (docs/protocol.md §5.5)."""

    SCHEMA = Schema(
        opcodes=(Opcode.GET_CLUSTER_CONFIG,),
        extras=(layout(), layout(("epoch", "q"), ("revision", "q"))),
    )
    epoch: int | None = None
    revision: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Stat(Request):
    """STAT 0x10: key = stat group, empty for the default group (docs/protocol.md §5.7)."""

    SCHEMA = Schema(opcodes=(Opcode.STAT,), key=("group", TEXT))
    group: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class StatResponse(ResponseMessage):
    """One stat of a STAT reply; an empty name and value end the list (docs/protocol.md §5.7)."""

    SCHEMA = Schema(
        opcodes=(Opcode.STAT,),
        response=True,
        key=("name", TEXT),
        value=("value", TEXT),
        statuses=SUCCESS_ONLY,
    )
    name: str = ""
    value: str = ""


# ---------------------------------------------------------------- KV


@dataclass(frozen=True, slots=True, kw_only=True)
class Get(Request):
    """GET 0x00: key = document key."""

    SCHEMA = Schema(opcodes=(Opcode.GET,), key=("key", RAW))
    key: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class GetResponse(ResponseMessage):
    """GET reply: extras = u32 item flags, value = document, CAS in the header."""

    SCHEMA = Schema(
        opcodes=(Opcode.GET,),
        response=True,
        extras=(layout(("flags", "I")),),
        value=("value", RAW),
        statuses=SUCCESS_ONLY,
    )
    flags: int = 0
    value: bytes = b""


_STORE_EXTRAS = (layout(("flags", "I"), ("expiration", "I")),)


@dataclass(frozen=True, slots=True, kw_only=True)
class Set(Request):
    """SET 0x01: extras = u32 flags, u32 expiration; header CAS guards (0 = none)."""

    SCHEMA = Schema(
        opcodes=(Opcode.SET,), extras=_STORE_EXTRAS, key=("key", RAW), value=("value", RAW)
    )
    key: bytes
    value: bytes = b""
    flags: int = 0
    expiration: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Add(Set):
    """ADD 0x02: SET that fails with KEY_EEXISTS if the key exists."""

    SCHEMA = Schema(
        opcodes=(Opcode.ADD,), extras=_STORE_EXTRAS, key=("key", RAW), value=("value", RAW)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Replace(Set):
    """REPLACE 0x03: SET that fails with KEY_ENOENT if the key is absent."""

    SCHEMA = Schema(
        opcodes=(Opcode.REPLACE,), extras=_STORE_EXTRAS, key=("key", RAW), value=("value", RAW)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Delete(Request):
    """DELETE 0x04: key = document key; header CAS guards."""

    SCHEMA = Schema(opcodes=(Opcode.DELETE,), key=("key", RAW))
    key: bytes


# docs/protocol.md §6: flags, expiration, rev_seqno, cas [, u32 options] [, u16 nmeta]
_META_BASE = (("flags", "I"), ("expiration", "I"), ("rev_seqno", "Q"), ("item_cas", "Q"))
_WITH_META_EXTRAS = (
    layout(*_META_BASE),
    layout(*_META_BASE, ("nmeta", "H")),
    layout(*_META_BASE, ("options", "I")),
    layout(*_META_BASE, ("options", "I"), ("nmeta", "H")),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SetWithMeta(Request):
    """SET_WITH_META 0xa2: store with the original metadata, extras 24/26/28/30 B.

    The layout is docs/protocol.md §6.
    """

    SCHEMA = Schema(
        opcodes=(Opcode.SET_WITH_META,),
        extras=_WITH_META_EXTRAS,
        key=("key", RAW),
        value=("value", RAW),
    )
    key: bytes
    value: bytes = b""
    flags: int = 0
    expiration: int = 0
    rev_seqno: int = 0
    item_cas: int = 0
    options: int | None = None
    nmeta: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DelWithMeta(SetWithMeta):
    """DEL_WITH_META 0xa8: delete with the original metadata (docs/protocol.md §6)."""

    SCHEMA = Schema(
        opcodes=(Opcode.DEL_WITH_META,),
        extras=_WITH_META_EXTRAS,
        key=("key", RAW),
        value=("value", RAW),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreResponse(ResponseMessage):
    """Success reply of SET/ADD/REPLACE/DELETE/*_WITH_META.

    With HELLO MutationSeqno the extras hold u64 vbucket uuid and u64 seqno.
    """

    SCHEMA = Schema(
        opcodes=(
            Opcode.SET,
            Opcode.ADD,
            Opcode.REPLACE,
            Opcode.DELETE,
            Opcode.SET_WITH_META,
            Opcode.DEL_WITH_META,
        ),
        response=True,
        extras=(layout(), layout(("vbucket_uuid", "Q"), ("seqno", "Q"))),
        statuses=SUCCESS_ONLY,
    )
    opcode: int = Opcode.SET
    vbucket_uuid: int | None = None
    seqno: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ObserveSeqno(Request):
    """OBSERVE_SEQNO 0x91: value = u64 vbucket uuid; vbucket in the header."""

    SCHEMA = Schema(opcodes=(Opcode.OBSERVE_SEQNO,), value=("vbucket_uuid", U64))
    vbucket_uuid: int


_OBSERVE_BASE = (
    ("format", "B"),
    ("observed_vbucket", "H"),
    ("vbucket_uuid", "Q"),
    ("persisted_seqno", "Q"),
    ("current_seqno", "Q"),
)


def _check_observe(kw: dict[str, Any]) -> str | None:
    hard = kw.get("old_vbucket_uuid") is not None
    if kw["format"] != (1 if hard else 0):
        return f"format {kw['format']} does not match a {'43' if hard else '27'}-byte body"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ObserveSeqnoResponse(ResponseMessage):
    """OBSERVE_SEQNO reply: format 0 (27 B), or 1 after a hard failover (43 B)."""

    SCHEMA = Schema(
        opcodes=(Opcode.OBSERVE_SEQNO,),
        response=True,
        value=(
            layout(*_OBSERVE_BASE),
            layout(*_OBSERVE_BASE, ("old_vbucket_uuid", "Q"), ("last_received_seqno", "Q")),
        ),
        statuses=SUCCESS_ONLY,
        check=_check_observe,
    )
    format: int = 0
    observed_vbucket: int = 0
    vbucket_uuid: int = 0
    persisted_seqno: int = 0
    current_seqno: int = 0
    old_vbucket_uuid: int | None = None
    last_received_seqno: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GetAllVbSeqnos(Request):
    """GET_ALL_VB_SEQNOS 0x48: extras empty, u32 state, or state + u32 collection.

    The layout is docs/protocol.md §2.19.
    """

    SCHEMA = Schema(
        opcodes=(Opcode.GET_ALL_VB_SEQNOS,),
        extras=(
            layout(),
            layout(("state", "I")),
            layout(("state", "I"), ("collection", "I")),
        ),
    )
    state: int | None = None
    collection: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GetAllVbSeqnosResponse(ResponseMessage):
    """GET_ALL_VB_SEQNOS reply: {u16 vbid, u64 seqno} records."""

    SCHEMA = Schema(
        opcodes=(Opcode.GET_ALL_VB_SEQNOS,),
        response=True,
        value=("seqnos", VB_SEQNOS),
        statuses=SUCCESS_ONLY,
    )
    seqnos: tuple[tuple[int, int], ...] = ()


# ---------------------------------------------------------------- DCP (docs/protocol.md §2)


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpOpen(Request):
    """DCP_OPEN 0x50: extras u32 reserved, u32 flags; key = name (docs/protocol.md §2.1)."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_OPEN,),
        extras=(layout(("reserved", "I"), ("flags", "I")),),
        key=("name", TEXT),
        value=("value", RAW),
    )
    name: str
    flags: int = 0
    reserved: int = 0
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class AddStream(Request):
    """DCP_ADD_STREAM 0x51: extras u32 stream flags (docs/protocol.md §2.2)."""

    SCHEMA = Schema(opcodes=(Opcode.DCP_ADD_STREAM,), extras=(layout(("flags", "I")),))
    flags: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class AddStreamResponse(ResponseMessage):
    """DCP_ADD_STREAM reply: extras u32 = the new stream's opaque."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_ADD_STREAM,),
        response=True,
        extras=(layout(("stream_opaque", "I")),),
        statuses=SUCCESS_ONLY,
    )
    stream_opaque: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseStream(Request):
    """DCP_CLOSE_STREAM 0x52: vbucket in the header, no body (docs/protocol.md §2.3)."""

    SCHEMA = Schema(opcodes=(Opcode.DCP_CLOSE_STREAM,))


STREAM_FOREVER = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamRequest(Request):
    """DCP_STREAM_REQ 0x53: 48-byte extras (docs/protocol.md §2.4); JSON value for collections."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_STREAM_REQ,),
        extras=(
            layout(
                ("flags", "I"),
                ("reserved", "I"),
                ("start_seqno", "Q"),
                ("end_seqno", "Q"),
                ("vbucket_uuid", "Q"),
                ("snap_start_seqno", "Q"),
                ("snap_end_seqno", "Q"),
            ),
        ),
        value=("value", RAW),
    )
    flags: int = 0
    reserved: int = 0
    start_seqno: int = 0
    end_seqno: int = STREAM_FOREVER
    vbucket_uuid: int = 0
    snap_start_seqno: int = 0
    snap_end_seqno: int = 0
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamRequestOk(ResponseMessage):
    """STREAM_REQ SUCCESS: value = failover log, {u64 uuid, u64 seqno} newest first.

    The layout is docs/protocol.md §2.4.
    """

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_STREAM_REQ,),
        response=True,
        value=("failover_log", FAILOVER_LOG),
        statuses=SUCCESS_ONLY,
    )
    failover_log: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamRequestRollback(ResponseMessage):
    """STREAM_REQ ROLLBACK 0x23: value = u64 rollback seqno (docs/protocol.md §2.4)."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_STREAM_REQ,),
        response=True,
        value=("rollback_seqno", U64),
        statuses=frozenset({Status.ROLLBACK}),
    )
    status: int = Status.ROLLBACK
    rollback_seqno: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class GetFailoverLog(Request):
    """DCP_GET_FAILOVER_LOG 0x54 (0x96 on plain connections): no body (docs/protocol.md §2.5)."""

    SCHEMA = Schema(opcodes=(Opcode.DCP_GET_FAILOVER_LOG, Opcode.GET_FAILOVER_LOG))
    opcode: int = Opcode.DCP_GET_FAILOVER_LOG


@dataclass(frozen=True, slots=True, kw_only=True)
class FailoverLogResponse(ResponseMessage):
    """GET_FAILOVER_LOG reply: the failover log, newest first (docs/protocol.md §2.5)."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_GET_FAILOVER_LOG, Opcode.GET_FAILOVER_LOG),
        response=True,
        value=("failover_log", FAILOVER_LOG),
        statuses=SUCCESS_ONLY,
    )
    opcode: int = Opcode.DCP_GET_FAILOVER_LOG
    failover_log: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamEnd(Request):
    """DCP_STREAM_END 0x55: extras u32 end status (docs/protocol.md §2.6)."""

    SCHEMA = Schema(opcodes=(Opcode.DCP_STREAM_END,), extras=(layout(("status", "I")),))
    status: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotMarker(Request):
    """DCP_SNAPSHOT_MARKER 0x56 v1: 20-byte extras start, end, flags (docs/protocol.md §2.7)."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_SNAPSHOT_MARKER,),
        extras=(layout(("start_seqno", "Q"), ("end_seqno", "Q"), ("flags", "I")),),
    )
    start_seqno: int
    end_seqno: int
    flags: int = 0


_MARKER_V2 = (
    ("start_seqno", "Q"),
    ("end_seqno", "Q"),
    ("flags", "I"),
    ("max_visible_seqno", "Q"),
    ("high_completed_seqno", "Q"),
)


def _check_marker_v2(kw: dict[str, Any]) -> str | None:
    v22 = kw.get("purge_seqno") is not None
    if kw["version"] != (2 if v22 else 0):
        return f"version byte {kw['version']} does not match a {52 if v22 else 36}-byte value"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotMarkerV2(Request):
    """DCP_SNAPSHOT_MARKER 0x56 v2.x: 1-byte extras = version; v2.0 36-B / v2.2 52-B value."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_SNAPSHOT_MARKER,),
        extras=(layout(("version", "B")),),
        value=(
            layout(*_MARKER_V2),
            layout(*_MARKER_V2, ("purge_seqno", "Q"), ("high_prepared_seqno", "Q")),
        ),
        check=_check_marker_v2,
    )
    version: int = 0
    start_seqno: int
    end_seqno: int
    flags: int = 0
    max_visible_seqno: int = 0
    high_completed_seqno: int = 0
    purge_seqno: int | None = None
    high_prepared_seqno: int | None = None


MUTATION_EXTRAS = layout(
    ("by_seqno", "Q"),
    ("rev_seqno", "Q"),
    ("flags", "I"),
    ("expiration", "I"),
    ("lock_time", "I"),
    ("nmeta", "H"),
    ("nru", "B"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Mutation(Request):
    """DCP_MUTATION 0x57: 31-byte extras (docs/protocol.md §2.8); CAS and datatype in the header."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_MUTATION,),
        extras=(MUTATION_EXTRAS,),
        key=("key", RAW),
        value=("value", RAW),
    )
    by_seqno: int
    rev_seqno: int = 1
    flags: int = 0
    expiration: int = 0
    lock_time: int = 0
    nmeta: int = 0
    nru: int = 0
    key: bytes
    value: bytes = b""


DELETION_V1_EXTRAS = layout(("by_seqno", "Q"), ("rev_seqno", "Q"), ("nmeta", "H"))
DELETION_V2_EXTRAS = layout(
    ("by_seqno", "Q"), ("rev_seqno", "Q"), ("delete_time", "I"), ("unused", "B")
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Deletion(Request):
    """DCP_DELETION 0x58 v1: 18-byte extras (docs/protocol.md §2.9)."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_DELETION,),
        extras=(DELETION_V1_EXTRAS,),
        key=("key", RAW),
        value=("value", RAW),
    )
    by_seqno: int
    rev_seqno: int = 1
    nmeta: int = 0
    key: bytes
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeletionV2(Request):
    """DCP_DELETION 0x58 v2 (IncludeDeleteTimes): 21-byte extras (docs/protocol.md §2.9)."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_DELETION,),
        extras=(DELETION_V2_EXTRAS,),
        key=("key", RAW),
        value=("value", RAW),
    )
    by_seqno: int
    rev_seqno: int = 1
    delete_time: int = 0
    unused: int = 0
    key: bytes
    value: bytes = b""


EXPIRATION_EXTRAS = layout(("by_seqno", "Q"), ("rev_seqno", "Q"), ("delete_time", "I"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Expiration(Request):
    """DCP_EXPIRATION 0x59: 20-byte extras (docs/protocol.md §2.10)."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_EXPIRATION,),
        extras=(EXPIRATION_EXTRAS,),
        key=("key", RAW),
        value=("value", RAW),
    )
    by_seqno: int
    rev_seqno: int = 1
    delete_time: int = 0
    key: bytes
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class SetVbucketState(Request):
    """DCP_SET_VBUCKET_STATE 0x5b: extras u8 state (1 active … 4 dead), optional JSON.

    The layout is docs/protocol.md §2.11.
    """

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_SET_VBUCKET_STATE,),
        extras=(layout(("state", "B")),),
        value=("value", RAW),
    )
    state: int
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class SetVbucket(Request):
    """SET_VBUCKET 0x3d (an orchestrator to a node): extras u8 state (1 active … 4 dead);
    header CAS = the bucket CAS; value JSON {"rev": N, "failover": bool} (formats/cluster.md)."""

    SCHEMA = Schema(
        opcodes=(Opcode.SET_VBUCKET,), extras=(layout(("state", "B")),), value=("value", RAW)
    )
    state: int
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class SetClusterConfig(Request):
    """SET_CLUSTER_CONFIG 0xb4: value = the bucket's cluster map JSON; header CAS = the
    bucket CAS; accepted only when its `rev` is newer than the node's (formats/cluster.md)."""

    SCHEMA = Schema(opcodes=(Opcode.SET_CLUSTER_CONFIG,), value=("value", RAW))
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectionsSetManifest(Request):
    """COLLECTIONS_SET_MANIFEST 0xb9: value = the bucket's collections manifest JSON, as
    the cluster manager pushes it to each data node (docs/protocol.md "Collections")."""

    SCHEMA = Schema(opcodes=(Opcode.COLLECTIONS_SET_MANIFEST,), value=("value", RAW))
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectionsGetManifest(Request):
    """COLLECTIONS_GET_MANIFEST 0xba: no body; the reply's value is the manifest JSON."""

    SCHEMA = Schema(opcodes=(Opcode.COLLECTIONS_GET_MANIFEST,))


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectionsGetId(Request):
    """COLLECTIONS_GET_ID 0xbb: the path "scope.collection" in the value (kv_engine's
    documented form; a node also takes it in the key, as newer clients send it)."""

    SCHEMA = Schema(opcodes=(Opcode.COLLECTIONS_GET_ID,), key=("key", RAW), value=("value", RAW))
    key: bytes = b""
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectionsGetScopeId(Request):
    """COLLECTIONS_GET_SCOPE_ID 0xbc: the path "scope" in the value (or the key)."""

    SCHEMA = Schema(
        opcodes=(Opcode.COLLECTIONS_GET_SCOPE_ID,), key=("key", RAW), value=("value", RAW)
    )
    key: bytes = b""
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectionsIdResponse(ResponseMessage):
    """GET_ID / GET_SCOPE_ID SUCCESS: extras u64 manifest uid, u32 collection (or scope) id."""

    SCHEMA = Schema(
        opcodes=(Opcode.COLLECTIONS_GET_ID, Opcode.COLLECTIONS_GET_SCOPE_ID),
        response=True,
        extras=(layout(("manifest_uid", "Q"), ("id", "I")),),
        statuses=SUCCESS_ONLY,
    )
    opcode: int = Opcode.COLLECTIONS_GET_ID
    manifest_uid: int
    id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EnableTraffic(Request):
    """ENABLE_TRAFFIC 0x8d: no body. A cluster node starts with front-end traffic off
    (data commands and stream requests answer ETMPFAIL) until its orchestrator has
    given it the map and states (formats/cluster.md §3; the UPR design specification,
    "How ns_server and ep-engine guarantee ordering of partition state transitions",
    step 3)."""

    SCHEMA = Schema(opcodes=(Opcode.ENABLE_TRAFFIC,))


@dataclass(frozen=True, slots=True, kw_only=True)
class DisableTraffic(Request):
    """DISABLE_TRAFFIC 0x8e: no body; front-end traffic off again (formats/cluster.md §3)."""

    SCHEMA = Schema(opcodes=(Opcode.DISABLE_TRAFFIC,))


@dataclass(frozen=True, slots=True, kw_only=True)
class SetParam(Request):
    """SET_PARAM 0x82: extras u32 parameter type (4: dcp), key = parameter name, value =
    its value; upr uses it for replication pause and resume (formats/cluster.md §6)."""

    SCHEMA = Schema(
        opcodes=(Opcode.SET_PARAM,), extras=(layout(("param_type", "I")),), key=("name", TEXT),
        value=("value", RAW),
    )  # fmt: skip
    param_type: int = 4
    name: str
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Noop(Request):
    """DCP_NOOP 0x5c: no body; the client answers with the same opaque (docs/protocol.md §2.12)."""

    SCHEMA = Schema(opcodes=(Opcode.DCP_NOOP,))


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferAck(Request):
    """DCP_BUFFER_ACKNOWLEDGEMENT 0x5d: extras u32 bytes processed (docs/protocol.md §2.13)."""

    SCHEMA = Schema(opcodes=(Opcode.DCP_BUFFER_ACKNOWLEDGEMENT,), extras=(layout(("acked", "I")),))
    acked: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Control(Request):
    """DCP_CONTROL 0x5e: key = control name, value = string (docs/protocol.md §2.14)."""

    SCHEMA = Schema(opcodes=(Opcode.DCP_CONTROL,), key=("name", TEXT), value=("value", TEXT))
    name: str
    value: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqnoAdvanced(Request):
    """DCP_SEQNO_ADVANCED 0x64: extras u64 seqno (docs/protocol.md §2.16)."""

    SCHEMA = Schema(opcodes=(Opcode.DCP_SEQNO_ADVANCED,), extras=(layout(("by_seqno", "Q")),))
    by_seqno: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SystemEvent(Request):
    """DCP_SYSTEM_EVENT 0x5f: extras u64 seqno, u32 event, u8 version (docs/protocol.md §2.15)."""

    SCHEMA = Schema(
        opcodes=(Opcode.DCP_SYSTEM_EVENT,),
        extras=(layout(("by_seqno", "Q"), ("event", "I"), ("version", "B")),),
        key=("key", RAW),
        value=("value", RAW),
    )
    by_seqno: int
    event: int
    version: int = 0
    key: bytes = b""
    value: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Barrier(Request):
    """UPR_BARRIER 0xE1, an upr extension (formats/barrier.md): key = cookie.

    Client → node: register the cookie (no value). Node → client: the barrier was
    reached; value = JSON {"cut": {partition: seq}} with decimal strings.
    """

    SCHEMA = Schema(opcodes=(Opcode.UPR_BARRIER,), key=("cookie", RAW), value=("value", RAW))
    cookie: bytes
    value: bytes = b""


# ---------------------------------------------------------------- dispatch

_REQUESTS: dict[int, list[type[Message]]] = {}
_RESPONSES: dict[int, list[type[Message]]] = {}


def _register() -> None:
    for cls in list(globals().values()):
        if not (isinstance(cls, type) and issubclass(cls, Message)) or "SCHEMA" not in vars(cls):
            continue
        cls._FIELD_NAMES = tuple(f.name for f in fields(cls))
        table = _RESPONSES if cls.SCHEMA.response else _REQUESTS
        for op in cls.SCHEMA.opcodes:
            table.setdefault(op, []).append(cls)


_register()

MESSAGE_CLASSES: tuple[type[Message], ...] = tuple(
    dict.fromkeys(c for cs in (*_REQUESTS.values(), *_RESPONSES.values()) for c in cs)
)


def decode_message(frame: Frame) -> Message:
    """The typed message for a frame; raises RemoteProtocolError on malformed bytes."""
    magic = frame.magic
    if magic in (Magic.SERVER_REQUEST, Magic.SERVER_RESPONSE):
        cls: type[Message] = Response if magic == Magic.SERVER_RESPONSE else UnknownRequest
        return cls.from_frame(frame)
    if magic in RESPONSE_MAGICS:
        cands = [
            c
            for c in _RESPONSES.get(frame.opcode, ())
            if c.SCHEMA.statuses is None or frame.vbucket_or_status in c.SCHEMA.statuses
        ]
        if not cands:
            return Response.from_frame(frame)
    else:
        cands = _REQUESTS.get(frame.opcode, [])
        if not cands:
            return UnknownRequest.from_frame(frame)
    n = len(frame.extras)
    for c in cands:
        if n in c.SCHEMA.extras_sizes():
            return c.from_frame(frame)
    sizes = sorted({s for c in cands for s in c.SCHEMA.extras_sizes()})
    raise RemoteProtocolError(
        f"opcode 0x{frame.opcode:02x}: extras length {n}, expected one of {sizes}"
    )


def decode_one(data: bytes) -> Message:
    """Decode exactly one whole packet; trailing or missing bytes are errors."""
    dec = FrameDecoder()
    dec.feed(data)
    frame = dec.next_frame()
    if frame is None:
        raise RemoteProtocolError(f"incomplete packet ({len(data)} bytes)")
    if dec.buffered:
        raise RemoteProtocolError(f"{dec.buffered} bytes after the packet")
    return decode_message(frame)
