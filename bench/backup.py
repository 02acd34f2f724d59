"""`upr backup` throughput, compression, memory; encrypted and s3:// against plain.

Loads --docs JSON documents (150-200 B, 1024 partitions) into a local `upr serve`, waits
until they are persisted, then: a full `upr backup` (items/s, MB/s of raw records, peak
RSS of the backup process) beside a bare DCP drain of the same node right after it (the
node's send rate, the most a backup can reach: bench/_ref.py), an incremental backup
after updating 10% of the documents, and the compression ratio beside `zstd -3` on the
same raw records as one stream (the zstd CLI when installed, else the library at level
3), and `upr restore` into a SQLite store beside a bare `executemany` of the same rows
into the same schema. Then the same documents spread over --collections collections on a
second node, fully backed up in the same run: items/s and bytes written beside the
default collection's (the cost of collections in the segment files: the id per record,
the system events).

Then the links (`wire_pass`): --wire-docs compressible JSON documents (--wire-size
bytes, padded) on a third node that also serves TLS (a trustme test CA), fully backed
up four ways, each into a new repository: plain and TLS, each with Snappy forced
(`--wire-compression force`: every value compressed by the node, inflated at the client)
and without (`off`). Items/s are the best of two runs straight to the node (the four links
interleaved); bytes on the wire come from one more run through a loopback proxy in
this process that counts every byte each way (TLS records included), which the node's
cluster map names as its data ports so the client reaches every partition through it.
Plain without Snappy is the reference.

The variants (`variants_part`, issue 30), against the first node after the full pass:
--pairs rounds, each a full `upr backup` of the node into a new repository per variant
named by --variants, then `upr restore --at latest` of each into a new SQLite file:
`plain` (a local directory, no key: the reference), `encrypted` (a local directory,
`--encrypt --key-file K` on the backup, `--key-file K` on the restore; K is 32 random
bytes) and `s3` (`--repo s3://upr-bench/pairN --s3-endpoint URL` on moto's standalone
server, which this script starts on a loopback port and stops: bench/_s3.py). The order
is reversed every other round (plain, encrypted, s3, then s3, encrypted, plain), so a
machine that slows down or speeds up weighs on every variant alike. Per variant: the
median items/s and MB/s (each command's own summary: records read by the backup, record
bytes written by the restore) with their spread (min-max); encrypted/plain and s3/plain
for backup and for restore: the median of the rounds' ratios with their spread, beside
the ratio of wall times (process start included: key stretching, client set-up), and
the issue's limit (encryption costs under 15%). The first round also checks that each
variant is what it claims: a restore of the encrypted repository without the key must
refuse, and the s3 backup must have left objects in the bucket. A variant whose command
fails (a feature missing) or whose check fails is said in one line and left out; plain
must work. Each round's repositories and SQLite files are deleted after its restores.

--skip leaves parts out: full (the full and incremental backups, compression, restore
beside executemany), variants, collections, wire.

Usage: python bench/backup.py [--docs 1000000] [--collections 8] [--wire-docs 100000]
    [--wire-size 512] [--variants plain,encrypted,s3] [--pairs 3]
    [--skip full,variants,collections,wire]
Last line: full_items_per_s=… target=… bare_drain_items_per_s=… drain_ratio=… ratio=…
zstd3_ratio=… backup_rss_mb=… …
variants=… pairs=… plain_backup_items_per_s=… encrypted_restore_mb_per_s=… …
enc_backup_ratio=… enc_restore_ratio=… enc_cost_met=yes|no s3_backup_ratio=…
s3_restore_ratio=… (…=skipped for a variant left out)
coll_full_items_per_s=… coll_ratio=… coll_bytes_per_doc=… bytes_per_doc=…
wire_docs=… plain_items_per_s=… plain_snappy_items_per_s=… tls_items_per_s=…
tls_snappy_items_per_s=… plain_wire_mb=… plain_snappy_wire_mb=… tls_wire_mb=…
tls_snappy_wire_mb=… snappy_wire_share=… tls_rate_share=…
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _node import UPR, BenchNode, CommandFailed, run_measured, say, upr
from _ref import bare_drain, bare_insert_rate
from _s3 import S3Server
from _wire import Proxy, make_certs, route_through

from upr_cli.repo.access import DEFAULT_TRANSFERS

TARGET_ITEMS = 200_000  # issue 27: full backup >= 200,000 items/s
TARGET_RSS_MB = 300
RESTORE_SHARE = 0.75  # restore into SQLite within 75% of a bare executemany


def backup_cmd(uri: str, repo: Path | str) -> list[str]:
    """The `upr backup` command line."""
    return [*UPR, "backup", uri, "--repo", str(repo), "--json", "--no-progress"]


def zstd3_ratio(repo: Path) -> tuple[float, int]:
    """Ratio of `zstd -3` on the backup's raw records, row-wise, as one stream."""
    from upr_cli.segments import SegmentReader

    head = struct.Struct("<BBHIQQQIIII")
    raw_path = repo.parent / "raw.bin"
    size = 0
    with open(raw_path, "wb") as out:
        for seg in sorted(repo.glob("*/*/p*.seg")):
            with SegmentReader(seg) as r:
                for x in r.records():
                    v = x.xattrs + x.value
                    rec = head.pack(x.op, x.datatype, len(x.key), len(v), x.seq, x.rev_seq,
                                    x.cas, x.flags, x.expiry, x.delete_time, 0)  # fmt: skip
                    rec += x.key + v
                    out.write(rec)
                    size += len(rec)
    if shutil.which("zstd"):
        comp = len(
            subprocess.run(
                ["zstd", "-3", "-c", str(raw_path)], capture_output=True, check=True
            ).stdout
        )
    else:
        import zstandard

        comp = len(zstandard.ZstdCompressor(level=3).compress(raw_path.read_bytes()))
    raw_path.unlink()
    return size / comp, size


