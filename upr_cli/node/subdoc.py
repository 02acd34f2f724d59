"""The sub-document engine of `upr serve` (formats/subdoc.md): SUBDOC_MULTI_LOOKUP (0xd0)
and SUBDOC_MULTI_MUTATION (0xd1) as kv_engine's docs/SubDocument.md and its validators
define them, without I/O: a request's bytes and a document in, per-spec results or a
new document out. `upr_cli/node/subdoc_kv.py` ties it to a bucket.

Theory of operation.

* **Validation** (`parse_request`) happens before the document is read and fails the
  whole request with one status, as kv_engine's validators do: EINVAL for a malformed
  request or a flag an operation does not take, SubdocInvalidCombo for an opcode that
  does not belong (or more than 16 specs), SubdocInvalidXattrOrder for an xattr spec
  after a body spec, XATTR_EINVAL for an xattr name that is not one, NotSupported for
  an xattr path on a connection without HELLO XATTR or a document flag upr serve does
  not implement (CreateAsDeleted, ReviveDocument, ReplicaRead).
* **Paths** (`parse_path`): components separated by `.`, array indexes in brackets
  (`[-1]` is the last element), backticks around a name that holds `.`, `[` or `]`
  (two backticks are one). An xattr path starts with the xattr's name, read literally
  up to the first `.` or `[`. A path that does not parse is SubdocPathEinval for its
  spec; more than 32 components SubdocPathE2big.
* **Execution** mirrors kv_engine's two phases: the xattr specs operate on one JSON
  object holding every xattr by name, the body specs on the body, which must be JSON
  (else SubdocDocNotJson). A lookup runs every spec and reports each; a mutation stops
  at its first failing spec, reported alone (SubdocMultiPathFailure). The JSON is
  parsed into Python objects (key order kept) and written back compact.
* **Macros** (`EXPAND_MACROS`, xattr specs only): a value that is exactly
  `"${Mutation.CAS}"`, `"${Mutation.seqno}"` or `"${Mutation.value_crc32c}"` becomes the
  new CAS (its 8 bytes in little-endian order as hex, as kv_engine prints the network-
  order value), the new seqno, or the CRC32C of the new body, each `"0x…"`; a
  `"${$document…}"` value becomes that field of the document before the mutation.
"""

from __future__ import annotations

import json
import re
import string
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from upr_cli.protocol import xattrs
from upr_cli.protocol.header import Datatype
from upr_cli.protocol.status import Status, StatusError
from upr_cli.protocol.subdoc import (
    ACCESS_DELETED,
    ADD,
    CREATE_AS_DELETED,
    DOC_FLAGS,
    EXPAND_MACROS,
    EXPIRY,
    LOOKUP_RESULT,
    LOOKUP_SPEC,
    MKDIR_P,
    MKDOC,
    MUTATION_FAILURE,
    MUTATION_RESULT,
    MUTATION_SPEC,
    REPLICA_READ,
    REVIVE_DOCUMENT,
    XATTR_PATH,
    SpecOp,
)

MAX_PATHS = 16  # specs in one request (kv_engine's SUBDOC_MULTI_MAX_PATHS)
MAX_PATH_LEN = 1024  # bytes of one path
MAX_COMPONENTS = 32  # components of one path
MAX_DEPTH = 32  # nesting of a document a path may reach
_INT64 = (-(1 << 63), (1 << 63) - 1)

# the document flags upr serve refuses (docs/SubDocument.md "Flags")
_UNIMPLEMENTED_DOC_FLAGS = CREATE_AS_DELETED | REVIVE_DOCUMENT | REPLICA_READ


