"""A user's script with a mistake in its ``hadpsgd.Distributed`` call (issue 47).

``argv[1]`` says where: ``after-init`` (``hadpsgd.init()`` first, then a bad option),
``before-init`` (no topology given: refused before MPI starts), ``one-rank`` (only rank 1
refuses: the others go on and wait, so the job is aborted with exit 2), ``adpsgd-ok`` (a
correct ADPSGD job: nothing printed by Open MPI's one-sided UCX component).
"""

from __future__ import annotations

import sys

import torch

import hadpsgd

where = sys.argv[1]
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if where == "before-init":
    hadpsgd.Distributed(model, optimizer, "bmuf", sync_period=0)
topo = hadpsgd.init()
if where == "after-init":
    hadpsgd.Distributed(model, optimizer, "bmuf", topology=topo, sync_period=0)
elif where == "one-rank":
    period = 0 if topo.rank == 1 else 2
    dist = hadpsgd.Distributed(model, optimizer, "bmuf", topology=topo, sync_period=period)
    topo.barrier()
elif where == "adpsgd-ok":
    dist = hadpsgd.Distributed(model, optimizer, "adpsgd", topology=topo)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        dist.step()
    dist.close()
    print(f"rank {topo.rank}: done", flush=True)
