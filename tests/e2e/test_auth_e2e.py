"""Authentication and misuse statuses of `upr serve`, over real sockets.

docs/commands/serve.md and the server's docstring document: wrong password →
AUTH_ERROR 0x20; a bucket command before SELECT_BUCKET → NO_BUCKET 0x08; SELECT_BUCKET
or DCP_OPEN before authenticating → EACCESS 0x24. docs/protocol.md adds: SELECT_BUCKET
of an unknown bucket → EACCESS (docs/protocol.md §5.3); an unknown CONTROL key → EINVAL
(docs/protocol.md §2.14); a second DCP_OPEN → EINVAL and no SASL after DCP_OPEN
(docs/protocol.md §2.1); STREAM_REQ on a connection that is not a DCP producer → EINVAL;
an unknown opcode → UNKNOWN_COMMAND 0x81 (docs/protocol.md §3). Each misuse is a status,
never a disconnect, so every test goes on using the same connection. The last tests run
`upr serve` with options it must refuse before it binds a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import PASSWORD, USER, Node, upr
from tests.e2e.e2e_helpers import spawn_upr
from upr_cli.net.bootstrap import BootstrapError, connect
from upr_cli.net.connection import Connection
from upr_cli.net.scram import ScramClient, plain_message
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import Frame
from upr_cli.protocol.header import Opcode
from upr_cli.protocol.messages import (
    Control,
    DcpOpen,
    Get,
    GetAllVbSeqnos,
    Hello,
    Request,
    ResponseMessage,
    SaslAuth,
    SaslListMechs,
    SaslListMechsResponse,
    SaslStep,
    SelectBucket,
    Set,
    Stat,
    StreamRequest,
    UnknownRequest,
)
from upr_cli.protocol.status import Status

SUCCESS, AUTH_ERROR, AUTH_CONTINUE = Status.SUCCESS, Status.AUTH_ERROR, Status.AUTH_CONTINUE
NO_BUCKET, EACCESS, EINVAL = Status.NO_BUCKET, Status.EACCESS, Status.EINVAL
UNKNOWN_COMMAND, NOT_SUPPORTED = Status.UNKNOWN_COMMAND, Status.NOT_SUPPORTED


@pytest.fixture(scope="module")
def auth_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One node (user admin) for the whole module."""
    node = Node(
        tmp_path_factory.mktemp("auth") / "node", "--flush-interval", "0.02", partitions=4
    ).start()
    yield node
    if node.alive():
        assert node.stop() == 0


class Peer:
    """A raw library `Connection`, keeping whatever DCP traffic the node pushes."""

    def __init__(self, conn: Connection, pushed: list[Any]) -> None:
        self.conn = conn
        self.pushed = pushed

    @classmethod
    async def open(cls, port: int) -> Peer:
        """Connect; no HELLO, no auth, no bucket."""
        pushed: list[Any] = []

        def on_server(items: list[tuple[object, ...]], _nbytes: int) -> None:
            pushed.extend(items)

        conn = await Connection.open("127.0.0.1", port, timeout=5, on_server=on_server)
        return cls(conn, pushed)

    async def call(self, make: Callable[[int], Request]) -> ResponseMessage:
        """Send `make(opaque)` and return its response, whatever the status."""
        return await self.conn.request(make(self.conn.next_opaque()), timeout=10, check=False)

    async def status(self, make: Callable[[int], Request]) -> int:
        """Only the status of `make(opaque)`'s response."""
        return (await self.call(make)).status

    async def plain(self, password: str = PASSWORD, user: str = USER) -> int:
        """SASL PLAIN (docs/protocol.md §5.2)."""
        payload = plain_message(user, password)
        return await self.status(lambda o: SaslAuth(mechanism="PLAIN", payload=payload, opaque=o))

    async def scram(self, password: str = PASSWORD, user: str = USER) -> tuple[int, int]:
        """SCRAM-SHA512: (status of AUTH, status of STEP); verifies the server on success."""
        client = ScramClient("SCRAM-SHA512", user, password)
        first = await self.call(
            lambda o: SaslAuth(mechanism="SCRAM-SHA512", payload=client.first_message(), opaque=o)
        )
        if first.status != AUTH_CONTINUE:
            return first.status, -1
        final = client.final_message(getattr(first, "value", b""))
        done = await self.call(
            lambda o: SaslStep(mechanism="SCRAM-SHA512", payload=final, opaque=o)
        )
        if done.status == SUCCESS:
            client.verify(getattr(done, "value", b""))  # the node proves it knows the key
        return first.status, done.status

    async def select(self, bucket: str = "default") -> int:
        """SELECT_BUCKET (docs/protocol.md §5.3)."""
        return await self.status(lambda o: SelectBucket(bucket=bucket, opaque=o))

    async def alive(self) -> None:
        """The connection still answers: HELLO is allowed in every state."""
        assert await self.status(lambda o: Hello(agent="auth-e2e", features=(), opaque=o)) == 0
        assert not self.conn.closed

    async def kv_round_trip(self, key: bytes) -> None:
        """SET then GET on the selected bucket."""
        value = b'{"k": "%s"}' % key
        assert await self.status(lambda o: Set(key=key, value=value, datatype=1, opaque=o)) == 0
        got = await self.call(lambda o: Get(key=key, opaque=o))
        assert got.status == 0 and getattr(got, "value", None) == value

    async def dcp_open(self, name: str = "auth-e2e") -> int:
        """DCP_OPEN as a producer connection (flag 0x01)."""
        return await self.status(lambda o: DcpOpen(name=name, flags=0x01, opaque=o))

    async def aclose(self) -> None:
        """Close the connection."""
        await self.conn.aclose()


