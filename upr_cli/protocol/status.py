"""Memcached binary-protocol status codes, each a named error class (docs/protocol.md §3).

`error_for_status(code)` returns the class for a code; unknown codes get
`UnknownStatus`. `retriable` says whether the same request may succeed later
without the caller changing anything but waiting (or refreshing the cluster map).
"""

from __future__ import annotations

import json
from enum import IntEnum
from typing import ClassVar

from upr_cli.errors import UprError


class Status(IntEnum):
    """Status field of a response (header bytes 6-7)."""

    SUCCESS = 0x00
    KEY_ENOENT = 0x01
    KEY_EEXISTS = 0x02
    E2BIG = 0x03
    EINVAL = 0x04
    NOT_STORED = 0x05
    NOT_MY_VBUCKET = 0x07
    NO_BUCKET = 0x08
    LOCKED = 0x09
    DCP_STREAM_NOT_FOUND = 0x0A
    OPAQUE_NO_MATCH = 0x0B
    AUTH_ERROR = 0x20
    AUTH_CONTINUE = 0x21
    ERANGE = 0x22
    ROLLBACK = 0x23
    EACCESS = 0x24
    UNKNOWN_COMMAND = 0x81
    ENOMEM = 0x82
    NOT_SUPPORTED = 0x83
    EBUSY = 0x85
    ETMPFAIL = 0x86
    UNKNOWN_COLLECTION = 0x88
    NO_COLLECTIONS_MANIFEST = 0x89
    CANNOT_APPLY_COLLECTIONS_MANIFEST = 0x8A
    COLLECTIONS_MANIFEST_IS_AHEAD = 0x8B
    UNKNOWN_SCOPE = 0x8C
    DCP_STREAMID_INVALID = 0x8D
    # the sub-document statuses (formats/subdoc.md; kv_engine's include/mcbp/protocol/status.h)
    XATTR_EINVAL = 0x87
    SUBDOC_PATH_ENOENT = 0xC0
    SUBDOC_PATH_MISMATCH = 0xC1
    SUBDOC_PATH_EINVAL = 0xC2
    SUBDOC_PATH_E2BIG = 0xC3
    SUBDOC_DOC_E2DEEP = 0xC4
    SUBDOC_VALUE_CANTINSERT = 0xC5
    SUBDOC_DOC_NOT_JSON = 0xC6
    SUBDOC_NUM_ERANGE = 0xC7
    SUBDOC_DELTA_EINVAL = 0xC8
    SUBDOC_PATH_EEXISTS = 0xC9
    SUBDOC_VALUE_ETOODEEP = 0xCA
    SUBDOC_INVALID_COMBO = 0xCB
    SUBDOC_MULTI_PATH_FAILURE = 0xCC
    SUBDOC_SUCCESS_DELETED = 0xCD
    SUBDOC_XATTR_INVALID_FLAG_COMBO = 0xCE
    SUBDOC_XATTR_INVALID_KEY_COMBO = 0xCF
    SUBDOC_XATTR_UNKNOWN_MACRO = 0xD0
    SUBDOC_XATTR_UNKNOWN_VATTR = 0xD1
    SUBDOC_XATTR_CANT_MODIFY_VATTR = 0xD2
    SUBDOC_MULTI_PATH_FAILURE_DELETED = 0xD3
    SUBDOC_INVALID_XATTR_ORDER = 0xD4
    SUBDOC_XATTR_UNKNOWN_VATTR_MACRO = 0xD5
    SUBDOC_DELETED_DOCUMENT_CANT_HAVE_VALUE = 0xD7


class StatusError(UprError):
    """A response carried a non-success status."""

    status: ClassVar[int] = -1
    retriable: ClassVar[bool] = False

    def __init__(self, message: str = "", *, body: bytes = b"", opcode: int | None = None):
        self.body = body
        self.opcode = opcode
        super().__init__(message or self.default_message())

    @classmethod
    def default_message(cls) -> str:
        """A short description of the status for messages."""
        return f"{cls.__name__} (status 0x{cls.status:02x})"

    @property
    def code(self) -> int:
        """The numeric status of this error."""
        return self.status


class UnknownStatus(StatusError):
    """A status code not in the registry; the code is kept on the instance."""

    def __init__(self, code: int, message: str = "", **kw: object):
        self._code = code
        super().__init__(message or f"unknown status 0x{code:04x}", **kw)  # type: ignore[arg-type]

    @property
    def code(self) -> int:
        """The numeric status of this error."""
        return self._code


def _status_error(
    name: str, status: Status, doc: str, retriable: bool = False
) -> type[StatusError]:
    cls = type(
        name, (StatusError,), {"__doc__": doc, "status": int(status), "retriable": retriable}
    )
    return cls


