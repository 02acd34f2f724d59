"""Golden bytes of the sub-document commands (formats/subdoc.md §7): the requests the
official SDK (couchbase 4.6.3) sent, captured against `upr serve`, are exactly what
upr's own encoder (`upr_cli.protocol.subdoc`, used by `upr load --xattrs` and
`upr salvage`) builds for the same specs, and the responses decode to the results the
SDK read."""

from __future__ import annotations

import pytest

from upr_cli.errors import RemoteProtocolError
from upr_cli.protocol import Frame, FrameDecoder, subdoc
from upr_cli.protocol.subdoc import Spec


def unhex(text: str) -> bytes:
    return bytes.fromhex(" ".join(line.split("#", 1)[0] for line in text.splitlines()))


MUTATION = unhex("""
    80 d1 0002 00 00 0002 0000002e 00000008 0000000000000000
    006b                                                 # key: collection 0, 'k'
    c8 15 0009 00000011 5f73796e632e636173               # DICT_UPSERT xattr|mkdir_p|macros
    22247b4d75746174696f6e2e4341537d22                   # '"${Mutation.CAS}"'
    cf 00 0001 00000001 6e 32                            # COUNTER 'n' by 2
""")
MUTATION_RESPONSE = unhex("""
    81 d1 0000 10 00 0000 00000018 00000008 18eb9f44b2cbc7ad
    00006c2240bc7d4f 0000000000000002                    # extras: vbucket uuid, seqno
    01 0000 00000001 33                                  # spec 1 (the counter): '3'
""")
LOOKUP = unhex("""
    80 d0 0002 00 00 0002 00000010 00000009 0000000000000000
    006b
    c5 04 0005 5f73796e63                                # GET xattr '_sync'
    c5 00 0001 6e                                        # GET 'n'
""")
LOOKUP_RESPONSE = unhex("""
    81 d0 0000 00 00 0000 00000029 00000009 18eb9f44b2cbc7ad
    0000 0000001c 7b22636173223a22307861646337636262323434396665623138227d
    0000 00000001 33
""")
FLAGS = subdoc.XATTR_PATH | subdoc.MKDIR_P | subdoc.EXPAND_MACROS


def test_mutation_request_matches_the_sdk() -> None:
    specs = [Spec(subdoc.DICT_UPSERT, "_sync.cas", subdoc.CAS_MACRO, FLAGS),
             Spec(subdoc.COUNTER, "n", b"2")]  # fmt: skip
    assert subdoc.multi_mutation(2, 8, b"\x00k", specs) == MUTATION
    # body specs given first still go after the xattr specs, as kv_engine requires
    assert subdoc.multi_mutation(2, 8, b"\x00k", specs[::-1]) == MUTATION


def test_lookup_request_matches_the_sdk() -> None:
    specs = [Spec(subdoc.GET, "n"), Spec(subdoc.GET, "_sync", flags=subdoc.XATTR_PATH)]
    assert subdoc.multi_lookup(2, 9, b"\x00k", specs) == LOOKUP


def _frame(packet: bytes) -> Frame:
    decoder = FrameDecoder()
    decoder.feed(packet)
    [frame] = decoder.read_rows(data_rows=False)
    assert isinstance(frame, Frame)
    return frame


def test_responses_decode_to_what_the_sdk_read() -> None:
    cas = 0x18EB9F44B2CBC7AD
    mut = _frame(MUTATION_RESPONSE)
    result = bytes.fromhex("01 0000 00000001") + b"3"  # index 1, status 0, 1 byte
    assert (mut.vbucket_or_status, mut.cas, bytes(mut.value)) == (0, cas, result)
    look = _frame(LOOKUP_RESPONSE)
    assert subdoc.lookup_results(look.value) == [
        (0, b'{"cas":"0x' + cas.to_bytes(8, "little").hex().encode() + b'"}'),
        (0, b"3"),
    ]


def test_doc_flags_ride_in_one_byte_of_extras_only_when_set() -> None:
    plain = subdoc.multi_mutation(0, 1, b"k", [Spec(subdoc.SET_DOC, "", b"{}")])
    flagged = subdoc.multi_mutation(0, 1, b"k", [Spec(subdoc.SET_DOC, "", b"{}")],
                                    doc_flags=subdoc.ADD)  # fmt: skip
    assert plain[4] == 0 and flagged[4] == 1 and flagged[24] == subdoc.ADD
    assert flagged[25:] == plain[24:]


@pytest.mark.parametrize("body", [b"\x00\x00\x00", b"\x00\x00\x00\x00\x00\x09ab"])
def test_a_cut_lookup_result_is_a_typed_error(body: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="subdoc lookup result"):
        subdoc.lookup_results(body)