def scenario(node: Node, body: Callable[[Peer], Awaitable[None]]) -> None:
    """Run `body` on a fresh connection to `node`, bounded in time."""

    async def main() -> None:
        peer = await Peer.open(node.port)
        try:
            await body(peer)
            assert not peer.conn.closed, "the node dropped the connection"
        finally:
            await peer.aclose()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert node.alive()


# ---------------------------------------------------------------- SASL


def test_the_node_offers_scram_sha512_and_plain(auth_node: Node) -> None:
    async def body(p: Peer) -> None:
        resp = await p.call(lambda o: SaslListMechs(opaque=o))
        assert isinstance(resp, SaslListMechsResponse)
        assert {"SCRAM-SHA512", "PLAIN"} <= set(resp.names)

    scenario(auth_node, body)


def test_wrong_password_over_plain_is_auth_error_and_the_connection_stays_usable(
    auth_node: Node,
) -> None:
    async def body(p: Peer) -> None:
        assert await p.plain("not-the-password") == AUTH_ERROR
        assert await p.plain(user="nobody") == AUTH_ERROR  # unknown user: the same answer
        await p.alive()
        assert await p.select() == EACCESS  # still not authenticated
        assert await p.plain() == SUCCESS
        assert await p.select() == SUCCESS
        await p.kv_round_trip(b"after-plain")

    scenario(auth_node, body)


def test_wrong_password_over_scram_fails_at_the_final_step(auth_node: Node) -> None:
    async def body(p: Peer) -> None:
        assert await p.scram("not-the-password") == (AUTH_CONTINUE, AUTH_ERROR)
        await p.alive()
        assert await p.select() == EACCESS
        assert await p.scram() == (AUTH_CONTINUE, SUCCESS)
        assert await p.select() == SUCCESS
        await p.kv_round_trip(b"after-scram")

    scenario(auth_node, body)


def test_scram_for_an_unknown_user_looks_like_a_wrong_password(auth_node: Node) -> None:
    """No user enumeration: a challenge comes back, the proof is refused."""

    async def body(p: Peer) -> None:
        assert await p.scram(user="nobody") == (AUTH_CONTINUE, AUTH_ERROR)
        step = await p.status(
            lambda o: SaslStep(mechanism="SCRAM-SHA512", payload=b"c=biws", opaque=o)
        )
        assert step == AUTH_ERROR  # a STEP with no exchange under way
        unknown = await p.status(lambda o: SaslAuth(mechanism="CRAM-MD5", payload=b"", opaque=o))
        assert unknown == AUTH_ERROR
        await p.alive()
        assert await p.scram() == (AUTH_CONTINUE, SUCCESS)

    scenario(auth_node, body)