class Code(IntEnum):
    """The statuses the engine answers, by the short names it uses (each is defined in
    protocol/status.py, as kv_engine's include/mcbp/protocol/status.h has it)."""

    SUCCESS = Status.SUCCESS
    KEY_ENOENT = Status.KEY_ENOENT
    KEY_EEXISTS = Status.KEY_EEXISTS
    EINVAL = Status.EINVAL
    NOT_SUPPORTED = Status.NOT_SUPPORTED
    XATTR_EINVAL = Status.XATTR_EINVAL
    PATH_ENOENT = Status.SUBDOC_PATH_ENOENT
    PATH_MISMATCH = Status.SUBDOC_PATH_MISMATCH
    PATH_EINVAL = Status.SUBDOC_PATH_EINVAL
    PATH_E2BIG = Status.SUBDOC_PATH_E2BIG
    DOC_E2DEEP = Status.SUBDOC_DOC_E2DEEP
    VALUE_CANTINSERT = Status.SUBDOC_VALUE_CANTINSERT
    DOC_NOT_JSON = Status.SUBDOC_DOC_NOT_JSON
    NUM_ERANGE = Status.SUBDOC_NUM_ERANGE
    DELTA_EINVAL = Status.SUBDOC_DELTA_EINVAL
    PATH_EEXISTS = Status.SUBDOC_PATH_EEXISTS
    VALUE_ETOODEEP = Status.SUBDOC_VALUE_ETOODEEP
    INVALID_COMBO = Status.SUBDOC_INVALID_COMBO
    MULTI_PATH_FAILURE = Status.SUBDOC_MULTI_PATH_FAILURE
    SUCCESS_DELETED = Status.SUBDOC_SUCCESS_DELETED
    XATTR_INVALID_FLAG_COMBO = Status.SUBDOC_XATTR_INVALID_FLAG_COMBO
    XATTR_INVALID_KEY_COMBO = Status.SUBDOC_XATTR_INVALID_KEY_COMBO
    XATTR_UNKNOWN_MACRO = Status.SUBDOC_XATTR_UNKNOWN_MACRO
    XATTR_UNKNOWN_VATTR = Status.SUBDOC_XATTR_UNKNOWN_VATTR
    XATTR_CANT_MODIFY_VATTR = Status.SUBDOC_XATTR_CANT_MODIFY_VATTR
    MULTI_PATH_FAILURE_DELETED = Status.SUBDOC_MULTI_PATH_FAILURE_DELETED
    INVALID_XATTR_ORDER = Status.SUBDOC_INVALID_XATTR_ORDER
    XATTR_UNKNOWN_VATTR_MACRO = Status.SUBDOC_XATTR_UNKNOWN_VATTR_MACRO
    DELETED_DOCUMENT_CANT_HAVE_VALUE = Status.SUBDOC_DELETED_DOCUMENT_CANT_HAVE_VALUE


class SubdocError(StatusError):
    """A sub-document request answered with one status in the header (no results)."""

    def __init__(self, code: int, message: str) -> None:
        self._code = int(code)
        super().__init__(message)

    @property
    def code(self) -> int:
        """The numeric status of this error."""
        return self._code


class SpecFailed(Exception):
    """A mutation spec failed: the request answers SubdocMultiPathFailure with it."""

    def __init__(self, index: int, status: int) -> None:
        super().__init__(f"spec {index}: status 0x{status:02x}")
        self.index, self.status = index, status


class _PathError(Exception):
    """One spec's failure (its status goes into that spec's result)."""

    def __init__(self, status: Code) -> None:
        super().__init__(status.name)
        self.status = status


@dataclass(frozen=True, slots=True)
class _Traits:
    """kv_engine's daemon/subdocument_traits.h for one spec opcode."""

    mutator: bool
    path_flags: int  # the path flags it takes
    doc_flags: int  # the document flags it takes
    has_value: bool
    empty_path: bool  # a body spec may have an empty path
    whole_doc: bool = False


_X, _XM, _XME = XATTR_PATH, XATTR_PATH | MKDIR_P, XATTR_PATH | MKDIR_P | EXPAND_MACROS
_LOOK = ACCESS_DELETED | REVIVE_DOCUMENT
_MAKE = MKDOC | ADD | ACCESS_DELETED | REVIVE_DOCUMENT | CREATE_AS_DELETED
TRAITS: dict[SpecOp, _Traits] = {
    SpecOp.GET_DOC: _Traits(False, 0, _LOOK, False, True, whole_doc=True),
    SpecOp.SET_DOC: _Traits(True, 0, MKDOC | ADD, True, True, whole_doc=True),
    SpecOp.DELETE_DOC: _Traits(True, 0, _LOOK, False, True, whole_doc=True),
    SpecOp.GET: _Traits(False, _X, _LOOK, False, False),
    SpecOp.EXISTS: _Traits(False, _X, _LOOK, False, False),
    SpecOp.GET_COUNT: _Traits(False, _X, _LOOK, False, True),
    SpecOp.DICT_ADD: _Traits(True, _XME, _MAKE, True, False),
    SpecOp.DICT_UPSERT: _Traits(True, _XME, _MAKE, True, False),
    SpecOp.DELETE: _Traits(True, _X, _LOOK, False, False),
    SpecOp.REPLACE: _Traits(True, _X | EXPAND_MACROS, _LOOK | ADD, True, False),
    SpecOp.ARRAY_PUSH_LAST: _Traits(True, _XME, _MAKE, True, True),
    SpecOp.ARRAY_PUSH_FIRST: _Traits(True, _XME, _MAKE, True, True),
    SpecOp.ARRAY_INSERT: _Traits(True, _X | EXPAND_MACROS, _MAKE & ~MKDOC, True, False),
    SpecOp.ARRAY_ADD_UNIQUE: _Traits(True, _XM, _MAKE, True, True),
    SpecOp.COUNTER: _Traits(True, _XM, _MAKE, True, False),
}

MACROS = ('"${Mutation.CAS}"', '"${Mutation.seqno}"', '"${Mutation.value_crc32c}"')
VATTRS = ("$document", "$XTOC", "$vbucket")


