"""Wire conformance: a live `upr tail` session, decoded by Wireshark (docs/protocol.md §8.1).

A `upr serve` node (16 partitions) gets a few hundred documents with updates and deletes
from `upr load`; tshark captures the node's port on `lo` while two real `upr tail`
processes run: `--until-end --format json -v` (a whole finite session) and `--count 5`
(a session that hangs up in the middle of the stream). The capture is decoded by one
`tshark -d tcp.port==PORT,couchbase -T pdml` run, with TCP reassembly on, so PDUs that
span segments are decoded once, in the frame that completes them.

The decoded PDUs must show every message of the session with its fields (bootstrap,
DCP_OPEN, CONTROLs, GET_ALL_VB_SEQNOS, one STREAM_REQ per partition and its failover
log, snapshot markers, mutations, deletions, stream ends, buffer acks), agree with what
`upr tail` printed for the same run (every change line, snapshot, stream open and stream
end), cover every byte each side sent, and carry no expert info beyond the dissector's
known quirks (`EXPECTED_QUIRKS` below; the field-level ones are handled where the field
is read: the byte-swapped opaque, a data record's key split into its LEB128 collection
id and document key (HELLO negotiated collections), STREAM_END extras left undecoded).

Skipped when tshark is missing or may not capture on `lo` (`make test` installs tshark
and CI runs as root).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import PASSWORD, USER, Node, upr
from tests.e2e.e2e_helpers import reap, spawn, wait_persisted
from upr_cli.net.bootstrap import WANTED
from upr_cli.protocol import Feature, leb128, snappy, xattrs

TSHARK = shutil.which("tshark")
pytestmark = pytest.mark.skipif(TSHARK is None, reason="tshark is not installed")

PARTITIONS = 16
BUFFER_SIZE = 4 * 1024 * 1024  # upr tail's default connection_buffer_size
# About 25 MB of documents, which Snappy (forced in the first session) shrinks about
# twentyfold on the wire: still more than a fifth of the 4 MiB window, so the client
# must send BUFFER_ACKs (it acks every fifth of the window) in the session.
# Every write carries xattrs (`--xattrs`: a system `_sync` and a user `meta`), so
# mutations have datatype bit 0x04 (compressed with their body) and tombstones keep
# `_sync` as their value (formats/wire.md "Xattrs").
LOAD = ("--docs", "3600", "--size", "10000", "--update-ratio", "0.3", "--delete-ratio",
        "0.1", "--seed", "11", "--xattrs")  # fmt: skip

# Opcodes (docs/protocol.md §2, §5).
HELLO, SASL_LIST, SASL_AUTH, SASL_STEP = 0x1F, 0x20, 0x21, 0x22
GET_ALL_VB_SEQNOS, SELECT_BUCKET, GET_CLUSTER_CONFIG, GET_ERROR_MAP = 0x48, 0x89, 0xB5, 0xFE
DCP_OPEN, STREAM_REQ, STREAM_END, SNAPSHOT_MARKER = 0x50, 0x53, 0x55, 0x56
MUTATION, DELETION, NOOP, BUFFER_ACK, CONTROL = 0x57, 0x58, 0x5C, 0x5D, 0x5E
AUTH_CONTINUE = 0x21
STREAM_FOREVER = 2**64 - 1
# Messages the producer counts against the flow-control window (docs/protocol.md §7.1).
FLOW_CONTROLLED = {SNAPSHOT_MARKER, MUTATION, DELETION, STREAM_END, 0x59, 0x5B, 0x5F, 0x64, 0x65}

STRAY = ("_ws.string.trailing_stray_characters", "Trailing stray characters")
# Expert infos that are the dissector's doing, not problems with our bytes, by the
# (magic, opcode) of the PDU they may appear on. Anything else fails the test.
EXPECTED_QUIRKS: dict[tuple[int, int], set[tuple[str, str]]] = {
    # docs/protocol.md §8.1 and test_tshark.py: the failover-log body is added as a string item
    # before its u64 pairs are decoded, so binary bytes give "Trailing stray characters".
    (0x81, STREAM_REQ): {STRAY},
    # Not listed in docs/protocol.md §8.1, seen here: the GET_ALL_VB_SEQNOS response body goes
    # through the same code (`proto_tree_add_item(hf_vbucket_states, ..., ENC_ASCII)` in
    # packet-couchbase.c); its {u16 vb, u64 seqno} records are decoded and checked below.
    (0x81, GET_ALL_VB_SEQNOS): {STRAY},
    # docs/protocol.md §8.1: a DCP mutation's or deletion's key is added as a string,
    # which the default collection's 0x00 prefix ends at once.
    (0x80, MUTATION): {STRAY},
    (0x80, DELETION): {STRAY},
    # test_tshark.py: any non-success status gets a "<opcode>: <status>" warning; SCRAM's
    # first SASL_AUTH reply is AUTH_CONTINUE by design (docs/protocol.md §5.2).
    (0x81, SASL_AUTH): {
        ("couchbase.warn.unknown_opcode", "SASL Authenticate: Authentication continue")
    },
}
# docs/protocol.md §8.1: a value with both Snappy and XATTR bits (kv_engine sends one
# whenever a document with xattrs goes out compressed) has its xattr pairs read from the
# still-compressed bytes (`dissect_value` takes the XATTR branch, which never inflates),
# so a pair's NUL separator is missed. Allowed only on such PDUs; their content is
# checked here by inflating and splitting the PDU's own bytes (`_change_from_wire`).
SNAPPY_XATTRS = 0x02 | 0x04
SNAPPY_XATTR_QUIRK = ("couchbase.warn.separator_not_found", "Null byte not found")
# Outside Couchbase PDUs only TCP's own notes on the conversation are allowed: connection
# life cycle (SYN, FIN, RST), window back-pressure, (spurious) retransmissions and SACKs.
# They depend on scheduling, not on our bytes (a loaded host makes the kernel retransmit
# on loopback); that every byte each side sent still decodes into PDUs, exactly once, is
# checked by test_capture_holds_both_sessions_fully_reassembled.
TCP_NOTES = "tcp."
# ... except these, which mean the capture itself missed packets (dumpcap's buffer
# overflowed): the fixture captures again, up to CAPTURE_ATTEMPTS times.
CAPTURE_LOSS = {"tcp.analysis.lost_segment", "tcp.analysis.ack_lost_segment"}
CAPTURE_ATTEMPTS = 3


# ---------------------------------------------------------------- decoded capture


@dataclass
class Pdu:
    """One Couchbase PDU as tshark decoded it."""

    frame: int
    stream: int
    to_server: bool
    fields: dict[str, list[tuple[str, str]]]  # field name -> [(show, raw hex)]
    experts: list[tuple[str, str]]  # (expert id, message) inside this PDU
    packet: bytes = b""  # the PDU's bytes, from the TCP payload or reassembled data

    def value(self) -> bytes:
        """The PDU's value, cut from its bytes (the dissector shows no raw value for one
        with xattrs: it splits it into pairs)."""
        start = 24 + self.num("couchbase.extras.length") + self.num("couchbase.key.length")
        assert len(self.packet) == self.wire_size, f"frame {self.frame}: bytes not found"
        return self.packet[start:]

    def show(self, name: str) -> str:
        values = self.fields.get(name, [])
        assert len(values) == 1, f"frame {self.frame}: {name} shown {values}"
        return values[0][0]

    def num(self, name: str) -> int:
        return int(self.show(name), 0)

    def nums(self, name: str) -> list[int]:
        return [int(show, 0) for show, _ in self.fields.get(name, [])]

    def raw(self, name: str) -> bytes:
        values = self.fields.get(name, [])
        assert len(values) == 1, f"frame {self.frame}: {name} shown {values}"
        return bytes.fromhex(values[0][1])

    def text(self, name: str) -> str:
        return self.raw(name).decode()

    @property
    def magic(self) -> int:
        return self.num("couchbase.magic")

    @property
    def opcode(self) -> int:
        return self.num("couchbase.opcode")

    @property
    def opaque(self) -> int:
        # Quirk (docs/protocol.md §8.1): the opaque is shown byte-swapped; read its raw bytes.
        return int.from_bytes(self.raw("couchbase.opaque"), "big")

    @property
    def vbucket(self) -> int:
        return self.num("couchbase.vbucket")

    @property
    def status(self) -> int:
        return self.num("couchbase.status")

    @property
    def wire_size(self) -> int:
        return 24 + self.num("couchbase.total_bodylength")

    def key(self) -> bytes:
        """The whole key, as sent."""
        return self.raw("couchbase.key")

    def doc_key(self) -> bytes:
        """A data record's document key: HELLO negotiated collections, so the wire key is
        the LEB128 collection id, then the key (docs/protocol.md §12.1). The dissector
        splits a mutation's key itself; a deletion's it shows whole (docs/protocol.md §8.1)."""
        cid, doc = leb128.split_key(self.key())
        if "couchbase.key.collection_id" in self.fields:
            assert self.num("couchbase.key.collection_id") == cid
            assert self.raw("couchbase.key.logical_key") == doc
        return bytes(doc)


@dataclass
class Capture:
    """Everything the test needs: the decoded capture and what `upr tail` printed."""

    port: int
    pdus: list[Pdu]
    other_experts: list[tuple[int, str, str]]  # (frame, id, message) outside Couchbase PDUs
    tcp_sent: dict[tuple[int, bool], int]  # (stream, to_server) -> payload bytes sent
    streams: list[int]
    until_end: list[dict[str, Any]]  # json lines of `upr tail --until-end -v`
    counted: list[dict[str, Any]]  # json lines of `upr tail --count 5 -v`
    load: dict[str, Any] = field(default_factory=dict)

    def session(self, index: int) -> list[Pdu]:
        return [p for p in self.pdus if p.stream == self.streams[index]]


def _expert(f: ET.Element) -> tuple[str, str]:
    kids = {k.get("name", ""): k.get("show", "") for k in f}
    ident = next((k for k in kids if not k.startswith("_ws.expert.")), "_ws.expert")
    return ident, kids.get("_ws.expert.message", "")


def _data_sources(packet: ET.Element) -> list[tuple[int, bytes]]:
    """(offset, bytes) of the data a PDU of this packet may lie in: the frame's TCP
    payload (offsets in the frame) and the reassembled PDU data (offsets from 0)."""
    out = []
    for f in packet.iter("field"):
        if f.get("name") in ("tcp.payload", "tcp.reassembled.data") and f.get("value"):
            start = int(f.get("pos", "0")) if f.get("name") == "tcp.payload" else 0
            out.append((start, bytes.fromhex(f.get("value", ""))))
    return out


def _pdu_bytes(proto: ET.Element, sources: list[tuple[int, bytes]], size: int) -> bytes:
    """The bytes of a couchbase PDU: the source whose slice at the PDU's position is a
    whole packet of its size."""
    pos = int(proto.get("pos", "0"))
    for start, data in sources:
        cut = data[pos - start : pos - start + size]
        whole = len(cut) == size and 24 + int.from_bytes(cut[8:12], "big") == size
        if pos >= start and whole and cut[:1] in (b"\x80", b"\x81"):
            return cut
    return b""


def parse_pdml(
    xml: bytes, port: int
) -> tuple[list[Pdu], list[tuple[int, str, str]], dict[tuple[int, bool], int]]:
    """Couchbase PDUs in capture order, the experts outside them, and the payload bytes each
    side of each TCP stream sent (the highest relative sequence number reached, so a
    retransmitted segment counts once)."""
    pdus: list[Pdu] = []
    others: list[tuple[int, str, str]] = []
    tcp_sent: dict[tuple[int, bool], int] = {}
    for packet in ET.fromstring(xml).iter("packet"):
        protos = packet.findall("proto")
        number = packet.find("proto[@name='frame']/field[@name='frame.number']")
        assert number is not None
        frame = int(number.get("show", "0"))
        tcp = next(p for p in protos if p.get("name") == "tcp")
        tcp_fields = {f.get("name", ""): f.get("show", "") for f in tcp.iter("field")}
        stream = int(tcp_fields["tcp.stream"])
        to_server = int(tcp_fields["tcp.dstport"]) == port
        if int(tcp_fields["tcp.len"]):  # SYN took relative seq 0, so payload starts at 1
            end = int(tcp_fields["tcp.seq"]) + int(tcp_fields["tcp.len"]) - 1
            tcp_sent[stream, to_server] = max(tcp_sent.get((stream, to_server), 0), end)
        sources = _data_sources(packet)
        for proto in protos:
            name = proto.get("name", "")
            if name == "couchbase":
                fields: dict[str, list[tuple[str, str]]] = {}
                experts = []
                for f in proto.iter("field"):
                    fname = f.get("name", "")
                    if fname == "_ws.expert":
                        experts.append(_expert(f))
                    elif fname.startswith("_ws.malformed"):
                        experts.append((fname, f.get("showname", "malformed")))
                    else:
                        fields.setdefault(fname, []).append((f.get("show", ""), f.get("value", "")))
                pdu = Pdu(frame, stream, to_server, fields, experts)
                pdu.packet = _pdu_bytes(proto, sources, pdu.wire_size)
                pdus.append(pdu)
            else:
                if name.startswith("_ws."):  # malformed / unreassembled as a layer of its own
                    others.append((frame, name, proto.get("showname", "")))
                for f in proto.iter("field"):
                    if f.get("name") == "_ws.expert":
                        others.append((frame, *_expert(f)))
                    elif f.get("name", "").startswith("_ws.malformed"):
                        others.append((frame, f.get("name", ""), f.get("showname", "")))
    return pdus, others, tcp_sent


# ---------------------------------------------------------------- capturing


class Tshark:
    """`tshark -i lo` writing a pcapng file.

    tshark prints "Capturing on 'lo'" before dumpcap has opened the device (it prints it
    even when that then fails for lack of permission); dumpcap reports "Capture started"
    only once the device is open, the capture filter installed and the file header
    written, so every packet from then on is in the file.
    """

    def __init__(self, proc: subprocess.Popen[str], pcap: Path) -> None:
        self.proc, self.pcap = proc, pcap
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Return once capturing; pytest.skip if capturing on lo is not permitted."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=0.05)
            except queue.Empty:
                line = ""
            if line is None:  # tshark exited
                self.proc.wait(timeout=10)
                denied = [ln.strip() for ln in self.stderr if "permission" in ln.lower()]
                if denied:
                    pytest.skip(f"tshark may not capture on lo: {denied[0]}")
                raise AssertionError(f"tshark exited {self.proc.returncode}: {self.stderr}")
            self.stderr.append(line)
            # dumpcap creates the file only after opening the device (and says so).
            if "Capture started" in line or (self.pcap.exists() and self.pcap.stat().st_size):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"tshark did not start capturing: {self.stderr}")

    def stop(self) -> None:
        """SIGINT (tshark drains what it captured and closes the file), then wait."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        finally:
            self._reader.join(timeout=10)
            reap(self.proc)  # killed if still running, pipes closed: nothing outlives the test
        while not self.lines.empty():
            line = self.lines.get_nowait()
            if line is not None:
                self.stderr.append(line)