def test_a_missing_password_or_user_is_named_not_an_auth_failure(auth_node: Node) -> None:
    """A user with no password anywhere (URI, UPR_PASSWORD) and a URI with no user at
    all on a node that has users: each error says what to give, not "authentication
    failed" or EACCESS."""
    where = f"127.0.0.1:{auth_node.port}/default"

    async def main() -> None:
        with pytest.raises(BootstrapError, match=r": no password for admin: set UPR_PASSWORD "
                           r"or put it in the URI$"):  # fmt: skip
            await connect(SourceUri.parse(f"upr://admin@{where}", env={}))
        with pytest.raises(BootstrapError, match=r": the node requires a user: put it in the "
                           rf"URI \(upr://USER@{where}\) and set UPR_PASSWORD$"):  # fmt: skip
            await connect(SourceUri.parse(f"upr://{where}", env={}))

    asyncio.run(asyncio.wait_for(main(), 30))
    proc = upr("tail", f"upr://admin@{where}", "--until-end", check=False)  # as users see it
    assert (proc.returncode, proc.stderr) == (1, f"upr: error: upr://admin@{where}: no "
                                              "password for admin: set UPR_PASSWORD or put it "
                                              "in the URI\n")  # fmt: skip


# ---------------------------------------------------------------- before auth / before a bucket


def test_select_bucket_before_auth_is_eaccess(auth_node: Node) -> None:
    async def body(p: Peer) -> None:
        assert await p.select() == EACCESS
        assert await p.select("no-such-bucket") == EACCESS
        await p.alive()
        assert await p.plain() == SUCCESS
        assert await p.select() == SUCCESS
        await p.kv_round_trip(b"after-eaccess")

    scenario(auth_node, body)


def test_dcp_open_before_auth_is_eaccess(auth_node: Node) -> None:
    async def body(p: Peer) -> None:
        assert await p.dcp_open() == EACCESS
        await p.alive()
        assert await p.plain() == SUCCESS
        assert await p.select() == SUCCESS
        assert await p.dcp_open() == SUCCESS

    scenario(auth_node, body)


@pytest.mark.parametrize(
    "make",
    [
        lambda o: Get(key=b"k", opaque=o),
        lambda o: Set(key=b"k", value=b"v", opaque=o),
        lambda o: GetAllVbSeqnos(opaque=o),
        lambda o: Stat(group="vbucket-seqno", opaque=o),
    ],
    ids=["GET", "SET", "GET_ALL_VB_SEQNOS", "STAT"],
)
def test_a_bucket_command_before_select_bucket_is_no_bucket(
    auth_node: Node, make: Callable[[int], Request]
) -> None:
    async def body(p: Peer) -> None:
        assert await p.plain() == SUCCESS
        assert await p.status(make) == NO_BUCKET
        await p.alive()
        assert await p.select() == SUCCESS
        assert await p.status(make) in (SUCCESS, Status.KEY_ENOENT)  # served now
        await p.kv_round_trip(b"after-no-bucket")

    scenario(auth_node, body)


def test_dcp_open_without_a_bucket_is_refused(auth_node: Node) -> None:
    """docs/protocol.md §2.1: DCP needs a selected bucket (docs/commands/serve.md: a bucket
    command → NO_BUCKET)."""

    async def body(p: Peer) -> None:
        assert await p.plain() == SUCCESS
        assert await p.dcp_open() in (NO_BUCKET, NOT_SUPPORTED)
        await p.alive()
        assert await p.select() == SUCCESS
        assert await p.dcp_open() == SUCCESS

    scenario(auth_node, body)


def test_select_of_an_unknown_bucket_is_eaccess(auth_node: Node) -> None:
    async def body(p: Peer) -> None:
        assert await p.plain() == SUCCESS
        assert await p.select("no-such-bucket") == EACCESS
        assert await p.status(lambda o: Get(key=b"k", opaque=o)) == NO_BUCKET  # none selected
        assert await p.select() == SUCCESS
        assert await p.select("still-not-there") == EACCESS
        await p.kv_round_trip(b"kept-bucket")  # the earlier selection stands

    scenario(auth_node, body)


