"""Worker: ``Topology.half_mean_`` (bf16 on the wire) against an independent reference.

Every rank draws its own tensor; the reference is the float64 mean of the bf16-rounded
inputs of the scope's learners (rounded once more to bf16, as the result is), computed here
from every rank's input. The result must equal it to one bf16 rounding, be the same bits on
every learner of the scope, and the bytes sent must be half of an fp32 ring's share.
"""

import sys

import torch

from hadpsgd import comm

topo = comm.init()
scope = sys.argv[1]
numel = 1001  # not a multiple of the ranks: the shards are padded
gen = torch.Generator().manual_seed(11 + topo.rank)
mine = torch.randn(numel, generator=gen) * (1 + topo.rank)
every = topo.allgather_object(mine)
members = list(range(topo.size)) if scope == "world" else topo.node_ranks
reference = torch.stack([every[r].to(torch.bfloat16).double() for r in members]).mean(0)
got = mine.clone()
sent = topo.half_mean_(got, scope)
n = len(members)
err = (got.double() - reference).abs()
bound = reference.abs() * 2.0**-8 + 1e-30  # one bf16 rounding of the mean
if not bool((err <= bound).all()):
    print(f"FAIL rank {topo.rank}: max error {float((err - bound).max())} over bf16 rounding")
    sys.exit(1)
shard = -(-numel // n)
if sent != 2 * (n - 1) * shard * 2:
    print(f"FAIL rank {topo.rank}: sent {sent} bytes, expected {2 * (n - 1) * shard * 2}")
    sys.exit(1)
results = topo.allgather_object(got)
if any(not torch.equal(results[r], got) for r in members):
    print(f"FAIL rank {topo.rank}: the scope's learners hold different bits")
    sys.exit(1)
print(f"OK rank {topo.rank}", flush=True)
