"""Worker: the direct path of the reductions (one guarded MPI call) against the general one.

With a small ``HADPSGD_BUCKET_MB`` some sizes fit in one bucket (direct path) and some do not
(general path, bucket by bucket). For every scope (flat, auto, intra, inter), op, dtype and
size, the public call must give exactly what the general path gives and what NumPy computes
(integer-valued data: every sum is exact), identical on every rank. Prints ``OK rank r`` or
the failures.
"""

import os
import sys

import numpy as np
import torch

from hadpsgd import comm

topo = comm.init(device="cpu", preload=False)  # no optimizer steps here
r, n = topo.rank, topo.size
red = topo.reducer
failures: list[str] = []
direct_taken: set[str] = set()


def check(name: str, ok: bool) -> None:
    if not ok:
        failures.append(name)


def make(k: int, dtype: torch.dtype, size: int) -> torch.Tensor:
    g = np.random.default_rng([k, size])
    return torch.from_numpy(g.integers(-8, 8, size).astype(np.float64)).to(dtype)


# (scope name, public call, general path, divisor of avg, data of rank k, ranks summed)
scopes = [
    ("flat", lambda t, op: topo.allreduce_(t, op=op, path="flat"),
     lambda t: red.world_sum_(t, "flat"), n, lambda k: k, range(n)),
    ("auto", lambda t, op: topo.allreduce_(t, op=op),
     lambda t: red.world_sum_(t, "auto"), n, lambda k: k, range(n)),
    ("intra", lambda t, op: topo.intra_allreduce_(t, op=op),
     red.intra_sum_, topo.local_size, lambda k: k, topo.node_ranks),
    # inter: a super-learner's value is the same on its members (node-indexed data)
    ("inter", lambda t, op: topo.inter_allreduce_(t, op=op),
     red.inter_sum_, topo.num_nodes, lambda k: 1000 + k, range(topo.num_nodes)),
]
bucket_elems = {torch.float32: red.bucket_bytes // 4, torch.float64: red.bucket_bytes // 8}
mine = {"flat": r, "auto": r, "intra": r, "inter": topo.node}
# Probing direct_sum_ alone is a collective only where every rank's answer is the same: with
# unequal nodes a lone rank's node reduces directly where the others would not.
probing = topo.equal_nodes

for dtype in (torch.float32, torch.float64):
    b = bucket_elems[dtype]
    for size in (0, 1, 7, b, b + 1, 3 * b + 5):
        for name, public, general, div, data, ranks in scopes:
            ref = sum(make(data(k), dtype, size).double() for k in ranks)
            for op in ("sum", "avg"):
                tag = f"{name} {op} {dtype} n={size}"
                probe = make(data(mine[name]), dtype, size)
                # Which path does this size take? (direct_sum_ sums in place when it can)
                took = probing and red.direct_sum_(probe, name)
                if took:
                    direct_taken.add(name)
                fast = public(make(data(mine[name]), dtype, size), op)
                slow = make(data(mine[name]), dtype, size)
                general(slow)
                if op == "avg" and div > 1:
                    slow.div_(div)
                want = ref / (div if op == "avg" else 1)
                check(f"value {tag}", torch.allclose(fast.double(), want, rtol=1e-6, atol=1e-6))
                check(f"fast==general {tag}", torch.equal(fast, slow))
                if took:
                    check(f"direct value {tag}", torch.equal(probe.double(), ref))
                every = topo.allgather_object(fast.numpy().tobytes())
                peers = topo.node_ranks if name == "intra" else range(n)
                check(f"identical {tag}", len({every[k] for k in peers}) == 1)

# A non-contiguous view, a half-precision tensor and a 0-d tensor take the general path
# (or, for the 0-d one, the direct one) and still give the right sums.
strided = torch.arange(20, dtype=torch.float32)[::2] * (r + 1)
topo.allreduce_(strided, op="sum", path="flat")
check("strided", torch.equal(strided, torch.arange(20, dtype=torch.float32)[::2]
                             * (n * (n + 1) / 2)))
half = torch.full((5,), float(r + 1), dtype=torch.float16)
topo.allreduce_(half, op="avg", path="flat")
check("float16", torch.equal(half, torch.full((5,), (n + 1) / 2, dtype=torch.float16)))
scalar = torch.tensor(float(r + 1), dtype=torch.float64)
topo.allreduce_(scalar, op="sum", path="flat")
check("0-d", float(scalar) == n * (n + 1) / 2)
ints = torch.full((3,), r + 1, dtype=torch.int64)
topo.allreduce_(ints, op="sum", path="flat")
check("int64", ints.tolist() == [n * (n + 1) // 2] * 3)
try:
    topo.allreduce_(torch.ones(2), op="max")  # type: ignore[arg-type]
    check("bad op refused", False)
except ValueError:
    pass

# The direct path was really taken where a scope is one MPI call (or this rank alone).
mpi_intra = red.intra.name == "mpi"
expect = {"flat"}
if not red.hierarchical and (topo.num_nodes > 1 or topo.local_size == 1 or mpi_intra):
    expect.add("auto")
if topo.local_size == 1 or mpi_intra:
    expect.add("intra")
if topo.local_size == 1 or topo.num_nodes == 1:
    expect.add("inter")
if probing:
    check(f"direct path taken for {sorted(expect)} (got {sorted(direct_taken)})",
          expect == direct_taken)
check("no direct path for hier", red.direct_sum_(torch.ones(1), "hier") is False)

topo.barrier()
topo.close()
if failures:
    print(f"FAIL rank {r}: {failures}", flush=True)
    sys.exit(1)
print(f"OK rank {r} direct={sorted(direct_taken)} {os.environ.get('HADPSGD_RANKS_PER_NODE')} "
      f"{topo.describe()}", flush=True)
