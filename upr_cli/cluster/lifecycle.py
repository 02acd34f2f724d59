"""The `upr cluster` operations as the CLI calls them: one function a command.

Each takes the cluster's directory, loads DIR/cluster.json, does the work (starting or
stopping node processes, pushing maps, failover, rebalance, pauses) and saves the file
again; the CLI only parses options and renders what comes back.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from upr_cli.cluster import procs, spec
from upr_cli.cluster.control import balanced_map, map_json, push, states_for
from upr_cli.cluster.orchestrate import Orchestrator, Report
from upr_cli.cluster.spec import ClusterSpec, NodeSpec
from upr_cli.errors import UprError, UsageError
from upr_cli.net.collections_manifest import change, spread, with_specs
from upr_cli.net.uri import SourceUri

Progress = Callable[[str], None]


def _loopback(text: str, option: str) -> SourceUri:
    """A node URI given to --adopt or --add: one loopback node."""
    uri = SourceUri.parse(text)
    if uri.host not in ("127.0.0.1", "localhost"):
        raise UsageError(f"{option} {uri.redacted()}: only loopback nodes are supported")
    if uri.seeds:
        raise UsageError(f"{option} {uri.redacted()}: one node per URI")
    return uri


def create(data: Path, *, nodes: int | None, adopt: list[str], replicas: int, partitions: int,
           base_port: int | None, bucket: str, collections: tuple[str, ...] = (),
           tls: tuple[Path, Path] | None = None,
           client_ca: tuple[Path, str] | None = None) -> ClusterSpec:  # fmt: skip
    """`cluster init`: start (or adopt) the nodes, give them the first map, then one
    collections manifest (the newest an adopted node holds, with `collections` created).
    With `tls` (certificate chain, key) every node started serves a TLS data port too;
    with `client_ca` (CA file, enable|mandatory) that port checks client certificates."""
    if client_ca is not None and tls is None:
        raise UsageError("--tls-client-ca needs --tls-cert and --tls-key")
    if (data / spec.CLUSTER_FILE).exists():
        raise UsageError(f"{data}: a cluster exists here (use `upr cluster start`)")
    if (nodes is None) == (not adopt):
        raise UsageError("give --nodes N (start new nodes) or --adopt URI… (running nodes)")
    if adopt and tls is not None:
        raise UsageError("--tls-cert and --tls-key are for the nodes --nodes starts: an "
                         "adopted node keeps the TLS port it was started with")  # fmt: skip
    if adopt:
        cl = asyncio.run(_adopted(adopt, replicas))
    else:
        assert nodes is not None
        cl = spec.ClusterSpec(bucket, partitions, replicas, "admin", spec.new_password())
        if tls is not None:
            cl.tls_cert, cl.tls_key = _tls_files(*tls, client_ca)
            if client_ca is not None:
                cl.tls_client_ca, cl.tls_client_auth = str(client_ca[0].resolve()), client_ca[1]
        for i in range(nodes):
            port = 0 if base_port is None else base_port + i
            cl.nodes.append(spec.NodeSpec(f"n{i}", port, str(data / f"n{i}")))
    if replicas >= len(cl.nodes):
        raise UsageError(f"--replicas {replicas} needs at least {replicas + 1} nodes")
    data.mkdir(parents=True, exist_ok=True)
    try:
        for node in cl.nodes:
            if not node.adopted:
                procs.start_node(cl, node)
            spec.save(data, cl)
        cl.rev, cl.vbmap = 1, balanced_map(cl.partitions, len(cl.nodes), replicas)
        config = map_json(cl, cl.vbmap, cl.rev)
        for i, node in enumerate(cl.nodes):
            want = states_for(cl.vbmap, i)
            asyncio.run(push(cl, node, config, want, full=want))
        spec.save(data, cl)
        # after the map: only active copies write the system events, replicas stream them
        asyncio.run(_first_manifest(cl, collections))
    except BaseException:
        for node in cl.nodes:
            procs.stop_node(node)
        spec.save(data, cl)
        raise
    return cl


def _tls_files(cert: Path, key: Path, client_ca: tuple[Path, str] | None) -> tuple[str, str]:
    """The certificate chain and key as absolute paths (the nodes start in other
    directories), checked now with the client CA: a file that cannot serve is one line
    before any node starts."""
    from upr_cli.net.tls import server_context

    server_context(str(cert), str(key), str(client_ca[0]) if client_ca else None)
    return str(cert.resolve()), str(key.resolve())


async def _first_manifest(cl: ClusterSpec, specs: tuple[str, ...]) -> None:
    """Every node gets the newest manifest any of them holds, then the specs' scopes and
    collections are created on all of them (formats/cluster.md "Collections")."""
    uris = [SourceUri.parse(cl.uri(n)) for n in cl.nodes]
    await spread(uris, range(len(uris)))
    if specs:
        await change(uris[0], lambda m: with_specs(m, specs))


async def _adopted(uris: list[str], replicas: int) -> ClusterSpec:
    """A cluster of running nodes: one bucket, partition count and set of credentials."""
    from upr_cli.net.bootstrap import connect

    parsed = [_loopback(u, "--adopt") for u in uris]
    first = parsed[0]
    for u in parsed:
        if (u.username, u.password, u.bucket) != (first.username, first.password, first.bucket):
            raise UsageError("--adopt: every node needs the same user, password and bucket")
    if not first.username or not first.bucket:
        raise UsageError("--adopt: the URIs need a user and a bucket (upr://user@host:port/b)")
    counts = set()
    tls_ports = []
    for u in parsed:
        s = await connect(u, name="upr-cluster")
        counts.add(s.num_partitions)
        tls_ports.append(tls_port_of(s.config, u.port))
        await s.conn.aclose()
    if len(counts) != 1:
        raise UsageError(f"--adopt: the nodes have different partition counts {sorted(counts)}")
    cl = spec.ClusterSpec(first.bucket, counts.pop(), replicas, first.username,
                          first.password or "")  # fmt: skip
    cl.nodes = [spec.NodeSpec(f"n{i}", u.port, adopted=True, tls_port=t)
                for i, (u, t) in enumerate(zip(parsed, tls_ports, strict=True))]  # fmt: skip
    return cl


def tls_port_of(config: dict[str, Any], port: int) -> int | None:
    """A running node's TLS data port, as its own config names it (`kvSSL` beside the
    plain port `port` in `nodesExt`); None when it serves no TLS."""
    nodes = config.get("nodesExt", [])
    for node in nodes if isinstance(nodes, list) else []:
        services = node.get("services", {}) if isinstance(node, dict) else {}
        kv, kv_ssl = services.get("kv"), services.get("kvSSL")
        if kv == port and isinstance(kv_ssl, int):
            return kv_ssl
    return None


def start(data: Path) -> tuple[ClusterSpec, int]:
    """`cluster start`: start the stopped nodes, give them the map, traffic on."""
    cl = spec.load(data)
    started = []
    for i, node in enumerate(cl.nodes):
        if not node.adopted and not procs.alive(node.pid):
            procs.start_node(cl, node)
            spec.save(data, cl)
            started.append(i)
    if cl.vbmap:
        # a node restarts in the states it persisted, its traffic off (the UPR design
        # specification, "Ordering of partition state transitions"): give it the current
        # map and states (a failed-over node holds nothing any more), then traffic on;
        # so too for one started some other way and still waiting
        orch = Orchestrator(data, cl)
        sts = asyncio.run(orch.statuses())
        waiting = [i for i, st in enumerate(sts) if st.up and not st.traffic and i not in started]
        # the newest collections manifest goes with the states, before traffic is on: a
        # node that missed a change while it was down never serves a stale one; nodes
        # already serving that missed one get it too (formats/cluster.md "Collections")
        asyncio.run(orch.load_manifest())
        if started or waiting:
            asyncio.run(orch.publish({i: orch.member_states(i) for i in started + waiting}))
        asyncio.run(orch.share_manifest(i for i, st in enumerate(sts) if st.up))
    return cl, len(started)


def stop(data: Path) -> tuple[ClusterSpec, int]:
    """`cluster stop`: SIGTERM every node this cluster started; returns how many ran."""
    cl = spec.load(data)
    stopped = sum(procs.stop_node(node) for node in cl.nodes)
    spec.save(data, cl)
    return cl, stopped


def env_lines(data: Path) -> tuple[list[str], bool]:
    """`cluster env`: shell lines exporting the nodes' URIs (UPR_N0, …; UPR_N0_TLS, … for
    their TLS data ports) and the cluster's password as UPR_PASSWORD; and whether the
    caller's UPR_PASSWORD was another one (the eval replaces it: the CLI says so)."""
    cl = spec.load(data)
    # the cluster's own password wins: a UPR_PASSWORD left from an earlier shell (another
    # cluster's, an older run's) would make every URI below fail to authenticate
    lines = [
        "# UPR_PASSWORD: the cluster's password (replaces one set before)",
        f"export UPR_PASSWORD={shlex.quote(cl.password)}",
    ]
    for n in cl.nodes:
        uri = f"upr://{cl.user}@{spec.HOST}:{n.port}/{cl.bucket}"
        lines.append(f"export UPR_{n.name.upper()}={shlex.quote(uri)}")
        if n.tls_port is not None:  # its TLS data port (uprs://, with --cacert)
            uri = f"uprs://{cl.user}@{spec.HOST}:{n.tls_port}/{cl.bucket}"
            lines.append(f"export UPR_{n.name.upper()}_TLS={shlex.quote(uri)}")
    mine = os.environ.get("UPR_PASSWORD")
    return lines, bool(mine) and mine != cl.password


