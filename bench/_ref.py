"""The references the SQLite paths are held to: one bare `executemany` of the same rows
into the same schema (formats/store.md), in one transaction, in this process."""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

Row = tuple[object, ...]


def bare_executemany(rows: list[Row], db: Path) -> float:
    """rows/s of ONE bare executemany of `documents` rows (formats/store.md column order)
    into a new store's schema, in one transaction: the reference the store is held to."""
    from upr_cli.store import Store

    with Store(db) as s:
        conn = s.db.conn
        t = time.perf_counter()
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO documents (partition, key, seq, rev_seq, cas, flags, expiry,"
            " delete_time, datatype, deleted, value, collection_id)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            rows,
        )
        conn.execute("COMMIT")
        return len(rows) / (time.perf_counter() - t)


def repo_rows(repo: Path) -> list[Row]:
    """The rows a restore of the repository's latest state into SQLite writes, partition
    by partition in seq order (the order it applies them)."""
    from upr_cli.jobs.restore import partition_state
    from upr_cli.jobs.state import select
    from upr_cli.protocol.decoder import OP_MUTATION
    from upr_cli.repo import Repository

    r = Repository(repo)
    manifests = r.manifests("default")
    sel = select(manifests)
    rows: list[Row] = []
    for p in sel.partitions:
        state = partition_state(r, "default", manifests, sel.backup_id, p)
        for rec in sorted(state.values(), key=lambda r: r.seq):
            value: bytes | str = rec.value.decode() if rec.datatype & 7 == 1 else rec.value
            cas = rec.cas - (1 << 64) if rec.cas >= 1 << 63 else rec.cas
            deleted = 0 if rec.op == OP_MUTATION else 1
            rows.append((p, rec.key, rec.seq, rec.rev_seq, cas, rec.flags, rec.expiry,
                         rec.delete_time, rec.datatype, deleted, value,
                         rec.collection))  # fmt: skip
    return rows


def bare_insert_rate(repo: Path, scratch: Path) -> tuple[float, int]:
    """(rows/s, rows) of one bare executemany of the rows a restore of `repo` writes."""
    rows = repo_rows(repo)
    return bare_executemany(rows, scratch / "bare.db"), len(rows)


# -- the node's bare rates: what a client that does nothing else reaches ----------------

_HEAD = struct.Struct(">BBHBBHIIQ")  # the 24-byte header (docs/protocol.md §1)


def _node_addr(uri: str) -> tuple[str, int, str]:
    """(host, port, bucket) of a no-auth loopback `upr://HOST:PORT/BUCKET`."""
    from upr_cli.net.uri import SourceUri

    u = SourceUri.parse(uri)
    return u.host, u.port, u.bucket or "default"


