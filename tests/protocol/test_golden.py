"""Golden wire bytes for every message upr speaks, driving both encode and decode.

Every packet below was written by hand from the byte layouts in docs/protocol.md
(section numbers cited per row), never produced by our encoder or by `struct.pack`. One
table drives all the tests:

* encode: `message.encode()` gives exactly the golden bytes;
* decode whole: `decode_one`, `FrameDecoder.next_frame` and `FrameDecoder.frames`
  all give back the message;
* decode one byte at a time: `next_frame()` is None until the last byte arrives;
* trailing bytes: a packet followed by the start of another yields one frame and keeps
  the rest buffered.

Hex notation. `#` starts a comment; whitespace is ignored. Header lines are split per
field, always in this order (docs/protocol.md §1.1: 24 bytes, big-endian):

    magic opcode keylen(2) extlen datatype vbucket|status(2) bodylen(4) opaque(4) cas(8)

The alternate header (magic 0x08 / 0x18, docs/protocol.md §1.3) replaces keylen(2) by
framelen(1) keylen(1):

    magic opcode framelen keylen extlen datatype vbucket|status(2) bodylen(4) opaque(4) cas(8)

The body follows in wire order: [framing extras] extras, key, value.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from upr_cli.errors import RemoteProtocolError
from upr_cli.protocol import FrameDecoder, decode_message, decode_one
from upr_cli.protocol.messages import (
    MESSAGE_CLASSES,
    STREAM_FOREVER,
    Add,
    AddStream,
    AddStreamResponse,
    Barrier,
    BufferAck,
    CloseStream,
    CollectionsGetId,
    CollectionsGetManifest,
    CollectionsGetScopeId,
    CollectionsIdResponse,
    CollectionsSetManifest,
    Control,
    DcpOpen,
    Delete,
    Deletion,
    DeletionV2,
    DelWithMeta,
    DisableTraffic,
    EnableTraffic,
    Expiration,
    FailoverLogResponse,
    Get,
    GetAllVbSeqnos,
    GetAllVbSeqnosResponse,
    GetClusterConfig,
    GetErrorMap,
    GetFailoverLog,
    GetResponse,
    Hello,
    HelloResponse,
    Message,
    Mutation,
    Noop,
    ObserveSeqno,
    ObserveSeqnoResponse,
    Replace,
    Response,
    SaslAuth,
    SaslListMechs,
    SaslListMechsResponse,
    SaslStep,
    SelectBucket,
    SeqnoAdvanced,
    Set,
    SetClusterConfig,
    SetParam,
    SetVbucket,
    SetVbucketState,
    SetWithMeta,
    SnapshotMarker,
    SnapshotMarkerV2,
    Stat,
    StatResponse,
    StoreResponse,
    StreamEnd,
    StreamRequest,
    StreamRequestOk,
    StreamRequestRollback,
    SystemEvent,
    UnknownRequest,
)


def unhex(text: str) -> bytes:
    """Hand-written hex → bytes: drop `#` comments, ignore whitespace between bytes."""
    return bytes.fromhex(" ".join(line.split("#", 1)[0] for line in text.splitlines()))


@dataclass(frozen=True)
class Row:
    """One golden packet and the message it is."""

    id: str
    message: Message
    hex: str
    xfail: str | None = None  # reason, when upr_cli disagrees with the spec

    @property
    def packet(self) -> bytes:
        """The golden bytes."""
        return unhex(self.hex)


# The first 10 bytes of a DCP NOOP request (docs/protocol.md §2.12), used as "trailing bytes".
NOOP_HEX = """
    80 5c 0000 00 00 0000 00000000 00000099 0000000000000000  # NOOP, opaque 0x99
"""
NOOP_PACKET = unhex(NOOP_HEX)
TRAILING = NOOP_PACKET[:10]

DOC1 = "646f6331  # key 'doc1'"
# formats/wire.md "Xattrs": a system xattr `_s` = {} and a user xattr `u` = 1
XATTR_BLOB = b"\x00\x00\x00\x12\x00\x00\x00\x06_s\x00{}\x00\x00\x00\x00\x04u\x001\x00"
XATTR_BLOB_HEX = """
        00000012          # xattr blob: u32 length 18
        00000006          #        u32 pair length 6
        5f73 00 7b7d 00   #        '_s' NUL '{}' NUL
        00000004          #        u32 pair length 4
        75 00 31 00       #        'u' NUL '1' NUL