# One class per status of docs/protocol.md §3 (plus the KV statuses SET/GET return).
KeyNotFound = _status_error("KeyNotFound", Status.KEY_ENOENT, "KEY_ENOENT: no such key or stream.")
KeyExists = _status_error(
    "KeyExists", Status.KEY_EEXISTS, "KEY_EEXISTS: key or stream exists / CAS mismatch."
)
ValueTooLarge = _status_error("ValueTooLarge", Status.E2BIG, "E2BIG: value too large.")
InvalidArguments = _status_error("InvalidArguments", Status.EINVAL, "EINVAL: malformed request.")
NotStored = _status_error("NotStored", Status.NOT_STORED, "NOT_STORED: the item was not stored.")
NotMyVbucket = _status_error(
    "NotMyVbucket", Status.NOT_MY_VBUCKET, "NOT_MY_VBUCKET: partition not held here.", True
)
NoBucket = _status_error("NoBucket", Status.NO_BUCKET, "NO_BUCKET: no bucket selected.")
Locked = _status_error("Locked", Status.LOCKED, "LOCKED: the item is locked.", True)
DcpStreamNotFound = _status_error(
    "DcpStreamNotFound", Status.DCP_STREAM_NOT_FOUND, "DCP stream not found (consumer side)."
)
OpaqueNoMatch = _status_error(
    "OpaqueNoMatch", Status.OPAQUE_NO_MATCH, "Opaque does not match a stream."
)
AuthError = _status_error("AuthError", Status.AUTH_ERROR, "AUTH_ERROR: authentication failed.")
AuthContinue = _status_error(
    "AuthContinue", Status.AUTH_CONTINUE, "AUTH_CONTINUE: SASL step needed."
)
OutOfRange = _status_error("OutOfRange", Status.ERANGE, "ERANGE: seqno arguments out of range.")
RollbackRequired = _status_error(
    "RollbackRequired", Status.ROLLBACK, "ROLLBACK: the stream must restart from a lower seqno."
)
AccessDenied = _status_error("AccessDenied", Status.EACCESS, "EACCESS: not authorised.")
UnknownCommand = _status_error("UnknownCommand", Status.UNKNOWN_COMMAND, "Unknown command.")
OutOfMemory = _status_error("OutOfMemory", Status.ENOMEM, "ENOMEM: out of memory.", True)
NotSupported = _status_error("NotSupported", Status.NOT_SUPPORTED, "Not supported.")
Busy = _status_error("Busy", Status.EBUSY, "EBUSY: server busy.", True)
TemporaryFailure = _status_error(
    "TemporaryFailure", Status.ETMPFAIL, "ETMPFAIL: temporary failure (e.g. warm-up).", True
)
UnknownCollection = _status_error(
    "UnknownCollection", Status.UNKNOWN_COLLECTION, "Unknown collection."
)
UnknownScope = _status_error("UnknownScope", Status.UNKNOWN_SCOPE, "Unknown scope.")
NoCollectionsManifest = _status_error(
    "NoCollectionsManifest", Status.NO_COLLECTIONS_MANIFEST, "No collections manifest set yet."
)
CannotApplyManifest = _status_error(
    "CannotApplyManifest", Status.CANNOT_APPLY_COLLECTIONS_MANIFEST,
    "The collections manifest cannot be applied.",
)  # fmt: skip
# retriable: the cluster manager brings the node the newer manifest
ManifestAhead = _status_error(
    "ManifestAhead", Status.COLLECTIONS_MANIFEST_IS_AHEAD,
    "The request's manifest uid is ahead of the node's.", True,
)  # fmt: skip
DcpStreamIdInvalid = _status_error(
    "DcpStreamIdInvalid",
    Status.DCP_STREAMID_INVALID,
    "Stream-id present/missing against the control.",
)
# The sub-document statuses (formats/subdoc.md), named as kv_engine names them; a header
# status for a whole request, or one spec's status in a multi-path response body.
_SUBDOC_DOCS = {
    Status.XATTR_EINVAL: ("XattrEinval", "An xattr name or value is not valid."),
    Status.SUBDOC_PATH_ENOENT: ("SubdocPathEnoent", "The path does not exist in the document."),
    Status.SUBDOC_PATH_MISMATCH: ("SubdocPathMismatch", "A path component meets the wrong type."),
    Status.SUBDOC_PATH_EINVAL: ("SubdocPathEinval", "The path does not parse."),
    Status.SUBDOC_PATH_E2BIG: ("SubdocPathE2big", "The path has too many components."),
    Status.SUBDOC_DOC_E2DEEP: ("SubdocDocE2deep", "The document nests too deeply."),
    Status.SUBDOC_VALUE_CANTINSERT: ("SubdocValueCantinsert", "The value cannot be inserted."),
    Status.SUBDOC_DOC_NOT_JSON: ("SubdocDocNotJson", "The document is not JSON."),
    Status.SUBDOC_NUM_ERANGE: ("SubdocNumErange", "The number at the path is out of range."),
    Status.SUBDOC_DELTA_EINVAL: ("SubdocDeltaEinval", "The counter delta is not valid."),
    Status.SUBDOC_PATH_EEXISTS: ("SubdocPathEexists", "The path already exists."),
    Status.SUBDOC_VALUE_ETOODEEP: ("SubdocValueEtoodeep", "The value would nest too deeply."),
    Status.SUBDOC_INVALID_COMBO: ("SubdocInvalidCombo", "The specs do not combine."),
    Status.SUBDOC_MULTI_PATH_FAILURE: ("SubdocMultiPathFailure", "At least one spec failed."),
    Status.SUBDOC_SUCCESS_DELETED: ("SubdocSuccessDeleted", "Success, on a deleted document."),
    Status.SUBDOC_XATTR_INVALID_FLAG_COMBO: (
        "SubdocXattrInvalidFlagCombo", "The path flags do not combine."),
    Status.SUBDOC_XATTR_INVALID_KEY_COMBO: (
        "SubdocXattrInvalidKeyCombo", "The specs name more than one xattr."),
    Status.SUBDOC_XATTR_UNKNOWN_MACRO: ("SubdocXattrUnknownMacro", "An unknown macro."),
    Status.SUBDOC_XATTR_UNKNOWN_VATTR: ("SubdocXattrUnknownVattr", "An unknown virtual xattr."),
    Status.SUBDOC_XATTR_CANT_MODIFY_VATTR: (
        "SubdocXattrCantModifyVattr", "A virtual xattr cannot change."),
    Status.SUBDOC_MULTI_PATH_FAILURE_DELETED: (
        "SubdocMultiPathFailureDeleted", "At least one spec failed, on a deleted document."),
    Status.SUBDOC_INVALID_XATTR_ORDER: (
        "SubdocInvalidXattrOrder", "An xattr spec after a body spec."),
    Status.SUBDOC_XATTR_UNKNOWN_VATTR_MACRO: (
        "SubdocXattrUnknownVattrMacro", "An unknown virtual-xattr macro."),
    Status.SUBDOC_DELETED_DOCUMENT_CANT_HAVE_VALUE: (
        "SubdocDeletedDocumentCantHaveValue", "A deleted document cannot have a value."),
}  # fmt: skip
_SUBDOC_ERRORS = [_status_error(name, code, doc) for code, (name, doc) in _SUBDOC_DOCS.items()]