def _open(uri: str) -> socket.socket:
    """A plain socket to the node with its bucket selected (no HELLO, no SASL: a node
    started with --no-auth)."""
    from upr_cli.protocol.messages import SelectBucket

    host, port, bucket = _node_addr(uri)
    sock = socket.create_connection((host, port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(SelectBucket(bucket=bucket, opaque=1).encode())
    head = _recv(sock, 24)
    _m, _op, _k, _e, _d, status, blen, _o, _c = _HEAD.unpack(head)
    _recv(sock, blen)
    if status != 0:
        raise SystemExit(f"SELECT_BUCKET {bucket!r} answered status 0x{status:02x}")
    return sock


def _recv(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes."""
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise SystemExit("the node closed the connection")
        buf += got
    return bytes(buf)


def bare_sets(uri: str, docs: int, partitions: int, *, size: int = 180,
              window: int = 1024) -> tuple[float, int]:  # fmt: skip
    """(sets/s, non-success answers) of a bare pipelined writer: `docs` SET requests of
    JSON values of about `size` bytes, encoded before the clock starts, sent on one
    connection in chunks of 256 with at most `window` unanswered, the answers counted
    by a bare header loop. The node's ingest with no client cost to speak of: the
    reference `upr load` is held to."""
    from upr_cli.net.bootstrap import partition_of
    from upr_cli.protocol.fast import encode_set

    pad = "x" * max(0, size - 60)
    chunk = 256
    frames = []
    for i in range(0, docs, chunk):
        part = []
        for j in range(i, min(i + chunk, docs)):
            key = f"bare-{j:09d}".encode()
            value = f'{{"n":{j},"name":"bare {j}","pad":"{pad}"}}'.encode()
            part.append(encode_set(0x01, partition_of(key, partitions), j, key, value,
                                   datatype=1))  # fmt: skip
        frames.append((b"".join(part), len(part)))
    sock = _open(uri)
    permits = threading.Semaphore(max(1, window // chunk))
    failed: list[BaseException] = []

    def send() -> None:
        try:
            for data, _n in frames:
                permits.acquire()
                sock.sendall(data)
        except OSError as exc:  # the reader reports it
            failed.append(exc)

    errors = answered = 0
    buf = bytearray()
    sizes = [n for _d, n in frames]
    next_release, chunk_no = sizes[0], 0
    t = time.perf_counter()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        while answered < docs:
            got = sock.recv(1 << 20)
            if not got:
                raise SystemExit(f"the node closed the connection: {failed}")
            buf += got
            off, end = 0, len(buf)
            while end - off >= 24:
                blen = int.from_bytes(buf[off + 8 : off + 12])
                if end - off < 24 + blen:
                    break
                if buf[off + 6] or buf[off + 7]:
                    errors += 1
                off += 24 + blen
                answered += 1
                if answered == next_release and chunk_no + 1 < len(sizes):
                    chunk_no += 1
                    next_release += sizes[chunk_no]
                    permits.release()
            del buf[:off]
        secs = time.perf_counter() - t
    finally:
        sock.close()
        sender.join(5)
    return docs / secs, errors


def bare_drain(uri: str) -> tuple[float, int]:
    """(items/s, items) of a bare DCP drain: one connection, DCP_OPEN, a stream request
    from 0 to the high seq of every partition at once, and a bare header loop that
    counts mutations and deletions until every stream ended. The node's send rate with
    no client cost to speak of: the reference a drain is held to."""
    import asyncio

    from upr_cli.net.bootstrap import connect
    from upr_cli.net.uri import SourceUri
    from upr_cli.protocol.messages import DcpOpen, StreamRequest

    async def highs() -> dict[int, int]:
        s = await connect(SourceUri.parse(uri))
        try:
            st = await s.conn.stats("vbucket-seqno")
        finally:
            await s.conn.aclose()
        return {int(k[3:].split(":")[0]): int(v) for k, v in st.items()
                if k.endswith(":high_seqno") and int(v) > 0}  # fmt: skip

    ends = asyncio.run(highs())
    sock = _open(uri)
    try:
        sock.sendall(DcpOpen(name="bench-bare-drain", flags=1, opaque=2).encode())
        head = _recv(sock, 24)
        _recv(sock, int.from_bytes(head[8:12]))
        if head[6] or head[7]:
            raise SystemExit("DCP_OPEN refused")
        t = time.perf_counter()
        sock.sendall(b"".join(StreamRequest(vbucket=vb, opaque=0x1000 + vb, end_seqno=hi)
                              .encode() for vb, hi in ends.items()))  # fmt: skip
        items = ended = 0
        buf = bytearray()
        while ended < len(ends):
            got = sock.recv(1 << 20)
            if not got:
                raise SystemExit("the node closed the DCP connection")
            buf += got
            off, end = 0, len(buf)
            while end - off >= 24:
                blen = int.from_bytes(buf[off + 8 : off + 12])
                if end - off < 24 + blen:
                    break
                op = buf[off + 1]
                if op == 0x57 or op == 0x58:  # DCP_MUTATION, DCP_DELETION
                    items += 1
                elif op == 0x55:  # DCP_STREAM_END
                    ended += 1
                elif op == 0x53 and buf[off] == 0x81 and (buf[off + 6] or buf[off + 7]):
                    raise SystemExit(f"a stream request was refused (vb opaque "
                                     f"{int.from_bytes(buf[off + 12 : off + 16])})")  # fmt: skip
                off += 24 + blen
            del buf[:off]
        secs = time.perf_counter() - t
    finally:
        sock.close()
    return items / secs, items