@contextlib.contextmanager
def capturing(port: int, pcap: Path) -> Iterator[Tshark]:
    """A `Tshark` capturing `port` into `pcap` for the block, stopped at its end (and
    reaped: nothing outlives the test)."""
    assert TSHARK is not None
    # -B: a kernel buffer larger than the default 2 MB holds a whole burst
    with spawn(TSHARK, "-n", "-i", "lo", "-B", "64", "-f", f"tcp port {port}", "-w", str(pcap),
               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
               text=True) as proc:  # fmt: skip
        tshark = Tshark(proc, pcap)
        try:
            yield tshark
        finally:
            tshark.stop()


def _tail(node: Node, *args: str) -> list[dict[str, Any]]:
    out = upr("tail", node.uri, "--format", "json", "-v", *args, timeout=60)
    return [json.loads(line) for line in out.stdout.splitlines()]


def _capture_sessions(node: Node, tmp: Path) -> tuple[Path, list[Any], list[Any]]:
    """Capture both `upr tail` sessions; return the capture file and what they printed."""
    pcap = tmp / "tail.pcapng"
    pcap.unlink(missing_ok=True)
    with capturing(node.port, pcap) as tshark:
        tshark.wait_ready()
        # the first forces Snappy (compressed values on the wire), the second has the
        # default (negotiated, not forced: values as the node stores them, plain here)
        until_end = _tail(node, "--until-end", "--wire-compression", "force")
        counted = _tail(node, "--count", "5")
        time.sleep(0.3)  # the last FIN/ACKs
    assert pcap.exists(), f"tshark wrote no capture: {''.join(tshark.stderr)}"
    return pcap, until_end, counted


