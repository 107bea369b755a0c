"""Worker: through ``hadpsgd.Distributed``, a learner that stops coming is named, not waited for.

Rank 1 stalls in its own code after step 1 (alive, never calling step 2); rank 0's step 2
must fail within ``HADPSGD_TIMEOUT`` with an error that names rank 1 and what it was doing,
and ``hadpsgd.init``'s hook must end the whole job, rank 0 leaving a ``failure`` record in
the run directory given as the first argument.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from api_common import dataset, loader, model
from torch import nn

import hadpsgd

topo = hadpsgd.init()
net = model(0)
dist = hadpsgd.Distributed(net, torch.optim.SGD(net.parameters(), lr=0.1), "ssgd",
                           topology=topo, run_dir=sys.argv[1], log_every=1)
batches, sampler = loader(dist, dataset(64), 4, seed=0)
sampler.set_epoch(0)
for i, (x, y, _) in enumerate(batches):
    if i == 1 and topo.rank == 1:
        print(f"STALL rank 1 {time.time():.3f}", flush=True)
        time.sleep(60)  # alive, answering its peers' questions, but never stepping again
        os._exit(0)
    loss = nn.functional.cross_entropy(dist.model(x), y)
    dist.zero_grad()
    loss.backward()
    dist.step(loss)
print("NO TIMEOUT", flush=True)
