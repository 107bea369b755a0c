"""Worker: every collective against a NumPy reference, on whatever layout it is launched with.

Integer-valued data make every sum exact, so the hierarchical and the flat results must be
equal bit for bit, and so must every rank's copy. Prints ``OK rank r`` or the failures, once
for each intra-node backend of ``COMM_OPS_BACKENDS`` (comma-separated, e.g. ``mpi,gloo``: one
launch checks both, each on a topology of its own, one after the other); without it, once
for the backend ``HADPSGD_INTRA_BACKEND`` picks.
"""

import hashlib
import os
import sys

import numpy as np
import torch

from hadpsgd import comm


def check_all(topo: comm.Topology) -> list[str]:
    """Every check on ``topo``; the names of those that failed."""
    r, n, dev = topo.rank, topo.size, topo.device
    failures: list[str] = []

    def check(name: str, ok: bool) -> None:
        if not ok:
            failures.append(name)

    def make(k: int, dtype: torch.dtype, size: int) -> torch.Tensor:
        g = np.random.default_rng([k, size])
        return torch.from_numpy(g.integers(-8, 8, size).astype(np.float64)).to(dev, dtype)

    def same_on_all(t: torch.Tensor) -> bool:
        digest = hashlib.sha256(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()
                                ).hexdigest()
        return len(set(topo.allgather_object(digest))) == 1

    # Sizes: 1, odd, and (with a tiny HADPSGD_BUCKET_MB) not a multiple of the bucket or nodes.
    for dtype in (torch.float32, torch.float64, torch.float16):
        for size in (1, 7, 1001):
            ref = sum(make(k, dtype, size).double() for k in range(n))
            node_ref = sum(make(k, dtype, size).double() for k in topo.node_ranks)
            # (references are on the same device as the data)
            for op in ("sum", "avg"):
                div = 1 if op == "sum" else n
                hier = topo.allreduce_(make(r, dtype, size), op=op, path="hier")
                flat = topo.allreduce_(make(r, dtype, size), op=op, path="flat")
                auto = topo.allreduce_(make(r, dtype, size), op=op)
                tag = f"{op} {dtype} n={size}"
                check(f"hier {tag}", torch.allclose(hier.double(), ref / div, atol=1e-2))
                check(f"hier==flat {tag}", torch.equal(hier, flat) and torch.equal(hier, auto))
                check(f"identical {tag}", same_on_all(hier))
                ndiv = 1 if op == "sum" else topo.local_size
                intra = topo.intra_allreduce_(make(r, dtype, size), op=op)
                check(f"intra {tag}", torch.allclose(intra.double(), node_ref / ndiv, atol=1e-2))
                # inter: the super-learner's value is the same on its members (node-indexed data)
                inter = topo.inter_allreduce_(make(1000 + topo.node, dtype, size), op=op)
                inter_ref = sum(make(1000 + k, dtype, size).double() for k in range(topo.num_nodes))
                idiv = 1 if op == "sum" else topo.num_nodes
                check(f"inter {tag}", torch.allclose(inter.double(), inter_ref / idiv, atol=1e-2))
                check(f"inter identical {tag}", same_on_all(inter))
            t = make(r, dtype, size)
            topo.broadcast_(t, root=n - 1)
            check(f"broadcast {dtype} {size}", torch.equal(t, make(n - 1, dtype, size)))

    # Pair exchange: even/odd neighbours (a rank without a partner sits out).
    peer = r + 1 if r % 2 == 0 else r - 1
    if 0 <= peer < n:
        for dtype in (torch.float32, torch.float16):
            send = torch.full((33,), float(r), dtype=dtype, device=dev)
            recv = torch.empty(33, dtype=dtype, device=dev)
            topo.exchange(send, recv, peer)
            want = torch.full((33,), float(peer), dtype=dtype, device=dev)
            check(f"exchange {dtype}", torch.equal(recv, want))
    check("bcast_object", topo.bcast_object({"x": r}, root=1 % n) == {"x": 1 % n})
    check("allgather_object", topo.allgather_object(r) == list(range(n)))
    check("layout", sum(topo.node_sizes) == n and topo.node_ranks[topo.local_rank] == r)
    # The device follows the physical host (one machine here): host rank = world rank whatever
    # the emulated nodes, and every rank appears in the start-up placement line.
    check("host rank", (topo.host_rank, topo.host_size) == (r, n))
    check("placement", topo.placement.count(">") == n)
    # Routing: host tensors never take a device backend; device tensors take NCCL when present.
    host_route = topo.route(torch.zeros(1, dtype=torch.float64))
    link = topo.reducer.host_link  # (tests/workers/host_link.py cuts host legs by host)
    host_inter = "mpi" if link is None or link.kind != "cpu" else (
        f"{link.name} on one host" + (", mpi between hosts" if link.hosts > 1 else ""))
    check("host route", host_route.intra == topo.reducer.intra.name
          and host_route.inter == host_inter)
    if dev.type == "cuda":
        want = "nccl" if topo.intra_backend == "nccl" else f"{topo.reducer.intra.name} via host"
        check("device route", topo.route(torch.zeros(1, device=dev)).intra == want)
        # Super-learners that share a host, each on its own GPU: NCCL between them.
        if link is not None:
            check("device link", topo.route(torch.zeros(1, device=dev)).inter.startswith(
                "nccl on one host"))
    # CUDA-awareness is asked of the MPI library mpi4py really loaded (not the global namespace).
    if "HADPSGD_CUDA_AWARE" not in os.environ:
        from hadpsgd.comm.mpi import cuda_support

        check("cuda query", "MPIX_" in cuda_support()[1])
    topo.barrier()
    return failures


device = os.environ.get("HADPSGD_TEST_DEVICE", "cpu")
backends = os.environ.get("COMM_OPS_BACKENDS", "auto").split(",")
for backend in backends:
    world = comm.init(device=device, intra_backend=backend, preload=False)
    failed = check_all(world)
    world.close()
    if failed:
        print(f"FAIL rank {world.rank} ({backend}): {failed}", flush=True)
        sys.exit(1)
    print(f"OK rank {world.rank} {world.describe()}", flush=True)
# The last topology and this rank, for the workers that run this one (comm_ops_spanning,
# host_link) and read what it built.
topo, r = world, world.rank