def _decode(pcap: Path, port: int, config_dir: Path) -> bytes:
    """`tshark -r` with the Couchbase dissector on the node's port, as PDML."""
    assert TSHARK is not None
    config_dir.mkdir(exist_ok=True)  # empty: no user preferences
    env = {**os.environ, "WIRESHARK_CONFIG_DIR": str(config_dir)}
    decoded = subprocess.run(
        [TSHARK, "-n", "-r", str(pcap), "-d", f"tcp.port=={port},couchbase",
         "-o", "tcp.check_checksum:FALSE", "-o", "tcp.desegment_tcp_streams:TRUE",
         "-o", "couchbase.desegment_pdus:TRUE", "-T", "pdml"],
        capture_output=True, check=False, env=env, timeout=120,
    )  # fmt: skip
    assert decoded.returncode == 0, decoded.stderr.decode(errors="replace")
    return decoded.stdout


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Capture:
    """Load a node, capture two `upr tail` sessions, decode the capture with tshark."""
    tmp = tmp_path_factory.mktemp("wire")
    # The same node as the `node` fixture (16 partitions, short flush interval), made here
    # because one capture serves every test of this module.
    node = Node(tmp / "node", "--flush-interval", "0.02", partitions=PARTITIONS).start()
    try:
        load = json.loads(upr("load", node.uri, *LOAD, "--json").stdout)
        assert load["errors"] == 0 and load["deletes"] > 0 and load["updates"] > 0
        wait_persisted(node.uri)
        for _attempt in range(CAPTURE_ATTEMPTS):
            pcap, until_end, counted = _capture_sessions(node, tmp)
            pdus, others, tcp_sent = parse_pdml(
                _decode(pcap, node.port, tmp / "wireshark-config"), node.port
            )
            if not any(ident in CAPTURE_LOSS for _, ident, _ in others):
                break
    finally:
        node.kill()
    streams = sorted({p.stream for p in pdus})
    return Capture(node.port, pdus, others, tcp_sent, streams, until_end, counted, load)