# -- CRC32C (the Castagnoli polynomial, for ${Mutation.value_crc32c}) ----------------


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C of `data` (what kv_engine's `value_crc32c` reports of a body)."""
    crc, table = 0xFFFFFFFF, _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# -- paths --------------------------------------------------------------------------

Component = str | int  # a name, or an array index (-1: the last element)


def parse_path(text: str) -> list[Component]:
    """The components of a body path (docs/SubDocument.md "Path"); _PathError with
    PATH_EINVAL if it does not parse, PATH_E2BIG past 32 components."""
    parts: list[Component] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] == "[":
            end = text.find("]", i)
            digits = text[i + 1 : end] if end > 0 else ""
            if digits == "-1":
                parts.append(-1)
            elif digits.isascii() and digits.isdigit():
                parts.append(int(digits))
            else:
                raise _PathError(Code.PATH_EINVAL)
            i = end + 1
        else:
            i = _name(text, i, parts)
        if i < n and text[i] == ".":
            i += 1
            if i == n or text[i] in ".[":
                raise _PathError(Code.PATH_EINVAL)
        elif i < n and text[i] != "[":
            raise _PathError(Code.PATH_EINVAL)
    if len(parts) > MAX_COMPONENTS:
        raise _PathError(Code.PATH_E2BIG)
    return parts


def _name(text: str, i: int, parts: list[Component]) -> int:
    """Read one name starting at `i` (backticks escape, two of them are one); returns
    where it ends. A name is compared with a document's keys after JSON unescaping."""
    out: list[str] = []
    n, quoted = len(text), False
    while i < n and text[i] not in ".[":
        c = text[i]
        if c == "`":
            quoted, i = True, i + 1
            while True:
                if i >= n:
                    raise _PathError(Code.PATH_EINVAL)  # no closing backtick
                if text[i] == "`":
                    if text.startswith("``", i):
                        out.append("`")
                        i += 2
                        continue
                    i += 1
                    break
                out.append(text[i])
                i += 1
        elif c == "]":
            raise _PathError(Code.PATH_EINVAL)
        else:
            out.append(c)
            i += 1
    name = "".join(out)
    if not name and not quoted:
        raise _PathError(Code.PATH_EINVAL)  # "a..b", ".a"
    if "\\" in name:
        try:
            name = json.loads(f'"{name}"')
        except ValueError:
            raise _PathError(Code.PATH_EINVAL) from None
    parts.append(name)
    return i


def xattr_key(path: str) -> str:
    """The xattr name a path starts with: up to the first `.` or `[`."""
    end = min((p for p in (path.find("."), path.find("[")) if p >= 0), default=len(path))
    return path[:end]


def valid_xattr_key(key: str) -> bool:
    """kv_engine's xattr/key_validator.cc: 1 to 15 bytes of UTF-8 without NUL, not
    starting with ASCII punctuation or a control character, except `_` (a system
    xattr, at least two bytes) and `$` (a virtual one)."""
    raw = key.encode("utf-8", errors="surrogatepass")
    if not 0 < len(raw) <= xattrs.MAX_NAME or "\0" in key:
        return False
    first = key[0]
    if first == "_":
        return len(key) > 1
    return first == "$" or not (first in string.punctuation or ord(first) < 32 or first == "\x7f")


def xattr_path(path: str) -> list[Component]:
    """The components of an xattr path: the name, then what follows it."""
    key = xattr_key(path)
    rest = path[len(key) :]
    if rest.startswith("."):
        rest = rest[1:]
        if not rest:
            raise _PathError(Code.PATH_EINVAL)
    return [key, *parse_path(rest)] if rest else [key]


# -- requests -----------------------------------------------------------------------

_DOCUMENT_MACRO = re.compile(r'"\$\{\$document(.*)\}"', re.DOTALL)


@dataclass(frozen=True, slots=True)
class Spec:
    """One operation of a request: its path as text, its value as sent."""

    op: SpecOp
    flags: int
    path: str
    value: bytes = b""

    @property
    def xattr(self) -> bool:
        """The path names an xattr (the XATTR_PATH flag)."""
        return bool(self.flags & XATTR_PATH)


@dataclass(frozen=True, slots=True)
class Request:
    """A validated SUBDOC_MULTI_LOOKUP or SUBDOC_MULTI_MUTATION."""

    mutation: bool
    doc_flags: int
    expiry: int | None  # a mutation's expiry extras, None when absent
    specs: tuple[Spec, ...]

    @property
    def access_deleted(self) -> bool:
        """The ACCESS_DELETED document flag: a tombstone is a document too."""
        return bool(self.doc_flags & ACCESS_DELETED)


