"""The sub-document engine (formats/subdoc.md), without a server: paths, request
validation with kv_engine's statuses, every lookup and mutation spec, the macros and
virtual xattrs, the response layouts (against bytes the official SDK exchanged with
`upr serve`), and the bucket rules of `subdoc_kv` on an in-process node."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from tests.dcp.inprocess import InProcessNode, nodes, run
from upr_cli.node import subdoc, subdoc_kv
from upr_cli.node.bucket import unpacked
from upr_cli.node.subdoc import Code, Document, Spec, SpecFailed, SubdocError
from upr_cli.protocol import xattrs
from upr_cli.protocol.status import KeyExists, KeyNotFound
from upr_cli.protocol.subdoc import (
    ACCESS_DELETED,
    ADD,
    EXPAND_MACROS,
    MKDIR_P,
    MKDOC,
    XATTR_PATH,
    SpecOp,
)

X = XATTR_PATH
MACRO = X | MKDIR_P | EXPAND_MACROS  # what the SDK sends for MutationMacro.cas()


def _path(text: str) -> list[Any] | Code:
    try:
        return subdoc.parse_path(text)
    except subdoc._PathError as exc:
        return exc.status


def _mut(*specs: tuple[SpecOp, int, str, bytes]) -> bytes:
    return b"".join(struct.pack(">BBHI", op, fl, len(p.encode()), len(v)) + p.encode() + v
                    for op, fl, p, v in specs)  # fmt: skip


def _look(*specs: tuple[SpecOp, int, str]) -> bytes:
    return b"".join(
        struct.pack(">BBH", op, fl, len(p.encode())) + p.encode() for op, fl, p in specs
    )


def _req(*specs: tuple[SpecOp, int, str, bytes], flags: int = 0, mutation: bool = True,
         expiry: int | None = None) -> subdoc.Request:  # fmt: skip
    extras = (struct.pack(">I", expiry) if expiry is not None else b"") + (
        bytes([flags]) if flags or expiry is not None else b""
    )
    if mutation:
        return subdoc.parse_request(mutation=True, extras=extras, value=_mut(*specs))
    value = _look(*((op, fl, p) for op, fl, p, _ in specs))
    return subdoc.parse_request(mutation=False, extras=extras, value=value)


def _doc(body: Any, blob: dict[str, Any] | None = None, **kw: Any) -> Document:
    """A live JSON document with the xattrs `blob`."""
    return Document(body=json.dumps(body).encode(), json=True, blob=xattrs.from_json(blob or {}),
                    **kw)  # fmt: skip


def _refused(mutation: bool, extras: bytes, value: bytes, **kw: Any) -> int:
    """The status `parse_request` refuses a request with."""
    return _status(lambda: subdoc.parse_request(mutation=mutation, extras=extras, value=value,
                                                **kw))  # fmt: skip


def _status(call: Any) -> int:
    with pytest.raises(SubdocError) as err:
        call()
    return err.value.code


# -- CRC32C and paths -----------------------------------------------------------------


def test_crc32c_is_castagnoli() -> None:
    assert subdoc.crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert subdoc.crc32c(b"") == 0


@pytest.mark.parametrize(("text", "parts"), [
    ("a", ["a"]), ("a.b[0].c", ["a", "b", 0, "c"]), ("arr[-1]", ["arr", -1]),
    ("[2][0]", [2, 0]), ("`a.b`.c", ["a.b", "c"]), ("`back``tick`", ["back`tick"]),
    ("x.`[1]`", ["x", "[1]"]), ('`say.\\"hi\\"`', ['say."hi"']), ("", []),
    ("ünï.cödé", ["ünï", "cödé"]),
])  # fmt: skip
def test_paths_parse(text: str, parts: list[Any]) -> None:
    assert _path(text) == parts


@pytest.mark.parametrize("text", ["a..b", ".a", "a.", "a[x]", "a[-2]", "a[1", "`open",
                                  "a]b", "a[0]b", "a.[0]", "a[]"])  # fmt: skip
def test_bad_paths_are_path_einval(text: str) -> None:
    assert _path(text) == Code.PATH_EINVAL


def test_too_many_components_are_path_e2big() -> None:
    assert _path(".".join("a" * 32)) == ["a"] * 32
    assert _path(".".join("a" * 33)) == Code.PATH_E2BIG


@pytest.mark.parametrize(("key", "ok"), [
    ("_sync", True), ("meta", True), ("$document", True), ("a" * 15, True), ("a" * 16, False),
    ("_", False), ("", False), ("!bang", False), (".dot", False), ("\x01ctl", False),
    ("ünïcode", True), ("sp ace", True),
])  # fmt: skip
def test_xattr_names_follow_kv_engines_validator(key: str, ok: bool) -> None:
    assert subdoc.valid_xattr_key(key) is ok
    if ok:
        assert subdoc.xattr_key(f"{key}.inner[0]") == subdoc.xattr_key(f"{key}[1]") == key


# -- validation (top-level statuses) -------------------------------------------------


def test_extras_and_document_flags() -> None:
    get = _look((SpecOp.GET, 0, "a"))
    for extras, code in ((b"\0\0", Code.EINVAL), (b"\0\0\0\0", Code.EINVAL),
                         (b"\x40", Code.EINVAL), (b"\x08", Code.NOT_SUPPORTED),
                         (b"\x20", Code.NOT_SUPPORTED), (b"\x01", Code.EINVAL)):  # fmt: skip
        assert _refused(False, extras, get) == code
    up = _mut((SpecOp.DICT_UPSERT, 0, "a", b"1"))
    req = subdoc.parse_request(mutation=True, extras=b"\0\0\0\x05\x01", value=up)
    assert (req.expiry, req.doc_flags) == (5, MKDOC)
    assert _refused(True, b"\x03", up) == Code.EINVAL  # Add and Mkdoc
    assert _refused(True, b"\x02", up, cas=7) == Code.EINVAL  # Add with a CAS


@pytest.mark.parametrize(("specs", "mutation", "code"), [
    ([(SpecOp.GET, 0, "a", b"")], True, Code.INVALID_COMBO),  # a lookup in a mutation
    ([(SpecOp.DICT_UPSERT, 0, "a", b"1")], False, Code.INVALID_COMBO),
    ([(SpecOp.DICT_UPSERT, 0x40, "a", b"1")], True, Code.EINVAL),  # a flag it does not take
    ([(SpecOp.DELETE, MKDIR_P, "a", b"")], True, Code.EINVAL),
    ([(SpecOp.DICT_UPSERT, EXPAND_MACROS, "a", b'"${Mutation.CAS}"')], True,
     Code.XATTR_INVALID_FLAG_COMBO),
    ([(SpecOp.DICT_UPSERT, X, "!a", b"1")], True, Code.XATTR_EINVAL),
    ([(SpecOp.DICT_UPSERT, X, "$document.x", b"1")], True, Code.XATTR_CANT_MODIFY_VATTR),
    ([(SpecOp.DICT_UPSERT, MACRO, "_s", b'"${Mutation.nope}"')], True, Code.XATTR_UNKNOWN_MACRO),
    ([(SpecOp.DICT_UPSERT, MACRO, "_s", b'{"c":"${Mutation.CAS}"}')], True,
     Code.XATTR_UNKNOWN_MACRO),  # the whole value is the macro
    ([(SpecOp.GET_DOC, 0, "a", b"")], False, Code.EINVAL),  # a whole-document path
    ([(SpecOp.GET, 0, "", b"")], False, Code.EINVAL),  # GET needs a path
    ([(SpecOp.DICT_UPSERT, 0, "a", b"")], True, Code.EINVAL),  # no value
    ([(SpecOp.DELETE, 0, "a", b"1")], True, Code.EINVAL),  # a value it does not take
    ([(SpecOp.GET, 0, "a", b""), (SpecOp.GET, X, "_s", b"")], False, Code.INVALID_XATTR_ORDER),
    ([(SpecOp.DELETE_DOC, 0, "", b""), (SpecOp.DICT_UPSERT, X, "_s", b"1")], True,
     Code.INVALID_COMBO),  # nothing after DELETE_DOC
    ([(SpecOp.DICT_UPSERT, 0, "a", b"1"), (SpecOp.DELETE_DOC, 0, "", b"")], True,
     Code.INVALID_COMBO),  # DELETE_DOC after a body spec
    ([(SpecOp.GET, 0, "a", b"")] * 17, False, Code.INVALID_COMBO),
    ([], False, Code.INVALID_COMBO),
])  # fmt: skip
def test_requests_kv_engine_refuses(specs: list[Any], mutation: bool, code: Code) -> None:
    assert _status(lambda: _req(*specs, mutation=mutation)) == code


def test_document_flags_per_spec_and_xattrs_need_hello() -> None:
    set_doc = (SpecOp.SET_DOC, 0, "", b"{}")
    assert _status(lambda: _req(set_doc, flags=ACCESS_DELETED)) == Code.EINVAL
    assert _status(lambda: _req((SpecOp.REPLACE, 0, "a", b"1"), flags=MKDOC)) == Code.EINVAL
    assert _req((SpecOp.REPLACE, 0, "a", b"1"), flags=ADD).doc_flags == ADD
    look = _look((SpecOp.GET, X, "_s"))
    assert _refused(False, b"", look, xattrs_enabled=False) == Code.NOT_SUPPORTED
    truncated = _mut((SpecOp.DICT_UPSERT, 0, "abc", b"1"))[:-2]
    assert _refused(True, b"", truncated) == Code.EINVAL
    unknown = struct.pack(">BBH", 0xE0, 0, 1) + b"a"
    assert _refused(False, b"", unknown) == Code.INVALID_COMBO
    assert len(_req(*[(SpecOp.GET, 0, "a", b"")] * 16, mutation=False).specs) == 16


# -- lookups --------------------------------------------------------------------------

BODY = {"name": "d", "tags": ["a", "b"], "n": 5, "o": {"k": None}}
BLOB = {"_sync": {"rev": "1-a", "seq": 3}, "meta": {"by": "u"}}


def test_lookups_of_the_body_and_xattrs() -> None:
    doc = _doc(BODY, BLOB, cas=0x0102030405060708, seqno=9, rev_seq=4, flags=7,
               datatype=0x05, vbucket_uuid=0xABC)  # fmt: skip
    req = _req((SpecOp.GET, X, "_sync.rev", b""), (SpecOp.EXISTS, X, "meta.nope", b""),
               (SpecOp.GET_COUNT, X, "_sync", b""), (SpecOp.GET, X, "$document.revid", b""),
               (SpecOp.GET, X, "$XTOC", b""), (SpecOp.GET, 0, "tags[-1]", b""),
               (SpecOp.EXISTS, 0, "o.k", b""), (SpecOp.GET_COUNT, 0, "", b""),
               (SpecOp.GET, 0, "n.x", b""), (SpecOp.GET, 0, "a..b", b""),
               (SpecOp.GET_DOC, 0, "", b""), mutation=False)  # fmt: skip
    got = subdoc.lookup(req, doc)
    assert got == [(0, b'"1-a"'), (Code.PATH_ENOENT, b""), (0, b"2"), (0, b'"4"'),
                   (0, b'["_sync","meta"]'), (0, b'"b"'), (0, b""), (0, b"4"),
                   (Code.PATH_MISMATCH, b""), (Code.PATH_EINVAL, b""), (0, doc.body)]  # fmt: skip
    assert subdoc.lookup_status(got, False) == Code.MULTI_PATH_FAILURE
    assert subdoc.lookup_status(got, True) == Code.MULTI_PATH_FAILURE_DELETED
    assert subdoc.lookup_status(got[:1], True) == Code.SUCCESS_DELETED
    assert subdoc.lookup_body(got[:2]) == b'\0\0\0\0\0\x05"1-a"\0\xc0\0\0\0\0'


def test_the_document_virtual_xattr() -> None:
    doc = _doc(BODY, BLOB, cas=0x18EB9F3FF66C5405, seqno=3, rev_seq=3, flags=0x02000000,
               expiry=1_900_000_000, datatype=0x07, vbucket_uuid=0x79659395E5C9)  # fmt: skip
    ((status, value),) = subdoc.lookup(_req((SpecOp.GET, X, "$document", b""), mutation=False), doc)
    assert status == 0 and json.loads(value) == {
        "CAS": "0x18eb9f3ff66c5405", "vbucket_uuid": "0x000079659395e5c9",
        "seqno": "0x0000000000000003", "revid": "3", "exptime": 1_900_000_000,
        "flags": 0x02000000, "value_bytes": len(doc.body), "datatype": ["json", "snappy", "xattr"],
        "deleted": False, "last_modified": str(0x18EB9F3FF66C5405 // 10**9),
        "value_crc32c": f"0x{subdoc.crc32c(doc.body):08x}",
    }  # fmt: skip
    req = _req((SpecOp.GET, X, "$document.exptime", b""), (SpecOp.GET, X, "$vbucket.HLC.mode", b""),
               (SpecOp.GET, X, "$nope", b""), mutation=False)  # fmt: skip
    assert subdoc.lookup(req, doc) == [(0, b"1900000000"), (0, b'"real"'),
                                       (Code.XATTR_UNKNOWN_VATTR, b"")]  # fmt: skip


def test_lookups_of_a_body_that_is_not_json_or_is_missing() -> None:
    raw = Document(body=b"plain text", json=False)
    req = _req((SpecOp.GET, 0, "a", b""), (SpecOp.GET_DOC, 0, "", b""), mutation=False)
    assert subdoc.lookup(req, raw) == [(Code.DOC_NOT_JSON, b""), (0, b"plain text")]
    tomb = Document(body=b"", json=False, blob=xattrs.from_json({"_s": 1}), deleted=True)
    req = _req((SpecOp.GET, X, "_s", b""), (SpecOp.GET_DOC, 0, "", b""), mutation=False)
    assert subdoc.lookup(req, tomb) == [(0, b"1"), (Code.PATH_ENOENT, b"")]
    deep = Document(body=b"[" * 33 + b"]" * 33, json=True)
    assert subdoc.lookup(_req((SpecOp.GET_COUNT, 0, "", b""), mutation=False), deep) == [
        (Code.DOC_E2DEEP, b"")]  # fmt: skip


# -- mutations ------------------------------------------------------------------------


def _apply(doc: Document, *specs: tuple[SpecOp, int, str, bytes], flags: int = 0,
           cas: int = 1, seqno: int = 1) -> subdoc.Outcome:  # fmt: skip
    return subdoc.mutate(_req(*specs, flags=flags), doc, cas=cas, seqno=seqno)


def test_every_body_mutation() -> None:
    out = _apply(_doc(BODY),
                 (SpecOp.DICT_ADD, 0, "new", b'{"x":1}'), (SpecOp.DICT_UPSERT, 0, "name", b'"e"'),
                 (SpecOp.REPLACE, 0, "tags[0]", b'"z"'), (SpecOp.DELETE, 0, "o.k", b""),
                 (SpecOp.ARRAY_PUSH_LAST, 0, "tags", b'"c", 1'),
                 (SpecOp.ARRAY_PUSH_FIRST, 0, "tags", b"0"),
                 (SpecOp.ARRAY_INSERT, 0, "tags[1]", b'"i"'),
                 (SpecOp.ARRAY_ADD_UNIQUE, 0, "tags", b'"u"'),
                 (SpecOp.COUNTER, 0, "n", b"-2"), (SpecOp.COUNTER, 0, "fresh", b"10"),
                 (SpecOp.DICT_UPSERT, MKDIR_P, "p.q.r", b"true"))  # fmt: skip
    assert json.loads(out.body) == {
        "name": "e", "tags": [0, "i", "z", "b", "c", 1, "u"], "n": 3, "o": {},
        "new": {"x": 1}, "fresh": 10, "p": {"q": {"r": True}},
    }  # fmt: skip
    assert list(json.loads(out.body)) == ["name", "tags", "n", "o", "new", "fresh", "p"]  # order
    assert out.results == [(8, b"3"), (9, b"10")]  # what the counters answered
    assert out.json and not out.deleted and out.blob == b""
    assert subdoc.mutation_body(out.results) == b"\x08\0\0\0\0\0\x013\x09\0\0\0\0\0\x0210"


@pytest.mark.parametrize(("spec", "code"), [
    ((SpecOp.DICT_ADD, 0, "n", b"1"), Code.PATH_EEXISTS),
    ((SpecOp.DICT_UPSERT, 0, "x.y", b"1"), Code.PATH_ENOENT),  # no MKDIR_P
    ((SpecOp.DICT_UPSERT, 0, "tags.x", b"1"), Code.PATH_MISMATCH),
    ((SpecOp.DICT_UPSERT, 0, "tags[0]", b"1"), Code.PATH_EINVAL),
    ((SpecOp.DICT_UPSERT, 0, "a", b"{nope"), Code.VALUE_CANTINSERT),
    ((SpecOp.REPLACE, 0, "missing", b"1"), Code.PATH_ENOENT),
    ((SpecOp.DELETE, 0, "tags[5]", b""), Code.PATH_ENOENT),
    ((SpecOp.ARRAY_PUSH_LAST, 0, "o", b"1"), Code.PATH_MISMATCH),
    ((SpecOp.ARRAY_PUSH_LAST, 0, "nothing", b"1"), Code.PATH_ENOENT),
    ((SpecOp.ARRAY_INSERT, 0, "tags[3]", b"1"), Code.PATH_ENOENT),
    ((SpecOp.ARRAY_INSERT, 0, "tags[-1]", b"1"), Code.PATH_EINVAL),
    ((SpecOp.ARRAY_INSERT, 0, "tags", b"1"), Code.PATH_EINVAL),
    ((SpecOp.ARRAY_ADD_UNIQUE, 0, "tags", b'"a"'), Code.PATH_EEXISTS),
    ((SpecOp.ARRAY_ADD_UNIQUE, 0, "tags", b"[1]"), Code.VALUE_CANTINSERT),
    ((SpecOp.ARRAY_ADD_UNIQUE, 0, "tags", b"1, 2"), Code.VALUE_CANTINSERT),
    ((SpecOp.COUNTER, 0, "name", b"1"), Code.PATH_MISMATCH),
    ((SpecOp.COUNTER, 0, "n", b"0"), Code.DELTA_EINVAL),
    ((SpecOp.COUNTER, 0, "n", b"1.5"), Code.DELTA_EINVAL),
    ((SpecOp.COUNTER, 0, "n", b"9223372036854775808"), Code.DELTA_EINVAL),
    ((SpecOp.COUNTER, 0, "n", b"9223372036854775807"), Code.VALUE_CANTINSERT),  # overflow
    ((SpecOp.COUNTER, 0, "big", b"1"), Code.NUM_ERANGE),
    ((SpecOp.DICT_UPSERT, 0, "deep", b"[" * 32 + b"]" * 32), Code.VALUE_ETOODEEP),
])  # fmt: skip
def test_a_failing_spec_is_reported_with_its_index(spec: Any, code: Code) -> None:
    doc = _doc({**BODY, "big": 2**64})
    with pytest.raises(SpecFailed) as failed:
        _apply(doc, (SpecOp.DICT_UPSERT, 0, "ok", b"1"), spec, (SpecOp.DELETE, 0, "zzz", b""))
    assert (failed.value.index, failed.value.status) == (1, code)
    assert subdoc.failure_body(failed.value) == bytes([1]) + struct.pack(">H", code)


def test_xattrs_are_one_object_by_name_and_fail_first() -> None:
    doc = _doc(BODY, BLOB)
    out = _apply(doc, (SpecOp.DICT_UPSERT, X | MKDIR_P, "txn.id", b'"t1"'),
                 (SpecOp.DELETE, X, "meta", b""), (SpecOp.COUNTER, X, "_sync.seq", b"1"),
                 (SpecOp.DICT_UPSERT, 0, "n", b"6"))  # fmt: skip
    assert xattrs.to_json(out.blob) == {"_sync": {"rev": "1-a", "seq": 4}, "txn": {"id": "t1"}}
    assert [n for n, _ in xattrs.pairs(out.blob)] == ["_sync", "txn"]  # stored order kept
    assert json.loads(out.body)["n"] == 6 and out.results == [(2, b"4")]
    with pytest.raises(SpecFailed) as failed:  # both phases fail: the xattr spec comes first
        _apply(doc, (SpecOp.DICT_ADD, X, "_sync", b"1"), (SpecOp.DICT_ADD, 0, "n", b"1"))
    assert (failed.value.index, failed.value.status) == (0, Code.PATH_EEXISTS)
    with pytest.raises(SpecFailed) as failed:
        _apply(doc, (SpecOp.DICT_UPSERT, X, "txn.id", b"1"))  # no MKDIR_P
    assert failed.value.status == Code.PATH_ENOENT
    out = _apply(doc, (SpecOp.DELETE, X, "_sync", b""), (SpecOp.DELETE, X, "meta", b""))
    assert out.blob == b""  # the last xattr gone: no blob


def test_mkdoc_and_add_imply_mkdir_p() -> None:
    req = _req((SpecOp.DICT_UPSERT, X, "_s.a.b", b"1"), (SpecOp.DICT_UPSERT, 0, "x.y", b"2"),
               flags=MKDOC)  # fmt: skip
    out = subdoc.mutate(req, subdoc.new_document(req), cas=1, seqno=1)
    assert xattrs.to_json(out.blob) == {"_s": {"a": {"b": 1}}} and json.loads(out.body) == {
        "x": {"y": 2}
    }


@pytest.mark.parametrize(("specs", "body"), [
    ([(SpecOp.DICT_UPSERT, X, "_s", b"1")], b"{}"),  # xattrs alone make an empty object
    ([(SpecOp.ARRAY_PUSH_LAST, 0, "", b"1")], b"[1]"),
    ([(SpecOp.ARRAY_PUSH_FIRST, 0, "[0]", b"1")], None),  # [] has no element 0
    ([(SpecOp.SET_DOC, 0, "", b"not json")], b"not json"),
    ([(SpecOp.DICT_UPSERT, X, "_s", b"1"), (SpecOp.SET_DOC, 0, "", b'{"v":1}')], b'{"v":1}'),
])  # fmt: skip
def test_a_created_document_starts_as_kv_engine_roots_it(
    specs: list[Any], body: bytes | None
) -> None:
    req = _req(*specs, flags=ADD)
    if body is None:
        with pytest.raises(SpecFailed):
            subdoc.mutate(req, subdoc.new_document(req), cas=1, seqno=1)
        return
    out = subdoc.mutate(req, subdoc.new_document(req), cas=1, seqno=1)
    assert out.body == body and out.json == (body != b"not json")


def test_the_macros() -> None:
    doc = _doc(BODY, {"_old": 1}, cas=0x1111, seqno=4, rev_seq=2, expiry=77)
    out = _apply(doc, (SpecOp.DICT_UPSERT, MACRO, "_m.cas", b'"${Mutation.CAS}"'),
                 (SpecOp.DICT_UPSERT, MACRO, "_m.seq", b'"${Mutation.seqno}"'),
                 (SpecOp.DICT_UPSERT, MACRO, "_m.crc", b'"${Mutation.value_crc32c}"'),
                 (SpecOp.DICT_UPSERT, MACRO, "_m.was", b'"${$document.CAS}"'),
                 (SpecOp.DICT_UPSERT, MACRO, "_m.exp", b'"${$document.exptime}"'),
                 (SpecOp.DICT_UPSERT, MACRO, "_m.doc", b'"${$document}"'),
                 (SpecOp.SET_DOC, 0, "", b'{"new":true}'),
                 cas=0x18EB9F44B2CBC7AD, seqno=0x1234)  # fmt: skip
    got = xattrs.to_json(out.blob)["_m"]
    assert got["cas"] == "0xadc7cbb2449feb18"  # the CAS's bytes, little-endian
    assert got["seq"] == "0x0000000000001234"
    new_body = b'{"new":true}'
    assert got["crc"] == f"0x{subdoc.crc32c(new_body):08x}"  # the new body's
    assert got["was"] == "0x0000000000001111" and got["exp"] == 77
    assert got["doc"]["revid"] == "2" and "$document" not in got["doc"]
    with pytest.raises(SpecFailed) as failed:
        _apply(doc, (SpecOp.DICT_UPSERT, MACRO, "_m", b'"${$document.nope}"'))
    assert failed.value.status == Code.XATTR_UNKNOWN_VATTR_MACRO


def test_delete_doc_keeps_the_system_xattrs_and_a_tombstone_takes_no_body() -> None:
    out = _apply(_doc(BODY, BLOB), (SpecOp.DICT_UPSERT, X, "_sync.gone", b"true"),
                 (SpecOp.DELETE_DOC, 0, "", b""))  # fmt: skip
    assert out.deleted and out.body == b"" and not out.json
    assert xattrs.to_json(out.blob) == {"_sync": {"rev": "1-a", "seq": 3, "gone": True}}
    tomb = Document(body=b"", json=False, blob=xattrs.from_json({"_s": 1}), deleted=True)
    out = _apply(tomb, (SpecOp.DICT_UPSERT, X, "_s", b"2"), flags=ACCESS_DELETED)
    assert out.deleted and xattrs.to_json(out.blob) == {"_s": 2}
    with pytest.raises(SpecFailed) as failed:  # a body path on a tombstone: no JSON there
        _apply(tomb, (SpecOp.DICT_UPSERT, 0, "a", b"1"), flags=ACCESS_DELETED)
    assert failed.value.status == Code.DOC_NOT_JSON
    req = _req((SpecOp.SET_DOC, 0, "", b"{}"))
    assert _status(lambda: subdoc.mutate(req, tomb, cas=1, seqno=1)) == (
        Code.DELETED_DOCUMENT_CANT_HAVE_VALUE)  # fmt: skip


# -- the bytes the SDK exchanged (formats/subdoc.md, "Examples") ----------------------

# couchbase 4.6.3: mutate_in("k", [upsert("_sync.cas", MutationMacro.cas(), xattr=True,
# create_parents=True), increment("n", 2)]) and lookup_in("k", [get("_sync", xattr=True),
# get("n")]), on a connection with collections (key 00 6b) to partition 2
SDK_MUTATION = bytes.fromhex(
    "80d10002000000020000002e000000080000000000000000006b"
    "c8150009000000115f73796e632e63617322247b4d75746174696f6e2e4341537d22"
    "cf000001000000016e32")  # fmt: skip
SDK_MUTATION_REPLY = bytes.fromhex(
    "81d10000100000000000001800000008" "18eb9f44b2cbc7ad"
    "00006c2240bc7d4f" "0000000000000002" "0100000000000133")  # fmt: skip
SDK_LOOKUP = bytes.fromhex(
    "80d000020000000200000010000000090000000000000000006bc50400055f73796e63c50000016e"
)
SDK_LOOKUP_REPLY = bytes.fromhex(
    "81d00000000000000000002900000009" "18eb9f44b2cbc7ad"
    "00000000001c" "7b22636173223a22307861646337636262323434396665623138227d"
    "0000000000013" "3")  # fmt: skip


def test_the_sdks_request_and_reply_bytes() -> None:
    body = SDK_MUTATION[24 + 2 :]
    req = subdoc.parse_request(mutation=True, extras=b"", value=body)
    assert req.specs == (Spec(SpecOp.DICT_UPSERT, 0x15, "_sync.cas", b'"${Mutation.CAS}"'),
                         Spec(SpecOp.COUNTER, 0, "n", b"2"))  # fmt: skip
    cas = int.from_bytes(SDK_MUTATION_REPLY[16:24], "big")
    out = subdoc.mutate(req, _doc({"n": 1}), cas=cas, seqno=2)
    assert SDK_MUTATION_REPLY[24 + 16 :] == subdoc.mutation_body(out.results)
    assert xattrs.to_json(out.blob) == {"_sync": {"cas": "0xadc7cbb2449feb18"}}
    look = subdoc.parse_request(mutation=False, extras=b"", value=SDK_LOOKUP[24 + 2 :])
    stored = Document(body=out.body, json=True, blob=out.blob, cas=cas)
    results = subdoc.lookup(look, stored)
    assert subdoc.lookup_body(results) == SDK_LOOKUP_REPLY[24:]
    assert subdoc.lookup_status(results, False) == 0


# -- against a bucket (subdoc_kv) -------------------------------------------------------

VB = 0
KEY = b"\x00doc"


def test_the_bucket_rules_of_lookups_and_mutations(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)
    up = (SpecOp.DICT_UPSERT, 0, "a", b"1")
    sys_x = (SpecOp.DICT_UPSERT, X | MKDIR_P, "_sync.rev", b'"1-a"')
    user_x = (SpecOp.DICT_UPSERT, X, "meta", b'"u"')

    async def scenario() -> None:
        async with nodes(node):
            b = node.bucket
            with pytest.raises(KeyNotFound):  # no document, no MKDOC
                subdoc_kv.mutate_in(b, VB, KEY, _req(up))
            status, doc, _ = subdoc_kv.mutate_in(b, VB, KEY, _req(sys_x, user_x, up, flags=ADD))
            assert status == 0 and doc.datatype == 0x05 and doc.flags == 0
            with pytest.raises(KeyExists):
                subdoc_kv.mutate_in(b, VB, KEY, _req(up, flags=ADD))
            with pytest.raises(KeyExists):
                subdoc_kv.mutate_in(b, VB, KEY, _req(up), cas=doc.cas + 1)
            b.store("set", VB, KEY, b'{"kept":1}', flags=9, expiry=0, datatype=1)  # keeps xattrs
            status, doc, _ = subdoc_kv.mutate_in(b, VB, KEY, _req(up, expiry=100))
            assert doc.flags == 9 and time.time() + 90 < doc.expiry <= time.time() + 101
            _, doc, _ = subdoc_kv.mutate_in(b, VB, KEY, _req(up), preserve_ttl=True)
            assert doc.expiry > 0
            _, doc, _ = subdoc_kv.mutate_in(b, VB, KEY, _req(up))
            assert doc.expiry == 0  # no expiry extras: reset, as kv_engine does
            _, blob, body = unpacked(doc)
            assert json.loads(body) == {"kept": 1, "a": 1}
            assert xattrs.to_json(blob) == {"_sync": {"rev": "1-a"}, "meta": "u"}
            b.delete(VB, KEY)  # the system xattrs stay on the tombstone
            get = _req((SpecOp.GET, X, "_sync", b""), (SpecOp.GET, X, "meta", b""),
                       mutation=False)  # fmt: skip
            with pytest.raises(KeyNotFound):
                subdoc_kv.lookup_in(b, VB, KEY, get)
            deleted = subdoc.parse_request(mutation=False, extras=bytes([ACCESS_DELETED]),
                                           value=_look((SpecOp.GET, X, "_sync")))  # fmt: skip
            status, _, body = subdoc_kv.lookup_in(b, VB, KEY, deleted)
            assert (status, body) == (Code.SUCCESS_DELETED, b'\0\0\0\0\0\x0d{"rev":"1-a"}')
            status, doc, _ = subdoc_kv.mutate_in(b, VB, KEY, _req(sys_x, flags=ACCESS_DELETED))
            assert status == Code.SUCCESS_DELETED and doc.deleted and doc.datatype == 0x04
            drop = _req((SpecOp.DELETE, X, "_sync", b""), flags=ACCESS_DELETED)
            subdoc_kv.mutate_in(b, VB, KEY, drop)  # the tombstone now keeps nothing
            with pytest.raises(KeyNotFound):
                subdoc_kv.mutate_in(b, VB, KEY, _req((SpecOp.DELETE_DOC, 0, "", b""),
                                                     flags=ACCESS_DELETED))  # fmt: skip
            status, doc, _ = subdoc_kv.mutate_in(b, VB, KEY, _req(up, flags=MKDOC))
            assert status == 0 and not doc.deleted and doc.datatype == 0x01  # afresh

    run(scenario())


def test_the_front_end_answers_subdoc_requests(tmp_path: Path) -> None:
    """Over TCP: the header status, CAS, mutation token and body of each answer, and the
    request-level checks the server makes before the engine's (datatype, PreserveTTL)."""
    from upr_cli.net.bootstrap import WANTED, connect
    from upr_cli.protocol.header import Feature, FrameId
    from upr_cli.protocol.messages import UnknownRequest

    node = InProcessNode(tmp_path, partitions=1)
    up = _mut((SpecOp.DICT_UPSERT, X | MKDIR_P, "_s.a", b"1"), (SpecOp.COUNTER, 0, "n", b"2"))

    async def call(features: tuple[int, ...], **kw: Any) -> Any:
        s = await connect(node.uri, features=features)
        try:
            msg = UnknownRequest(vbucket=VB, key=s.qualify(b"k"), **kw)
            return await s.conn.request(msg, check=False)
        finally:
            await s.conn.aclose()

    async def scenario() -> None:
        async with nodes(node):
            full = (*WANTED, Feature.XATTR, Feature.MUTATION_SEQNO)
            r = await call(full, opcode=0xD1, extras=bytes([MKDOC]), value=up)
            part = node.bucket.partitions[VB]
            assert (r.status, bytes(r.value)) == (0, b"\x01\0\0\0\0\0\x012")
            assert bytes(r.extras) == struct.pack(">QQ", part.uuid, part.high_seq)
            stored = node.bucket.lookup(VB, b"\x00k")
            assert stored is not None and r.cas == stored.cas and stored.datatype == 0x05
            r = await call(full, opcode=0xD1, value=_mut((SpecOp.REPLACE, 0, "zz", b"1")))
            assert (r.status, bytes(r.value)) == (Code.MULTI_PATH_FAILURE, b"\0\0\xc0")
            look = _look((SpecOp.GET, X, "_s"))
            r = await call(WANTED, opcode=0xD0, value=look)  # no HELLO XATTR
            assert r.status == Code.NOT_SUPPORTED
            r = await call(full, opcode=0xD0, value=look, datatype=1)
            assert r.status == Code.EINVAL
            ttl = ((FrameId.PRESERVE_TTL, b"\x01"),)
            r = await call(full, opcode=0xD1, value=up, frame_infos=ttl)
            assert r.status == Code.EINVAL
            r = await call(full, opcode=0xD0, value=look, cas=12345)
            assert r.status == Code.KEY_EEXISTS
            r = await call(full, opcode=0xD0, value=look)
            assert (r.status, bytes(r.value)) == (0, b'\0\0\0\0\0\x07{"a":1}')

    run(scenario())
