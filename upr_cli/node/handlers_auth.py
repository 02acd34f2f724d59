"""The node's connection bootstrap commands: HELLO, the error map, SASL and
SELECT_BUCKET (docs/protocol.md §5). Each handler takes the session and the decoded
request, as `node/dispatch.py` calls it, and answers through the session.

Statuses for a misuse, as the README documents them: wrong password → AUTH_ERROR
(0x20); SELECT_BUCKET before authenticating → EACCESS (0x24). A connection that a client
certificate logged in (docs/protocol.md §13.5) keeps that identity: SASL is refused.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from upr_cli.net.scram import AuthenticationFailed, ScramServer, make_credential, parse_plain
from upr_cli.protocol.header import DATATYPE_JSON, Feature, Opcode
from upr_cli.protocol.messages import (
    GetErrorMap,
    Hello,
    HelloResponse,
    Response,
    SaslAuth,
    SaslListMechs,
    SaslListMechsResponse,
    SaslStep,
    SelectBucket,
)
from upr_cli.protocol.status import (
    AccessDenied,
    AuthError,
    InvalidArguments,
    NotSupported,
    Status,
    registered_statuses,
)

if TYPE_CHECKING:
    from upr_cli.node.server import ClientSession

log = logging.getLogger(__name__)

# the HELLO features the node grants (docs/protocol.md §5.1); others asked for are left out
GRANTABLE = {
    Feature.TCP_NODELAY,
    Feature.XERROR,
    Feature.SELECT_BUCKET,
    Feature.JSON,
    Feature.MUTATION_SEQNO,
    Feature.ALT_REQUEST_SUPPORT,
    Feature.COLLECTIONS,
    Feature.SNAPPY,  # values kept as they come, compressed or not (formats/wire.md "Snappy")
    Feature.XATTR,  # documents keep extended attributes (formats/wire.md "Xattrs")
}


def hello(session: ClientSession, msg: Hello) -> None:
    """HELLO: the features asked for that the node grants, remembered per connection."""
    granted = tuple(dict.fromkeys(f for f in msg.features if f in GRANTABLE))
    session.features = set(granted)
    session.send(HelloResponse(opaque=msg.opaque, features=granted))


def sasl_list_mechs(session: ClientSession, msg: SaslListMechs) -> None:
    """SASL_LIST_MECHS: PLAIN alone on a --no-auth node without users."""
    session.send(SaslListMechsResponse(opaque=msg.opaque, mechanisms=session.server.mechanisms))


def get_error_map(session: ClientSession, msg: GetErrorMap) -> None:
    """GET_ERROR_MAP: every registered status, retriable ones with the attribute temp."""
    errors = {
        f"{code:x}": {
            "name": cls.__name__,
            "desc": (cls.__doc__ or "").strip(),
            "attrs": ["temp"] if cls.retriable else ["item-only"],
        }
        for code, cls in registered_statuses().items()
    }
    body = json.dumps({"version": 2, "revision": 1, "errors": errors}).encode()
    session.send(
        Response(opcode=Opcode.GET_ERROR_MAP, opaque=msg.opaque, value=body, datatype=DATATYPE_JSON)
    )


def select_bucket(session: ClientSession, msg: SelectBucket) -> None:
    """SELECT_BUCKET, for an authenticated connection."""
    if not session.authenticated:
        raise AccessDenied("authenticate before selecting a bucket")
    bucket = session.server.buckets.get(msg.bucket)
    if bucket is None:
        raise AccessDenied(f"no bucket {msg.bucket!r}")
    session.bucket = bucket
    session.send(Response(opcode=Opcode.SELECT_BUCKET, opaque=msg.opaque))


def sasl(session: ClientSession, msg: SaslAuth | SaslStep) -> None:
    """SASL PLAIN and SCRAM-SHA512 (docs/protocol.md §5.2); refused after DCP_OPEN (§2.1).
    With --no-auth, PLAIN takes any user and password (SCRAM only the node's users)."""
    if session.dcp is not None:
        raise InvalidArguments("SASL is not accepted after DCP_OPEN")
    if session.cert_user is not None:  # as kv_engine: no change of identity
        raise NotSupported(
            f"this connection is logged in as {session.cert_user!r} by its client "
            "certificate; SASL cannot change that"
        )
    server = session.server
    creds = server.credentials
    try:
        if isinstance(msg, SaslAuth) and msg.mechanism == "PLAIN":
            user, password = parse_plain(msg.payload)
            stored = creds.get(user)
            if not server.config.no_auth and (
                stored is None
                or make_credential(
                    "SCRAM-SHA512", password, salt=stored.salt, iterations=stored.iterations
                )
                != stored
            ):
                raise AuthenticationFailed("bad credentials")
            _authenticated(session, user, msg, b"")
        elif isinstance(msg, SaslAuth) and msg.mechanism == "SCRAM-SHA512":
            session.scram = ScramServer("SCRAM-SHA512", creds.get)
            challenge = session.scram.first(msg.payload)
            session.send(
                Response(
                    opcode=Opcode.SASL_AUTH,
                    opaque=msg.opaque,
                    status=Status.AUTH_CONTINUE,
                    value=challenge,
                )
            )
        elif isinstance(msg, SaslStep) and session.scram is not None:
            final = session.scram.final(msg.payload)
            _authenticated(session, session.scram.username or "", msg, final)
            session.scram = None
        else:
            raise AuthenticationFailed(f"unsupported mechanism {msg.mechanism!r}")
    except AuthenticationFailed:
        session.scram = None
        if server.config.no_auth and msg.mechanism != "PLAIN":
            # the official SDK uses SCRAM on a plain connection unless told
            # otherwise: say once what works instead
            if not server.warned_no_auth_scram:
                server.warned_no_auth_scram = True
                log.warning(
                    "a client failed SCRAM on this --no-auth node: it takes any user and "
                    "password with SASL PLAIN (the Couchbase SDKs: "
                    "allowed_sasl_mechanisms=PLAIN), SCRAM only for --user"
                )
            raise AuthError(
                "authentication failed: a --no-auth node takes any user and password "
                "with PLAIN, SCRAM only for its own users"
            ) from None
        raise AuthError("authentication failed") from None


def _authenticated(session: ClientSession, user: str, msg: SaslAuth | SaslStep,
                   payload: bytes) -> None:  # fmt: skip
    """Log the connection in, raise its frame limit (docs/protocol.md §1.6) and answer."""
    session.authenticated, session.user = True, user
    session.decoder.max_body = session.server.config.max_body
    opcode = Opcode.SASL_AUTH if isinstance(msg, SaslAuth) else Opcode.SASL_STEP
    session.send(Response(opcode=opcode, opaque=msg.opaque, value=payload))