def collections_pass(docs: int, n: int, tmp: Path) -> dict[str, float]:
    """A full backup of `docs` documents spread over `n` collections (1024 partitions)."""
    names = ",".join(f"bench.c{i}" for i in range(n))
    node = BenchNode(tmp / "coll-node", 1024, "--collections", names)
    try:
        upr("load", node.uri, "--docs", str(docs), "--collections", names, "--json")
        node.wait_persisted()
        _secs, rss, out = run_measured(backup_cmd(node.uri, tmp / "coll-repo"))
    finally:
        node.stop()
    full = json.loads(out)
    return {"rate": full["items"] / full["seconds"], "items": full["items"], "rss": rss,
            "read": int(full["bytes_read"]), "written": int(full["bytes_written"])}  # fmt: skip


#: the four links of `wire_pass`: (name, TLS, Snappy); plain without Snappy first (the
#: reference)
LINKS = (("plain", False, False), ("plain_snappy", False, True), ("tls", True, False),
         ("tls_snappy", True, True))  # fmt: skip
#: runs of each link straight to the node, interleaved; the best one counts (the machine
#: is shared: one slow run says little about a link)
WIRE_ROUNDS = 2


def wire_pass(docs: int, size: int, tmp: Path) -> dict[str, dict[str, float]]:
    """Per link: items/s of a full backup straight to a TLS-serving node, and the bytes
    each way of a second one through the counting proxy (module docstring)."""
    ca, cert, key = make_certs(tmp / "certs")
    node = BenchNode(tmp / "wire-node", 1024, "--tls-cert", str(cert), "--tls-key", str(key),
                     "--tls-port", "0")  # fmt: skip
    assert node.proc.stdout is not None
    tls_line = node.proc.stdout.readline()  # "listening-tls uprs://127.0.0.1:PORT/default"
    tls_port = int(tls_line.rsplit(":", 1)[1].split("/")[0])
    plain_port = int(node.uri.rsplit(":", 1)[1].split("/")[0])
    out: dict[str, dict[str, float]] = {}
    proxy = None
    try:
        upr("load", node.uri, "--docs", str(docs), "--size", str(size), "--json")
        node.wait_persisted()

        def run(name: str, tls: bool, snappy: bool, port: int, k: int) -> dict[str, float]:
            uri = f"{'uprs' if tls else 'upr'}://127.0.0.1:{port}/default"
            cmd = [sys.executable, str(Path(__file__).parent / "_wire.py"), "one-backup", uri,
                   str(tmp / f"wire-{name}-{k}"), "--cacert", str(ca)]  # fmt: skip
            _secs, rss, text = run_measured(cmd + ([] if snappy else ["--no-snappy"]))
            got = json.loads(text)
            return {"items": got["items"], "rate": got["items"] / got["seconds"], "rss": rss,
                    "raw": int(got["bytes_read"])}  # fmt: skip

        for k in range(WIRE_ROUNDS):  # straight to the node, interleaved: the best items/s
            for name, tls, snappy in LINKS:
                got = run(name, tls, snappy, tls_port if tls else plain_port, k)
                if name not in out or got["rate"] > out[name]["rate"]:
                    out[name] = got
        proxy = Proxy([plain_port, tls_port])
        route_through(plain_port, proxy.ports[0], proxy.ports[1], 1024)
        for name, tls, snappy in LINKS:  # through the proxy: bytes on the wire
            proxy.reset()
            run(name, tls, snappy, proxy.ports[1] if tls else proxy.ports[0], WIRE_ROUNDS)
            out[name] |= {"down": proxy.down, "up": proxy.up}
    finally:
        node.stop()
        if proxy is not None:
            proxy.stop()
    return out


