"""Worker: SSGD replicas stay bit-identical after every step; broadcast fixes different inits."""

import hashlib
import sys

import torch

from hadpsgd import comm
from hadpsgd.algorithms import SSGD
from hadpsgd.models import build_model

topo = comm.init()
torch.manual_seed(100 + topo.rank)  # deliberately different initial replicas
model = build_model("tiny", 6, 5)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
algo = SSGD(model, opt, topo)


def digest() -> str:
    return hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                          .numpy().tobytes()).hexdigest()


gen = torch.Generator().manual_seed(7 + topo.rank)  # different data on every rank
for step in range(6):
    x = torch.randn(4, 9, 6, generator=gen)
    y = torch.randint(0, 5, (4, 9), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 5), y.reshape(-1))
    loss.backward()
    algo.step()
    if step % 2:
        algo.zero_grad()
    else:  # the ordinary optimizer call must work too (it detaches .grad from the buffer)
        opt.zero_grad(set_to_none=True)
    digests = topo.allgather_object(digest())
    if len(set(digests)) != 1:
        print(f"MISMATCH at step {step}: {digests}", flush=True)
        sys.exit(1)
algo.close()
print(f"OK rank {topo.rank}", flush=True)