# ---------------------------------------------------------------- helpers


def _requests(pdus: list[Pdu], opcode: int) -> list[Pdu]:
    return [p for p in pdus if p.to_server and p.magic == 0x80 and p.opcode == opcode]


def _server(pdus: list[Pdu], opcode: int) -> list[Pdu]:
    return [p for p in pdus if not p.to_server and p.opcode == opcode]


def _one(pdus: list[Pdu], opcode: int, *, to_server: bool) -> Pdu:
    got = [p for p in pdus if p.to_server == to_server and p.opcode == opcode]
    assert len(got) == 1, f"opcode {opcode:#x}: {len(got)} PDUs (to_server={to_server})"
    return got[0]


def _reply(pdus: list[Pdu], request: Pdu) -> Pdu:
    got = [p for p in pdus if not p.to_server and p.magic == 0x81 and p.opcode == request.opcode
           and p.opaque == request.opaque]  # fmt: skip
    assert len(got) == 1, f"reply to {request.opcode:#x} opaque {request.opaque:#x}: {len(got)}"
    return got[0]


def _change_from_wire(p: Pdu) -> dict[str, Any]:
    """A MUTATION/DELETION as the JSON object `upr tail` prints for it."""
    row: dict[str, Any] = {
        "partition": p.vbucket,
        "seq": str(p.num("couchbase.extras.by_seqno")),
        "op": "mutation" if p.opcode == MUTATION else "deletion",
        "key": p.doc_key().decode(),
        "cas": str(p.num("couchbase.cas")),
        "rev_seq": str(p.num("couchbase.extras.rev_seqno")),
    }
    value = p.value()
    if p.num("couchbase.datatype.snappy"):  # stored or forced compressed (formats/wire.md)
        value = snappy.inflate(value)
    assert p.num("couchbase.datatype.xattr") == 1  # upr load --xattrs: every version has some
    blob, body = xattrs.split(value)
    row["xattrs"] = xattrs.to_json(blob)
    if p.opcode == MUTATION:
        assert p.num("couchbase.datatype.json") == 1  # upr load writes JSON documents
        row["value"] = json.loads(body)
        row["flags"] = p.num("couchbase.extras.flags")
        row["expiry"] = p.num("couchbase.extras.expiration")
        assert p.num("couchbase.extras.lock_time") == 0 and p.num("couchbase.extras.nmeta") == 0
    else:
        assert body == b"" and set(row["xattrs"]) == {"_sync"}  # the tombstone keeps _sync
        assert p.num("couchbase.extras.nmeta") == 0
    return row