_REGISTRY: dict[int, type[StatusError]] = {
    cls.status: cls
    for cls in (
        KeyNotFound,
        KeyExists,
        ValueTooLarge,
        InvalidArguments,
        NotStored,
        NotMyVbucket,
        NoBucket,
        Locked,
        DcpStreamNotFound,
        OpaqueNoMatch,
        AuthError,
        AuthContinue,
        OutOfRange,
        RollbackRequired,
        AccessDenied,
        UnknownCommand,
        OutOfMemory,
        NotSupported,
        Busy,
        TemporaryFailure,
        UnknownCollection,
        NoCollectionsManifest,
        CannotApplyManifest,
        ManifestAhead,
        UnknownScope,
        DcpStreamIdInvalid,
        *_SUBDOC_ERRORS,
    )
}


def error_for_status(code: int) -> type[StatusError]:
    """The error class registered for a status code (`UnknownStatus` if none)."""
    return _REGISTRY.get(code, UnknownStatus)


def status_error(
    code: int, message: str = "", *, body: bytes = b"", opcode: int | None = None
) -> StatusError:
    """Build the error instance for a non-success status code."""
    if code == Status.SUCCESS:
        raise ValueError("status 0 is success, not an error")
    cls = _REGISTRY.get(code)
    if cls is None:
        return UnknownStatus(code, message, body=body, opcode=opcode)
    return cls(message, body=body, opcode=opcode)


def error_context(body: bytes) -> str:
    """The text of an error body, on one line: the `error.context` of kv_engine's JSON
    error body (docs/protocol.md §3), else the body as text."""
    text = body.decode(errors="replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        return " ".join(text.split())
    found = doc.get("error", {}).get("context") if isinstance(doc, dict) else None
    if not isinstance(found, str) and isinstance(doc, dict) and "manifest_uid" in doc:
        found = (
            f"manifest uid 0x{doc['manifest_uid']}"  # UnknownCollection (docs/protocol.md §12.2)
        )
    return " ".join(found.split()) if isinstance(found, str) else " ".join(text.split())


def registered_statuses() -> dict[int, type[StatusError]]:
    """A copy of the code → class registry (for docs and tests)."""
    return dict(_REGISTRY)
