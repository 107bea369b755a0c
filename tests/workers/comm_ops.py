"""Worker: allreduce / broadcast / pair exchange against NumPy references on every rank."""

import sys

import numpy as np
import torch

from hadpsgd import comm

topo = comm.init()
r, n = topo.rank, topo.size
failures = []


def check(name: str, ok: bool) -> None:
    if not ok:
        failures.append(name)


for dtype in (torch.float32, torch.float64, torch.float16):
    for size in (1, 7, 1001):
        def make(k: int, dtype=dtype, size=size) -> torch.Tensor:
            g = np.random.default_rng([k, size])
            return torch.from_numpy(g.integers(-8, 8, size).astype(np.float64)).to(dtype)

        ref = sum(make(k).double() for k in range(n))
        for op in ("sum", "avg"):
            t = make(r)
            topo.allreduce_(t, op=op)
            want = ref if op == "sum" else ref / n
            check(f"allreduce {op} {dtype} {size}", torch.allclose(t.double(), want, atol=1e-2))
        t = make(r)
        topo.broadcast_(t, root=n - 1)
        check(f"broadcast {dtype} {size}", torch.equal(t, make(n - 1)))

# Pair exchange: ring neighbours in even/odd pairs (a rank without a partner sits out).
peer = r + 1 if r % 2 == 0 else r - 1
if 0 <= peer < n:
    send = torch.full((33,), float(r))
    recv = torch.empty(33)
    topo.exchange(send, recv, peer)
    check("exchange", torch.equal(recv, torch.full((33,), float(peer))))
check("bcast_object", topo.bcast_object({"x": r}, root=1 % n) == {"x": 1 % n})
check("allgather_object", topo.allgather_object(r) == list(range(n)))
topo.barrier()
if failures:
    print(f"FAIL rank {r}: {failures}", flush=True)
    sys.exit(1)
print(f"OK rank {r}", flush=True)