# ---------------------------------------------------------------- DCP misuse


async def _ready(p: Peer) -> None:
    assert await p.plain() == SUCCESS
    assert await p.select() == SUCCESS


def _finite_stream(o: int) -> StreamRequest:
    return StreamRequest(vbucket=0, opaque=o, start_seqno=0, end_seqno=0)


def test_stream_req_before_dcp_open_is_einval(auth_node: Node) -> None:
    async def body(p: Peer) -> None:
        await _ready(p)
        assert await p.status(_finite_stream) == EINVAL
        ctl = await p.status(lambda o: Control(name="enable_noop", value="true", opaque=o))
        assert ctl == EINVAL  # every DCP request needs DCP_OPEN first
        await p.kv_round_trip(b"before-open")
        assert await p.dcp_open() == SUCCESS
        assert await p.status(_finite_stream) == SUCCESS
        await _wait_for_stream_end(p)

    scenario(auth_node, body)


def test_an_unknown_dcp_control_key_is_einval(auth_node: Node) -> None:
    async def body(p: Peer) -> None:
        await _ready(p)
        assert await p.dcp_open() == SUCCESS
        for name, value in [
            ("no_such_control", "true"),
            ("connection_buffer_size", "lots"),
            ("enable_noop", "maybe"),
        ]:
            got = await p.status(lambda o, n=name, v=value: Control(name=n, value=v, opaque=o))
            assert got == EINVAL, (name, value, got)
        ok = await p.status(
            lambda o: Control(name="connection_buffer_size", value="65536", opaque=o)
        )
        assert ok == SUCCESS
        assert await p.status(_finite_stream) == SUCCESS
        await _wait_for_stream_end(p)

    scenario(auth_node, body)


def test_a_second_dcp_open_is_einval(auth_node: Node) -> None:
    async def body(p: Peer) -> None:
        await _ready(p)
        assert await p.dcp_open("first") == SUCCESS
        assert await p.dcp_open("second") == EINVAL
        assert await p.dcp_open("first") == EINVAL
        ctl = await p.status(lambda o: Control(name="enable_noop", value="true", opaque=o))
        assert ctl == SUCCESS  # the first DCP connection is intact
        assert await p.status(_finite_stream) == SUCCESS
        await _wait_for_stream_end(p)

    scenario(auth_node, body)


def test_sasl_after_dcp_open_is_refused(auth_node: Node) -> None:
    async def body(p: Peer) -> None:
        await _ready(p)
        assert await p.dcp_open() == SUCCESS
        assert await p.plain() != SUCCESS
        assert await p.status(_finite_stream) == SUCCESS  # and the DCP connection goes on
        await _wait_for_stream_end(p)

    scenario(auth_node, body)


async def _wait_for_stream_end(p: Peer) -> None:
    """The finite stream of partition 0 (end seq 0) ends at once with STREAM_END."""
    for _ in range(200):
        if any(type(i) is Frame and i.opcode == Opcode.DCP_STREAM_END for i in p.pushed):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no STREAM_END, got {p.pushed!r}")


# ---------------------------------------------------------------- unknown opcodes


@pytest.mark.parametrize("opcode", [0xEE, 0x0A, 0x83, 0xC0])
def test_an_unknown_opcode_is_unknown_command_in_every_state(auth_node: Node, opcode: int) -> None:
    def unknown(o: int) -> UnknownRequest:
        return UnknownRequest(opcode=opcode, key=b"k", value=b"v", opaque=o)

    async def body(p: Peer) -> None:
        assert await p.status(unknown) == UNKNOWN_COMMAND  # before auth
        assert await p.plain() == SUCCESS
        assert await p.status(unknown) == UNKNOWN_COMMAND  # without a bucket
        assert await p.select() == SUCCESS
        assert await p.status(unknown) == UNKNOWN_COMMAND
        await p.kv_round_trip(b"after-unknown")
        assert await p.dcp_open() == SUCCESS
        assert await p.status(unknown) == UNKNOWN_COMMAND  # on a DCP connection

    scenario(auth_node, body)


