"""The main job on the embedded default: backups through a failover, on a local `upr serve`.

What `make demo` runs. Every step is a real `upr` command in its own process:

1. start a node (loopback, no auth) with sample data (`upr load`);
2. a full backup, more writes, an incremental backup;
3. restart the node so new writes stay unpersisted, write, and back them up;
4. SIGKILL the node (those writes are lost) and restart it;
5. a fourth backup: it records each partition's rollback and carries on;
6. `upr info`, `upr verify`, `upr examine` of a lost write;
7. restore into SQLite: row count and content hash equal the node's;
8. a replica replays the node and rolls the lost writes back;
9. collections: a 64-partition node with several collections (the workload spread over
   them, with updates and deletes, and one collection dropped), backed up and restored
   into a node with 16 partitions: every key rehashed, every collection equal;
10. xattrs: documents written with a system xattr (`_sync`, holding the CAS the node
   expanded) and a user xattr (`meta`), updated and deleted (a tombstone keeps `_sync`),
   backed up and restored into another node: every xattr and tombstone comes back.

Along the way a replica follows the node with `upr replay` into SQLite (queried with
SQLite's JSON functions); after the crash `upr diff` shows where the node and the backup
diverged and `upr salvage` lists the lost writes that could go back (dry run); the
replica's next replay rolls those writes back and it ends equal to the node.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
console = Console(width=None if sys.stdout.isatty() else 120, highlight=False)
PARTITIONS = 16


def upr(
    *args: str, show: bool = False, ok: tuple[int, ...] = (0,)
) -> subprocess.CompletedProcess[str]:
    """Run `upr ARGS`; fail loudly unless it exits with one of `ok`; optionally echo it."""
    console.print(f"[dim]$ upr {' '.join(args)}[/]")
    proc = subprocess.run([sys.executable, "-m", "upr_cli", *args], capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    if proc.returncode not in ok:
        raise SystemExit(f"demo: `upr {args[0]}` failed: {proc.stderr.strip()}")
    if show:
        console.print(proc.stdout.rstrip(), markup=False, highlight=False, soft_wrap=True)
    return proc


class Node:
    """`upr serve` on a free loopback port, restartable on the same port."""

    def __init__(self, data: Path, partitions: int = PARTITIONS) -> None:
        self.data, self.port, self.partitions = data, 0, partitions
        self.proc: subprocess.Popen[str] | None = None

    def start(self, *extra: str) -> None:
        for _ in range(50):
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "upr_cli", "serve", "--data", str(self.data), "--port",
                 str(self.port), "--no-auth", "--num-partitions", str(self.partitions), *extra],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if line.startswith("listening "):
                self.port = int(line.rsplit(":", 1)[1].split("/")[0])
                return
            self.proc.wait()
            time.sleep(0.1)
        raise SystemExit("demo: upr serve did not start")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    @property
    def uri(self) -> str:
        return f"upr://127.0.0.1:{self.port}/default"


def node_content(uri: str) -> tuple[int, str]:
    """Live documents and their content hash, read from the node over DCP (the library)."""
    from upr_cli.dcp.consumer import DcpConsumer
    from upr_cli.net.uri import SourceUri
    from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
    from upr_cli.store import content_hash_of

    async def drain() -> dict[bytes, tuple[bytes, int, int, int, int]]:
        c = DcpConsumer(SourceUri.parse(uri), until_end=True)
        live: dict[bytes, tuple[bytes, int, int, int, int]] = {}
        await c.open()
        try:
            async for batch in c.batches():
                for it in batch:
                    if type(it) is DcpRecord:
                        k = bytes(it.key)
                        if it.opcode == OP_MUTATION:
                            live[k] = (bytes(it.value), it.cas, it.rev_seqno, it.flags,
                                       it.expiration)  # fmt: skip
                        else:
                            live.pop(k, None)
        finally:
            await c.aclose()
        return live

    live = asyncio.run(drain())
    return len(live), content_hash_of((k, *v) for k, v in live.items())


def backup(node: Node, repo: Path, title: str) -> dict[str, object]:
    out = json.loads(upr("backup", node.uri, "--repo", str(repo), "--json").stdout)
    ratio = out["ratio"] or "-"
    console.print(
        f"[bold]{title}[/]: backup {out['backup_id']}: {out['items']:,} items, "
        f"ratio {ratio}, {out['items_per_s'] or 0:,} items/s, "
        f"{len(out['rollbacks'])} rollbacks"
    )  # type: ignore[arg-type]
    return out


def by_collection(uri: str) -> dict[str, tuple[int, str]]:
    """Live documents per scope.collection and a hash of their keys and values, as
    `upr tail --until-end` prints them (the names come from the node's manifest)."""
    import hashlib

    out = upr("tail", uri, "--until-end", "--format", "json").stdout
    live: dict[tuple[str, str], bytes] = {}
    for line in out.splitlines():
        row = json.loads(line)
        if "event" in row:
            continue  # a collection or scope created or dropped
        doc = (f"{row['scope']}.{row['collection']}", row["key"])
        if row["op"] == "mutation":
            live[doc] = json.dumps([row.get("value"), row.get("value_b64"), row["flags"],
                                    row["expiry"]]).encode()  # fmt: skip
        else:
            live.pop(doc, None)
    counts: dict[str, tuple[int, str]] = {}
    for name in sorted({c for c, _k in live}):
        h = hashlib.sha256()
        keys = sorted(k for c, k in live if c == name)
        for k in keys:
            h.update(k.encode() + b"\0" + live[(name, k)])
        counts[name] = (len(keys), h.hexdigest()[:16])
    return counts


def collections_story(tmp: Path) -> bool:
    """Step 9: collections backed up from 64 partitions and restored into 16."""
    src, dst = Node(tmp / "coll-src", partitions=64), Node(tmp / "coll-dst", partitions=16)
    src.start("--flush-interval", "0.05", "--collections", "app.users,app.orders,app.logs,"
              "inventory.items:86400")  # fmt: skip
    dst.start("--flush-interval", "0.05")
    try:
        upr("collections", "list", src.uri, show=True)
        upr("load", src.uri, "--docs", "12000", "--collections",
            "app.users,app.orders,app.logs,inventory.items", "--update-ratio", "0.3",
            "--delete-ratio", "0.1", "--seed", "9")  # fmt: skip
        upr("load", src.uri, "--docs", "2000", "--prefix", "plain", "--seed", "10")
        upr("collections", "drop", src.uri, "app.logs", show=True)
        repo = tmp / "coll-repo"
        backup(src, repo, "collections")
        upr("info", "--repo", str(repo), show=True)
        out = json.loads(upr("restore", "--repo", str(repo), dst.uri, "--json").stdout)
        parts = f"{out['source_partitions']} into {out['target_partitions']} partitions"
        how = "every key rehashed" if out["rehash"] else "same partitions"
        console.print(f"restored {out['items']:,} items from {parts} ({how})")
        before, after = by_collection(src.uri), by_collection(dst.uri)
        table = Table(title="live documents per collection")
        for col in ("collection", "source (64)", "restored (16)", "equal"):
            table.add_column(col, justify="right" if col != "collection" else "left")
        for name in sorted(set(before) | set(after)):
            a, b = before.get(name, (0, "")), after.get(name, (0, ""))
            table.add_row(name, f"{a[0]:,}", f"{b[0]:,}", "yes" if a == b else "NO")
        console.print(table)
        return before == after and "app.logs" not in after and len(after) == 4
    finally:
        src.signal(signal.SIGTERM)
        dst.signal(signal.SIGTERM)


def xattrs_by_key(uri: str) -> dict[str, tuple[str, object, object]]:
    """Each document's op, body and xattrs, as `upr tail --until-end` prints them."""
    out = upr("tail", uri, "--until-end", "--format", "json").stdout
    docs: dict[str, tuple[str, object, object]] = {}
    for line in out.splitlines():
        row = json.loads(line)
        if "event" not in row:
            docs[row["key"]] = (row["op"], row.get("value"), row.get("xattrs"))
    return docs


def xattrs_story(tmp: Path) -> bool:
    """Step 10: xattrs and tombstones with system xattrs survive backup and restore."""
    src, dst = Node(tmp / "xattr-src", partitions=16), Node(tmp / "xattr-dst", partitions=8)
    src.start("--flush-interval", "0.05")
    dst.start("--flush-interval", "0.05")
    try:
        upr("load", src.uri, "--docs", "3000", "--xattrs", "--update-ratio", "0.3",
            "--delete-ratio", "0.1", "--seed", "12", show=True)  # fmt: skip
        repo = tmp / "xattr-repo"
        backup(src, repo, "xattrs")
        upr("restore", "--repo", str(repo), dst.uri, show=True)
        before, after = xattrs_by_key(src.uri), xattrs_by_key(dst.uri)
        live = next(k for k, v in sorted(before.items()) if v[0] == "mutation")
        gone = next(k for k, v in sorted(before.items()) if v[0] != "mutation")
        for key in (live, gone):
            console.print(f"[bold]{key}[/] ({before[key][0]}) xattrs on the source:")
            console.print(f"  {json.dumps(before[key][2])}", markup=False)
            console.print(f"  restored: {json.dumps(after.get(key, (0, 0, None))[2])}",
                          markup=False)  # fmt: skip
        table = Table(title="xattrs: source (16) and restored (8)")
        for col in ("", "source", "restored"):
            table.add_column(col, justify="right" if col else "left")
        for name, pick in (
            ("live, with xattrs", lambda v: v[0] == "mutation" and v[2]),
            ("tombstones keeping _sync", lambda v: v[0] != "mutation" and v[2]),
        ):
            table.add_row(name, f"{sum(1 for v in before.values() if pick(v)):,}",
                          f"{sum(1 for v in after.values() if pick(v)):,}")  # fmt: skip
        console.print(table)
        return before == after and bool(before[gone][2]) and "meta" in before[live][2]  # type: ignore[operator]
    finally:
        src.signal(signal.SIGTERM)
        dst.signal(signal.SIGTERM)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="upr-demo-") as tmp:
        data, repo, db = Path(tmp) / "node", Path(tmp) / "repo", Path(tmp) / "restored.db"
        node = Node(data)
        node.start("--flush-interval", "0.05")
        try:
            console.rule(f"[bold]1. a local upr serve ({PARTITIONS} partitions) with sample data")
            upr("load", node.uri, "--docs", "20000", "--update-ratio", "0.2", "--delete-ratio",
                "0.05")  # fmt: skip
            console.rule("[bold]2. a full backup, more writes, an incremental backup")
            backup(node, repo, "full")
            upr("load", node.uri, "--docs", "3000", "--update-ratio", "0.5", "--seed", "2")
            backup(node, repo, "incremental")
            replica = Path(tmp) / "replica.db"
            upr("replay", node.uri, "--into", str(replica), show=True)
            query = (
                "SELECT json_extract(doc, '$.name') AS name, count(*) AS n FROM json_documents"
                " GROUP BY name ORDER BY n DESC, name LIMIT 3"
            )
            console.print(f"[dim]sqlite> {query}[/]")
            with sqlite3.connect(replica) as conn:
                for name, n in conn.execute(query):
                    console.print(f"  {name:<24} {n:>5}")
            conn.close()

            console.rule("[bold]3. writes the node never persists, backed up anyway")
            node.signal(signal.SIGTERM)
            node.start("--flush-interval", "3600")
            upr("load", node.uri, "--docs", "2000", "--seed", "3")  # rewrites doc-000000000..
            backup(node, repo, "third")
            upr("replay", node.uri, "--into", str(replica), show=True)  # the replica too

            console.rule("[bold]4. SIGKILL the node and restart it: those writes are gone")
            node.signal(signal.SIGKILL)
            node.start("--flush-interval", "0.05")
            console.print("[bold]where the node and the backup diverged[/]")
            upr("diff", node.uri, f"repo:{repo}", show=True, ok=(1,))
            console.print("[bold]the lost writes that could go back (dry run)[/]")
            salvage = upr("salvage", "--repo", str(repo), "--into", node.uri, "--json", ok=(0, 1))
            lost = json.loads(salvage.stdout)
            console.print(f"{lost['lost_writes']:,} lost writes: {lost['counts']}")
            for it in lost["writes"][:3]:
                seq = it["lost_version"]["seq"]
                console.print(f"  partition {it['partition']} {it['key']}: seq {seq}"
                              f" above cut {it['cut']}: {it['outcome']}")  # fmt: skip

            console.rule("[bold]5. the next backup records the rollback and carries on")
            fourth = backup(node, repo, "after the crash")
            table = Table(title="rollbacks recorded in the manifest")
            for col in ("partition", "from", "to", "seed rule", "producer rule"):
                table.add_column(col, justify="right")
            for rb in fourth["rollbacks"]:  # type: ignore[attr-defined]
                table.add_row(str(rb["partition"]), rb["from"], rb["to"], str(rb["seed_rule_seq"]),
                              rb["producer_seq"])  # fmt: skip
            console.print(table)

            console.rule("[bold]6. upr info, upr verify, upr examine")
            upr("info", "--repo", str(repo), show=True)
            upr("verify", "--repo", str(repo), show=True)
            upr("examine", "--repo", str(repo), "doc-000000001", show=True)

            console.rule("[bold]7. restore the latest state into SQLite and compare")
            upr("restore", "--repo", str(repo), f"sqlite:{db}", show=True)
            from upr_cli.store import Store

            with Store(db) as s:
                restored = (s.count(), s.content_hash())
            live = node_content(node.uri)
            console.print(f"node:     {live[0]:,} documents, content hash {live[1][:16]}…")
            console.print(f"restored: {restored[0]:,} documents, content hash {restored[1][:16]}…")
            console.rule("[bold]8. the replica replays: it rolls the lost writes back")
            upr("replay", node.uri, "--into", str(replica), show=True)
            with Store(replica) as s:
                replayed = (s.count(), s.content_hash())
            console.print(f"replica:  {replayed[0]:,} documents, content hash {replayed[1][:16]}…")
            console.rule("[bold]9. collections: 64 partitions backed up, restored into 16")
            colls_ok = collections_story(Path(tmp))
            console.rule("[bold]10. xattrs survive backup and restore, tombstones too")
            xattrs_ok = xattrs_story(Path(tmp))
            ok = (
                restored == live == replayed
                and len(fourth["rollbacks"]) == PARTITIONS  # type: ignore[arg-type]
                and lost["lost_writes"] > 0
                and colls_ok
                and xattrs_ok
            )
            console.print("[bold green]match[/]" if ok else "[bold red]MISMATCH[/]")
        finally:
            node.signal(signal.SIGTERM)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