def print_wire(wire: dict[str, dict[str, float]], docs: int, size: int) -> str:
    """The links' lines; returns their key=value part of the last line."""
    ref = wire["plain"]
    print(f"links: {docs:,} documents of {size} B (compressible JSON), full backup each way; "
          f"plain without Snappy is the reference")  # fmt: skip
    for name, _tls, _snappy in LINKS:
        w = wire[name]
        print(f"  {name:<13} {w['rate']:>9,.0f} items/s ({w['rate'] / ref['rate']:.2f})  "
              f"{w['down'] / 1e6:>7.1f} MB node→client ({w['down'] / ref['down']:.2f}), "
              f"{w['up'] / 1e3:,.0f} kB client→node; {w['raw'] / 1e6:.1f} MB of records; "
              f"peak RSS {w['rss']:.0f} MB")  # fmt: skip
    keys = [f"wire_docs={docs} wire_doc_size={size}"]
    keys += [f"{n}_items_per_s={wire[n]['rate']:.0f}" for n, _t, _s in LINKS]
    keys += [f"{n}_wire_mb={wire[n]['down'] / 1e6:.2f}" for n, _t, _s in LINKS]
    share = wire["plain_snappy"]["down"] / ref["down"]
    tls_share = wire["tls_snappy"]["rate"] / wire["plain_snappy"]["rate"]
    keys.append(f"snappy_wire_share={share:.3f} tls_rate_share={tls_share:.3f}")
    return " ".join(keys)


# -- the variants: encrypted and s3:// repositories beside a plain local one ------------

#: the repositories `variants_part` compares, in the order of the first pair; plain (a
#: local directory, no key) is the reference of both comparisons
VARIANTS = ("plain", "encrypted", "s3")
ENC_COST_LIMIT = 0.15  # issue 30: encryption costs under 15% of backup and restore rates
S3_BUCKET = "upr-bench"
#: a round's figures of one command: items/s and MB/s from its own summary, items/s with
#: process start (wall), items
Figures = dict[str, float]