def failover(data: Path, node: str, *, graceful: bool, to: str | None, timeout: float,
             progress: Progress) -> Report:  # fmt: skip
    """`cluster failover`: see `Orchestrator.failover`."""
    orch = Orchestrator(data, spec.load(data), timeout=timeout, progress=progress)
    return asyncio.run(orch.failover(node, graceful=graceful, to=to))


def rebalance(data: Path, *, add: list[str], remove: list[str], base_port: int | None,
              timeout: float, progress: Progress) -> Report:  # fmt: skip
    """`cluster rebalance`: start or adopt the added nodes, then move partitions."""
    cl = spec.load(data)
    for name in remove:
        cl.node(name)
    added: list[NodeSpec] = []
    readd: list[str] = []
    try:
        for item in add:
            known = next((n for n in cl.nodes if n.name == item), None)
            if known is None:
                added.append(_new_node(data, cl, item, added, base_port))
                continue
            if known.member:  # a failed-over or removed node comes back
                raise UsageError(f"--add {item}: the node is in the map already")
            if not known.adopted and not procs.alive(known.pid):
                procs.start_node(cl, known)
            readd.append(item)
    except BaseException:
        for node in added:
            procs.stop_node(node)
        raise
    orch = Orchestrator(data, cl, timeout=timeout, progress=progress)
    return asyncio.run(orch.rebalance(added, remove, readd=readd))


