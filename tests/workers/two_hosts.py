"""Worker: the topology and a hierarchical allreduce across two emulated hosts.

Prints, on rank 0, the nodes ``hadpsgd.comm.init`` found and checks an 8 MiB hierarchical
allreduce (each rank's value is its rank + 1) against its closed form on every rank.
"""

import sys

import torch

from hadpsgd import comm

topo = comm.init(preload=False)  # no optimizer steps here
t = torch.full((2 * 2**20,), float(topo.rank + 1))
topo.allreduce_(t, op="sum")
want = topo.size * (topo.size + 1) / 2
ok = bool((t == want).all())
hosts = topo.allgather_object(topo.hosts[topo.rank] if topo.hosts else "")
if topo.rank == 0:
    print(f"nodes {topo.num_nodes} sizes {topo.node_sizes} hosts {hosts}", flush=True)
print(f"rank {topo.rank} {'OK' if ok else 'FAIL'}", flush=True)
sys.exit(0 if ok else 1)