@dataclass
class Variant:
    """One way of keeping a repository: the options its commands take, its figures per
    pair, and why it was left out (`failed`: a command exited non-zero, a check failed)."""

    name: str
    access: list[str]  # options every command on its repository takes
    create: list[str] = field(default_factory=list)  # options of the backup that creates it
    env: dict[str, str] | None = None
    s3: S3Server | None = None
    failed: str | None = None
    backup: list[Figures] = field(default_factory=list)
    restore: list[Figures] = field(default_factory=list)
    stored: str = ""  # what the first pair's repository holds (files or objects, bytes)
    bare: list[Figures] = field(default_factory=list)  # s3: bare PUT and GET per pair

    def location(self, tmp: Path, k: int) -> str:
        """Pair k's repository: a new directory, or a new prefix of the bucket."""
        return f"s3://{S3_BUCKET}/pair{k}" if self.s3 else str(tmp / f"{self.name}-{k}")

    def run(self, cmd: list[str], what: str) -> tuple[dict[str, Any], float] | None:
        """(summary, wall seconds) of `upr ...` on this variant; None, with the variant
        marked failed and one line said, when it exits non-zero."""
        if self.failed:
            return None
        try:
            wall, _rss, out = run_measured(cmd, env=self.env)
        except CommandFailed as exc:
            if self.name == "plain":
                raise  # the reference: nothing to compare without it
            self.fail(f"`upr {what}` exited {exc.returncode}: {exc.last_line}")
            return None
        return json.loads(out), wall

    def fail(self, why: str) -> None:
        """Leave the variant out from here on, saying why in one line."""
        self.failed = why
        say(f"{self.name}: left out: {why}")


def make_variant(name: str, key: Path, s3: S3Server | None) -> Variant:
    """The plain, encrypted or s3 variant (the command lines of issue 30)."""
    if name == "encrypted":
        return Variant(name, ["--key-file", str(key)], create=["--encrypt"])
    if name == "s3":
        assert s3 is not None
        return Variant(name, ["--s3-endpoint", s3.endpoint], env=s3.env, s3=s3)
    return Variant(name, [])


def local_bytes(path: Path) -> tuple[int, int]:
    """(files, bytes) under a directory."""
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def check_stored(v: Variant, where: str, tmp: Path) -> None:
    """After the first pair's backup: what the repository holds, and that it holds it
    where it should: objects in the bucket for s3 (not a local directory named `s3:`);
    for encrypted, a restore without the key must refuse (not plaintext written under
    an option that was accepted)."""
    if v.s3 is not None:
        objects, size = v.s3.usage(S3_BUCKET, where.split("/", 3)[3])
        if objects == 0:
            v.fail(f"the backup reported success but {where} holds no object")
        v.stored = f"{objects:,} objects, {size / 1e6:,.1f} MB"
        return
    files, size = local_bytes(Path(where))
    v.stored = f"{files:,} files, {size / 1e6:,.1f} MB"
    if v.name != "encrypted":
        return
    env = {k: x for k, x in os.environ.items() if k not in ("UPR_KEY_FILE", "UPR_PASSPHRASE")}
    db = tmp / "nokey.db"
    cmd = [*UPR, "restore", f"sqlite:{db}", "--repo", where, "--json", "--no-progress"]
    try:  # no stdin: a prompt for the key would wait for ever
        got = subprocess.run(cmd, capture_output=True, text=True, env=env,
                             stdin=subprocess.DEVNULL, timeout=300).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        got = None
    db.unlink(missing_ok=True)
    if got == 0:
        v.fail("a restore without the key succeeded: the repository is not encrypted")
    elif got is None:
        v.fail("a restore without the key neither refused nor ended within 300 s")


def figures(summary: dict[str, Any], wall: float, size: str) -> Figures:
    """A command's figures from its JSON summary (`size`: its field of record bytes)."""
    secs = summary["seconds"]
    return {"rate": summary["items"] / secs, "mbs": int(summary[size]) / 1e6 / secs,
            "wall": summary["items"] / wall, "items": summary["items"], "secs": secs}  # fmt: skip