def _printed_change(line: dict[str, Any], op: str) -> dict[str, Any]:
    keep = ("partition", "seq", "op", "key", "cas", "rev_seq", "xattrs")
    if op == "mutation":
        keep += ("value", "flags", "expiry")
    return {k: line[k] for k in keep}


def _stream_opaques(pdus: list[Pdu]) -> dict[int, int]:
    return {p.vbucket: p.opaque for p in _requests(pdus, STREAM_REQ)}


# ---------------------------------------------------------------- tests


def test_capture_holds_both_sessions_fully_reassembled(capture: Capture) -> None:
    """Two TCP sessions; every payload byte of the finite one is inside a decoded PDU."""
    assert len(capture.streams) == 2, f"TCP streams with Couchbase PDUs: {capture.streams}"
    first = capture.streams[0]
    for to_server in (True, False):
        decoded = sum(p.wire_size for p in capture.session(0) if p.to_server == to_server)
        assert decoded == capture.tcp_sent[first, to_server], f"to_server={to_server}"
    # The --count session hangs up mid-stream: what the client sent is still whole.
    second = capture.streams[1]
    client = sum(p.wire_size for p in capture.session(1) if p.to_server)
    assert client == capture.tcp_sent[second, True]
    for p in capture.pdus:
        assert p.magic in (0x80, 0x81), f"frame {p.frame}: magic {p.magic:#x}"
        assert p.num("couchbase.total_bodylength") == (
            p.num("couchbase.extras.length") + p.num("couchbase.key.length")
            + p.num("couchbase.value.length")
        )  # fmt: skip


@pytest.mark.parametrize("index", [0, 1], ids=["until_end", "count"])
def test_bootstrap_messages_with_their_fields(capture: Capture, index: int) -> None:
    """HELLO → SASL (list mechs, SCRAM auth, step) → error map → SELECT_BUCKET → config."""
    pdus = capture.session(index)
    order = [p.opcode for p in pdus if p.to_server][:7]
    assert order == [HELLO, SASL_LIST, SASL_AUTH, SASL_STEP, GET_ERROR_MAP, SELECT_BUCKET,
                     GET_CLUSTER_CONFIG]  # fmt: skip
    for request in (p for p in pdus if p.to_server and p.opcode in order):
        assert request.magic == 0x80 and request.vbucket == 0
        assert request.num("couchbase.cas") == 0
        reply = _reply(pdus, request)
        assert reply.status == (AUTH_CONTINUE if request.opcode == SASL_AUTH else 0)

    hello = _one(pdus, HELLO, to_server=True)
    assert hello.text("couchbase.key").startswith("upr/")
    offered = [*map(int, WANTED), int(Feature.SNAPPY), int(Feature.XATTR)]  # the consumer adds
    assert hello.nums("couchbase.hello.features.feature") == offered
    granted = _reply(pdus, hello).nums("couchbase.hello.features.feature")
    assert set(granted) <= set(offered) and 0x07 in granted  # XERROR: the error map follows
    assert Feature.SNAPPY in granted

    mechs = _reply(pdus, _one(pdus, SASL_LIST, to_server=True)).text("couchbase.value")
    assert "SCRAM-SHA512" in mechs.split()
    auth = _one(pdus, SASL_AUTH, to_server=True)
    assert auth.text("couchbase.key") == "SCRAM-SHA512"
    client_first = auth.text("couchbase.value")
    assert client_first.startswith(f"n,,n={USER},r=")
    server_first = _reply(pdus, auth).text("couchbase.value")
    assert server_first.startswith("r=" + client_first.split("r=", 1)[1])
    assert ",s=" in server_first and ",i=" in server_first
    step = _one(pdus, SASL_STEP, to_server=True)
    assert step.text("couchbase.key") == "SCRAM-SHA512"
    client_final = step.text("couchbase.value")
    assert client_final.startswith("c=biws,r=") and ",p=" in client_final
    assert PASSWORD not in client_first + client_final
    assert _reply(pdus, step).text("couchbase.value").startswith("v=")

    errmap = _one(pdus, GET_ERROR_MAP, to_server=True)
    assert errmap.num("couchbase.geterrmap.version") == 2
    assert json.loads(_reply(pdus, errmap).raw("couchbase.value"))["version"] == 2

    assert _one(pdus, SELECT_BUCKET, to_server=True).text("couchbase.key") == "default"
    config_reply = _reply(pdus, _one(pdus, GET_CLUSTER_CONFIG, to_server=True))
    assert config_reply.num("couchbase.datatype.json") == 1
    config = json.loads(config_reply.raw("couchbase.value"))
    assert config["name"] == "default"
    assert len(config["vBucketServerMap"]["vBucketMap"]) == PARTITIONS
    assert "json.object" in config_reply.fields  # tshark handed the config to its JSON dissector


