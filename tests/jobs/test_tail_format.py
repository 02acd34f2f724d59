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
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_EXPIRATION, OP_MUTATION, DcpRecord
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


SYNC = xattrs.encode({"_sync": '{"rev": "2-b", "seq": 9}', "meta": '"x"', "n": "[1, 2]"})


def test_xattrs_are_an_object_only_when_the_change_has_some() -> None:
    with_x = json.loads(json_line(row(b"k")._replace(xattrs=SYNC)))
    assert with_x["xattrs"] == {"_sync": {"rev": "2-b", "seq": 9}, "meta": "x", "n": [1, 2]}
    assert with_x["value"] == {"a": 1, "b": [True, None]}  # the body alone
    # the convention is upr's fields; xattrs hold the document's own data as it is
    assert not problems({k: v for k, v in with_x.items() if k != "xattrs"})
    assert "xattrs" not in json.loads(json_line(row(b"k")))
    # a binary body and a non-UTF-8 key keep their own fields beside the xattrs
    odd = json.loads(json_line(row(b"\xff", b"\x00", datatype=0)._replace(xattrs=SYNC)))
    assert base64.b64decode(odd["value_b64"]) == b"\x00" and odd["xattrs"]["meta"] == "x"
    assert base64.b64decode(odd["key_b64"]) == b"\xff"


def test_tombstones_show_the_xattrs_they_kept() -> None:
    kept = xattrs.system_only(SYNC)
    for op, name in ((OP_DELETION, "deletion"), (OP_EXPIRATION, "expiration")):
        gone = row(b"gone", b"", datatype=0, op=op)._replace(xattrs=kept)
        obj = json.loads(json_line(gone))
        assert obj["op"] == name and "value" not in obj
        assert obj["xattrs"] == {"_sync": {"rev": "2-b", "seq": 9}}
        assert text_line(gone).endswith(f"{name} key=gone cas={2**64 - 1} rev=3 xattrs=_sync")


def test_text_lines_name_the_xattrs_before_the_value() -> None:
    line = text_line(row(b"k")._replace(xattrs=SYNC))
    assert " xattrs=_sync,meta,n value={" in line
    assert "xattrs" not in text_line(row(b"k"))


@given(st.dictionaries(st.text(min_size=1, max_size=15).filter(lambda n: "\0" not in n),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                                    lambda c: st.lists(c) | st.dictionaries(st.text(), c),
                                    max_leaves=5), max_size=4))  # fmt: skip
def test_any_xattrs_give_one_valid_json_object(found: dict[str, object]) -> None:
    rec = row(b"k")._replace(xattrs=xattrs.from_json(found))
    assert json.loads(json_line(rec)).get("xattrs", {}) == found


def test_partition_lists() -> None:
    assert parse_partitions("0-3,9,2") == [0, 1, 2, 3, 9]