def run_pair(variants: list[Variant], uri: str, k: int, tmp: Path) -> None:
    """Pair k: each variant's full backup into a new repository, then each one's restore
    into a new SQLite file, in the pair's order (reversed every other pair)."""
    order = variants if k % 2 == 0 else variants[::-1]
    live = [v for v in order if not v.failed]
    say(f"variants pair {k + 1}: {', '.join(v.name for v in live)}")
    for v in live:
        where = v.location(tmp, k)
        got = v.run([*backup_cmd(uri, where), *v.create, *v.access],
                    " ".join(["backup --repo", where, *v.create]))  # fmt: skip
        if got is not None:
            summary, wall = got
            v.backup.append(figures(summary, wall, "bytes_read"))
            if k == 0:
                check_stored(v, where, tmp)
    plain = next(v for v in variants if v.name == "plain")
    for v in live:
        if v.s3 is not None and not v.failed:  # the references of this round's s3 figures
            put = v.s3.bare_put(S3_BUCKET, f"bare{k}", Path(plain.location(tmp, k)),
                                DEFAULT_TRANSFERS)  # fmt: skip
            v.s3.delete_prefix(S3_BUCKET, f"bare{k}")
            get = v.s3.bare_get(S3_BUCKET, f"pair{k}", DEFAULT_TRANSFERS)
            v.bare.append({"put": put.seconds, "put_objects": put.objects, "put_mb": put.size / 1e6,
                           "get": get.seconds, "get_objects": get.objects,
                           "get_mb": get.size / 1e6})  # fmt: skip
    for v in live:
        where, db = v.location(tmp, k), tmp / f"{v.name}-{k}.db"
        cmd = [*UPR, "restore", f"sqlite:{db}", "--repo", where, "--at", "latest", "--json",
               "--no-progress", *v.access]  # fmt: skip
        got = v.run(cmd, f"restore --repo {where}")
        db.unlink(missing_ok=True)
        if v.s3 is not None:
            v.s3.delete_prefix(S3_BUCKET, f"pair{k}")
        else:
            shutil.rmtree(where, ignore_errors=True)
        if got is None:
            continue
        summary, wall = got
        if summary["items"] != v.backup[-1]["items"]:
            v.fail(f"restored {summary['items']:,} items of the {v.backup[-1]['items']:,} "
                   f"backed up")  # fmt: skip
            continue
        v.restore.append(figures(summary, wall, "bytes"))


def spread(values: list[float], fmt: str = ",.0f") -> str:
    """The median of `values` and their spread: "median (min-max)"."""
    return (f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-"
            f"{max(values):{fmt}})")  # fmt: skip


def ratios(head: list[Figures], base: list[Figures], what: str) -> list[float]:
    """Per pair, head's `what` over base's."""
    return [h[what] / b[what] for h, b in zip(head, base, strict=True)]


def print_bare(v: Variant) -> str:
    """The s3 commands' seconds beside bare boto3 transfers of the same objects; returns
    the key=value part."""
    put, get = [b["put"] for b in v.bare], [b["get"] for b in v.bare]
    back, rest = [x["secs"] for x in v.backup], [x["secs"] for x in v.restore]
    b = v.bare[0]
    print(f"  s3 beside bare boto3 ({DEFAULT_TRANSFERS} requests at once, one per object): "
          f"PUT of the plain repository's {b['put_objects']:,.0f} files ({b['put_mb']:.1f} MB) "
          f"{spread(put, '.2f')} s against the s3 backup's {spread(back, '.2f')} s; GET of "
          f"the s3 repository's {b['get_objects']:,.0f} objects ({b['get_mb']:.1f} MB) "
          f"{spread(get, '.2f')} s against the s3 restore's {spread(rest, '.2f')} s")  # fmt: skip
    return (f"s3_bare_put_s={statistics.median(put):.3f} s3_backup_s={statistics.median(back):.3f} "
            f"s3_bare_get_s={statistics.median(get):.3f} "
            f"s3_restore_s={statistics.median(rest):.3f}")  # fmt: skip


