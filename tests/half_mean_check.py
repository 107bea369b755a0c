"""``half_mean_`` (bf16 on the wire) of a world against an independent reference.

Every rank draws its own tensor; the reference is the float64 mean of the bf16-rounded
inputs of the scope's learners (rounded once more to bf16, as the result is), computed here
from every rank's input. The result must equal it to one bf16 rounding, be the same bits on
every learner of the scope, and the bytes sent must be half of an fp32 ring's share. Where
the world spans several nodes only the inter-node leg is bf16: what is rounded is each
node's fp32 mean, and the bytes are those sent between nodes, by local rank j for slice j
of the node's sum (``tests/workers/half_mean_nodes.py`` checks that path bit for bit).

:func:`check_half_mean` runs on either world: ``tests/workers/half_mean.py`` under mpirun,
``tests/unit/test_precision_threads.py`` on learners as threads.
"""

from __future__ import annotations

import torch

from hadpsgd.comm import World


def check_half_mean(topo: World, scope: str) -> str | None:
    """``topo.half_mean_`` over ``scope`` against the reference; None, or what failed."""
    numel = 1001  # not a multiple of the ranks: the shards are padded
    gen = torch.Generator().manual_seed(11 + topo.rank)
    mine = torch.randn(numel, generator=gen) * (1 + topo.rank)
    every = topo.allgather_object(mine)
    nodes = topo.allgather_object(topo.node)
    members = (list(range(topo.size)) if scope == "world"
               else [r for r in range(topo.size) if nodes[r] == topo.node])
    across = scope == "world" and topo.num_nodes > 1
    if across:  # each node's fp32 mean is what is rounded to bf16
        rounded = [(sum(every[r] for r in members if nodes[r] == k) / topo.local_size)
                   .to(torch.bfloat16).double() for k in range(topo.num_nodes)]
    else:
        rounded = [every[r].to(torch.bfloat16).double() for r in members]
    reference = torch.stack(rounded).mean(0)
    got = mine.clone()
    sent = topo.half_mean_(got, scope)
    n = len(members)
    err = (got.double() - reference).abs()
    bound = reference.abs() * 2.0**-8 + 1e-30  # one bf16 rounding of the mean
    if not bool((err <= bound).all()):
        return f"FAIL rank {topo.rank}: max error {float((err - bound).max())} over bf16 rounding"
    legs, length = (topo.num_nodes, -(-numel // topo.local_size)) if across else (n, numel)
    shard = -(-length // legs)
    if sent != 2 * (legs - 1) * shard * 2:
        return f"FAIL rank {topo.rank}: sent {sent} bytes, expected {2 * (legs - 1) * shard * 2}"
    results = topo.allgather_object(got)
    if any(not torch.equal(results[r], got) for r in members):
        return f"FAIL rank {topo.rank}: the scope's learners hold different bits"
    return None