"""

GOLDEN: list[Row] = [
    # ------------------------------------------------------------ bootstrap (docs/protocol.md §5)
    Row(
        "hello",  # docs/protocol.md §5.1
        Hello(opaque=0xDEADBEEF, agent="upr/1", features=(0x06, 0x07, 0x12)),
        """
        80 1f 0005 00 00 0000 0000000b deadbeef 0000000000000000
        7570722f31      # key: agent 'upr/1'
        0006 0007 0012  # value: XATTR, XERROR, Collections
        """,
    ),
    Row(
        "hello-response",  # docs/protocol.md §5.1
        HelloResponse(opaque=0xDEADBEEF, features=(0x07, 0x12)),
        """
        81 1f 0000 00 00 0000 00000004 deadbeef 0000000000000000
        0007 0012       # value: granted XERROR, Collections
        """,
    ),
    Row(
        "sasl-list-mechs",  # docs/protocol.md §5.2
        SaslListMechs(opaque=0x01020304),
        """
        80 20 0000 00 00 0000 00000000 01020304 0000000000000000
        """,
    ),
    Row(
        "sasl-list-mechs-response",  # docs/protocol.md §5.2
        SaslListMechsResponse(opaque=0x01020304, mechanisms="SCRAM-SHA512 PLAIN"),
        """
        81 20 0000 00 00 0000 00000012 01020304 0000000000000000
        5343 52 41 4d 2d 53 48 41 35 31 32  # value: 'SCRAM-SHA512'
        20                                  #        ' '
        50 4c 41 49 4e                      #        'PLAIN'
        """,
    ),
    Row(
        "sasl-auth-plain",  # docs/protocol.md §5.2
        SaslAuth(opaque=0x05060708, mechanism="PLAIN", payload=b"\0alice\0secret"),
        """
        80 21 0005 00 00 0000 00000012 05060708 0000000000000000
        504c41494e      # key: 'PLAIN'
        00 616c696365   # value: '\\0alice'
        00 736563726574 #        '\\0secret'
        """,
    ),
    Row(
        "sasl-step",  # docs/protocol.md §5.2
        SaslStep(opaque=0x090A0B0C, mechanism="SCRAM-SHA512", payload=b"c=biws"),
        """
        80 22 000c 00 00 0000 00000012 090a0b0c 0000000000000000
        5343 52 41 4d 2d 53 48 41 35 31 32  # key: 'SCRAM-SHA512'
        633d62697773                        # value: 'c=biws'
        """,
    ),
    Row(
        "select-bucket",  # docs/protocol.md §5.3
        SelectBucket(opaque=0x0D0E0F10, bucket="default"),
        """
        80 89 0007 00 00 0000 00000007 0d0e0f10 0000000000000000
        64656661756c74  # key: 'default'
        """,
    ),
    Row(
        "get-error-map",  # docs/protocol.md §5.4
        GetErrorMap(opaque=0x11121314, version=2),
        """
        80 fe 0000 00 00 0000 00000002 11121314 0000000000000000
        0002            # value: u16 version 2
        """,
    ),
    Row(
        "get-cluster-config",  # docs/protocol.md §5.5, no extras
        GetClusterConfig(opaque=0x15161718),
        """
        80 b5 0000 00 00 0000 00000000 15161718 0000000000000000
        """,
    ),
    Row(
        "get-cluster-config-known-version",  # docs/protocol.md §5.5: 16-byte extras
        GetClusterConfig(opaque=0x15161719, epoch=2, revision=0x78),
        """
        80 b5 0000 10 00 0000 00000010 15161719 0000000000000000
        0000000000000002  # extras: i64 epoch 2
        0000000000000078  #         i64 revision 120
        """,
    ),
    Row(
        "get-cluster-config-epoch-minus-1",  # docs/protocol.md §5.5, i64 is signed
        GetClusterConfig(opaque=0x1516171A, epoch=-1, revision=5),
        """
        80 b5 0000 10 00 0000 00000010 1516171a 0000000000000000
        ffffffffffffffff  # extras: i64 epoch -1
        0000000000000005  #         i64 revision 5
        """,
    ),
    Row(
        "stat-vbucket-seqno",  # docs/protocol.md §5.7
        Stat(opaque=0x1A1B1C1D, group="vbucket-seqno"),
        """
        80 10 000d 00 00 0000 0000000d 1a1b1c1d 0000000000000000
        76 62 75 63 6b 65 74 2d 73 65 71 6e 6f  # key: 'vbucket-seqno'
        """,
    ),
    Row(
        "stat-default-group",  # docs/protocol.md §5.7, empty key
        Stat(opaque=0x1A1B1C1E),
        """
        80 10 0000 00 00 0000 00000000 1a1b1c1e 0000000000000000
        """,
    ),
    Row(
        "stat-response",  # docs/protocol.md §5.7
        StatResponse(opaque=0x1A1B1C1D, name="vb_3:high_seqno", value="42"),
        """
        81 10 000f 00 00 0000 00000011 1a1b1c1d 0000000000000000
        76625f33 3a 686967685f7365716e6f  # key: 'vb_3' ':' 'high_seqno'
        3432                              # value: '42'
        """,
    ),
    Row(
        "stat-response-end",  # docs/protocol.md §5.7, the empty terminator
        StatResponse(opaque=0x1A1B1C1D),
        """
        81 10 0000 00 00 0000 00000000 1a1b1c1d 0000000000000000
        """,
    ),
    # ------------------------------------------------------------ KV
    Row(
        "get",
        Get(opaque=0x21222324, vbucket=0x0203, key=b"doc1"),
        f"""
        80 00 0004 00 00 0203 00000004 21222324 0000000000000000
        {DOC1}
        """,
    ),
    Row(
        "get-response",
        GetResponse(
            opaque=0x21222324,
            cas=0x1122334455667788,
            datatype=0x01,
            flags=0xA1B2C3D4,
            value=b'{"a":1}',
        ),
        """
        81 00 0000 04 01 0000 0000000b 21222324 1122334455667788
        a1b2c3d4        # extras: u32 flags
        7b2261223a317d  # value: '{"a":1}'
        """,
    ),
    Row(
        "set",
        Set(
            opaque=0x25262728,
            vbucket=0x0203,
            cas=0xABC,
            key=b"doc1",
            value=b"hello",
            flags=0xCAFEF00D,
            expiration=86400,
        ),
        f"""
        80 01 0004 08 00 0203 00000011 25262728 0000000000000abc
        cafef00d        # extras: u32 flags
        00015180        #         u32 expiration 86400
        {DOC1}
        68656c6c6f      # value: 'hello'
        """,
    ),
    Row(
        "add",
        Add(
            opaque=0x292A2B2C,
            vbucket=0x0203,
            datatype=0x01,
            key=b"k2",
            value=b"{}",
            flags=1,
            expiration=3600,
        ),
        """
        80 02 0002 08 01 0203 0000000c 292a2b2c 0000000000000000
        00000001        # extras: u32 flags 1
        00000e10        #         u32 expiration 3600
        6b32            # key: 'k2'
        7b7d            # value: '{}'
        """,
    ),
    Row(
        "replace",
        Replace(
            opaque=0x2D2E2F30,
            vbucket=0x0203,
            cas=0xDEF,
            key=b"k3",
            value=b"v",
            expiration=0x5F5E1000,
        ),
        """
        80 03 0002 08 00 0203 0000000b 2d2e2f30 0000000000000def
        00000000        # extras: u32 flags 0
        5f5e1000        #         u32 expiration (absolute)
        6b33            # key: 'k3'
        76              # value: 'v'
        """,
    ),
    Row(
        "delete",
        Delete(opaque=0x31323334, vbucket=0x0203, cas=0x1122334455667788, key=b"doc1"),
        f"""
        80 04 0004 00 00 0203 00000004 31323334 1122334455667788
        {DOC1}
        """,
    ),
    Row(
        "store-response-set",
        StoreResponse(opaque=0x25262728, cas=0x1122334455667788, opcode=0x01),
        """
        81 01 0000 00 00 0000 00000000 25262728 1122334455667788
        """,
    ),
    Row(
        "store-response-delete-mutation-seqno",  # 16-byte extras with HELLO MutationSeqno
        StoreResponse(
            opaque=0x31323334,
            cas=0x1122334455667799,
            opcode=0x04,
            vbucket_uuid=0x0000A1B2C3D4E5F6,
            seqno=0x1003,
        ),
        """
        81 04 0000 10 00 0000 00000010 31323334 1122334455667799
        0000a1b2c3d4e5f6  # extras: u64 vbucket uuid
        0000000000001003  #         u64 seqno
        """,
    ),
    Row(
        # docs/protocol.md §1.2/§1.3: 0x18 response, frame id 0 len 2
        "store-response-alt-magic-frame",
        StoreResponse(
            opaque=0x35363738,
            cas=0x1122334455667788,
            opcode=0xA2,
            frame_infos=((0, b"\x01\x23"),),
        ),
        """
        18 a2 03 00 00 00 0000 00000003 35363738 1122334455667788
        02 0123         # frame: id 0 (server duration), len 2, u16 0x0123
        """,
    ),
    # ------------------------------------------------------------ *_WITH_META (docs/protocol.md §6)
    Row(
        "set-with-meta-24",
        SetWithMeta(
            opaque=0x41424344,
            vbucket=0x0203,
            key=b"doc1",
            value=b"hello",
            flags=0x01020304,
            expiration=0x05060708,
            rev_seqno=0x1112131415161718,
            item_cas=0x2122232425262728,
        ),
        f"""
        80 a2 0004 18 00 0203 00000021 41424344 0000000000000000
        01020304          # extras: u32 flags
        05060708          #         u32 expiration
        1112131415161718  #         u64 rev_seqno
        2122232425262728  #         u64 cas to store
        {DOC1}
        68656c6c6f        # value: 'hello'
        """,
    ),
    Row(
        "set-with-meta-26",
        SetWithMeta(
            opaque=0x41424345,
            vbucket=0x0203,
            key=b"doc1",
            value=b"hello",
            flags=0x01020304,
            expiration=0x05060708,
            rev_seqno=0x1112131415161718,
            item_cas=0x2122232425262728,
            nmeta=0,
        ),
        f"""
        80 a2 0004 1a 00 0203 00000023 41424345 0000000000000000
        01020304          # extras: u32 flags
        05060708          #         u32 expiration
        1112131415161718  #         u64 rev_seqno
        2122232425262728  #         u64 cas to store
        0000              #         u16 nmeta (at offset 24)
        {DOC1}
        68656c6c6f        # value: 'hello'
        """,
    ),
    Row(
        "set-with-meta-28",
        SetWithMeta(
            opaque=0x41424346,
            vbucket=0x0203,
            key=b"doc1",
            value=b"hello",
            flags=0x01020304,
            expiration=0x05060708,
            rev_seqno=0x1112131415161718,
            item_cas=0x2122232425262728,
            options=0x0C,
        ),
        f"""
        80 a2 0004 1c 00 0203 00000025 41424346 0000000000000000
        01020304          # extras: u32 flags
        05060708          #         u32 expiration
        1112131415161718  #         u64 rev_seqno
        2122232425262728  #         u64 cas to store
        0000000c          #         u32 options REGENERATE_CAS|SKIP_CONFLICT_RESOLUTION
        {DOC1}
        68656c6c6f        # value: 'hello'
        """,
    ),
    Row(
        "set-with-meta-30",
        SetWithMeta(
            opaque=0x41424347,
            vbucket=0x0203,
            datatype=0x01,
            cas=0x0000000000000777,
            key=b"doc1",
            value=b'{"a":1}',
            flags=0x01020304,
            expiration=0x05060708,
            rev_seqno=0x1112131415161718,
            item_cas=0x2122232425262728,
            options=0x02,
            nmeta=0,
        ),
        f"""
        80 a2 0004 1e 01 0203 00000029 41424347 0000000000000777
        01020304          # extras: u32 flags
        05060708          #         u32 expiration
        1112131415161718  #         u64 rev_seqno
        2122232425262728  #         u64 cas to store
        00000002          #         u32 options FORCE_ACCEPT_WITH_META_OPS
        0000              #         u16 nmeta (at offset 28)
        {DOC1}
        7b2261223a317d    # value: '{{"a":1}}'
        """,
    ),
    Row(
        "del-with-meta-28",
        DelWithMeta(
            opaque=0x45464748,
            vbucket=0x0203,
            key=b"doc1",
            flags=0x01020304,
            expiration=0x05060708,
            rev_seqno=0x1112131415161718,
            item_cas=0x2122232425262728,
            options=0x10,
        ),
        f"""
        80 a8 0004 1c 00 0203 00000020 45464748 0000000000000000
        01020304          # extras: u32 flags
        05060708          #         u32 expiration
        1112131415161718  #         u64 rev_seqno
        2122232425262728  #         u64 cas to store
        00000010          #         u32 options IS_EXPIRATION
        {DOC1}
        """,
    ),
    # ------------------------------------------------------------ seqno queries
    # OBSERVE_SEQNO (0x91): docs/protocol.md §11; layout from kv_engine docs/BinaryProtocol.md:
    # request value u64 vbucket uuid; reply u8 format, u16 vbucket, u64 uuid,
    # u64 persisted seqno, u64 current seqno [, u64 old uuid, u64 last received seqno].
    Row(
        "observe-seqno",
        ObserveSeqno(opaque=0x494A4B4C, vbucket=0x0203, vbucket_uuid=0x0000A1B2C3D4E5F6),
        """
        80 91 0000 00 00 0203 00000008 494a4b4c 0000000000000000
        0000a1b2c3d4e5f6  # value: u64 vbucket uuid
        """,
    ),
    Row(
        "observe-seqno-response-format-0",
        ObserveSeqnoResponse(
            opaque=0x494A4B4C,
            format=0,
            observed_vbucket=0x0203,
            vbucket_uuid=0x0000A1B2C3D4E5F6,
            persisted_seqno=0x1001,
            current_seqno=0x1003,
        ),
        """
        81 91 0000 00 00 0000 0000001b 494a4b4c 0000000000000000
        00                # value: u8 format 0
        0203              #        u16 vbucket
        0000a1b2c3d4e5f6  #        u64 vbucket uuid
        0000000000001001  #        u64 persisted seqno
        0000000000001003  #        u64 current seqno
        """,
    ),
    Row(
        "observe-seqno-response-format-1",
        ObserveSeqnoResponse(
            opaque=0x494A4B4D,
            format=1,
            observed_vbucket=0x0203,
            vbucket_uuid=0x0000A1B2C3D4E5F6,
            persisted_seqno=0x1001,
            current_seqno=0x1003,
            old_vbucket_uuid=0x00001122334455AA,
            last_received_seqno=0x0FA0,
        ),
        """
        81 91 0000 00 00 0000 0000002b 494a4b4d 0000000000000000
        01                # value: u8 format 1 (hard failover)
        0203              #        u16 vbucket
        0000a1b2c3d4e5f6  #        u64 vbucket uuid
        0000000000001001  #        u64 persisted seqno
        0000000000001003  #        u64 current seqno
        00001122334455aa  #        u64 old vbucket uuid
        0000000000000fa0  #        u64 last received seqno
        """,
    ),
    Row(
        "get-all-vb-seqnos-0",  # docs/protocol.md §2.19
        GetAllVbSeqnos(opaque=0x51525354),
        """
        80 48 0000 00 00 0000 00000000 51525354 0000000000000000
        """,
    ),
    Row(
        "get-all-vb-seqnos-4",  # docs/protocol.md §2.19
        GetAllVbSeqnos(opaque=0x51525355, state=1),
        """
        80 48 0000 04 00 0000 00000004 51525355 0000000000000000
        00000001          # extras: u32 vbucket state (active)
        """,
    ),
    Row(
        "get-all-vb-seqnos-8",  # docs/protocol.md §2.19
        GetAllVbSeqnos(opaque=0x51525356, state=2, collection=0x0A),
        """
        80 48 0000 08 00 0000 00000008 51525356 0000000000000000
        00000002          # extras: u32 vbucket state (replica)
        0000000a          #         u32 collection id
        """,
    ),
    Row(
        "get-all-vb-seqnos-response",  # docs/protocol.md §2.19
        GetAllVbSeqnosResponse(
            opaque=0x51525354, seqnos=((0x0000, 0x0102030405060708), (0x0203, 0x0ABC))
        ),
        """
        81 48 0000 00 00 0000 00000014 51525354 0000000000000000
        0000 0102030405060708  # value: u16 vb 0,     u64 seqno
        0203 0000000000000abc  #        u16 vb 0x203, u64 seqno
        """,
    ),
    # ------------------------------------------------------------ DCP (docs/protocol.md §2)
    Row(
        "dcp-open-producer",  # docs/protocol.md §2.1
        DcpOpen(opaque=0x61626364, name="upr:backup-1", flags=0x25),
        """
        80 50 000c 08 00 0000 00000014 61626364 0000000000000000
        00000000          # extras: u32 reserved
        00000025          #         u32 flags Producer|IncludeXattrs|IncludeDeleteTimes
        7570723a 6261636b75702d31  # key: 'upr:' 'backup-1'
        """,
    ),
    Row(
        "dcp-open-consumer-json",  # docs/protocol.md §2.1
        DcpOpen(
            opaque=0x61626365,
            datatype=0x01,
            name="repl:c1",
            reserved=0x2A,
            flags=0,
            value=b'{"consumer_name":"c1"}',
        ),
        """
        80 50 0007 08 01 0000 00000025 61626365 0000000000000000
        0000002a          # extras: u32 reserved (ignored by the server)
        00000000          #         u32 flags: consumer
        7265706c3a6331    # key: 'repl:c1'
        7b22 636f6e73756d65725f6e616d65 223a22 6331 227d  # value: {"consumer_name":"c1"}
        """,
    ),
    Row(
        "add-stream",  # docs/protocol.md §2.2
        AddStream(opaque=0x71727374, vbucket=0x0203, flags=0x11),
        """
        80 51 0000 04 00 0203 00000004 71727374 0000000000000000
        00000011          # extras: u32 flags TakeOver|ActiveVbOnly
        """,
    ),
    Row(
        "add-stream-response",  # docs/protocol.md §2.2
        AddStreamResponse(opaque=0x71727374, stream_opaque=0xABCD),
        """
        81 51 0000 04 00 0000 00000004 71727374 0000000000000000
        0000abcd          # extras: u32 new stream's opaque
        """,
    ),
    Row(
        "close-stream",  # docs/protocol.md §2.3
        CloseStream(opaque=0x75767778, vbucket=0x0203),
        """
        80 52 0000 00 00 0203 00000000 75767778 0000000000000000
        """,
    ),
    Row(
        "close-stream-stream-id",  # docs/protocol.md §2.3, §1.3
        CloseStream(opaque=0x75767779, vbucket=0x0203, stream_id=7),
        """
        08 52 03 00 00 00 0203 00000003 75767779 0000000000000000
        22 0007           # frame: id 2 (stream-id), len 2, u16 7
        """,
    ),
    Row(
        "stream-request",  # docs/protocol.md §2.4
        StreamRequest(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            flags=0x20,
            start_seqno=0x1001,
            end_seqno=STREAM_FOREVER,
            vbucket_uuid=0x0000A1B2C3D4E5F6,
            snap_start_seqno=0x1000,
            snap_end_seqno=0x1002,
        ),
        """
        80 53 0000 30 00 0203 00000030 deadbeef 0000000000000000
        00000020          # extras: u32 flags StrictVbUuid
        00000000          #         u32 reserved
        0000000000001001  #         u64 start_seqno
        ffffffffffffffff  #         u64 end_seqno (forever)
        0000a1b2c3d4e5f6  #         u64 vbucket_uuid
        0000000000001000  #         u64 snap_start_seqno
        0000000000001002  #         u64 snap_end_seqno
        """,
    ),
    Row(
        "stream-request-json-value",  # docs/protocol.md §2.4
        StreamRequest(
            opaque=0xDEADBEF0,
            vbucket=0x0203,
            datatype=0x01,
            flags=0x04,
            end_seqno=0x2000,
            value=b'{"sid":7}',
        ),
        """
        80 53 0000 30 01 0203 00000039 deadbef0 0000000000000000
        00000004          # extras: u32 flags ToLatest
        00000000          #         u32 reserved
        0000000000000000  #         u64 start_seqno
        0000000000002000  #         u64 end_seqno
        0000000000000000  #         u64 vbucket_uuid
        0000000000000000  #         u64 snap_start_seqno
        0000000000000000  #         u64 snap_end_seqno
        7b22736964223a377d  # value: {"sid":7}
        """,
    ),
    Row(
        "stream-request-ok",  # docs/protocol.md §2.4
        StreamRequestOk(
            opaque=0xDEADBEEF,
            failover_log=((0x0000A1B2C3D4E5F6, 0x1000), (0x00001122334455AA, 0)),
        ),
        """
        81 53 0000 00 00 0000 00000020 deadbeef 0000000000000000
        0000a1b2c3d4e5f6 0000000000001000  # value: newest {u64 uuid, u64 seqno}
        00001122334455aa 0000000000000000  #        oldest {u64 uuid, u64 seqno}
        """,
    ),
    Row(
        "stream-request-rollback",  # docs/protocol.md §2.4, status 0x23
        StreamRequestRollback(opaque=0xDEADBEEF, rollback_seqno=0x0FA0),
        """
        81 53 0000 00 00 0023 00000008 deadbeef 0000000000000000
        0000000000000fa0  # value: u64 rollback seqno
        """,
    ),
    Row(
        "get-failover-log-dcp",  # docs/protocol.md §2.5: 0x54
        GetFailoverLog(opaque=0x81828384, vbucket=0x0203),
        """
        80 54 0000 00 00 0203 00000000 81828384 0000000000000000
        """,
    ),
    Row(
        "get-failover-log-plain",  # docs/protocol.md §2.5: 0x96
        GetFailoverLog(opaque=0x81828385, vbucket=0x0203, opcode=0x96),
        """
        80 96 0000 00 00 0203 00000000 81828385 0000000000000000
        """,
    ),
    Row(
        "failover-log-response-dcp",  # docs/protocol.md §2.5
        FailoverLogResponse(opaque=0x81828384, failover_log=((0x0000A1B2C3D4E5F6, 0x1000),)),
        """
        81 54 0000 00 00 0000 00000010 81828384 0000000000000000
        0000a1b2c3d4e5f6 0000000000001000  # value: {u64 uuid, u64 seqno}
        """,
    ),
    Row(
        "failover-log-response-plain",  # docs/protocol.md §2.5
        FailoverLogResponse(
            opaque=0x81828385,
            opcode=0x96,
            failover_log=((0x0000A1B2C3D4E5F6, 0x1000), (0x00001122334455AA, 0x10)),
        ),
        """
        81 96 0000 00 00 0000 00000020 81828385 0000000000000000
        0000a1b2c3d4e5f6 0000000000001000  # value: newest {u64 uuid, u64 seqno}
        00001122334455aa 0000000000000010  #        oldest {u64 uuid, u64 seqno}
        """,
    ),
    Row(
        "stream-end",  # docs/protocol.md §2.6
        StreamEnd(opaque=0xDEADBEEF, vbucket=0x0203, status=2),
        """
        80 55 0000 04 00 0203 00000004 deadbeef 0000000000000000
        00000002          # extras: u32 end status StateChanged
        """,
    ),
    Row(
        "snapshot-marker-v1",  # docs/protocol.md §2.7
        SnapshotMarker(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            start_seqno=0x0102030405060708,
            end_seqno=0x1112131415161718,
            flags=0x06,
        ),
        """
        80 56 0000 14 00 0203 00000014 deadbeef 0000000000000000
        0102030405060708  # extras: u64 start
        1112131415161718  #         u64 end
        00000006          #         u32 flags Disk|Checkpoint
        """,
    ),
    Row(
        "snapshot-marker-v2.0",  # docs/protocol.md §2.7
        SnapshotMarkerV2(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            version=0,
            start_seqno=0x1001,
            end_seqno=0x1FFF,
            flags=0x06,
            max_visible_seqno=0x1FFE,
            high_completed_seqno=0x1FF0,
        ),
        """
        80 56 0000 01 00 0203 00000025 deadbeef 0000000000000000
        00                # extras: u8 version 0 (v2.0)
        0000000000001001  # value: u64 start
        0000000000001fff  #        u64 end
        00000006          #        u32 flags Disk|Checkpoint
        0000000000001ffe  #        u64 max visible seqno
        0000000000001ff0  #        u64 high completed seqno
        """,
    ),
    Row(
        "snapshot-marker-v2.2",  # docs/protocol.md §2.7
        SnapshotMarkerV2(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            version=2,
            start_seqno=0x1001,
            end_seqno=0x1FFF,
            flags=0x12,
            max_visible_seqno=0x1FFE,
            high_completed_seqno=0x1FF0,
            purge_seqno=0x0800,
            high_prepared_seqno=0x1FF8,
        ),
        """
        80 56 0000 01 00 0203 00000035 deadbeef 0000000000000000
        02                # extras: u8 version 2 (v2.2)
        0000000000001001  # value: u64 start
        0000000000001fff  #        u64 end
        00000012          #        u32 flags Disk|History
        0000000000001ffe  #        u64 max visible seqno
        0000000000001ff0  #        u64 high completed seqno
        0000000000000800  #        u64 purge seqno
        0000000000001ff8  #        u64 high prepared seqno
        """,
    ),
    Row(
        "mutation",  # docs/protocol.md §2.8
        Mutation(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            cas=0x1122334455667788,
            datatype=0x01,
            by_seqno=0x1001,
            rev_seqno=3,
            flags=0xA1B2C3D4,
            expiration=0x5F5E1000,
            nru=2,
            key=b"doc1",
            value=b'{"a":1}',
        ),
        f"""
        80 57 0004 1f 01 0203 0000002a deadbeef 1122334455667788
        0000000000001001  # extras: u64 by_seqno
        0000000000000003  #         u64 rev_seqno
        a1b2c3d4          #         4 B flags
        5f5e1000          #         u32 expiration
        00000000          #         u32 lock_time
        0000              #         u16 nmeta
        02                #         u8 nru
        {DOC1}
        7b2261223a317d    # value: '{{"a":1}}'
        """,
    ),
    Row(
        "mutation-collection-key",  # docs/protocol.md §12.1: LEB128 id 0x88 before the key
        Mutation(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            cas=0x1122334455667788,
            datatype=0x01,
            by_seqno=0x1002,
            rev_seqno=1,
            key=b"\x88\x01doc1",
            value=b"{}",
        ),
        """
        80 57 0006 1f 01 0203 00000027 deadbeef 1122334455667788
        0000000000001002  # extras: u64 by_seqno
        0000000000000001  #         u64 rev_seqno
        00000000          #         4 B flags
        00000000          #         u32 expiration
        00000000          #         u32 lock_time
        0000              #         u16 nmeta
        00                #         u8 nru
        8801              # key: collection id 0x88 as LEB128 (two bytes)
        646f6331          #      'doc1'
        7b7d              # value: '{}'
        """,
    ),
    Row(
        "mutation-stream-id",  # docs/protocol.md §2.8 with §1.3 stream-id frame, magic 0x08
        Mutation(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            cas=0x1122334455667788,
            datatype=0x01,
            stream_id=7,
            by_seqno=0x1001,
            rev_seqno=3,
            flags=0xA1B2C3D4,
            expiration=0x5F5E1000,
            lock_time=9,
            nru=2,
            key=b"doc1",
            value=b'{"a":1}',
        ),
        f"""
        08 57 03 04 1f 01 0203 0000002d deadbeef 1122334455667788
        22 0007           # frame: id 2 (stream-id), len 2, u16 7
        0000000000001001  # extras: u64 by_seqno
        0000000000000003  #         u64 rev_seqno
        a1b2c3d4          #         4 B flags
        5f5e1000          #         u32 expiration
        00000009          #         u32 lock_time
        0000              #         u16 nmeta
        02                #         u8 nru
        {DOC1}
        7b2261223a317d    # value: '{{"a":1}}'
        """,
    ),
    Row(
        "mutation-xattrs",  # formats/wire.md "Xattrs": the blob, then the body; bit 0x04
        Mutation(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            cas=0x1122334455667788,
            datatype=0x05,
            by_seqno=0x1005,
            rev_seqno=7,
            key=b"doc1",
            value=XATTR_BLOB + b'{"a":1}',
        ),
        f"""
        80 57 0004 1f 05 0203 00000040 deadbeef 1122334455667788
        0000000000001005  # extras: u64 by_seqno
        0000000000000007  #         u64 rev_seqno
        00000000          #         4 B flags
        00000000          #         u32 expiration
        00000000          #         u32 lock_time
        0000              #         u16 nmeta
        00                #         u8 nru
        {DOC1}
        {XATTR_BLOB_HEX}
        7b2261223a317d    # body '{{"a":1}}'
        """,
    ),
    Row(
        "mutation-snappy",  # formats/wire.md "Snappy": raw block, bits JSON | Snappy
        Mutation(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            cas=0x1122334455667788,
            datatype=0x03,
            by_seqno=0x1006,
            rev_seqno=8,
            key=b"doc1",
            value=b"\x07\x18" + b'{"a":1}',
        ),
        f"""
        80 57 0004 1f 03 0203 0000002c deadbeef 1122334455667788
        0000000000001006  # extras: u64 by_seqno
        0000000000000008  #         u64 rev_seqno
        00000000          #         4 B flags
        00000000          #         u32 expiration
        00000000          #         u32 lock_time
        0000              #         u16 nmeta
        00                #         u8 nru
        {DOC1}
        07                # value: varint inflated length 7
        18                #        literal of 7 bytes: tag (7 - 1) << 2
        7b2261223a317d    #        '{{"a":1}}'
        """,
    ),
    Row(
        "mutation-snappy-xattrs",  # the blob and body compressed as one value: bits 0x07
        Mutation(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            cas=0x1122334455667788,
            datatype=0x07,
            by_seqno=0x1007,
            rev_seqno=9,
            key=b"doc1",
            value=b"\x1d\x70" + XATTR_BLOB + b'{"a":1}',
        ),
        f"""
        80 57 0004 1f 07 0203 00000042 deadbeef 1122334455667788
        0000000000001007  # extras: u64 by_seqno
        0000000000000009  #         u64 rev_seqno
        00000000          #         4 B flags
        00000000          #         u32 expiration
        00000000          #         u32 lock_time
        0000              #         u16 nmeta
        00                #         u8 nru
        {DOC1}
        1d                # value: varint inflated length 29
        70                #        literal of 29 bytes: tag (29 - 1) << 2
        {XATTR_BLOB_HEX}
        7b2261223a317d    # body '{{"a":1}}'
        """,
    ),
    Row(
        "deletion-v1",  # docs/protocol.md §2.9
        Deletion(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            cas=0x1122334455667799,
            by_seqno=0x1002,
            rev_seqno=4,
            key=b"doc1",
        ),
        f"""
        80 58 0004 12 00 0203 00000016 deadbeef 1122334455667799
        0000000000001002  # extras: u64 by_seqno
        0000000000000004  #         u64 rev_seqno
        0000              #         u16 nmeta
        {DOC1}
        """,
    ),
    Row(
        "deletion-v2-xattrs",  # docs/protocol.md §2.9, value = xattr section (§1.4)
        DeletionV2(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            cas=0x11223344556677AA,
            datatype=0x04,
            by_seqno=0x1003,
            rev_seqno=5,
            delete_time=0x65A0B1C2,
            key=b"doc1",
            value=b"\x00\x00\x00\x0a\x00\x00\x00\x06_s\x00{}\x00",
        ),
        f"""
        80 58 0004 15 04 0203 00000027 deadbeef 11223344556677aa
        0000000000001003  # extras: u64 by_seqno
        0000000000000005  #         u64 rev_seqno
        65a0b1c2          #         u32 delete_time
        00                #         u8 unused
        {DOC1}
        0000000a          # value: u32 xattr section length 10
        00000006          #        u32 pair length 6
        5f73 00 7b7d 00   #        '_s' NUL '{{}}' NUL
        """,
    ),
    Row(
        "expiration",  # docs/protocol.md §2.10
        Expiration(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            cas=0x11223344556677BB,
            by_seqno=0x1004,
            rev_seqno=6,
            delete_time=0x65A0B1C3,
            key=b"doc1",
        ),
        f"""
        80 59 0004 14 00 0203 00000018 deadbeef 11223344556677bb
        0000000000001004  # extras: u64 by_seqno
        0000000000000006  #         u64 rev_seqno
        65a0b1c3          #         u32 delete_time
        {DOC1}
        """,
    ),
    Row(
        "set-vbucket-state",  # docs/protocol.md §2.11
        SetVbucketState(opaque=0xDEADBEEF, vbucket=0x0203, state=3),
        """
        80 5b 0000 01 00 0203 00000001 deadbeef 0000000000000000
        03                # extras: u8 state pending
        """,
    ),
    Row(
        "set-vbucket",  # formats/cluster.md §3: the bucket CAS in the header, rev in JSON
        SetVbucket(
            opaque=0x01020304, vbucket=0x0007, state=2, cas=0x1122334455667788, value=b'{"rev":3}'
        ),
        """
        80 3d 0000 01 00 0007 0000000a 01020304 1122334455667788
        02                          # extras: u8 state replica
        7b 22 72 65 76 22 3a 33 7d  # {"rev":3}
        """,
    ),
    Row(
        "set-cluster-config",  # formats/cluster.md §3
        SetClusterConfig(opaque=0x05, cas=0x0102, value=b'{"rev":1}'),
        """
        80 b4 0000 00 00 0000 00000009 00000005 0000000000000102
        7b 22 72 65 76 22 3a 31 7d  # {"rev":1}
        """,
    ),
    Row(
        "collections-set-manifest",  # docs/protocol.md "Collections": ns_server's push
        CollectionsSetManifest(opaque=0x07, value=b'{"uid":"1"}'),
        """
        80 b9 0000 00 00 0000 0000000b 00000007 0000000000000000
        7b 22 75 69 64 22 3a 22 31 22 7d  # {"uid":"1"}
        """,
    ),
    Row(
        "collections-get-manifest",  # docs/protocol.md "Collections": no body
        CollectionsGetManifest(opaque=0x08),
        """
        80 ba 0000 00 00 0000 00000000 00000008 0000000000000000
        """,
    ),
    Row(
        "collections-get-id",  # docs/protocol.md "Collections": path in the value
        CollectionsGetId(opaque=0x09, value=b"app.users"),
        """
        80 bb 0000 00 00 0000 00000009 00000009 0000000000000000
        617070 2e 7573657273  # value: 'app' '.' 'users'
        """,
    ),
    Row(
        "collections-get-scope-id",  # docs/protocol.md "Collections": path in the value
        CollectionsGetScopeId(opaque=0x0A, value=b"app"),
        """
        80 bc 0000 00 00 0000 00000003 0000000a 0000000000000000
        617070  # value: 'app'
        """,
    ),
    Row(
        "collections-get-id-response",  # u64 manifest uid, u32 collection id
        CollectionsIdResponse(opaque=0x09, manifest_uid=0x1F, id=0x08),
        """
        81 bb 0000 0c 00 0000 0000000c 00000009 0000000000000000
        000000000000001f  # extras: u64 manifest uid
        00000008          #         u32 collection id
        """,
    ),
    Row(
        "set-param",  # formats/cluster.md §6: replication pause, ep-engine's SET_PARAM shape
        SetParam(opaque=0x06, name="replication_pause", value=b'{"after":5}'),
        """
        80 82 0011 04 00 0000 00000020 00000006 0000000000000000
        00000004                               # extras: u32 param type 4 (dcp)
        7265706c69636174696f6e 5f 7061757365    # key: 'replication' '_' 'pause'
        7b 22 61 66 74 65 72 22 3a 35 7d        # {"after":5}
        """,
    ),
    Row(
        "enable-traffic",  # formats/cluster.md §3: memcached's ENABLE_TRAFFIC, no body
        EnableTraffic(opaque=0x07),
        """
        80 8d 0000 00 00 0000 00000000 00000007 0000000000000000
        """,
    ),
    Row(
        "disable-traffic",  # formats/cluster.md §3
        DisableTraffic(opaque=0x08),
        """
        80 8e 0000 00 00 0000 00000000 00000008 0000000000000000
        """,
    ),
    Row(
        "noop",  # docs/protocol.md §2.12
        Noop(opaque=0x11),
        """
        80 5c 0000 00 00 0000 00000000 00000011 0000000000000000
        """,
    ),
    Row(
        "noop-response",  # docs/protocol.md §2.12: no schema, so the generic Response
        Response(opcode=0x5C, opaque=0x11),
        """
        81 5c 0000 00 00 0000 00000000 00000011 0000000000000000
        """,
    ),
    Row(
        "buffer-ack",  # docs/protocol.md §2.13
        BufferAck(acked=0x00012345),
        """
        80 5d 0000 04 00 0000 00000004 00000000 0000000000000000
        00012345          # extras: u32 bytes acked
        """,
    ),
    Row(
        "control",  # docs/protocol.md §2.14
        Control(opaque=0x91929394, name="enable_noop", value="true"),
        """
        80 5e 000b 00 00 0000 0000000f 91929394 0000000000000000
        656e61626c65 5f 6e6f6f70  # key: 'enable' '_' 'noop'
        74727565                  # value: 'true'
        """,
    ),
    Row(
        "system-event-create-scope",  # docs/protocol.md §2.15, event 3 version 0
        SystemEvent(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            by_seqno=0x1005,
            event=3,
            version=0,
            key=b"inventory",
            value=b"\x00\x00\x00\x00\x00\x00\x00\x0a\x00\x00\x00\x09",
        ),
        """
        80 5f 0009 0d 00 0203 00000022 deadbeef 0000000000000000
        0000000000001005    # extras: u64 by_seqno
        00000003            #         u32 event (scope created)
        00                  #         u8 version
        696e76656e746f7279  # key: 'inventory'
        000000000000000a    # value: u64 manifest uid
        00000009            #        u32 scope id
        """,
    ),
    Row(
        "system-event-begin-collection-v1",  # docs/protocol.md §2.15, event 0 version 1
        SystemEvent(
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            by_seqno=0x1006,
            event=0,
            version=1,
            key=b"fruit",
            value=bytes.fromhex("000000000000000b 00000009 0000000c 00000e10"),
        ),
        """
        80 5f 0005 0d 00 0203 00000026 deadbeef 0000000000000000
        0000000000001006  # extras: u64 by_seqno
        00000000          #         u32 event (collection begins)
        01                #         u8 version
        6672756974        # key: 'fruit'
        000000000000000b  # value: u64 manifest uid
        00000009          #        u32 scope id
        0000000c          #        u32 collection id
        00000e10          #        u32 max_ttl
        """,
    ),
    Row(
        "seqno-advanced",  # docs/protocol.md §2.16
        SeqnoAdvanced(opaque=0xDEADBEEF, vbucket=0x0203, by_seqno=0x0102030405060708),
        """
        80 64 0000 08 00 0203 00000008 deadbeef 0000000000000000
        0102030405060708  # extras: u64 seqno
        """,
    ),
    # ------------------------------------------------------------ upr extension: barrier.md
    Row(
        "barrier-register",
        Barrier(opaque=0xDEADBEEF, cookie=b"ck1"),
        """
        80 e1 0003 00 00 0000 00000003 deadbeef 0000000000000000
        63 6b 31  # key: cookie "ck1"
        """,
    ),
    Row(
        "barrier-reached",
        Barrier(opaque=0xDEADBEEF, cookie=b"ck1", datatype=1, value=b'{"cut":{"3":"9"}}'),
        """
        80 e1 0003 00 01 0000 00000014 deadbeef 0000000000000000
        63 6b 31  # key: cookie "ck1"
        7b 22 63 75 74 22 3a 7b 22 33 22 3a 22 39 22 7d 7d  # value: {"cut":{"3":"9"}}
        """,
    ),
    # ------------------------------------------------------------ generic fallbacks
    Row(
        "unknown-request-abort",  # docs/protocol.md §2.18 ABORT 0x63 has no schema in upr
        UnknownRequest(
            opcode=0x63,
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            extras=bytes.fromhex("0000000000000010 0000000000000011"),
            key=b"doc1",
        ),
        f"""
        80 63 0004 10 00 0203 00000014 deadbeef 0000000000000000
        0000000000000010  # extras: u64 prepared seqno
        0000000000000011  #         u64 abort seqno
        {DOC1}
        """,
    ),
    Row(
        # docs/protocol.md §2.17 OSO_SNAPSHOT 0x65, §1.3 magic 0x08
        "unknown-request-oso-stream-id",
        UnknownRequest(
            opcode=0x65,
            opaque=0xDEADBEEF,
            vbucket=0x0203,
            stream_id=7,
            extras=b"\x00\x00\x00\x01",
        ),
        """
        08 65 03 00 04 00 0203 00000007 deadbeef 0000000000000000
        22 0007           # frame: id 2 (stream-id), len 2, u16 7
        00000001          # extras: u32 flags (start of OSO snapshot)
        """,
    ),
    Row(
        # docs/protocol.md §1.2 magic 0x82, 0x01 ClustermapChangeNotification
        "unknown-request-server-initiated",
        UnknownRequest(
            magic=0x82,
            opcode=0x01,
            opaque=0x0000CAFE,
            datatype=0x01,
            key=b"default",
            value=b'{"rev":1}',
        ),
        """
        82 01 0007 00 01 0000 00000010 0000cafe 0000000000000000
        64656661756c74      # key: 'default' (body kept raw)
        7b22726576223a317d  # value: {"rev":1}
        """,
    ),
    Row(
        # docs/protocol.md §1.2 magic 0x83: the client's answer to 0x82
        "response-server-initiated",
        Response(magic=0x83, opcode=0x01, opaque=0x0000CAFE),
        """
        83 01 0000 00 00 0000 00000000 0000cafe 0000000000000000
        """,
    ),
    Row(
        # docs/protocol.md §1.3 magic 0x18, frame id 1 len 2
        "response-alt-magic-enoent-read-units",
        Response(
            opcode=0x00,
            status=0x01,
            opaque=0x21222325,
            frame_infos=((1, b"\x00\x01"),),
        ),
        """
        18 00 03 00 00 00 0001 00000003 21222325 0000000000000000
        12 0001           # frame: id 1 (read units), len 2, u16 1
        """,
    ),
    Row(
        "response-not-my-vbucket-config",  # docs/protocol.md §3: NOT_MY_VBUCKET with a config body
        Response(opcode=0x53, status=0x07, opaque=0xDEADBEEF, datatype=0x01, value=b'{"rev":1}'),
        """
        81 53 0000 00 01 0007 00000009 deadbeef 0000000000000000
        7b22726576223a317d  # value: {"rev":1}
        """,
    ),
    Row(
        "response-einval-xerror",  # docs/protocol.md §1.5, §3: EINVAL with an XERROR body
        Response(
            opcode=0x5E,
            status=0x04,
            opaque=0x91929394,
            datatype=0x01,
            value=b'{"error":{"context":"bad"}}',
        ),
        """
        81 5e 0000 00 01 0004 0000001b 91929394 0000000000000000
        7b 22 6572726f72 22 3a 7b          # value: {"error":{
        22 636f6e74657874 22 3a 22 626164  #        "context":"bad
        22 7d 7d                           #        "}}
        """,
    ),
]


def _params(rows: list[Row]) -> list[object]:
    return [
        pytest.param(
            row,
            id=row.id,
            marks=[pytest.mark.xfail(strict=True, reason=row.xfail)] if row.xfail else [],
        )
        for row in rows
    ]


GOLDEN_PARAMS = _params(GOLDEN)


# ---------------------------------------------------------------- the table itself


def test_ids_are_unique() -> None:
    ids = [row.id for row in GOLDEN]
    assert len(ids) == len(set(ids))


def test_table_covers_every_message_class() -> None:
    covered = {type(row.message) for row in GOLDEN}
    wanted = {*MESSAGE_CLASSES, UnknownRequest, Response}
    missing = sorted(c.__name__ for c in wanted - covered)
    assert not missing, f"no golden row for {missing}"


@pytest.mark.parametrize("row", _params(GOLDEN))
def test_golden_hex_is_self_consistent(row: Row) -> None:
    """Guards against typos in the table: lengths in the header match the body written."""
    packet = row.packet
    assert len(packet) >= 24
    bodylen = int.from_bytes(packet[8:12], "big")
    assert bodylen == len(packet) - 24
    if packet[0] in (0x08, 0x18):
        framelen, keylen = packet[2], packet[3]
    else:
        framelen, keylen = 0, int.from_bytes(packet[2:4], "big")
    assert framelen + packet[4] + keylen <= bodylen


# ---------------------------------------------------------------- encode


@pytest.mark.parametrize("row", GOLDEN_PARAMS)
def test_encode(row: Row) -> None:
    assert row.message.encode().hex(" ") == row.packet.hex(" ")


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("row", GOLDEN_PARAMS)
def test_decode_whole(row: Row) -> None:
    packet = row.packet
    assert decode_one(packet) == row.message

    dec = FrameDecoder()
    dec.feed(packet)
    frame = dec.next_frame()
    assert frame is not None
    assert frame.size == len(packet)
    assert decode_message(frame) == row.message
    assert dec.buffered == 0
    assert dec.next_frame() is None

    batch = FrameDecoder()
    batch.feed(packet)
    frames = batch.frames()
    assert [decode_message(f) for f in frames] == [row.message]
    assert batch.buffered == 0


@pytest.mark.parametrize("row", GOLDEN_PARAMS)
def test_decode_one_byte_at_a_time(row: Row) -> None:
    packet = row.packet
    dec = FrameDecoder()
    for i, byte in enumerate(packet[:-1]):
        dec.feed(bytes([byte]))
        assert dec.next_frame() is None, f"frame returned after {i + 1} of {len(packet)} bytes"
    dec.feed(packet[-1:])
    frame = dec.next_frame()
    assert frame is not None
    assert decode_message(frame) == row.message
    assert dec.buffered == 0
    assert dec.next_frame() is None


@pytest.mark.parametrize("row", GOLDEN_PARAMS)
def test_decode_with_trailing_bytes(row: Row) -> None:
    packet = row.packet
    dec = FrameDecoder()
    dec.feed(packet + TRAILING)
    frame = dec.next_frame()
    assert frame is not None
    assert decode_message(frame) == row.message
    assert dec.buffered == len(TRAILING)
    assert dec.next_frame() is None
    assert dec.buffered == len(TRAILING)
    # The rest of the NOOP completes the second packet.
    dec.feed(NOOP_PACKET[len(TRAILING) :])
    second = dec.next_frame()
    assert second is not None
    assert decode_message(second) == Noop(opaque=0x99)
    assert dec.buffered == 0
    # decode_one insists on exactly one packet.
    with pytest.raises(RemoteProtocolError):
        decode_one(packet + TRAILING)
    with pytest.raises(RemoteProtocolError):
        decode_one(packet[:-1])


def test_whole_table_as_one_stream() -> None:
    """Every golden packet back to back, fed in one chunk, decodes in order."""
    rows = [row for row in GOLDEN if row.xfail is None]
    stream = b"".join(row.packet for row in rows)
    dec = FrameDecoder()
    dec.feed(stream)
    assert [decode_message(f) for f in dec.frames()] == [row.message for row in rows]
    assert dec.buffered == 0


# ---------------------------------------------------------------- negative rows


@dataclass(frozen=True)
class BadRow:
    """Bytes that frame correctly but do not decode to any message."""

    id: str
    hex: str


BAD_MESSAGES: list[BadRow] = [
    BadRow(
        "mutation-30-byte-extras",  # docs/protocol.md §2.8 requires 31
        f"""
        80 57 0004 1e 00 0203 00000022 deadbeef 1122334455667788
        0000000000001001 0000000000000003 a1b2c3d4 5f5e1000 00000000 0000  # 30 B extras
        {DOC1}
        """,
    ),
    BadRow(
        "stream-end-no-extras",  # docs/protocol.md §2.6 requires 4
        """
        80 55 0000 00 00 0203 00000000 deadbeef 0000000000000000
        """,
    ),
    BadRow(
        "snapshot-marker-v2.1",  # docs/protocol.md §2.7: version byte 1 is rejected
        """
        80 56 0000 01 00 0203 00000025 deadbeef 0000000000000000
        01
        0000000000001001 0000000000001fff 00000006 0000000000001ffe 0000000000001ff0
        """,
    ),
    BadRow(
        "snapshot-marker-version-0-with-52-byte-value",  # docs/protocol.md §2.7
        """
        80 56 0000 01 00 0203 00000035 deadbeef 0000000000000000
        00
        0000000000001001 0000000000001fff 00000006 0000000000001ffe 0000000000001ff0
        0000000000000800 0000000000001ff8
        """,
    ),
    BadRow(
        "set-with-meta-25-byte-extras",  # docs/protocol.md §6: 24, 26, 28 or 30
        f"""
        80 a2 0004 19 00 0203 0000001d 41424344 0000000000000000
        01020304 05060708 1112131415161718 2122232425262728 00
        {DOC1}
        """,
    ),
    BadRow(
        "stream-request-47-byte-extras",  # docs/protocol.md §2.4 requires 48
        """
        80 53 0000 2f 00 0203 0000002f deadbeef 0000000000000000
        00000000 00000000 0000000000000000 ffffffffffffffff 0000000000000000
        0000000000000000 00000000000000
        """,
    ),
    BadRow(
        "failover-log-20-bytes",  # docs/protocol.md §2.4: 16 bytes per entry
        """
        81 53 0000 00 00 0000 00000014 deadbeef 0000000000000000
        0000a1b2c3d4e5f6 0000000000001000 00000000
        """,
    ),
    BadRow(
        "rollback-4-bytes",  # docs/protocol.md §2.4: u64 rollback seqno
        """
        81 53 0000 00 00 0023 00000004 deadbeef 0000000000000000
        00000fa0
        """,
    ),
    BadRow(
        "hello-odd-feature-list",  # docs/protocol.md §5.1: u16 codes
        """
        81 1f 0000 00 00 0000 00000003 deadbeef 0000000000000000
        0007 12
        """,
    ),
    BadRow(
        "stream-id-frame-1-byte",  # docs/protocol.md §1.3: stream-id data is a u16
        """
        08 52 02 00 00 00 0203 00000002 75767779 0000000000000000
        21 07
        """,
    ),
    BadRow(
        "frame-info-overruns-framing",  # docs/protocol.md §1.3: frame says 2 data bytes, 1 present
        """
        08 52 02 00 00 00 0203 00000002 75767779 0000000000000000
        22 00
        """,
    ),
    BadRow(
        "control-key-not-utf8",  # docs/protocol.md §2.14: key is an ASCII name
        """
        80 5e 0002 00 00 0000 00000006 91929394 0000000000000000
        ff fe
        74727565
        """,
    ),
    BadRow(
        "close-stream-with-value",  # docs/protocol.md §2.3: no extras, key or value
        """
        80 52 0000 00 00 0203 00000001 75767778 0000000000000000
        00
        """,
    ),
]


@pytest.mark.parametrize("bad", BAD_MESSAGES, ids=[b.id for b in BAD_MESSAGES])
def test_malformed_message_is_rejected(bad: BadRow) -> None:
    packet = unhex(bad.hex)
    assert int.from_bytes(packet[8:12], "big") == len(packet) - 24
    dec = FrameDecoder()
    dec.feed(packet)
    frame = dec.next_frame()
    assert frame is not None
    with pytest.raises(RemoteProtocolError):
        decode_message(frame)
    with pytest.raises(RemoteProtocolError):
        decode_one(packet)


BAD_HEADERS: list[tuple[str, int | None, str]] = [
    (
        "bad-magic",
        None,
        """
        90 5c 0000 00 00 0000 00000000 00000011 0000000000000000  # magic 0x90
        """,
    ),
    (
        "body-over-max-body",
        0x100,
        """
        80 57 0004 1f 00 0203 00000101 deadbeef 0000000000000000  # bodylen 257 > 256
        """,
    ),
    (
        "body-over-default-max",  # DEFAULT_MAX_BODY is 20 MiB
        None,
        """
        80 57 0004 1f 00 0203 01400001 deadbeef 0000000000000000  # bodylen 20 MiB + 1
        """,
    ),
    (
        "extras-and-key-exceed-body",  # docs/protocol.md §1.1
        None,
        """
        80 57 0004 1f 00 0203 00000010 deadbeef 0000000000000000  # 31 + 4 > 16
        """,
    ),
    (
        "alt-framing-and-key-exceed-body",  # docs/protocol.md §1.3
        None,
        """
        08 57 03 04 1f 00 0203 00000020 deadbeef 0000000000000000  # 3 + 31 + 4 > 32
        """,
    ),
]


@pytest.mark.parametrize(
    ("max_body", "header_hex"),
    [pytest.param(m, h, id=i) for i, m, h in BAD_HEADERS],
)
def test_bad_header_raises_as_soon_as_header_is_fed(max_body: int | None, header_hex: str) -> None:
    header = unhex(header_hex)
    assert len(header) == 24
    dec = FrameDecoder() if max_body is None else FrameDecoder(max_body=max_body)
    for byte in header[:-1]:
        dec.feed(bytes([byte]))
        assert dec.next_frame() is None
    dec.feed(header[-1:])
    with pytest.raises(RemoteProtocolError):
        dec.next_frame()
    # The decoder stays poisoned, even once more bytes arrive.
    dec.feed(b"\x00" * 64)
    with pytest.raises(RemoteProtocolError):
        dec.next_frame()
