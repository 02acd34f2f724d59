"""`upr cluster`: several `upr serve` nodes on one machine, one cluster map (issue 7).

`spec` is the cluster file (nodes, ports, credentials); `procs` starts and stops the
node processes; `control` pushes the map and the partition states with the bucket CAS
and map revisions of formats/cluster.md; `orchestrate` runs failover, rebalance and
replication pauses; `health` reads every node back and judges what is degraded;
`lifecycle` is the one function per `upr cluster` command that the CLI calls;
`collections` reads and pushes the collections manifest on every node (`upr
collections`, and the orchestrator for the nodes it starts or adds).
"""