def parse_request(*, mutation: bool, extras: bytes, value: bytes, cas: int = 0,
                  xattrs_enabled: bool = True) -> Request:  # fmt: skip
    """Validate a request as kv_engine's daemon/subdocument_validators.cc does; a
    request it refuses raises SubdocError with the status it answers."""
    expiry, doc_flags = _extras(mutation, extras)
    if doc_flags & ~DOC_FLAGS:
        raise SubdocError(Code.EINVAL, f"unknown document flags 0x{doc_flags:02x}")
    if doc_flags & _UNIMPLEMENTED_DOC_FLAGS:
        raise SubdocError(Code.NOT_SUPPORTED, "CreateAsDeleted, ReviveDocument and ReplicaRead "
                          "are not supported by upr serve")  # fmt: skip
    if doc_flags & ADD and doc_flags & MKDOC:
        raise SubdocError(Code.EINVAL, "the Add and Mkdoc document flags exclude each other")
    if doc_flags & ADD and cas:
        raise SubdocError(Code.EINVAL, "a request with the Add document flag must have CAS 0")
    specs: list[Spec] = []
    pos, body_seen, closed = 0, False, False
    while pos < len(value):
        if len(specs) == MAX_PATHS or closed:
            raise SubdocError(Code.INVALID_COMBO, "at most 16 specs, none after a DELETE_DOC")
        spec, pos = _read_spec(mutation, value, pos)
        _check_spec(spec, mutation, doc_flags, xattrs_enabled)
        if spec.xattr and body_seen:
            raise SubdocError(Code.INVALID_XATTR_ORDER, "xattr specs must come first")
        if spec.op == SpecOp.DELETE_DOC and body_seen:
            raise SubdocError(Code.INVALID_COMBO, "DELETE_DOC comes alone after xattr specs")
        body_seen = body_seen or not spec.xattr
        closed = spec.op == SpecOp.DELETE_DOC
        specs.append(spec)
    if not specs:
        raise SubdocError(Code.INVALID_COMBO, "a request needs at least one spec")
    return Request(mutation, doc_flags, expiry, tuple(specs))


def _extras(mutation: bool, extras: bytes) -> tuple[int | None, int]:
    """(expiry, document flags) of the extras: 0 or 1 byte for a lookup; 0, 1, 4 or 5
    for a mutation (a u32 expiry first, the flags byte last)."""
    n = len(extras)
    if n == 0:
        return None, 0
    if n == 1:
        return None, extras[0]
    if mutation and n in (4, 5):
        return EXPIRY.unpack_from(extras)[0], extras[4] if n == 5 else 0
    raise SubdocError(Code.EINVAL, f"extras of {n} bytes")


def _read_spec(mutation: bool, value: bytes, pos: int) -> tuple[Spec, int]:
    head = MUTATION_SPEC if mutation else LOOKUP_SPEC
    if pos + head.size > len(value):
        raise SubdocError(Code.EINVAL, "a truncated spec")
    if mutation:
        op, flags, plen, vlen = MUTATION_SPEC.unpack_from(value, pos)
    else:
        (op, flags, plen), vlen = LOOKUP_SPEC.unpack_from(value, pos), 0
    start = pos + head.size
    end = start + plen + vlen
    if end > len(value):
        raise SubdocError(Code.EINVAL, "a spec's path and value run past the request")
    if op not in TRAITS:
        raise SubdocError(Code.INVALID_COMBO, f"opcode 0x{op:02x} is not a sub-document spec")
    path = value[start : start + plen].decode("utf-8", errors="surrogateescape")
    return Spec(SpecOp(op), flags, path, value[start + plen : end]), end


def _check_spec(spec: Spec, mutation: bool, doc_flags: int, xattrs_enabled: bool) -> None:
    """One spec's checks, in the order of kv_engine's `is_valid_multipath_spec`."""
    traits = TRAITS[spec.op]
    if traits.mutator != mutation:
        raise SubdocError(Code.INVALID_COMBO, f"{spec.op.name} does not belong in this command")
    if spec.flags & ~traits.path_flags:
        raise SubdocError(Code.EINVAL, f"{spec.op.name} does not take path flags "
                          f"0x{spec.flags:02x}")  # fmt: skip
    if doc_flags & ~traits.doc_flags:
        raise SubdocError(Code.EINVAL, f"{spec.op.name} does not take document flags "
                          f"0x{doc_flags:02x}")  # fmt: skip
    raw_path = spec.path.encode("utf-8", errors="surrogateescape")
    if len(raw_path) > MAX_PATH_LEN:
        raise SubdocError(Code.EINVAL, "a path longer than 1024 bytes")
    if traits.whole_doc and raw_path:
        raise SubdocError(Code.EINVAL, f"{spec.op.name} takes no path")
    if spec.xattr:
        _check_xattr(spec, mutation, xattrs_enabled)
    elif spec.flags & EXPAND_MACROS:
        raise SubdocError(Code.XATTR_INVALID_FLAG_COMBO, "EXPAND_MACROS needs XATTR_PATH")
    elif not raw_path and not traits.empty_path:
        raise SubdocError(Code.EINVAL, f"{spec.op.name} needs a path")
    if traits.has_value != bool(spec.value):
        raise SubdocError(Code.EINVAL, f"{spec.op.name} " +
                          ("needs a value" if traits.has_value else "takes no value"))  # fmt: skip