def print_variants(variants: list[Variant], pairs: int) -> str:
    """Per variant the median rates with their spread, the ratios encrypted/plain and
    s3/local, the cost limit; returns the part's key=value part."""
    by = {v.name: v for v in variants}
    plain = by["plain"]
    items = plain.backup[0]["items"]
    print(f"variants: a full backup of the node ({items:,.0f} items, 1024 partitions) into a "
          f"new repository, then `upr restore` of it into a new SQLite file, {pairs} "
          f"round{'s' if pairs > 1 else ''} (order reversed every other round); rates from "
          f"each command's summary, median (min-max); plain is the reference")  # fmt: skip
    keys = [f"variants={','.join(by)} pairs={pairs} variant_items={items:.0f}"]
    for v in variants:
        if v.failed:
            print(f"  {v.name:<9}  skipped: {v.failed}")
            keys.append(f"{v.name}=skipped")
            continue
        parts = []
        for what, figs in (("backup", v.backup), ("restore", v.restore)):
            rate, mbs = [x["rate"] for x in figs], [x["mbs"] for x in figs]
            parts.append(f"{what} {spread(rate)} items/s = {spread(mbs, '.1f')} MB/s")
            keys.append(f"{v.name}_{what}_items_per_s={statistics.median(rate):.0f} "
                        f"{v.name}_{what}_mb_per_s={statistics.median(mbs):.2f}")  # fmt: skip
        print(f"  {v.name:<9}  {'; '.join(parts)}; repository: {v.stored}")
    for name, label, key in (("encrypted", "encrypted / plain", "enc"),
                             ("s3", "s3 / local dir", "s3")):  # fmt: skip
        if name not in by:
            continue
        v = by[name]
        if v.failed:
            keys.append(f"{key}_backup_ratio=skipped {key}_restore_ratio=skipped")
            continue
        parts, meds = [], []
        for what in ("backup", "restore"):
            r = ratios(getattr(v, what), getattr(plain, what), "rate")
            w = ratios(getattr(v, what), getattr(plain, what), "wall")
            meds.append(statistics.median(r))
            parts.append(f"{what} {spread(r, '.2f')} (with process start "
                         f"{statistics.median(w):.2f})")  # fmt: skip
            keys.append(f"{key}_{what}_ratio={statistics.median(r):.3f} "
                        f"{key}_{what}_ratio_min={min(r):.3f} {key}_{what}_ratio_max={max(r):.3f} "
                        f"{key}_{what}_wall_ratio={statistics.median(w):.3f}")  # fmt: skip
        verdict = ""
        if name == "encrypted":
            met = min(meds) >= 1 - ENC_COST_LIMIT
            verdict = (f"; cost < {ENC_COST_LIMIT:.0%} of both: "
                       f"{'MET' if met else 'MISSED'}")  # fmt: skip
            keys.append(f"enc_cost_limit={ENC_COST_LIMIT} enc_cost_met={'yes' if met else 'no'}")
        print(f"  {label:<17}  {'; '.join(parts)}{verdict}")
        if name == "s3":
            keys.append(print_bare(v))
    sys.stdout.flush()
    return " ".join(keys)


def variants_part(uri: str, names: list[str], pairs: int, tmp: Path) -> str:
    """--pairs rounds of the variants against the node (module docstring); prints the
    part's lines and returns its key=value part."""
    key = tmp / "bench.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    s3 = S3Server(tmp / "s3.log") if "s3" in names else None
    try:
        if s3 is not None:
            s3.create_bucket(S3_BUCKET)
        variants = [make_variant(n, key, s3) for n in names]
        for k in range(pairs):
            run_pair(variants, uri, k, tmp)
    finally:
        if s3 is not None:
            s3.stop()
    return print_variants(variants, pairs)


#: the parts --skip can leave out
PARTS = ("full", "variants", "collections", "wire")