def _new_node(data: Path, cl: ClusterSpec, item: str, added: list[NodeSpec],
              base_port: int | None) -> NodeSpec:  # fmt: skip
    """A node for `--add new` (started, on base port + its number when given) or `--add
    URI` (adopted)."""
    names = {n.name for n in cl.nodes + added}
    k = len(cl.nodes) + len(added)
    while f"n{k}" in names:
        k += 1
    if item != "new":
        node = spec.NodeSpec(f"n{k}", _loopback(item, "--add").port, adopted=True)
        node.tls_port = asyncio.run(_tls_port(cl, node))
        return node
    port = 0 if base_port is None else base_port + k
    node = spec.NodeSpec(f"n{k}", port, str(data / f"n{k}"))
    procs.start_node(cl, node)
    return node


async def _tls_port(cl: ClusterSpec, node: NodeSpec) -> int | None:
    """An adopted node's TLS data port, as it answers with the cluster's credentials
    (None when it serves no TLS or does not answer: the rebalance says what is wrong)."""
    from upr_cli.net.bootstrap import connect

    try:
        s = await connect(SourceUri.parse(cl.uri(node)), name="upr-cluster", timeout=5.0)
    except (UprError, OSError):
        return None
    try:
        return tls_port_of(s.config, node.port)
    finally:
        await s.conn.aclose()


def pause(data: Path, node: str, partitions: list[int] | None, after: int | None, *,
          resume: bool) -> list[int]:  # fmt: skip
    """`cluster pause`/`resume`: the partitions whose replication changed."""
    orch = Orchestrator(data, spec.load(data))
    return asyncio.run(orch.pause(node, partitions, after, resume=resume))
