"""Bad input to the sub-document engine (formats/subdoc.md): any bytes as a request, any
path and value as a spec, any body as a document, get a status, never a crash. A
request that validates and a lookup or mutation that runs answer with the statuses the
protocol has; the server turns them into responses, so nothing here may escape as an
exception of another kind."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from upr_cli.node import subdoc
from upr_cli.node.subdoc import Document, SpecFailed, SubdocError
from upr_cli.protocol import xattrs
from upr_cli.protocol.subdoc import SpecOp

STATUSES = {int(c) for c in subdoc.Code}
FAST = settings(max_examples=600, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])  # fmt: skip

paths = st.text(alphabet="ab_$.[]`-019 ", max_size=12)
values = st.sampled_from([b"1", b"-2", b'"s"', b"[1,2]", b'{"k":1}', b"null", b"1,2",
                          b'"${Mutation.CAS}"', b"", b"{", b"9" * 30, b"\xff"])  # fmt: skip
LOOKUPS = [SpecOp.GET, SpecOp.EXISTS, SpecOp.GET_COUNT, SpecOp.GET_DOC]
ops = st.sampled_from(list(SpecOp))
path_ops = st.sampled_from(
    [
        SpecOp.GET,
        SpecOp.EXISTS,
        SpecOp.GET_COUNT,
        SpecOp.DICT_ADD,
        SpecOp.DICT_UPSERT,
        SpecOp.DELETE,
        SpecOp.REPLACE,
        SpecOp.ARRAY_PUSH_LAST,
        SpecOp.ARRAY_PUSH_FIRST,
        SpecOp.ARRAY_INSERT,
        SpecOp.ARRAY_ADD_UNIQUE,
        SpecOp.COUNTER,
    ]
)
good_values = st.sampled_from(
    [b"1", b"-2", b'"s"', b"[1,2]", b'{"k":1}', b"null", b"1,2", b'"${Mutation.CAS}"', b"9" * 30]
)
flags = st.sampled_from([0, subdoc.XATTR_PATH, subdoc.MKDIR_P, subdoc.XATTR_PATH | subdoc.MKDIR_P,
                         subdoc.XATTR_PATH | subdoc.MKDIR_P | 0x10, 0x02, 0xFF])  # fmt: skip
# mostly well-formed specs, so that lookups and mutations run, not only validation
body_paths = st.sampled_from(["a", "a.b", "a.b[0]", "a.b[-1]", "a.b[2].c", "n", "`a.b`",
                              "z.y", "[0]", "[1][0]", "a..b", "a[", "a.b[9]"])  # fmt: skip
xattr_paths = st.sampled_from(["_s", "_s.r", "u", "meta.op", "meta.l[0]", "$document",
                               "$document.CAS", "$XTOC", "_", "toolongxattrname.x"])  # fmt: skip
good_specs = st.one_of(
    st.tuples(path_ops, st.sampled_from([0, subdoc.MKDIR_P]), body_paths, good_values),
    st.tuples(path_ops, st.sampled_from([subdoc.XATTR_PATH, subdoc.XATTR_PATH | subdoc.MKDIR_P,
                                         subdoc.XATTR_PATH | subdoc.MKDIR_P | 0x10]),
              xattr_paths, good_values),
    st.tuples(ops, flags, paths, values),  # anything
)  # fmt: skip
bodies = st.sampled_from([b'{"a":{"b":[1,2,{"c":3}]},"n":5}', b"[1,[2,3]]", b"not json",
                          b"", b'{"a":' * 40 + b"1" + b"}" * 40, b'{"x":1e400}'])  # fmt: skip


def _encode(mutation: bool, specs: list[tuple[SpecOp, int, str, bytes]]) -> bytes:
    out = b""
    for op, fl, path, value in specs:
        p = path.encode()
        if mutation:
            out += struct.pack(">BBHI", op, fl, len(p), len(value)) + p + value
        else:
            out += struct.pack(">BBH", op, fl, len(p)) + p
    return out


@FAST
@given(st.booleans(), st.binary(max_size=6), st.binary(max_size=80))
def test_any_bytes_validate_or_get_a_status(mutation: bool, extras: bytes, value: bytes) -> None:
    try:
        subdoc.parse_request(mutation=mutation, extras=extras, value=value)
    except SubdocError as exc:
        assert exc.code in STATUSES


@FAST
@given(
    st.booleans(),
    st.lists(good_specs, min_size=1, max_size=3),
    st.sampled_from([b"", b"\x01", b"\x02", b"\x04", b"\x00\x00\x00\x10\x01"]),
    bodies,
    st.dictionaries(
        st.sampled_from(["_s", "u", "meta"]), st.sampled_from(["1", '{"r":2}']), max_size=2
    ),
    st.booleans(),
    st.booleans(),
)
def test_any_spec_on_any_document_gets_statuses(
    mutation: bool,
    specs: list[tuple[SpecOp, int, str, bytes]],
    extras: bytes,
    body: bytes,
    xattr_items: dict[str, str],
    deleted: bool,
    tidy: bool,
) -> None:
    if not mutation:
        extras = extras[:1]
        specs = [(op, fl, path, b"") for op, fl, path, _v in specs]
    # kv_engine wants xattr specs first and lookups only in a lookup: mostly obey
    specs.sort(key=lambda sp: not sp[1] & subdoc.XATTR_PATH)
    swap = LOOKUPS if not mutation else [SpecOp.DICT_UPSERT, SpecOp.COUNTER, SpecOp.DELETE,
                                         SpecOp.ARRAY_PUSH_LAST]  # fmt: skip
    specs = [sp if (sp[0] in LOOKUPS) != mutation else (swap[sp[0] % 4], *sp[1:])
             for sp in specs]  # fmt: skip
    if tidy:  # only flags and values the spec's opcode takes
        specs = [(op, fl & subdoc.XATTR_PATH if op in LOOKUPS else fl, path,
                  b"" if op in (*LOOKUPS, SpecOp.DELETE) else v)
                 for op, fl, path, v in specs]  # fmt: skip
    try:
        req = subdoc.parse_request(mutation=mutation, extras=extras,
                                   value=_encode(mutation, specs))  # fmt: skip
    except SubdocError as exc:
        assert exc.code in STATUSES
        event(f"refused {exc.code:#x}")
        return
    blob = xattrs.encode(xattr_items)
    doc = Document(body=b"" if deleted else body, json=body[:1] in (b"{", b"["), blob=blob,
                   deleted=deleted, cas=0x1122, seqno=7, datatype=0x01)  # fmt: skip
    if not mutation:
        for spec, (status, out) in zip(req.specs, subdoc.lookup(req, doc), strict=True):
            assert status in STATUSES
            if status == subdoc.Code.SUCCESS and out and (spec.xattr or doc.json):
                json.loads(out)  # a path's result, an xattr or a JSON body: whole JSON
        event("lookup ran")
        return
    try:
        outcome = subdoc.mutate(req, doc, cas=0x3344, seqno=8)
    except SpecFailed as exc:
        assert exc.status in STATUSES
    except SubdocError as exc:
        assert exc.code in STATUSES
    else:
        event("mutation applied")
        xattrs.pairs(outcome.blob)  # a well-formed blob, whatever the specs did
        if outcome.json and outcome.body:
            json.loads(outcome.body)


def test_the_server_answers_every_malformed_request_on_one_connection(tmp_path: Path) -> None:
    """Over TCP, one connection: random extras and values in 0xd0/0xd1 requests (and a
    document that exists, with xattrs) each get an answer, and the connection stays up:
    a bad request is a status, never a disconnect."""
    import random

    from tests.dcp.inprocess import InProcessNode, nodes, run
    from upr_cli.net.bootstrap import WANTED, connect
    from upr_cli.protocol.header import Feature
    from upr_cli.protocol.messages import UnknownRequest

    node = InProcessNode(tmp_path, partitions=1)
    rng = random.Random(19)
    good = _encode(True, [(SpecOp.DICT_UPSERT, subdoc.XATTR_PATH | subdoc.MKDIR_P, "_s.a", b"1"),
                          (SpecOp.SET_DOC, 0, "", b'{"n":1}')])  # fmt: skip

    def noise(base: bytes) -> bytes:
        out = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            if out and rng.random() < 0.7:
                out[rng.randrange(len(out))] = rng.randrange(256)
            else:
                out[rng.randrange(len(out) + 1) : 0] = rng.randbytes(rng.randrange(1, 5))
        return bytes(out[: rng.randrange(len(out) + 1)]) if rng.random() < 0.3 else bytes(out)

    async def scenario() -> list[int]:
        async with nodes(node):
            s = await connect(node.uri, features=(*WANTED, Feature.XATTR))
            try:
                key = s.qualify(b"k")
                first = UnknownRequest(opcode=0xD1, vbucket=0, key=key, extras=bytes([1]),
                                       value=good)  # fmt: skip
                assert (await s.conn.request(first, check=False)).status == 0
                statuses = []
                for i in range(300):
                    opcode = 0xD1 if i % 2 else 0xD0
                    extras = rng.choice([b"", b"\x01", b"\x04", rng.randbytes(rng.randrange(6))])
                    msg = UnknownRequest(opcode=opcode, vbucket=0, key=key, extras=extras,
                                         value=noise(good))  # fmt: skip
                    statuses.append((await s.conn.request(msg, check=False)).status)
                assert not s.conn.closed
                return statuses
            finally:
                await s.conn.aclose()

    statuses = run(scenario())
    assert len(statuses) == 300 and set(statuses) <= STATUSES | {0x01, 0x02, 0x04, 0x87}
    assert len(set(statuses)) > 3  # the noise reached more than one check
