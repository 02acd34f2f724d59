"""`upr tail` line formats: valid JSON for any key, the value spliced only when it is JSON."""

from __future__ import annotations

import base64
import json

from hypothesis import given
from hypothesis import strategies as st

from tests.cli.json_convention import problems
from upr_cli.dcp.events import Rollback, Snapshot, StreamEnded, StreamOpened
from upr_cli.jobs.tail import event_line, json_line, text_line
from upr_cli.position import StreamPosition
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.source import parse_partitions

DOC = b'{"a":1,"b":[true,null]}'


def row(key: bytes, value: bytes = DOC, datatype: int = 1, op: int = OP_MUTATION) -> DcpRecord:
    return DcpRecord(
        opcode=op,
        vbucket=7,
        by_seqno=42,
        rev_seqno=3,
        cas=2**64 - 1,
        flags=9,
        expiration=100,
        delete_time=0,
        datatype=datatype,
        key=memoryview(key),
        value=memoryview(value),
        opaque=1,
    )


@given(st.binary(max_size=40), st.binary(max_size=60))
def test_any_key_and_raw_value_give_one_valid_json_object(key: bytes, value: bytes) -> None:
    obj = json.loads(json_line(row(key, value, datatype=0)))
    assert obj["partition"] == 7 and obj["seq"] == "42" and obj["op"] == "mutation"
    assert obj["cas"] == str(2**64 - 1) and obj["rev_seq"] == "3" and obj["flags"] == 9
    assert base64.b64decode(obj["value_b64"]) == value
    try:
        assert obj["key"] == key.decode()
    except UnicodeDecodeError:
        assert base64.b64decode(obj["key_b64"]) == key


def test_json_values_are_spliced_as_documents() -> None:
    obj = json.loads(json_line(row(b'k"\\', DOC)))
    assert obj["value"] == {"a": 1, "b": [True, None]} and obj["key"] == 'k"\\'
    snappy = json.loads(json_line(row(b"k", b"\x01\x02", datatype=0x03)))
    assert "value_b64" in snappy


def test_deletions_have_no_value() -> None:
    obj = json.loads(json_line(row(b"gone", b"", datatype=0, op=OP_DELETION)))
    assert obj["op"] == "deletion" and "value" not in obj and "value_b64" not in obj
    assert "deletion key=gone" in text_line(row(b"gone", b"", datatype=0, op=OP_DELETION))


def test_change_and_event_lines_follow_the_json_convention() -> None:
    big = 2**64 - 2
    rec = row(b"k")._replace(by_seqno=big, rev_seqno=big)
    assert not problems(json.loads(json_line(rec)))
    assert json.loads(json_line(rec))["seq"] == str(big)
    at = StreamPosition(7, 0xA, big, big, big)
    events = [
        StreamOpened(7, ((0xA, big),), at),
        Snapshot(7, big - 1, big, 1),
        Rollback(7, at, big - 5, 0xA, big - 3),
        StreamEnded(7, 0, at),
    ]
    for ev in events:
        obj = json.loads(event_line(ev, "json") or "")
        assert not problems(obj), obj
        seqs = {k: v for k, v in obj.items() if k in ("seq", "start", "end") or k.endswith("_seq")}
        assert seqs and all(v == str(int(v)) for v in seqs.values()), obj
    assert "start=18446744073709551613" in (event_line(events[1], "text") or "")


def test_partition_lists() -> None:
    assert parse_partitions("0-3,9,2") == [0, 1, 2, 3, 9]