# ---------------------------------------------------------------- `upr serve` options


def _serve(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "upr_cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_no_auth_on_a_non_loopback_address_is_refused_before_binding(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = _serve("--data", str(data), "--port", "0", "--no-auth", "--host", "0.0.0.0")
    assert proc.returncode == 2, proc  # a usage error (README "Errors and exit codes")
    assert proc.stdout == ""  # no `listening` line: it never served
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("upr: error: "), proc.stderr
    assert "--no-auth" in proc.stderr and "loopback" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_without_users_and_without_no_auth_is_refused(tmp_path: Path) -> None:
    proc = _serve("--data", str(tmp_path / "data"), "--port", "0")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("upr: error: "), proc.stderr
    assert "user" in proc.stderr


def test_no_auth_on_loopback_serves_without_sasl(tmp_path: Path) -> None:
    with _no_auth_node(tmp_path / "data") as (port, proc):

        async def main() -> None:
            p = await Peer.open(port)
            try:
                assert await p.select() == SUCCESS
                await p.kv_round_trip(b"no-auth")
                assert await p.dcp_open() == SUCCESS
                assert not p.conn.closed, "the node dropped the connection"
            finally:
                await p.aclose()

        asyncio.run(asyncio.wait_for(main(), 30))
        assert proc.poll() is None


@contextlib.contextmanager
def _no_auth_node(data: Path) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """`upr serve --no-auth` with no users (docs/commands/serve.md's "tests and demos" example):
    (its port, the process), killed at the end of the block."""
    with spawn_upr("serve", "--data", str(data), "--port", "0", "--no-auth",
                   "--num-partitions", "4", "--flush-interval", "0.02") as proc:  # fmt: skip
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("listening "), line
        yield int(line.rsplit(":", 1)[1].split("/")[0]), proc


def test_no_auth_takes_any_plain_login_and_offers_plain_alone(tmp_path: Path) -> None:
    """SCRAM cannot accept a password the node does not know (its final message proves
    the node knows it), so a --no-auth node without users offers PLAIN, which takes any."""
    with _no_auth_node(tmp_path / "data") as (port, _proc):

        async def main() -> None:
            p = await Peer.open(port)
            try:
                mechs = await p.call(lambda o: SaslListMechs(opaque=o))
                assert isinstance(mechs, SaslListMechsResponse) and mechs.names == ("PLAIN",)
                failed = await p.scram(user="anyone", password="anything")
                assert failed == (AUTH_CONTINUE, AUTH_ERROR)
                assert await p.plain(user="anyone", password="anything") == SUCCESS
                assert await p.select() == SUCCESS
                await p.kv_round_trip(b"any-login")
            finally:
                await p.aclose()

        asyncio.run(asyncio.wait_for(main(), 30))
        # upr's own client takes what the node offers: PLAIN, with any credentials
        out = upr("tail", f"upr://anyone:anything@127.0.0.1:{port}/default", "--until-end",
                  "--format", "json").stdout  # fmt: skip
        assert '"any-login"' in out


def test_the_official_sdk_uses_a_no_auth_node_with_any_credentials(tmp_path: Path) -> None:
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.exceptions import AuthenticationException
    from couchbase.options import ClusterOptions

    with _no_auth_node(tmp_path / "data") as (port, proc):
        where = f"couchbase://127.0.0.1:{port}=kv"
        # the SDK uses PLAIN on a plain connection only when allowed to
        auth = PasswordAuthenticator("anyone", "anything", allowed_sasl_mechanisms=["PLAIN"])
        cluster = Cluster(where, ClusterOptions(auth))
        try:
            docs = cluster.bucket("default").default_collection()
            docs.upsert("k", {"any": "login"})
            assert docs.get("k").content_as[dict] == {"any": "login"}
        finally:
            cluster.close()
        # with its defaults it insists on SCRAM, which no node can pass for a password
        # it does not know: refused, and the node says once what works instead
        with pytest.raises(AuthenticationException):
            Cluster(where, ClusterOptions(PasswordAuthenticator("anyone", "anything")))
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert err.count("allowed_sasl_mechanisms=PLAIN") == 1, err
    assert "Traceback" not in err
