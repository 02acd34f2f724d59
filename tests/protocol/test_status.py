"""Status registry: every status of docs/protocol.md §3 is a named error class with `retriable`."""

from __future__ import annotations

import pytest

from upr_cli.errors import UprError
from upr_cli.protocol.status import (
    NotMyVbucket,
    RollbackRequired,
    Status,
    StatusError,
    UnknownStatus,
    error_for_status,
    registered_statuses,
    status_error,
)

# docs/protocol.md §3, "Status codes seen around DCP" (0x00 success is not an error).
SPEC_CODES = {
    0x01: "KeyEnoent", 0x02: "KeyEexists", 0x04: "Einval", 0x07: "NotMyVbucket",
    0x08: "NoBucket", 0x0A: "DcpStreamNotFound", 0x0B: "OpaqueNoMatch", 0x20: "AuthError",
    0x21: "AuthContinue", 0x22: "Erange", 0x23: "Rollback", 0x24: "Eaccess",
    0x81: "UnknownCommand", 0x82: "Enomem", 0x83: "NotSupported", 0x85: "Ebusy",
    0x86: "Etmpfail", 0x88: "UnknownCollection", 0x8C: "UnknownScope",
    0x8D: "DcpStreamIdInvalid",
}  # fmt: skip
RETRIABLE = {0x07, 0x82, 0x85, 0x86}


@pytest.mark.parametrize("code", sorted(SPEC_CODES))
def test_every_spec_status_has_a_class(code: int) -> None:
    cls = error_for_status(code)
    assert cls is not UnknownStatus and issubclass(cls, StatusError) and issubclass(cls, UprError)
    assert cls.status == code == Status(code)
    assert cls.retriable is (code in RETRIABLE)
    err = status_error(code, body=b"ctx", opcode=0x53)
    assert isinstance(err, cls) and err.code == code and err.body == b"ctx" and err.opcode == 0x53
    assert str(err)


def test_class_names_are_distinct() -> None:
    reg = registered_statuses()
    assert len({c.__name__ for c in reg.values()}) == len(reg)
    assert set(SPEC_CODES) <= set(reg)


def test_unknown_code_keeps_its_value() -> None:
    err = status_error(0xFF01)
    assert isinstance(err, UnknownStatus) and err.code == 0xFF01 and not err.retriable


def test_success_is_not_an_error() -> None:
    with pytest.raises(ValueError):
        status_error(0)


def test_specific_classes_can_be_caught() -> None:
    with pytest.raises(RollbackRequired):
        raise status_error(0x23)
    assert NotMyVbucket.retriable


def test_every_status_has_a_class_and_the_subdoc_ones_are_named_as_kv_engine() -> None:
    reg = registered_statuses()
    assert set(reg) == {int(s) for s in Status} - {Status.SUCCESS}
    assert reg[0x87].__name__ == "XattrEinval" and reg[0xC0].__name__ == "SubdocPathEnoent"
    assert reg[0xD7].__name__ == "SubdocDeletedDocumentCantHaveValue"
    assert not any(reg[code].retriable for code in (0x87, *range(0xC0, 0xD6), 0xD7))