def full_pass(node: BenchNode, docs: int, repo: Path) -> dict[str, Any]:
    """The full backup, the bare drain beside it, the incremental backup after 10% of
    the documents changed, and the node's peak RSS."""
    secs, rss, out = run_measured(backup_cmd(node.uri, repo))
    drain_rate, _n = bare_drain(node.uri)
    upr("load", node.uri, "--docs", str(docs // 10), "--seed", "2", "--json")
    node.wait_persisted()
    _isecs, irss, iout = run_measured(backup_cmd(node.uri, repo))
    return {"full": json.loads(out), "secs": secs, "rss": max(rss, irss), "drain": drain_rate,
            "inc": json.loads(iout), "node_rss": node.peak_rss_mb()}  # fmt: skip


def print_full(f: dict[str, Any], repo: Path, tmp: Path, docs: int) -> str:
    """`upr restore` of the full pass's repository into SQLite beside a bare executemany,
    and the compression beside zstd -3; prints the part's lines and returns its
    key=value part."""
    full, inc, rss, drain_rate = f["full"], f["inc"], f["rss"], f["drain"]
    _rsecs, _rrss, rout = run_measured(
        [*UPR, "restore", "--repo", str(repo), f"sqlite:{tmp / 'restore.db'}", "--json"]
    )
    restored = json.loads(rout)
    restore_rate = restored["written"] / restored["seconds"]
    bare_rate, bare_rows = bare_insert_rate(repo, tmp)
    z3, raw = zstd3_ratio(repo)
    ratio = int(full["bytes_read"]) / int(full["bytes_written"])
    items = full["items"]
    rate = items / full["seconds"]
    mbs = int(full["bytes_read"]) / 1e6 / full["seconds"]
    print(f"node with {docs:,} documents (1024 partitions), all persisted")
    print(
        f"  full backup:        {items:,} items in {full['seconds']:.2f}s = {rate:,.0f} items/s "
        f"({mbs:,.1f} MB/s raw; {f['secs']:.2f}s with process start)  target >= "
        f"{TARGET_ITEMS:,} {'MET' if rate >= TARGET_ITEMS else 'MISSED'}"
    )
    print(
        f"  bare DCP drain of the same node (the reference): {drain_rate:,.0f} items/s; "
        f"backup / bare {rate / drain_rate:.2f}"
    )
    print(
        f"  incremental (10%):  {inc['items']:,} items in {inc['seconds']:.2f}s = "
        f"{inc['items'] / inc['seconds']:,.0f} items/s"
    )
    print(
        f"  compression ratio:  {ratio:.2f}  vs zstd -3 on the same {raw / 1e6:,.1f} MB of raw "
        f"records: {z3:.2f}  {'MET' if ratio >= z3 else 'MISSED'}"
    )
    print(
        f"  backup peak RSS:    {rss:.0f} MB  target < {TARGET_RSS_MB} MB "
        f"{'MET' if rss < TARGET_RSS_MB else 'MISSED'}; node peak RSS {f['node_rss']:.0f} MB"
    )
    share = restore_rate / bare_rate
    print(
        f"  restore to SQLite:  {restored['written']:,} documents at {restore_rate:,.0f} items/s "
        f"vs bare executemany {bare_rate:,.0f} rows/s ({bare_rows:,} rows) = {share:.0%}  "
        f"target >= {RESTORE_SHARE:.0%} {'MET' if share >= RESTORE_SHARE else 'MISSED'}",
        flush=True,
    )
    f["rate"], f["per_item"] = rate, int(full["bytes_written"]) / docs
    return (
        f"full_items_per_s={rate:.0f} target={TARGET_ITEMS} full_mb_per_s={mbs:.1f} "
        f"bare_drain_items_per_s={drain_rate:.0f} drain_ratio={rate / drain_rate:.3f} "
        f"incremental_items_per_s={inc['items'] / inc['seconds']:.0f} ratio={ratio:.2f} "
        f"zstd3_ratio={z3:.2f} backup_rss_mb={rss:.0f} rss_target_mb={TARGET_RSS_MB} "
        f"restore_items_per_s={restore_rate:.0f} bare_insert_items_per_s={bare_rate:.0f} "
        f"restore_share={share:.2f} restore_share_target={RESTORE_SHARE}"
    )


def print_collections(coll: dict[str, float], n: int, docs: int,
                      full: dict[str, Any] | None) -> str:  # fmt: skip
    """The collections pass's line (beside the default collection's full backup when
    that part ran); returns its key=value part."""
    coll_per_item = coll["written"] / docs
    coll_ratio = coll["read"] / coll["written"]
    keys = (f"collections={n} coll_full_items_per_s={coll['rate']:.0f} "
            f"coll_ratio={coll_ratio:.2f} coll_bytes_per_doc={coll_per_item:.2f}")  # fmt: skip
    if full is None:
        print(f"over {n} collections: full backup {coll['items']:,.0f} items at "
              f"{coll['rate']:,.0f} items/s; ratio {coll_ratio:.2f}; {coll_per_item:.1f} "
              f"bytes written per document", flush=True)  # fmt: skip
        return keys
    print(
        f"  over {n} collections: full backup {coll['items']:,.0f} items at "
        f"{coll['rate']:,.0f} items/s ({coll['rate'] / full['rate']:.2f} of the default "
        f"collection's); ratio {coll_ratio:.2f}; {coll_per_item:.1f} bytes written per "
        f"document vs {full['per_item']:.1f} ({coll['items'] - full['full']['items']:+,.0f} "
        f"items: the system events)",
        flush=True,
    )
    return (f"{keys} coll_rate_ratio={coll['rate'] / full['rate']:.3f} "
            f"bytes_per_doc={full['per_item']:.2f}")  # fmt: skip


def csv_of(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated list of names out of `allowed`, in `allowed`'s order."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    if names - set(allowed):
        raise SystemExit(f"{what}: unknown {', '.join(sorted(names - set(allowed)))} "
                         f"(known: {','.join(allowed)})")  # fmt: skip
    return [n for n in allowed if n in names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--collections", type=int, default=8)
    ap.add_argument("--wire-docs", type=int, default=100_000)
    ap.add_argument("--wire-size", type=int, default=512)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"the repositories compared (default {','.join(VARIANTS)})")  # fmt: skip
    ap.add_argument("--pairs", type=int, default=3, help="rounds of the variants (default 3)")
    ap.add_argument("--skip", default="", help=f"parts left out: {','.join(PARTS)}")
    args = ap.parse_args()  # fmt: skip
    skip = csv_of(args.skip, PARTS, "--skip")
    variants = csv_of(args.variants, VARIANTS, "--variants")
    if args.pairs < 1:
        raise SystemExit("--pairs: at least 1")
    if "plain" not in variants:
        raise SystemExit("--variants: plain is the reference of every ratio: name it")
    keys: list[str] = []
    f: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="upr-bench-backup-") as name:
        tmp = Path(name)
        repo = tmp / "repo"
        if "full" not in skip or "variants" not in skip:
            node = BenchNode(tmp / "node")
            try:
                say(f"loading {args.docs:,} documents")
                upr("load", node.uri, "--docs", str(args.docs), "--json")
                node.wait_persisted()
                if "full" not in skip:
                    say("full and incremental backups, bare drain")
                    f = full_pass(node, args.docs, repo)
                if "variants" not in skip:
                    keys.append(variants_part(node.uri, variants, args.pairs, tmp))
            finally:
                node.stop()
        if f is not None:
            keys.insert(0, print_full(f, repo, tmp, args.docs))
        if "collections" not in skip:
            say(f"{args.docs:,} documents over {args.collections} collections")
            coll = collections_pass(args.docs, args.collections, tmp)
            keys.append(print_collections(coll, args.collections, args.docs, f))
        if "wire" not in skip:
            say(f"links: {args.wire_docs:,} documents of {args.wire_size} B")
            wire = wire_pass(args.wire_docs, args.wire_size, tmp)
            keys.append(print_wire(wire, args.wire_docs, args.wire_size))
    print(" ".join(keys))


if __name__ == "__main__":
    main()
