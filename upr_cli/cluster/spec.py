"""The cluster file `DIR/cluster.json`: what `upr cluster` created or adopted.

It names each node (data directory, port, TLS port, pid while running), the bucket, the
partition count and replica count, the credentials the nodes were started with (the
file is written with mode 0600) and, for a TLS cluster, the certificate and key every
node serves its TLS data port with. Only loopback addresses are used.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from upr_cli.errors import UsageError
from upr_cli.fsio import atomic_write

CLUSTER_FILE = "cluster.json"
HOST = "127.0.0.1"


@dataclass
class NodeSpec:
    """One node: its name, data directory (empty when adopted), ports and pid."""

    name: str
    port: int
    data: str = ""
    pid: int | None = None
    adopted: bool = False
    member: bool = True  # False once failed over or rebalanced out (it holds no partition)
    tls_port: int | None = None  # its TLS data port (kvSSL in the map); None: plain only


@dataclass
class ClusterSpec:
    """A cluster: its nodes and what the map must hold."""

    bucket: str
    partitions: int
    replicas: int
    user: str
    password: str
    nodes: list[NodeSpec] = field(default_factory=list)
    rev: int = 0  # the newest map revision pushed
    vbmap: list[list[int]] = field(default_factory=list)  # partition → [active, replicas…]
    tls_cert: str = ""  # PEM chain the started nodes serve TLS with ("": no TLS port)
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM CA the TLS ports check client certificates with ("": none)
    tls_client_auth: str = ""  # "enable" or "mandatory" with tls_client_ca

    @property
    def tls(self) -> bool:
        """True when the nodes this cluster starts serve a TLS data port."""
        return bool(self.tls_cert)

    def uri(self, node: NodeSpec) -> str:
        """The node's URI with credentials (never printed: use `redacted`)."""
        return f"upr://{self.user}:{self.password}@{HOST}:{node.port}/{self.bucket}"

    def members(self) -> list[int]:
        """Indices of the nodes that may hold partitions."""
        return [i for i, n in enumerate(self.nodes) if n.member]

    def index(self, name: str) -> int:
        """A node's index in the map's server list."""
        return self.nodes.index(self.node(name))

    def node(self, name: str) -> NodeSpec:
        """A node by name; a usage error names the known ones."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise UsageError(
            f"no node {name!r} in the cluster ({', '.join(n.name for n in self.nodes)})"
        )

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> ClusterSpec:
        """Parse `to_json` output."""
        try:
            nodes = [NodeSpec(**n) for n in obj["nodes"]]
            vbmap = [[int(i) for i in row] for row in obj.get("vbmap", [])]
            return cls(obj["bucket"], int(obj["partitions"]), int(obj["replicas"]), obj["user"],
                       obj["password"], nodes, int(obj.get("rev", 0)), vbmap,
                       str(obj.get("tls_cert", "")), str(obj.get("tls_key", "")),
                       str(obj.get("tls_client_ca", "")),
                       str(obj.get("tls_client_auth", "")))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"malformed cluster file: {exc}") from None


def new_password() -> str:
    """Credentials for the nodes of a new local cluster."""
    return secrets.token_urlsafe(18)


def load(directory: Path) -> ClusterSpec:
    """The cluster of `directory`; a missing one is a usage error."""
    path = directory / CLUSTER_FILE
    try:
        return ClusterSpec.from_json(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise UsageError(f"{directory}: no cluster here (run `upr cluster init`)") from None
    except ValueError as exc:
        raise UsageError(f"{path}: not a cluster file: {exc}") from None


def save(directory: Path, spec: ClusterSpec) -> None:
    """Write the cluster file atomically, readable by its owner only (credentials)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CLUSTER_FILE
    atomic_write(path, (json.dumps(spec.to_json(), indent=2) + "\n").encode())
    os.chmod(path, 0o600)
