"""HELLO Collections (docs/protocol.md "Collections"): offered by default, used only
when granted, and keys sent in the form the connection negotiated."""

from __future__ import annotations

import pytest

from tests.dcp.inprocess import run
from tests.dcp.test_consumer_collections import RawNode, serving
from upr_cli.net.bootstrap import WANTED, BootstrapError, Session, connect, partition_of
from upr_cli.net.router import Router, RouterError
from upr_cli.protocol.header import Feature


async def _session(node: RawNode, **kw: object) -> Session:
    return await connect(node.uri, **kw)  # type: ignore[arg-type]


def test_a_server_that_grants_collections_gets_prefixed_keys() -> None:
    async def scenario() -> None:
        async with serving(RawNode()) as node:
            s = await _session(node)
            try:
                assert Feature.COLLECTIONS in node.offered and Feature.COLLECTIONS in WANTED
                assert s.collections and s.conn.collections  # the decoder splits ids
                assert s.qualify(b"k") == b"\x00k"
                assert s.qualify(b"k", 0x90) == b"\x90\x01k"
            finally:
                await s.conn.aclose()

    run(scenario())


def test_a_server_that_does_not_grant_them_keeps_plain_keys() -> None:
    async def scenario() -> None:
        async with serving(RawNode(collections=False)) as node:
            s = await _session(node)
            try:
                assert Feature.COLLECTIONS in node.offered  # asked, refused
                assert not s.collections and not s.conn.collections
                assert s.qualify(b"k") == b"k"
                with pytest.raises(BootstrapError, match="does not support collections"):
                    s.qualify(b"k", 8)
            finally:
                await s.conn.aclose()

    run(scenario())


def test_a_caller_may_leave_collections_out_of_hello() -> None:
    async def scenario() -> None:
        async with serving(RawNode()) as node:
            without = tuple(f for f in WANTED if f != Feature.COLLECTIONS)
            s = await _session(node, features=without)
            try:
                assert Feature.COLLECTIONS not in node.offered and not s.collections
            finally:
                await s.conn.aclose()

    run(scenario())


@pytest.mark.parametrize("granted", [True, False])
def test_the_router_qualifies_keys_as_its_nodes_negotiated(granted: bool) -> None:
    async def scenario() -> None:
        async with serving(RawNode(collections=granted, partitions=4)) as node:
            router = await Router.open(node.uri)
            try:
                assert router.collections is granted
                assert router.qualify(b"doc") == (b"\x00doc" if granted else b"doc")
                # the partition hashes the document key, never the prefixed one
                assert router.partition(b"doc") == partition_of(b"doc", 4)
                if granted:
                    assert router.qualify(b"doc", 9) == b"\x09doc"
                else:
                    with pytest.raises(RouterError, match="does not support collections"):
                        router.qualify(b"doc", 9)
            finally:
                await router.aclose()

    run(scenario())