@pytest.mark.parametrize("index", [0, 1], ids=["until_end", "count"])
def test_dcp_open_and_controls(capture: Capture, index: int) -> None:
    """DCP_OPEN as a producer connection, then the CONTROLs, each answered SUCCESS:
    force_value_compression only in the session run with --wire-compression force (by
    default Snappy is negotiated, not forced)."""
    pdus = capture.session(index)
    dcp_open = _one(pdus, DCP_OPEN, to_server=True)
    assert dcp_open.num("couchbase.extras.length") == 8
    assert dcp_open.num("couchbase.extras.seqno") == 0  # the reserved u32
    # producer, IncludeXattrs, IncludeDeletedUserXattrs (formats/wire.md "Xattrs")
    assert dcp_open.num("couchbase.extras.flags") == 0x105
    assert dcp_open.num("couchbase.extras.flags.dcp_connection_type") == 1  # producer
    assert dcp_open.num("couchbase.extras.flags.dcp_include_xattrs") == 1
    for flag in ("dcp_no_value", "dcp_collections", "dcp_include_delete_times"):
        assert dcp_open.num(f"couchbase.extras.flags.{flag}") == 0, flag
    assert dcp_open.key().decode().startswith("upr-tail:")
    assert _reply(pdus, dcp_open).status == 0
    controls = _requests(pdus, CONTROL)
    shown = [(c.key().decode(), c.text("couchbase.value")) for c in controls]
    assert shown == [("connection_buffer_size", str(BUFFER_SIZE)), ("enable_noop", "true"),
                     ("set_noop_interval", "2")] + ([("force_value_compression", "true")]
                                                    if index == 0 else [])  # fmt: skip
    assert all(_reply(pdus, c).status == 0 for c in controls)
    assert all(c.num("couchbase.extras.length") == 0 for c in controls)


@pytest.mark.parametrize("index", [0, 1], ids=["until_end", "count"])
def test_stream_request_per_partition_with_its_extras(capture: Capture, index: int) -> None:
    """GET_ALL_VB_SEQNOS, then one STREAM_REQ per partition: from 0 up to the high seqno
    (--until-end) or forever, uuid 0, empty snapshot; each gets its own opaque."""
    pdus = capture.session(index)
    seqnos = _reply(pdus, _one(pdus, GET_ALL_VB_SEQNOS, to_server=True))
    assert seqnos.num("couchbase.vbucket_states.size") == PARTITIONS
    assert seqnos.num("couchbase.value.length") == 10 * PARTITIONS
    highs = dict(zip(seqnos.nums("couchbase.vbucket_states.id"),
                     seqnos.nums("couchbase.vbucket_states.seqno"), strict=True))  # fmt: skip
    assert sorted(highs) == list(range(PARTITIONS)) and all(highs.values())
    requests = _requests(pdus, STREAM_REQ)
    assert sorted(p.vbucket for p in requests) == list(range(PARTITIONS))
    assert len({p.opaque for p in requests}) == PARTITIONS
    for p in requests:
        assert p.num("couchbase.extras.length") == 48
        assert p.num("couchbase.key.length") == 0 and p.num("couchbase.value.length") == 0
        expected_end = highs[p.vbucket] if index == 0 else STREAM_FOREVER
        assert {
            name: p.num(f"couchbase.extras.{name}")
            for name in ("flags", "reserved", "start_seqno", "end_seqno", "vbucket_uuid",
                         "snap_start_seqno", "snap_end_seqno")
        } == {"flags": ACTIVE_VB_ONLY, "reserved": 0, "start_seqno": 0, "end_seqno": expected_end,
              "vbucket_uuid": 0, "snap_start_seqno": 0, "snap_end_seqno": 0}  # fmt: skip