def _check_xattr(spec: Spec, mutation: bool, xattrs_enabled: bool) -> None:
    if not xattrs_enabled:
        raise SubdocError(Code.NOT_SUPPORTED, "xattr paths need HELLO XATTR on this connection")
    key = xattr_key(spec.path)
    if not valid_xattr_key(key):
        raise SubdocError(Code.XATTR_EINVAL, f"{key!r} is not an xattr name")
    if key.startswith("$") and mutation:
        raise SubdocError(Code.XATTR_CANT_MODIFY_VATTR, f"{key} is virtual: it cannot change")
    if spec.flags & EXPAND_MACROS:
        text = spec.value.decode("utf-8", errors="replace")
        if text not in MACROS and not _DOCUMENT_MACRO.fullmatch(text):
            raise SubdocError(Code.XATTR_UNKNOWN_MACRO, f"unknown macro {text}")


# -- JSON trees -----------------------------------------------------------------------


class _Raw:
    """A stored xattr value that is not JSON: kept as it is, SubdocDocNotJson if used."""

    __slots__ = ("text",)

    def __init__(self, text: bytes) -> None:
        self.text = text


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: bytes | str) -> Any:
    """JSON text to Python objects, strictly (no NaN or Infinity)."""
    return json.loads(text, parse_constant=_reject_constant)


def dumps(obj: Any) -> bytes:
    """Compact JSON text (UTF-8, key order kept)."""
    if isinstance(obj, _Raw):
        return obj.text
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode()  # fmt: skip
    except ValueError:  # a number json.loads made infinite (1e999)
        raise _PathError(Code.DOC_NOT_JSON) from None


def _depth(obj: Any) -> int:
    """How deeply containers nest in `obj`: 0 for a scalar, 1 for `{}` or `[1]`."""
    depth, level = 0, [obj]
    while containers := [o for o in level if isinstance(o, dict | list)]:
        depth += 1
        level = [c for o in containers for c in (o.values() if isinstance(o, dict) else o)]
    return depth


def parse_document(body: bytes) -> Any:
    """A body as a tree: SubdocDocNotJson if it is not JSON, SubdocDocE2deep if it nests
    deeper than a path may reach."""
    try:
        root = _loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _PathError(Code.DOC_NOT_JSON) from None
    if _depth(root) > MAX_DEPTH:
        raise _PathError(Code.DOC_E2DEEP)
    return root


