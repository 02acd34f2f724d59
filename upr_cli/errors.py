"""Error hierarchy shared by every layer: errors are split by who is at fault.

`UprError` is the base the CLI turns into one line on stderr and exit 1.
`LocalProtocolError`: we misused the protocol (a bug or bad arguments on our side).
`RemoteProtocolError`: the peer sent bytes that do not follow the protocol.
`UsageError`: the user gave input that cannot be acted on (the CLI exits 2).
"""

from __future__ import annotations


class UprError(Exception):
    """Base of every error upr raises on purpose."""

    exit_code: int = 1


class LocalProtocolError(UprError):
    """We tried to send something the protocol does not allow."""


class RemoteProtocolError(UprError):
    """The peer sent bytes that do not follow the protocol."""


class UsageError(UprError):
    """Input given by the user is malformed or inconsistent."""

    exit_code = 2
