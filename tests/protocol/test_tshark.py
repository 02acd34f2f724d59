"""Wireshark's Couchbase dissector as an independent oracle for our encoder (docs/protocol.md §8.1).

Every packet of one made-up DCP conversation (HELLO, DCP_OPEN, CONTROL, STREAM_REQ and
its success/ROLLBACK replies, markers v1/v2.0, mutations with and without a stream-id
frame, deletions v1/v2, expiration, SEQNO_ADVANCED, SYSTEM_EVENT, SET_VBUCKET_STATE,
STREAM_END, NOOP and its reply, BUFFER_ACK, GET_FAILOVER_LOG) is built by `upr_cli`'s
encoder, written into a pcap file, each as one TCP segment between 127.0.0.1:50000 and the
dissector's port 11210, and decoded by a single `tshark -T pdml` run. Each packet's
header fields, extras fields, key and value as tshark shows them must equal the values we
meant to encode (written out here from the spec, not read back through our decoder), and
tshark must report no expert info beyond the dissector's known quirks:

* the opaque is shown byte-swapped (it is dissected little-endian): its raw bytes are
  checked big-endian and its shown value swapped;
* DCP keys (also the DCP_OPEN connection name) are always read as if collections were on,
  even with a HELLO in the capture that declines them, so a key's first byte is shown as
  a collection id; the whole key is still `couchbase.key`;
* failover-log, rollback and binary (system-event) values get "Trailing stray characters";
  the rollback seqno is not decoded, so the raw value bytes are compared instead;
* any non-success status gets a "<opcode>: <status>" warning;
* tshark 4.0 does not decode STREAM_END or SET_VBUCKET_STATE extras, only shows them as
  `couchbase.extras.unknown`, so their raw bytes are compared.

Skipped when tshark is not installed (`make test` installs it when run as root).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from upr_cli.errors import LocalProtocolError
from upr_cli.protocol.fast import encode_mutation
from upr_cli.protocol.messages import (
    STREAM_FOREVER,
    BufferAck,
    Control,
    DcpOpen,
    Deletion,
    DeletionV2,
    Expiration,
    FailoverLogResponse,
    GetFailoverLog,
    Hello,
    HelloResponse,
    Mutation,
    Noop,
    Response,
    SeqnoAdvanced,
    SetVbucketState,
    SnapshotMarker,
    SnapshotMarkerV2,
    StreamEnd,
    StreamRequest,
    StreamRequestOk,
    StreamRequestRollback,
    SystemEvent,
)

TSHARK = shutil.which("tshark")
pytestmark = pytest.mark.skipif(TSHARK is None, reason="tshark is not installed")

CLIENT_PORT = 50000
SERVER_PORT = 11210  # the dissector's registered port (couchbase.tcp.port)
LOCALHOST = bytes((127, 0, 0, 1))

VB = 5
STREAM_OPAQUE = 0x12345678  # asymmetric bytes, so the byte-swapped display is visible
ROLLBACK_OPAQUE = 0x12345679
NOOP_OPAQUE = 0x0000AB01
UUID_NEW = 0xABCDEF0123456789
UUID_OLD = 0x0FEDCBA987654321
SYSTEM_EVENT_VALUE = struct.pack(">QII", 3, 0, 8)  # manifest uid, scope id, collection id

# Expert infos that are dissector behaviour, not problems with our bytes (module docstring).
STRAY = ("_ws.string.trailing_stray_characters", "Trailing stray characters")
ROLLBACK_STATUS_NOTE = ("couchbase.warn.unknown_opcode", "DCP Stream Request: Rollback")

Expected = int | str | tuple[int | str, ...]
# What a broken encoder might raise; it fails only the tests of that packet.
ENCODE_ERRORS = (
    LocalProtocolError,
    struct.error,
    ArithmeticError,
    AttributeError,
    LookupError,
    TypeError,
    ValueError,
)


@dataclass(frozen=True)
class Case:
    """One packet: how our encoder builds it and what the dissector must show for it."""

    name: str
    to_server: bool
    build: Callable[[], bytes]
    magic: int
    opcode: int
    opaque: int
    word: int  # header bytes 6-7: vbucket (requests) or status (responses)
    extlen: int = 0
    key: bytes = b""
    value_len: int = 0
    cas: int = 0
    datatype: int = 0
    framing: int = 0  # flexible framing extras length (magic 0x08)
    fields: Mapping[str, Expected] = field(default_factory=dict)
    raw: Mapping[str, bytes] = field(default_factory=dict)  # field -> exact bytes shown
    quirks: frozenset[tuple[str, str]] = frozenset()  # allowed (expert id, message)


CASES: tuple[Case, ...] = (
    Case(
        "hello",
        True,
        lambda: Hello(agent="upr-tshark", features=(0x03, 0x06, 0x07), opaque=1).encode(),
        magic=0x80,
        opcode=0x1F,
        opaque=1,
        word=0,
        key=b"upr-tshark",
        value_len=6,
        fields={"couchbase.hello.features.feature": (0x03, 0x06, 0x07)},
    ),
    Case(
        "hello_response_without_collections",
        False,
        lambda: HelloResponse(features=(0x03, 0x07), opaque=1).encode(),
        magic=0x81,
        opcode=0x1F,
        opaque=1,
        word=0,
        value_len=4,
        fields={"couchbase.hello.features.feature": (0x03, 0x07)},
    ),
    Case(
        "dcp_open",
        True,
        lambda: DcpOpen(name="upr-tshark:0001", flags=0x25, opaque=2).encode(),
        magic=0x80,
        opcode=0x50,
        opaque=2,
        word=0,
        extlen=8,
        key=b"upr-tshark:0001",
        fields={
            "couchbase.extras.seqno": 0,  # the reserved u32
            "couchbase.extras.flags": 0x25,
            "couchbase.extras.flags.dcp_connection_type": 1,
            "couchbase.extras.flags.dcp_include_xattrs": 1,
            "couchbase.extras.flags.dcp_no_value": 0,
            "couchbase.extras.flags.dcp_include_delete_times": 1,
        },
    ),
    Case(
        "dcp_open_response",
        False,
        lambda: Response(opcode=0x50, opaque=2).encode(),
        magic=0x81,
        opcode=0x50,
        opaque=2,
        word=0,
    ),
    Case(
        "control",
        True,
        lambda: Control(name="enable_noop", value="true", opaque=3).encode(),
        magic=0x80,
        opcode=0x5E,
        opaque=3,
        word=0,
        key=b"enable_noop",
        value_len=4,
        fields={"couchbase.value": "true"},
    ),
    Case(
        "control_response",
        False,
        lambda: Response(opcode=0x5E, opaque=3).encode(),
        magic=0x81,
        opcode=0x5E,
        opaque=3,
        word=0,
    ),
    Case(
        "stream_request",
        True,
        lambda: StreamRequest(
            vbucket=VB,
            opaque=STREAM_OPAQUE,
            flags=0x10,
            start_seqno=10,
            end_seqno=STREAM_FOREVER,
            vbucket_uuid=UUID_NEW,
            snap_start_seqno=8,
            snap_end_seqno=12,
        ).encode(),
        magic=0x80,
        opcode=0x53,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=48,
        fields={
            "couchbase.extras.flags": 0x10,
            "couchbase.extras.reserved": 0,
            "couchbase.extras.start_seqno": 10,
            "couchbase.extras.end_seqno": 2**64 - 1,
            "couchbase.extras.vbucket_uuid": UUID_NEW,
            "couchbase.extras.snap_start_seqno": 8,
            "couchbase.extras.snap_end_seqno": 12,
        },
    ),
    Case(
        "stream_request_ok_failover_log",
        False,
        lambda: StreamRequestOk(
            opaque=STREAM_OPAQUE, failover_log=((UUID_NEW, 8), (UUID_OLD, 0))
        ).encode(),
        magic=0x81,
        opcode=0x53,
        opaque=STREAM_OPAQUE,
        word=0,
        value_len=32,
        fields={
            "couchbase.dcp.failover_log.size": 2,
            "couchbase.dcp.failover_log.vbucket_uuid": (UUID_NEW, UUID_OLD),
            "couchbase.dcp.failover_log.seqno": (8, 0),
        },
        quirks=frozenset({STRAY}),
    ),
    Case(
        "stream_request_for_rollback",
        True,
        lambda: StreamRequest(
            vbucket=VB + 1,
            opaque=ROLLBACK_OPAQUE,
            start_seqno=100,
            vbucket_uuid=0x77,
            snap_start_seqno=100,
            snap_end_seqno=100,
        ).encode(),
        magic=0x80,
        opcode=0x53,
        opaque=ROLLBACK_OPAQUE,
        word=VB + 1,
        extlen=48,
        fields={
            "couchbase.extras.flags": 0,
            "couchbase.extras.start_seqno": 100,
            "couchbase.extras.end_seqno": 2**64 - 1,
            "couchbase.extras.vbucket_uuid": 0x77,
            "couchbase.extras.snap_start_seqno": 100,
            "couchbase.extras.snap_end_seqno": 100,
        },
    ),
    Case(
        "stream_request_rollback",
        False,
        lambda: StreamRequestRollback(opaque=ROLLBACK_OPAQUE, rollback_seqno=42).encode(),
        magic=0x81,
        opcode=0x53,
        opaque=ROLLBACK_OPAQUE,
        word=0x23,
        value_len=8,
        raw={"couchbase.value": (42).to_bytes(8, "big")},
        quirks=frozenset({STRAY, ROLLBACK_STATUS_NOTE}),
    ),
    Case(
        "snapshot_marker_v1",
        False,
        lambda: SnapshotMarker(
            vbucket=VB, opaque=STREAM_OPAQUE, start_seqno=10, end_seqno=20, flags=0x05
        ).encode(),
        magic=0x80,
        opcode=0x56,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=20,
        fields={
            "couchbase.extras.start_seqno": 10,
            "couchbase.extras.end_seqno": 20,
            "couchbase.extras.flags": 0x05,
            "couchbase.extras.flags.dcp_snapshot_marker_memory": 1,
            "couchbase.extras.flags.dcp_snapshot_marker_disk": 0,
            "couchbase.extras.flags.dcp_snapshot_marker_chk": 1,
            "couchbase.extras.flags.dcp_snapshot_marker_ack": 0,
        },
    ),
    Case(
        "mutation",
        False,
        lambda: Mutation(
            vbucket=VB,
            opaque=STREAM_OPAQUE,
            cas=0x16F0A1B2C3D40000,
            datatype=0x01,
            by_seqno=11,
            rev_seqno=3,
            flags=0xDEADBEEF,
            expiration=1234567,
            key=b"doc::1",
            value=b'{"n":1}',
        ).encode(),
        magic=0x80,
        opcode=0x57,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=31,
        key=b"doc::1",
        value_len=7,
        cas=0x16F0A1B2C3D40000,
        datatype=0x01,
        fields={
            "couchbase.extras.by_seqno": 11,
            "couchbase.extras.rev_seqno": 3,
            "couchbase.extras.flags": 0xDEADBEEF,
            "couchbase.extras.expiration": 1234567,
            "couchbase.extras.lock_time": 0,
            "couchbase.extras.nmeta": 0,
            "couchbase.extras.nru": 0,
            "couchbase.datatype.json": 1,
            "couchbase.value": '{"n":1}',
        },
    ),
    Case(
        "mutation_with_stream_id",
        False,
        lambda: Mutation(
            vbucket=VB,
            opaque=STREAM_OPAQUE,
            cas=99,
            by_seqno=12,
            rev_seqno=4,
            key=b"doc::2",
            value=b"v2",
            stream_id=7,
        ).encode(),
        magic=0x08,
        opcode=0x57,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=31,
        key=b"doc::2",
        value_len=2,
        cas=99,
        framing=3,
        fields={
            "couchbase.flex_frame.frame.id": 2,
            "couchbase.flex_frame.frame.len": 2,
            "couchbase.flex_frame.frame.dcp_stream_id": 7,
            "couchbase.extras.by_seqno": 12,
            "couchbase.extras.rev_seqno": 4,
            "couchbase.extras.flags": 0,
            "couchbase.extras.expiration": 0,
            "couchbase.value": "v2",
        },
        raw={"couchbase.flex_frame_extras": bytes((0x22, 0x00, 0x07))},
    ),
    Case(
        "fast_encode_mutation",
        False,
        lambda: encode_mutation(
            VB, STREAM_OPAQUE, 77, 0, 13, 2, 0x01020304, 1700000000, b"doc::3", b"fast"
        ),
        magic=0x80,
        opcode=0x57,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=31,
        key=b"doc::3",
        value_len=4,
        cas=77,
        fields={
            "couchbase.extras.by_seqno": 13,
            "couchbase.extras.rev_seqno": 2,
            "couchbase.extras.flags": 0x01020304,
            "couchbase.extras.expiration": 1700000000,
            "couchbase.extras.lock_time": 0,
            "couchbase.extras.nmeta": 0,
            "couchbase.extras.nru": 0,
            "couchbase.value": "fast",
        },
    ),
    Case(
        "snapshot_marker_v2_0",
        False,
        lambda: SnapshotMarkerV2(
            vbucket=VB,
            opaque=STREAM_OPAQUE,
            start_seqno=14,
            end_seqno=30,
            flags=0x06,
            max_visible_seqno=29,
            high_completed_seqno=25,
        ).encode(),
        magic=0x80,
        opcode=0x56,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=1,
        value_len=36,
        fields={
            "couchbase.extras.marker_version": 0,
            "couchbase.extras.start_seqno": 14,
            "couchbase.extras.end_seqno": 30,
            "couchbase.extras.flags": 0x06,
            "couchbase.extras.flags.dcp_snapshot_marker_memory": 0,
            "couchbase.extras.flags.dcp_snapshot_marker_disk": 1,
            "couchbase.extras.flags.dcp_snapshot_marker_chk": 1,
            "couchbase.extras.max_visible_seqno": 29,
            "couchbase.extras.high_completed_seqno": 25,
        },
    ),
    Case(
        "deletion_v1",
        False,
        lambda: Deletion(
            vbucket=VB, opaque=STREAM_OPAQUE, cas=5, by_seqno=14, rev_seqno=6, key=b"doc::4"
        ).encode(),
        magic=0x80,
        opcode=0x58,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=18,
        key=b"doc::4",
        cas=5,
        fields={
            "couchbase.extras.by_seqno": 14,
            "couchbase.extras.rev_seqno": 6,
            "couchbase.extras.nmeta": 0,
        },
    ),
    Case(
        "deletion_v2",
        False,
        lambda: DeletionV2(
            vbucket=VB,
            opaque=STREAM_OPAQUE,
            cas=6,
            by_seqno=15,
            rev_seqno=7,
            delete_time=1600000000,
            key=b"doc::5",
        ).encode(),
        magic=0x80,
        opcode=0x58,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=21,
        key=b"doc::5",
        cas=6,
        fields={
            "couchbase.extras.by_seqno": 15,
            "couchbase.extras.rev_seqno": 7,
            "couchbase.extras.delete_time": 1600000000,
            "couchbase.extras.delete_unused": 0,
        },
    ),
    Case(
        "expiration",
        False,
        lambda: Expiration(
            vbucket=VB,
            opaque=STREAM_OPAQUE,
            cas=7,
            by_seqno=16,
            rev_seqno=8,
            delete_time=1600000001,
            key=b"doc::6",
        ).encode(),
        magic=0x80,
        opcode=0x59,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=20,
        key=b"doc::6",
        cas=7,
        fields={
            "couchbase.extras.by_seqno": 16,
            "couchbase.extras.rev_seqno": 8,
            "couchbase.extras.delete_time": 1600000001,
        },
    ),
    Case(
        "seqno_advanced",
        False,
        lambda: SeqnoAdvanced(vbucket=VB, opaque=STREAM_OPAQUE, by_seqno=17).encode(),
        magic=0x80,
        opcode=0x64,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=8,
        fields={"couchbase.extras.by_seqno": 17},
    ),
    Case(
        "system_event",
        False,
        lambda: SystemEvent(
            vbucket=VB,
            opaque=STREAM_OPAQUE,
            by_seqno=18,
            event=0,
            version=0,
            key=b"orders",
            value=SYSTEM_EVENT_VALUE,
        ).encode(),
        magic=0x80,
        opcode=0x5F,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=13,
        key=b"orders",
        value_len=16,
        fields={
            "couchbase.extras.by_seqno": 18,
            "couchbase.extras.system_event_id": 0,
            "couchbase.extras.system_event_version": 0,
        },
        raw={"couchbase.value": SYSTEM_EVENT_VALUE},
        quirks=frozenset({STRAY}),
    ),
    Case(
        "set_vbucket_state",
        False,
        lambda: SetVbucketState(vbucket=VB, opaque=STREAM_OPAQUE, state=2).encode(),
        magic=0x80,
        opcode=0x5B,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=1,
        raw={"couchbase.extras.unknown": b"\x02"},  # kv_engine state 2 = replica
    ),
    Case(
        "stream_end",
        False,
        lambda: StreamEnd(vbucket=VB, opaque=STREAM_OPAQUE, status=2).encode(),
        magic=0x80,
        opcode=0x55,
        opaque=STREAM_OPAQUE,
        word=VB,
        extlen=4,
        raw={"couchbase.extras.unknown": (2).to_bytes(4, "big")},  # 2 = StateChanged
    ),
    Case(
        "noop",
        False,
        lambda: Noop(opaque=NOOP_OPAQUE).encode(),
        magic=0x80,
        opcode=0x5C,
        opaque=NOOP_OPAQUE,
        word=0,
    ),
    Case(
        "noop_response",
        True,
        lambda: Response(opcode=0x5C, opaque=NOOP_OPAQUE).encode(),
        magic=0x81,
        opcode=0x5C,
        opaque=NOOP_OPAQUE,
        word=0,
    ),
    Case(
        "buffer_ack",
        True,
        lambda: BufferAck(acked=4096).encode(),
        magic=0x80,
        opcode=0x5D,
        opaque=0,
        word=0,
        extlen=4,
        fields={"couchbase.extras.bytes_to_ack": 4096},
    ),
    Case(
        "get_failover_log",
        True,
        lambda: GetFailoverLog(vbucket=VB, opaque=9).encode(),
        magic=0x80,
        opcode=0x54,
        opaque=9,
        word=VB,
    ),
    Case(
        "failover_log_response",
        False,
        lambda: FailoverLogResponse(opaque=9, failover_log=((UUID_NEW, 8),)).encode(),
        magic=0x81,
        opcode=0x54,
        opaque=9,
        word=0,
        value_len=16,
        fields={
            "couchbase.dcp.failover_log.size": 1,
            "couchbase.dcp.failover_log.vbucket_uuid": (UUID_NEW,),
            "couchbase.dcp.failover_log.seqno": (8,),
        },
        quirks=frozenset({STRAY}),
    ),
)

# ---------------------------------------------------------------- pcap writer


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f">{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _segment(src_port: int, dst_port: int, seq: int, ack: int, payload: bytes, ip_id: int) -> bytes:
    """An IPv4 packet holding one TCP PSH|ACK segment, both checksums filled in."""
    tcp = struct.pack(">HHIIBBHHH", src_port, dst_port, seq, ack, 5 << 4, 0x18, 65535, 0, 0)
    pseudo = LOCALHOST + LOCALHOST + struct.pack(">BBH", 0, 6, len(tcp) + len(payload))
    tcp = tcp[:16] + struct.pack(">H", _checksum(pseudo + tcp + payload)) + tcp[18:]
    ip = struct.pack(
        ">BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(tcp) + len(payload),
        ip_id,
        0x4000,  # don't fragment
        64,
        6,
        0,
        LOCALHOST,
        LOCALHOST,
    )
    ip = ip[:10] + struct.pack(">H", _checksum(ip)) + ip[12:]
    return ip + tcp + payload


def write_pcap(path: Path, packets: list[tuple[bool, bytes]]) -> None:
    """Classic little-endian libpcap file, linktype 101 (raw IPv4), one TCP conversation."""
    out = bytearray(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 101))
    next_seq = {True: 1000, False: 500000}  # keyed by "sent by the client"
    for i, (to_server, payload) in enumerate(packets):
        ports = (CLIENT_PORT, SERVER_PORT) if to_server else (SERVER_PORT, CLIENT_PORT)
        seq, ack = next_seq[to_server], next_seq[not to_server]
        frame = _segment(*ports, seq, ack, payload, ip_id=i + 1)
        next_seq[to_server] = seq + len(payload)
        out += struct.pack("<IIII", 1700000000 + i, 0, len(frame), len(frame)) + frame
    path.write_bytes(bytes(out))


# ---------------------------------------------------------------- tshark output


@dataclass
class Decoded:
    """What tshark showed for one frame."""

    fields: dict[str, list[tuple[str, str]]]  # couchbase field -> [(show, raw hex)]
    experts: list[tuple[str, str]]  # (expert id, message) from any layer
    couchbase_pdus: int
    tcp: dict[str, str]


def _parse_packet(packet: ET.Element) -> Decoded:
    fields: dict[str, list[tuple[str, str]]] = {}
    tcp: dict[str, str] = {}
    experts: list[tuple[str, str]] = []
    pdus = 0
    for proto in packet.iter("proto"):
        name = proto.get("name", "")
        if name.startswith("_ws.malformed"):
            experts.append((name, proto.get("showname", "malformed")))
        if name == "couchbase":
            pdus += 1
            for f in proto.iter("field"):
                fields.setdefault(f.get("name", ""), []).append(
                    (f.get("show", ""), f.get("value", ""))
                )
        elif name == "tcp":
            tcp.update((f.get("name", ""), f.get("show", "")) for f in proto.iter("field"))
    for f in packet.iter("field"):
        if f.get("name") == "_ws.expert":
            kids = {k.get("name", ""): k.get("show", "") for k in f}
            ident = next((k for k in kids if not k.startswith("_ws.expert.")), "_ws.expert")
            experts.append((ident, kids.get("_ws.expert.message", "")))
        elif f.get("name", "").startswith("_ws.malformed"):
            experts.append((f.get("name", ""), f.get("showname", "malformed")))
    return Decoded(fields, experts, pdus, tcp)


@pytest.fixture(scope="module")
def decoded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Decoded | Exception]:
    """Encode every case, write them as one conversation, decode with one tshark run."""
    assert TSHARK is not None
    tmp = tmp_path_factory.mktemp("tshark")
    results: dict[str, Decoded | Exception] = {}
    built: list[tuple[Case, bytes]] = []
    for case in CASES:
        try:
            built.append((case, case.build()))
        except ENCODE_ERRORS as exc:  # reported by that case's tests
            results[case.name] = exc
    pcap = tmp / "dcp.pcap"
    write_pcap(pcap, [(case.to_server, data) for case, data in built])
    env = {**os.environ, "WIRESHARK_CONFIG_DIR": str(tmp / "wireshark-config")}
    proc = subprocess.run(
        [
            TSHARK,
            "-n",
            "-r",
            str(pcap),
            "-o",
            "tcp.check_checksum:FALSE",
            "-d",
            f"tcp.port=={SERVER_PORT},couchbase",
            "-T",
            "pdml",
        ],
        capture_output=True,
        check=False,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    packets = ET.fromstring(proc.stdout).findall("packet")
    assert len(packets) == len(built), "tshark read a different number of frames"
    for (case, _), packet in zip(built, packets, strict=True):
        results[case.name] = _parse_packet(packet)
    return results


def _get(case: Case, decoded: dict[str, Decoded | Exception]) -> Decoded:
    got = decoded[case.name]
    if isinstance(got, Exception):
        raise got
    assert got.couchbase_pdus == 1, f"tshark found {got.couchbase_pdus} Couchbase PDUs"
    return got


def _one(d: Decoded, name: str) -> tuple[str, str]:
    values = d.fields.get(name, [])
    assert len(values) == 1, f"{name}: expected one occurrence, tshark shows {values}"
    return values[0]


def _matches(expected: int | str, show: str) -> bool:
    return int(show, 0) == expected if isinstance(expected, int) else show == expected


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_header_as_encoded(case: Case, decoded: dict[str, Decoded | Exception]) -> None:
    """Magic, opcode, lengths, vbucket/status, opaque, CAS, datatype and key."""
    d = _get(case, decoded)
    is_response = case.magic in (0x81, 0x18)
    header: dict[str, int] = {
        "couchbase.magic": case.magic,
        "couchbase.opcode": case.opcode,
        "couchbase.status" if is_response else "couchbase.vbucket": case.word,
        "couchbase.extras.length": case.extlen,
        "couchbase.key.length": len(case.key),
        "couchbase.value.length": case.value_len,
        "couchbase.total_bodylength": case.framing + case.extlen + len(case.key) + case.value_len,
        "couchbase.cas": case.cas,
        "couchbase.datatype": case.datatype,
    }
    if case.framing:
        header["couchbase.flex_extras"] = case.framing
    shown = {name: int(_one(d, name)[0], 0) for name in header}
    assert shown == header
    assert ("couchbase.vbucket" if is_response else "couchbase.status") not in d.fields

    # Quirk: the opaque is dissected little-endian; its bytes must still be ours (BE).
    opaque_show, opaque_raw = _one(d, "couchbase.opaque")
    assert opaque_raw == case.opaque.to_bytes(4, "big").hex()
    assert int(opaque_show, 0) == int.from_bytes(case.opaque.to_bytes(4, "big"), "little")

    if case.key:
        assert _one(d, "couchbase.key") == (case.key.decode(), case.key.hex())
        # Quirk: DCP keys are always read as collection-prefixed (LEB128 id, then the key).
        if "couchbase.key.collection_id" in d.fields:
            assert int(_one(d, "couchbase.key.collection_id")[0], 0) == case.key[0]
            assert _one(d, "couchbase.key.logical_key")[0] == case.key[1:].decode()
    else:
        assert "couchbase.key" not in d.fields


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.fields or c.raw],
    ids=[c.name for c in CASES if c.fields or c.raw],
)
def test_body_fields_as_encoded(case: Case, decoded: dict[str, Decoded | Exception]) -> None:
    """Extras fields, failover logs, frame infos and values, by tshark field name."""
    d = _get(case, decoded)
    for name, expected in case.fields.items():
        if isinstance(expected, tuple):
            shown = [show for show, _ in d.fields.get(name, [])]
            assert len(shown) == len(expected), f"{name}: {shown} vs {expected}"
            assert all(map(_matches, expected, shown)), f"{name}: {shown} vs {expected}"
        else:
            show = _one(d, name)[0]
            assert _matches(expected, show), f"{name}: tshark shows {show!r}, sent {expected!r}"
    for name, data in case.raw.items():
        assert _one(d, name)[1] == data.hex(), name


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_no_unexpected_expert_info(case: Case, decoded: dict[str, Decoded | Exception]) -> None:
    """No malformed-packet or other expert info beyond the dissector's documented quirks."""
    d = _get(case, decoded)
    assert [e for e in d.experts if e not in case.quirks] == []


def test_one_tcp_conversation_on_the_couchbase_port(
    decoded: dict[str, Decoded | Exception],
) -> None:
    """The pcap writer itself: every frame is one in-order segment of TCP stream 0."""
    for case in CASES:
        got = decoded[case.name]
        if isinstance(got, Exception):
            continue
        src, dst = (CLIENT_PORT, SERVER_PORT) if case.to_server else (SERVER_PORT, CLIENT_PORT)
        assert got.tcp["tcp.stream"] == "0", case.name
        assert (int(got.tcp["tcp.srcport"]), int(got.tcp["tcp.dstport"])) == (src, dst)
        assert "tcp.analysis.flags" not in got.tcp, case.name