ACTIVE_VB_ONLY = 0x10  # docs/protocol.md §2.2: clients stream the active copy only


@pytest.mark.parametrize("index", [0, 1], ids=["until_end", "count"])
def test_stream_request_success_carries_the_failover_log_tail_printed(
    capture: Capture, index: int
) -> None:
    """Every STREAM_REQ gets SUCCESS with a failover log: the one `tail -v` printed."""
    pdus = capture.session(index)
    lines = capture.until_end if index == 0 else capture.counted
    printed = {e["partition"]: [(int(u), int(s)) for u, s in e["failover_log"]]
               for e in lines if e.get("event") == "stream_open"}  # fmt: skip
    assert sorted(printed) == list(range(PARTITIONS))
    for request in _requests(pdus, STREAM_REQ):
        reply = _reply(pdus, request)
        assert reply.status == 0 and reply.num("couchbase.extras.length") == 0
        size = reply.num("couchbase.dcp.failover_log.size")
        assert size >= 1 and reply.num("couchbase.value.length") == 16 * size
        log = list(zip(reply.nums("couchbase.dcp.failover_log.vbucket_uuid"),
                       reply.nums("couchbase.dcp.failover_log.seqno"), strict=True))  # fmt: skip
        assert len(log) == size and log == printed[request.vbucket]
        assert all(uuid != 0 for uuid, _ in log)


def test_every_change_tail_printed_is_one_decoded_mutation_or_deletion(capture: Capture) -> None:
    """MUTATION/DELETION PDUs of the finite session = tail's change lines, field by field,
    value by value, in the same order (PDUs counted after reassembly, not frames)."""
    pdus = capture.session(0)
    wire = [
        _change_from_wire(p) for p in pdus if not p.to_server and p.opcode in (MUTATION, DELETION)
    ]
    lines = [line for line in capture.until_end if "event" not in line]  # the changes
    printed = [_printed_change(line, line["op"]) for line in lines]
    assert len(wire) == len(printed)
    assert wire == printed
    ops = Counter(line["op"] for line in lines)
    assert ops["mutation"] > 0 and ops["deletion"] > 0
    assert ops["mutation"] == capture.load["created"] - capture.load["deletes"]
    assert ops["deletion"] == capture.load["deletes"]
    for p in _server(pdus, MUTATION):
        assert p.num("couchbase.extras.length") == 31 and p.num("couchbase.cas") != 0
    for p in _server(pdus, DELETION):
        assert p.num("couchbase.extras.length") == 18 and p.num("couchbase.cas") != 0


def test_snapshot_markers_and_stream_ends_match_tail(capture: Capture) -> None:
    """SNAPSHOT_MARKER (start, end, flags) and STREAM_END (status) as tail -v printed them;
    every DCP message of a partition carries its STREAM_REQ's opaque."""
    pdus = capture.session(0)
    opaques = _stream_opaques(pdus)
    markers = _server(pdus, SNAPSHOT_MARKER)
    wire_markers = []
    for p in markers:
        assert p.magic == 0x80 and p.num("couchbase.extras.length") == 20
        flags = p.num("couchbase.extras.flags")
        bits = {name: p.num(f"couchbase.extras.flags.dcp_snapshot_marker_{name}")
                for name in ("memory", "disk", "chk", "ack")}  # fmt: skip
        assert bits == {"memory": flags & 1, "disk": flags >> 1 & 1, "chk": flags >> 2 & 1,
                        "ack": flags >> 3 & 1}  # fmt: skip
        wire_markers.append((p.vbucket, p.num("couchbase.extras.start_seqno"),
                             p.num("couchbase.extras.end_seqno"), flags))  # fmt: skip
    printed = [(e["partition"], int(e["start"]), int(e["end"]), e["flags"])
               for e in capture.until_end if e.get("event") == "snapshot"]  # fmt: skip
    assert wire_markers == printed
    assert {vb for vb, *_ in wire_markers} == set(range(PARTITIONS))

    ends = _server(pdus, STREAM_END)
    assert sorted(p.vbucket for p in ends) == list(range(PARTITIONS))
    printed_ends = {e["partition"]: e for e in capture.until_end if e.get("event") == "stream_end"}
    ends_at = {p.vbucket: p.num("couchbase.extras.end_seqno") for p in _requests(pdus, STREAM_REQ)}
    for p in ends:
        assert p.num("couchbase.extras.length") == 4
        # Quirk (test_tshark.py): tshark 4.0 leaves STREAM_END extras undecoded; raw u32.
        status = int.from_bytes(p.raw("couchbase.extras.unknown"), "big")
        assert status == printed_ends[p.vbucket]["status"] == 0  # 0 = OK, end reached
        assert int(printed_ends[p.vbucket]["seq"]) == ends_at[p.vbucket]

    for p in pdus:
        if not p.to_server and p.opcode in FLOW_CONTROLLED:
            assert p.opaque == opaques[p.vbucket], f"frame {p.frame}"
    # Per partition: marker, then its changes, then STREAM_END last.
    for vb in range(PARTITIONS):
        kinds = [p.opcode for p in pdus if not p.to_server and p.opcode in FLOW_CONTROLLED
                 and p.vbucket == vb]  # fmt: skip
        assert kinds[0] == SNAPSHOT_MARKER and kinds[-1] == STREAM_END
        assert kinds.count(STREAM_END) == 1