def _value(text: bytes, *, many: bool = False) -> Any:
    """A spec's value: one JSON value, or (`many`) a list of the comma-separated values
    an array spec may carry; SubdocValueCantinsert if it is not that."""
    try:
        return _loads(b"[" + text + b"]" if many else text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _PathError(Code.VALUE_CANTINSERT) from None


def _step(node: Any, part: Component) -> Any:
    """The child `part` of `node`: PATH_MISMATCH if `node` is not the right container,
    PATH_ENOENT if it has no such child."""
    if isinstance(node, _Raw):
        raise _PathError(Code.DOC_NOT_JSON)
    if isinstance(part, int):
        if not isinstance(node, list):
            raise _PathError(Code.PATH_MISMATCH)
        if not node or part >= len(node):
            raise _PathError(Code.PATH_ENOENT)
        return node[part]
    if not isinstance(node, dict):
        raise _PathError(Code.PATH_MISMATCH)
    if part not in node:
        raise _PathError(Code.PATH_ENOENT)
    return node[part]


def _find(root: Any, parts: list[Component]) -> Any:
    node = root
    for part in parts:
        node = _step(node, part)
    return node


def _parent(root: Any, parts: list[Component], mkdir: bool) -> Any:
    """The container holding the last component; with `mkdir` missing dictionaries on
    the way are created (never array elements)."""
    node = root
    for i, part in enumerate(parts[:-1]):
        if mkdir and isinstance(part, str) and isinstance(node, dict) and part not in node:
            nxt = parts[i + 1]
            if isinstance(nxt, int):
                raise _PathError(Code.PATH_ENOENT)  # an array is never made up
            node[part] = {}
        node = _step(node, part)
    if isinstance(node, _Raw):
        raise _PathError(Code.DOC_NOT_JSON)
    return node


def lookup_one(op: SpecOp, root: Any, parts: list[Component]) -> bytes:
    """GET (the value as JSON), EXISTS (nothing) or GET_COUNT (the number of members of
    an object or array, as text) of the path."""
    node = _find(root, parts)
    if op == SpecOp.GET:
        return dumps(node)
    if op == SpecOp.GET_COUNT:
        if not isinstance(node, dict | list):
            raise _PathError(Code.PATH_MISMATCH)
        return str(len(node)).encode()
    return b""


def mutate_one(op: SpecOp, root: Any, parts: list[Component], value: bytes,
               mkdir: bool) -> bytes | None:  # fmt: skip
    """Apply one path mutation to `root` in place; returns what COUNTER answers."""
    if op in (SpecOp.ARRAY_PUSH_LAST, SpecOp.ARRAY_PUSH_FIRST, SpecOp.ARRAY_ADD_UNIQUE):
        _array_add(op, root, parts, value, mkdir)
        return None
    if op == SpecOp.COUNTER:
        return _counter(root, parts, value, mkdir)
    parent = _parent(root, parts, mkdir)
    last = parts[-1]
    if op in (SpecOp.DICT_ADD, SpecOp.DICT_UPSERT):
        if isinstance(last, int):
            raise _PathError(Code.PATH_EINVAL)  # a dictionary spec names a key
        if not isinstance(parent, dict):
            raise _PathError(Code.PATH_MISMATCH)
        if op == SpecOp.DICT_ADD and last in parent:
            raise _PathError(Code.PATH_EEXISTS)
        parent[last] = _fits(parts, _value(value))
    elif op == SpecOp.ARRAY_INSERT:
        if not isinstance(last, int) or last < 0:
            raise _PathError(Code.PATH_EINVAL)
        if not isinstance(parent, list):
            raise _PathError(Code.PATH_MISMATCH)
        if last > len(parent):
            raise _PathError(Code.PATH_ENOENT)
        parent[last:last] = _fits(parts, _value(value, many=True))
    else:  # REPLACE and DELETE: the path must exist
        _step(parent, last)
        slot = len(parent) - 1 if last == -1 else last
        if op == SpecOp.DELETE:
            del parent[slot]
        else:
            parent[slot] = _fits(parts, _value(value))
    return None


def _fits(parts: list[Component], value: Any) -> Any:
    """SubdocValueEtoodeep if `value` at `parts` would nest deeper than allowed."""
    if len(parts) + _depth(value) > MAX_DEPTH:
        raise _PathError(Code.VALUE_ETOODEEP)
    return value


def _array_add(op: SpecOp, root: Any, parts: list[Component], value: bytes,
               mkdir: bool) -> None:  # fmt: skip
    """ARRAY_PUSH_LAST / _FIRST (one or more comma-separated values) and
    ARRAY_ADD_UNIQUE (one primitive, not yet there), on the array at `parts` (made
    empty with `mkdir` when missing)."""
    if not parts:
        target = root
    else:
        parent = _parent(root, parts, mkdir)
        last = parts[-1]
        if mkdir and isinstance(last, str) and isinstance(parent, dict) and last not in parent:
            parent[last] = []
        target = _step(parent, last)
    if not isinstance(target, list):
        raise _PathError(Code.PATH_MISMATCH)
    items = _fits([*parts, 0], _value(value, many=True))
    if op == SpecOp.ARRAY_ADD_UNIQUE:
        if len(items) != 1 or isinstance(items[0], dict | list):
            raise _PathError(Code.VALUE_CANTINSERT)
        if any(isinstance(e, dict | list) for e in target):
            raise _PathError(Code.PATH_MISMATCH)
        text = dumps(items[0])
        if any(dumps(e) == text for e in target):
            raise _PathError(Code.PATH_EEXISTS)
    if op == SpecOp.ARRAY_PUSH_FIRST:
        target[0:0] = items
    else:
        target.extend(items)


_DELTA = re.compile(rb"-?[0-9]+")


def _counter(root: Any, parts: list[Component], delta_text: bytes, mkdir: bool) -> bytes:
    """COUNTER: add a signed 64-bit delta (not 0) to the integer at the path, or create
    it as the delta; the result as text."""
    delta = int(delta_text) if _DELTA.fullmatch(delta_text) else 0
    if not delta or not _INT64[0] <= delta <= _INT64[1]:
        raise _PathError(Code.DELTA_EINVAL)
    parent = _parent(root, parts, mkdir)
    last = parts[-1]
    if isinstance(last, str) and isinstance(parent, dict) and last not in parent:
        current = 0
    else:
        current = _step(parent, last)
        if not isinstance(current, int) or isinstance(current, bool):
            raise _PathError(Code.PATH_MISMATCH)
        if not _INT64[0] <= current <= _INT64[1]:
            raise _PathError(Code.NUM_ERANGE)
    total = current + delta
    if not _INT64[0] <= total <= _INT64[1]:
        raise _PathError(Code.VALUE_CANTINSERT)  # kv_engine's answer to DELTA_OVERFLOW
    if isinstance(last, int):
        parent[len(parent) - 1 if last == -1 else last] = total
    else:
        parent[last] = total
    return str(total).encode()


# -- executing a request ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Document:
    """A stored version as the engine sees it: inflated, its xattr blob apart."""

    body: bytes
    json: bool  # the body's JSON bit
    blob: bytes = b""  # the xattr blob (b"": none)
    deleted: bool = False
    cas: int = 0
    seqno: int = 0
    rev_seq: int = 0
    expiry: int = 0
    flags: int = 0
    datatype: int = 0  # as stored (Snappy included), for $document.datatype
    vbucket_uuid: int = 0


def document_vattr(doc: Document, *, crc: bool = True) -> dict[str, Any]:
    """The `$document` virtual xattr (kv_engine's `get_document_vattr`)."""
    bits = ((Datatype.JSON, "json"), (Datatype.SNAPPY, "snappy"), (Datatype.XATTR, "xattr"))
    names = [n for bit, n in bits if doc.datatype & bit] or ["raw"]
    out: dict[str, Any] = {
        "CAS": f"0x{doc.cas:016x}", "vbucket_uuid": f"0x{doc.vbucket_uuid:016x}",
        "seqno": f"0x{doc.seqno:016x}", "revid": str(doc.rev_seq), "exptime": doc.expiry,
        "flags": doc.flags, "value_bytes": len(doc.body), "datatype": names,
        "deleted": doc.deleted, "last_modified": str(doc.cas // 1_000_000_000),
    }  # fmt: skip
    if crc:
        out["value_crc32c"] = f"0x{crc32c(doc.body):08x}"
    return out


def _vattr_root(key: str, doc: Document, path: str) -> dict[str, Any]:
    """The document a virtual xattr spec reads: `{"$document": {...}}` and the like."""
    if key == "$document":
        crc = path in ("$document", "$document.value_crc32c")
        return {key: document_vattr(doc, crc=crc)}
    if key == "$XTOC":
        return {key: [name for name, _ in xattrs.pairs(doc.blob)]}
    if key == "$vbucket":
        return {key: {"HLC": {"now": str(int(time.time())), "mode": "real"}}}
    raise _PathError(Code.XATTR_UNKNOWN_VATTR)


def _xattr_root(blob: bytes) -> dict[str, Any]:
    """Every xattr by name, parsed (a value that is not JSON kept as `_Raw`)."""
    out: dict[str, Any] = {}
    for name, text in xattrs.pairs(blob):
        try:
            out[name] = _loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError):
            out[name] = _Raw(text)
    return out


def lookup(req: Request, doc: Document) -> list[tuple[int, bytes]]:
    """(status, value) per spec of a SUBDOC_MULTI_LOOKUP, in the request's order."""
    out: list[tuple[int, bytes]] = []
    stored: dict[str, Any] | None = None
    body: Any = None
    for spec in req.specs:
        try:
            if spec.xattr:
                key = xattr_key(spec.path)
                if key.startswith("$"):
                    root: Any = _vattr_root(key, doc, spec.path)
                else:
                    root = stored = _xattr_root(doc.blob) if stored is None else stored
                out.append((Code.SUCCESS, lookup_one(spec.op, root, xattr_path(spec.path))))
            elif spec.op == SpecOp.GET_DOC:
                if not doc.body:
                    raise _PathError(Code.PATH_ENOENT)  # a body that does not exist
                out.append((Code.SUCCESS, doc.body))
            else:
                if not doc.json:
                    raise _PathError(Code.DOC_NOT_JSON)
                body = parse_document(doc.body) if body is None else body
                out.append((Code.SUCCESS, lookup_one(spec.op, body, parse_path(spec.path))))
        except _PathError as exc:
            out.append((exc.status, b""))
    return out


@dataclass(slots=True)
class Outcome:
    """What a successful SUBDOC_MULTI_MUTATION leaves."""

    body: bytes
    json: bool
    blob: bytes
    deleted: bool  # the new version is a tombstone
    results: list[tuple[int, bytes]] = field(default_factory=list)  # (spec index, value)
    delete_doc: bool = False  # a DELETE_DOC spec ran


def new_document(req: Request) -> Document:
    """The empty document a mutation that may create one starts from (kv_engine's
    `get_root_type`: `[]` when the first path spec works on an array at the root or
    starts with an index, `{}` for any other path spec, nothing for whole-document
    specs alone)."""
    for spec in req.specs:
        if TRAITS[spec.op].whole_doc:
            continue
        array = not spec.xattr and (spec.path.startswith("[") or not spec.path)
        return Document(body=b"[]" if array else b"{}", json=True)
    return Document(body=b"", json=False)


def mutate(req: Request, doc: Document, *, cas: int, seqno: int) -> Outcome:
    """Apply a validated SUBDOC_MULTI_MUTATION to `doc` (a new document from
    `new_document` when it is created). `cas` and `seqno` are the new version's, for the
    macros. SpecFailed names the first spec that failed; SubdocError is a status for the
    whole request (a tombstone that would get a body)."""
    mkdir = bool(req.doc_flags & (MKDOC | ADD))  # both imply MKDIR_P on every path
    indexed = list(enumerate(req.specs))
    body_specs = [(i, s) for i, s in indexed if not s.xattr]
    body_fail, outcome = _body_phase(body_specs, doc, mkdir)
    macros = _Macros(doc, cas, seqno, outcome.body)
    xattr_fail, outcome.blob, results = _xattr_phase([(i, s) for i, s in indexed if s.xattr],
                                                     doc.blob, mkdir, macros)  # fmt: skip
    outcome.results[:0] = results  # the xattr specs come first
    failed = xattr_fail or body_fail
    if failed is not None:
        raise failed
    if outcome.delete_doc:  # the user xattrs go with the body
        outcome.blob = xattrs.system_only(outcome.blob)
    elif doc.deleted:
        outcome.deleted = True
        if outcome.body:
            raise SubdocError(Code.DELETED_DOCUMENT_CANT_HAVE_VALUE,
                              "a deleted document cannot have a value")  # fmt: skip
    return outcome


def _body_phase(specs: list[tuple[int, Spec]], doc: Document,
                mkdir: bool) -> tuple[SpecFailed | None, Outcome]:  # fmt: skip
    body, is_json, deleted = doc.body, doc.json, False
    results: list[tuple[int, bytes]] = []
    root: Any = None
    try:
        for index, spec in specs:
            if spec.op == SpecOp.SET_DOC:
                body, root = spec.value, None
                is_json = _is_json(body)
            elif spec.op == SpecOp.DELETE_DOC:
                body, is_json, root, deleted = b"", False, None, True
            else:
                try:
                    if root is None:
                        if not is_json:
                            raise _PathError(Code.DOC_NOT_JSON)
                        root = parse_document(body)
                    got = mutate_one(spec.op, root, parse_path(spec.path), spec.value, mkdir
                                     or bool(spec.flags & MKDIR_P))  # fmt: skip
                    body = dumps(root)  # DOC_NOT_JSON for a number Python made infinite
                except _PathError as exc:
                    raise SpecFailed(index, exc.status) from None
                if got is not None:
                    results.append((index, got))
    except SpecFailed as exc:
        return exc, Outcome(doc.body, doc.json, doc.blob, False)
    return None, Outcome(body, is_json, doc.blob, deleted, results, delete_doc=deleted)


def _is_json(body: bytes) -> bool:
    try:
        _loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return True


class _Macros:
    """The values EXPAND_MACROS puts in: the new version's CAS and seqno, the CRC32C of
    its body, and fields of the document as it was (`${$document…}`)."""

    def __init__(self, doc: Document, cas: int, seqno: int, body: bytes) -> None:
        self.doc, self.cas, self.seqno, self.body = doc, cas, seqno, body

    def expand(self, value: bytes) -> bytes:
        text = value.decode("utf-8", errors="replace")
        if text == MACROS[0]:  # the CAS in network order, printed as a host-order number
            swapped = int.from_bytes(self.cas.to_bytes(8, "big"), "little")
            return f'"0x{swapped:016x}"'.encode()
        if text == MACROS[1]:
            return f'"0x{self.seqno:016x}"'.encode()
        if text == MACROS[2]:
            return f'"0x{crc32c(self.body):08x}"'.encode()
        match = _DOCUMENT_MACRO.fullmatch(text)
        vattr = document_vattr(self.doc)
        if match is None:
            raise _PathError(Code.XATTR_UNKNOWN_MACRO)
        name = match.group(1)
        if not name:
            return dumps(vattr)
        if not name.startswith(".") or name[1:] not in vattr:
            raise _PathError(Code.XATTR_UNKNOWN_VATTR_MACRO)
        return dumps(vattr[name[1:]])


def _xattr_phase(specs: list[tuple[int, Spec]], blob: bytes, mkdir: bool, macros: _Macros
                 ) -> tuple[SpecFailed | None, bytes, list[tuple[int, bytes]]]:  # fmt: skip
    if not specs:
        return None, blob, []
    root = _xattr_root(blob)
    results: list[tuple[int, bytes]] = []
    for index, spec in specs:
        try:
            value = macros.expand(spec.value) if spec.flags & EXPAND_MACROS else spec.value
            got = mutate_one(spec.op, root, xattr_path(spec.path), value,
                             mkdir or bool(spec.flags & MKDIR_P))  # fmt: skip
        except _PathError as exc:
            return SpecFailed(index, exc.status), blob, []
        if got is not None:
            results.append((index, got))
    return None, xattrs.encode((name, dumps(v)) for name, v in root.items()), results


# -- responses ------------------------------------------------------------------------


def lookup_status(results: list[tuple[int, bytes]], deleted: bool) -> int:
    """The header status of a lookup: SUCCESS or SubdocMultiPathFailure, their Deleted
    forms on a tombstone."""
    if all(status == Code.SUCCESS for status, _ in results):
        return Code.SUCCESS_DELETED if deleted else Code.SUCCESS
    return Code.MULTI_PATH_FAILURE_DELETED if deleted else Code.MULTI_PATH_FAILURE


def lookup_body(results: list[tuple[int, bytes]]) -> bytes:
    """`u16 status, u32 length, value` per spec."""
    return b"".join(LOOKUP_RESULT.pack(st, len(v)) + v for st, v in results)


def mutation_body(results: list[tuple[int, bytes]]) -> bytes:
    """`u8 index, u16 status, u32 length, value` per spec that returns a value."""
    return b"".join(MUTATION_RESULT.pack(i, Code.SUCCESS, len(v)) + v for i, v in results)


def failure_body(failed: SpecFailed) -> bytes:
    """`u8 index, u16 status` of the spec a mutation failed on."""
    return MUTATION_FAILURE.pack(failed.index, failed.status)
