#!/usr/bin/env bash
# The UPR design specification, "UPR in action on a Cluster" (its figures 1-9), staged
# on one machine.
#
# Three nodes: A (n0) is the master of the one partition, B (n1) and C (n2) replicas fed
# over UPR; D (n3) joins later. Replication pauses (`upr cluster pause --after SEQ`)
# stage the design's exact interleaving: B and C take the snapshot 1-5; B stops in the
# middle of the snapshot 6-8, C has all of it. A dies; B is promoted with a new failover
# entry at the last complete snapshot it persisted (5); C rolls back to 5 (a snapshot
# boundary it received: formats/cluster.md §5), repairs the master with the write only
# it held (`upr salvage --node-data`), and ends equal to B; D streams from B. The
# workload updates and deletes documents too (+key sets doc-key, -key deletes it):
#   A, seqs 1-5: +a +b +c +a +d   6-8: +b -c +e   9-11 (lost with A): +e -a +f
#   B, seqs 8-9: +a +g   10: C's +e (salvaged)   11-13: +e -g +h
#
# Usage: examples/failover-walkthrough.sh [WORKDIR]   (after `make demo` or `make test`)
# The last line is machine-readable: walkthrough key=value …
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
UPR=${UPR:-$here/.venv/bin/upr}
PY=${PY:-$here/.venv/bin/python}
work=${1:-$(mktemp -d /tmp/upr-walkthrough.XXXXXX)}
cl="$work/cluster"
rm -rf "$cl"
trap '"$UPR" cluster stop --data "$cl" >/dev/null 2>&1 || true' EXIT

say() { printf '\n== %s\n' "$*"; }
status() { "$UPR" cluster status --data "$cl" --logs | grep -v '^[┏┃┡│└]' || true; }
field() {  # field NODE KEY: a partition-0 field of a node from `status --json`
  "$UPR" cluster status --data "$cl" --json --logs |
    "$PY" -c "import json,sys; d=json.load(sys.stdin); n=[n for n in d['nodes'] if n['name']=='$1'][0]
p=next((p for p in n['partitions'] if p['partition']==0), {}); print(p.get('$2', n.get('$2')))"
}
wait_high() {  # wait_high NODE SEQ: until the node's copy of partition 0 reaches SEQ
  for _ in $(seq 200); do
    [ "$(field "$1" high_seqno)" -ge "$2" ] && [ "$(field "$1" persisted_seqno)" -ge "$2" ] && return 0
    sleep 0.05
  done
  echo "timed out waiting for $1 to reach seq $2" >&2; return 1
}
writes() {  # writes URI FIGURE OP…: in order; +KEY sets doc-KEY (new or updated), -KEY deletes it
  "$PY" - "$@" <<'EOF'
import asyncio, json, sys
from upr_cli.net.router import Router
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.messages import Delete, Set

async def main(uri: str, figure: str, ops: list[str]) -> None:
    router = await Router.open(SourceUri.parse(uri), name="walkthrough")  # follows the map
    try:
        for op in ops:
            key = f"doc-{op[1:]}".encode()
            vb = router.partition(key)
            wire = router.qualify(key)  # with its collection id where the nodes take one
            if op[0] == "-":
                make = lambda o, k=wire, vb=vb: Delete(vbucket=vb, key=k, opaque=o).encode()
            else:
                value = json.dumps({"key": key.decode(), "figure": figure}).encode()
                make = lambda o, k=wire, vb=vb, v=value: Set(
                    vbucket=vb, key=k, value=v, datatype=1, opaque=o).encode()
            status = (await router.request(vb, make)).vbucket_or_status
            if status:
                sys.exit(f"{op}: status 0x{status:02x}")
    finally:
        await router.aclose()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
EOF
}

say "Figure 1: A comes online as the master (failover entry at 0); B and C are replicas"
"$UPR" cluster init --nodes 3 --replicas 2 --num-partitions 1 --data "$cl"
eval "$("$UPR" cluster env --data "$cl")"
A=$UPR_N0 B=$UPR_N1
"$UPR" cluster pause n1 --after 0 --data "$cl"
"$UPR" cluster pause n2 --after 0 --data "$cl"
status

say "Figure 2: A takes 5 mutations (a updated at 4); B and C stream the snapshot 1-5"
writes "$A" 2 +a +b +c +a +d
"$UPR" cluster pause n1 --after 5 --data "$cl"
"$UPR" cluster pause n2 --after 5 --data "$cl"
wait_high n1 5
wait_high n2 5

say "Figure 3: A takes 3 more (6-8: b updated, c deleted, e new); C gets the snapshot 6-8"
writes "$A" 3 +b -c +e
"$UPR" cluster pause n2 --after 8 --data "$cl"
wait_high n2 8

say "Figure 4: B streams the next snapshot 6-8 but persists only 6 and 7 of it; A takes 3 more"
"$UPR" cluster pause n1 --after 7 --data "$cl"
wait_high n1 7
writes "$A" 4 +e -a +f
status

say "Figure 5: master A dies"
kill -9 "$(field n0 pid)"

say "Figure 6: B becomes the master, with a new failover entry at its last complete snapshot"
"$UPR" cluster failover n0 --to n1 --data "$cl"
b_entry=$(field n1 failover_log | "$PY" -c "import ast,sys; print(ast.literal_eval(sys.stdin.read())[0]['seq'])")
echo "B's new failover entry is at seq $b_entry"
status

say "Figure 7: B accepts mutations; C compares its failover log with B's"
writes "$B" 7 +a +g
status

say "Figure 8: C rolls back to the common snapshot, then repairs the master"
"$UPR" cluster resume n2 --data "$cl"
wait_high n2 "$(field n1 high_seqno)"
c_rollback=$(grep -o 'replica partition 0 rolled back to [0-9]*' "$cl/n2/serve.log" | tail -1 | awk '{print $NF}')
echo "C rolled back to seq $c_rollback"
"$UPR" salvage --node-data "$cl/n2" --into "$B" --apply || true
say "  D joins (rebalance) and streams from B"
"$UPR" cluster rebalance --add new --data "$cl"

say "Figure 9: streaming continues from the new master"
writes "$B" 9 +e -g +h
high=$(field n1 high_seqno)
wait_high n2 "$high"
wait_high n3 "$high"
status
same=$("$PY" - "$cl" <<'EOF'
import sqlite3, sys
rows = []
for n in ("n1", "n2", "n3"):
    with sqlite3.connect(f"{sys.argv[1]}/{n}/default.sqlite3") as c:
        rows.append(c.execute("SELECT key, seq, cas, rev_seq, deleted, value FROM docs"
                              " ORDER BY key").fetchall())
print("true" if rows[0] == rows[1] == rows[2] else "false")
EOF
)
echo "B, C and D hold the same documents: $same"
echo "walkthrough b_entry_seq=$b_entry c_rollback_to=$c_rollback high_seq=$high replicas_equal=$same"