def test_buffer_acks_acknowledge_only_bytes_received(capture: Capture) -> None:
    """BUFFER_ACK (bytes_to_ack, opaque 0, no reply): at least one in a ~2 MB session, and
    never more than the flow-controlled bytes the producer had sent so far
    (docs/protocol.md §7.1)."""
    pdus = capture.session(0)
    sent = acked = 0
    acks = 0
    for p in pdus:
        if not p.to_server and p.opcode in FLOW_CONTROLLED:
            sent += p.wire_size
        elif p.to_server and p.opcode == BUFFER_ACK:
            acks += 1
            assert p.num("couchbase.extras.length") == 4 and p.opaque == 0
            assert p.num("couchbase.key.length") == 0 and p.num("couchbase.value.length") == 0
            value = p.num("couchbase.extras.bytes_to_ack")
            assert value >= BUFFER_SIZE // 5
            acked += value
            assert acked <= sent, f"frame {p.frame}: acked {acked} of {sent} bytes sent"
    assert acks >= 1, f"no BUFFER_ACK for {sent} flow-controlled bytes"
    assert not [p for p in pdus if not p.to_server and p.opcode == BUFFER_ACK]
    # NOOPs are unlikely in a session this short (2 s interval); any must be answered.
    for noop in [p for p in pdus if not p.to_server and p.magic == 0x80 and p.opcode == NOOP]:
        answers = [p for p in pdus if p.to_server and p.magic == 0x81 and p.opcode == NOOP
                   and p.opaque == noop.opaque]  # fmt: skip
        assert len(answers) == 1 and answers[0].status == 0


def test_count_session_prints_the_first_changes_on_the_wire(capture: Capture) -> None:
    """`tail --count 5` printed exactly the first five MUTATION/DELETION PDUs it received."""
    pdus = capture.session(1)
    wire = [
        _change_from_wire(p) for p in pdus if not p.to_server and p.opcode in (MUTATION, DELETION)
    ]
    changes = [line for line in capture.counted if "event" not in line]
    printed = [_printed_change(line, line["op"]) for line in changes]
    assert len(printed) == 5
    assert wire[:5] == printed
    opaques = _stream_opaques(pdus)
    for p in pdus:
        if not p.to_server and p.opcode in FLOW_CONTROLLED:
            assert p.opaque == opaques[p.vbucket], f"frame {p.frame}"


def _allowed(p: Pdu) -> set[tuple[str, str]]:
    quirks = EXPECTED_QUIRKS.get((p.magic, p.opcode), set())
    if p.num("couchbase.datatype") & SNAPPY_XATTRS == SNAPPY_XATTRS:
        return quirks | {SNAPPY_XATTR_QUIRK}
    return quirks


def test_no_expert_info_beyond_the_dissector_quirks(capture: Capture) -> None:
    """No couchbase.warn.*, _ws.expert or _ws.malformed item except EXPECTED_QUIRKS."""
    unexpected = [
        (p.frame, f"{p.magic:#x}/{p.opcode:#x}", ident, message)
        for p in capture.pdus
        for ident, message in p.experts
        if (ident, message) not in _allowed(p)
    ]
    assert unexpected == []
    # Belt and braces: no couchbase.warn.* field outside an expert item we allowed.
    warned = [
        (p.frame, name)
        for p in capture.pdus
        for name in p.fields
        if name.startswith("couchbase.warn") and name not in {ident for ident, _ in p.experts}
    ]
    assert warned == []
    # The same quirk may read a garbage pair length past the value's end: the exception
    # is reported as a malformed layer of the frame holding that PDU.
    quirky = {p.frame for p in capture.pdus if SNAPPY_XATTR_QUIRK in p.experts or
              p.num("couchbase.datatype") & SNAPPY_XATTRS == SNAPPY_XATTRS}  # fmt: skip
    outside = [
        e for e in capture.other_experts
        if (not e[1].startswith(TCP_NOTES) or e[1] in CAPTURE_LOSS)
        and not (e[1].startswith("_ws.malformed") and e[0] in quirky)
    ]  # fmt: skip
    assert outside == [], outside
    # The quirks do show up where expected (so the allow-list is not stale).
    seen = {(p.magic, p.opcode) for p in capture.pdus if p.experts}
    assert seen == set(EXPECTED_QUIRKS)
    # ... and every value with xattrs was on the wire: plain ones decoded without a
    # warning, compressed ones (the quirk) checked by content
    bits = Counter(p.num("couchbase.datatype") for p in capture.pdus if p.opcode == MUTATION)
    assert bits[0x05] + bits[0x07] == sum(bits.values()) and bits[0x07] > 0
