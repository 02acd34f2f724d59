"""Codec benchmark: decode and encode rates for a 64 MiB buffer of DCP mutations.

Mutations carry JSON values of 150-200 bytes over 1024 partitions. Figures, each the
best of --repeat runs on one core, are printed beside the floor measured in the same
run: a bare loop that only unpacks each 24-byte header and slices key and value.

decode = FrameDecoder fed in 256 KiB socket-sized reads and `read_rows`: every header
         and extras field decoded into a row tuple, key and value as zero-copy
         memoryviews: what the DCP consumer does.
encode = `encode_mutation` for every record: what the producer does.
Also shown, not part of the target: the typed-dataclass path (`decode_message`,
`Mutation.encode`) on a slice of the buffer.

Usage: python bench/codec.py [--mib 64] [--repeat 3]
Last line: decode_fps=… encode_fps=… floor_fps=… ratio=…
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from upr_cli.protocol import FrameDecoder, decode_message
from upr_cli.protocol.fast import encode_mutation
from upr_cli.protocol.messages import Mutation

TARGET_DECODE_FPS = 1_000_000
READ_SIZE = 256 * 1024


def make_records(mib: int, seed: int = 7) -> list[tuple[int, int, int, int, bytes, bytes]]:
    """(vbucket, seq, cas, rev, key, value) tuples filling about `mib` MiB once encoded."""
    rng = random.Random(seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    seqs = [0] * 1024
    out = []
    size, limit = 0, mib * 1024 * 1024
    i = 0
    while size < limit:
        vb = rng.randrange(1024)
        seqs[vb] += 1
        key = f"user::{i:08d}".encode()
        doc = {
            "name": f"{rng.choice(words)} {rng.choice(words)}",
            "age": rng.randrange(18, 90),
            "email": f"user{i}@example.com",
            "tags": rng.sample(words, 3),
            "score": round(rng.random() * 1000, 2),
            "active": rng.random() < 0.5,
            "bio": "x" * rng.randrange(0, 60),
        }
        value = json.dumps(doc, separators=(",", ":")).encode()
        value += b" " * max(0, 150 - len(value))  # keep values in 150-200 bytes
        value = value[:200]
        out.append((vb, seqs[vb], 0x1600000000000000 + i, 1, key, value))
        size += 55 + len(key) + len(value)
        i += 1
    return out


def best(fn: Callable[[], int], repeat: int) -> tuple[float, int]:
    """(best seconds, count) over `repeat` runs."""
    times, count = [], 0
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        count = fn()
        times.append(time.perf_counter() - t)
    return min(times), count


def encode_phase(
    records: list[tuple[int, int, int, int, bytes, bytes]], repeat: int
) -> tuple[float, float, int, bytes, bytes]:
    """Time both encoders; return (fast s, typed s, typed count, buffer, typed prefix)."""

    def encode() -> int:
        out = [encode_mutation(vb, 0x1000 + vb, cas, 1, seq, rev, 0, 0, key, value)
               for vb, seq, cas, rev, key, value in records]  # fmt: skip
        return len(out)

    typed_msgs = [Mutation(vbucket=vb, opaque=0x1000 + vb, cas=cas, datatype=1, by_seqno=seq,
                           rev_seqno=rev, key=key, value=value)
                  for vb, seq, cas, rev, key, value in records[:50_000]]  # fmt: skip

    def typed_encode() -> int:
        return len([m.encode() for m in typed_msgs])

    t_enc, _ = best(encode, repeat)
    t_te, _ = best(typed_encode, repeat)
    buf = b"".join(
        encode_mutation(vb, 0x1000 + vb, cas, 1, seq, rev, 0, 0, key, value)
        for vb, seq, cas, rev, key, value in records
    )
    typed_buf = buf[: sum(len(m.encode()) for m in typed_msgs)]
    return t_enc, t_te, len(typed_msgs), buf, typed_buf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    records = make_records(args.mib)
    n = len(records)
    values = [len(r[5]) for r in records]
    print(f"buffer: {args.mib} MiB, {n:,} mutations, 1024 partitions, values "
          f"{min(values)}-{max(values)} B; best of {args.repeat}")  # fmt: skip
    t_enc, t_te, typed_n, buf, typed_buf = encode_phase(records, args.repeat)
    # A consumer holds the received buffer, not a list of every record: drop the inputs
    # so the decode timings are not charged for GC passes over them.
    del records
    gc.collect()
    hdr = struct.Struct(">BBHBBHIIQ")

    def floor() -> int:
        mv = memoryview(buf)
        unpack = hdr.unpack_from
        off, count, end = 0, 0, len(buf)
        while off < end:
            _m, _op, klen, elen, _dt, _vb, blen, _opq, _cas = unpack(buf, off)
            k = off + 24 + elen
            _key = mv[k : k + klen]
            _val = mv[k + klen : off + 24 + blen]
            off += 24 + blen
            count += 1
        return count

    def decode() -> int:
        dec = FrameDecoder()
        mv = memoryview(buf)
        count = 0
        for pos in range(0, len(buf), READ_SIZE):
            dec.feed(mv[pos : pos + READ_SIZE])
            while rows := dec.read_rows():
                count += len(rows)
        return count

    def typed_decode() -> int:
        dec = FrameDecoder()
        dec.feed(typed_buf)
        return len([decode_message(f) for f in dec.frames()])

    t_floor, c = best(floor, args.repeat)
    assert c == n
    floor_fps = n / t_floor
    t_dec, c = best(decode, args.repeat)
    assert c == n, (c, n)
    decode_fps = n / t_dec
    encode_fps = n / t_enc
    t_td, _ = best(typed_decode, args.repeat)
    ratio = decode_fps / floor_fps
    mib = len(buf) / 2**20
    print(f"floor  (header unpack + key/value slices): {floor_fps:>12,.0f} frames/s  "
          f"{mib / t_floor:8.1f} MiB/s")  # fmt: skip
    print(f"decode (FrameDecoder.read_rows):           {decode_fps:>12,.0f} frames/s  "
          f"{mib / t_dec:8.1f} MiB/s  = {ratio:.2f} x floor; target >= {TARGET_DECODE_FPS:,} "
          f"{'MET' if decode_fps >= TARGET_DECODE_FPS else 'MISSED'}")  # fmt: skip
    print(
        f"encode (encode_mutation):                  {encode_fps:>12,.0f} frames/s  "
        f"{mib / t_enc:8.1f} MiB/s  = {encode_fps / floor_fps:.2f} x floor"
    )
    print(f"typed decode_message (slow path, info):    {typed_n / t_td:>12,.0f} frames/s")
    print(f"typed Mutation.encode (slow path, info):   {typed_n / t_te:>12,.0f} frames/s")
    print(
        f"decode_fps={decode_fps:.0f} encode_fps={encode_fps:.0f} floor_fps={floor_fps:.0f} "
        f"ratio={ratio:.3f}"
    )


if __name__ == "__main__":
    main()
