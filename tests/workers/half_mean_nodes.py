"""Worker: ``--grad-wire bf16`` across nodes (``Topology.half_mean_`` over a world of nodes).

Usage: ``half_mean_nodes.py HIER_ALGO`` (``auto``: the shard form, ``leader``) under
``HADPSGD_RANKS_PER_NODE`` (and ``HADPSGD_INTRA_BACKEND``: with gloo its store must wait
``HADPSGD_TIMEOUT``; ``HADPSGD_TEST_DEVICE=cuda``: the tensors on the GPU). Every rank draws
its own tensor; the reference is built here from every rank's input, as the layout defines
it: each node's mean in fp32 (its members' sum, then divided by the learners per node:
size / nodes, for unequal nodes too, so that the mean across nodes is the world's), rounded to
bf16; those summed in node order in fp32, divided by the number of nodes and rounded to bf16
once more. The result must equal it bit for bit and be the same bits on every rank.

The inter-node communicator is wrapped in a counter of the bytes each call hands MPI for
other nodes (a ring's share of an allreduce, (N - 1) / N of an all-to-all, (N - 1) times an
allgather's contribution): the count ``half_mean_`` returns must be what crossed between
nodes, and about half of what the fp32 hierarchical allreduce of the same tensor crosses.
Nothing may go over the world communicator meanwhile.
"""

import os
import sys
from typing import Any

import torch

from hadpsgd import comm


class Counting:
    """An MPI communicator that counts the bytes this rank hands it for other ranks."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.bytes = 0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _count(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.calls += 1

    def Allreduce(self, send: Any, recv: Any, *args: Any, **kw: Any) -> None:  # noqa: N802
        n = self.inner.Get_size()
        self._count(2 * (n - 1) * recv.nbytes // n)
        self.inner.Allreduce(send, recv, *args, **kw)

    def Alltoall(self, send: Any, recv: Any) -> None:  # noqa: N802
        n = self.inner.Get_size()
        self._count((n - 1) * send.nbytes // n)
        self.inner.Alltoall(send, recv)

    def Allgather(self, send: Any, recv: Any) -> None:  # noqa: N802
        self._count((self.inner.Get_size() - 1) * send.nbytes)
        self.inner.Allgather(send, recv)


def fail(why: str) -> None:
    print(f"FAIL rank {topo.rank}: {why}", flush=True)
    sys.exit(1)


topo = comm.init(device=os.environ.get("HADPSGD_TEST_DEVICE", "cpu"), hier_algo=sys.argv[1],
                 preload=False)  # no optimizer steps here
numel = 100_003  # a multiple of neither the node size nor the number of nodes: padded
gen = torch.Generator().manual_seed(7 + topo.rank)
mine = torch.randn(numel, generator=gen) * (1 + topo.rank)
mine[:4] = torch.tensor([0.0, -0.0, 1e30, -3.0])  # exact, signed zero, large
every = topo.allgather_object(mine)
nodes = topo.allgather_object(topo.node)

means = []
for k in range(topo.num_nodes):
    members = [r for r in range(topo.size) if nodes[r] == k]
    acc = every[members[0]].clone()
    for r in members[1:]:  # two members: fp32 addition is commutative, so exact either way
        acc += every[r]
    # The node's share of the world's mean: its mean where nodes are of equal size.
    means.append((acc / (topo.size / topo.num_nodes)).to(torch.bfloat16).float())
acc = means[0].clone()
for m in means[1:]:
    acc += m
reference = (acc / topo.num_nodes).to(torch.bfloat16).float()

inter = Counting(topo.inter)
world = Counting(topo.comm)
topo.inter = topo.reducer.inter = inter
topo.comm = topo.reducer.world = world
got = mine.to(topo.device, copy=True)
sent = topo.half_mean_(got, "world")
got = got.cpu()
half_crossed, world_calls = inter.bytes, world.calls
inter.bytes = 0
full = mine.to(topo.device, copy=True)
topo.allreduce_(full, "avg", path="hier")
full = full.cpu()
fp32_crossed = inter.bytes
topo.inter = topo.reducer.inter = inter.inner
topo.comm = topo.reducer.world = world.inner

store = getattr(topo.reducer.intra, "store", None)  # gloo's rendezvous (HADPSGD_INTRA_BACKEND)
if store is not None and store.timeout.total_seconds() != topo.timeout:
    fail(f"the {topo.reducer.intra.name} store waits {store.timeout}, not HADPSGD_TIMEOUT")
if not torch.equal(got, reference) or not torch.equal(got.signbit(), reference.signbit()):
    bad = int((got != reference).sum())
    fail(f"{bad} elements differ from the reference, e.g. {got[:6]} vs {reference[:6]}")
if world_calls:
    fail(f"{world_calls} calls over the world communicator: the mean must not go flat")
if sent != half_crossed:
    fail(f"half_mean_ counted {sent} bytes, but {half_crossed} crossed between nodes")
ratio = sent / fp32_crossed if fp32_crossed else None
if (fp32_crossed == 0) != (sent == 0) or (ratio is not None and not 0.5 <= ratio < 0.501):
    fail(f"bf16 sent {sent} bytes between nodes, fp32 hierarchical {fp32_crossed}")
drift = float((full[4:] - got[4:]).norm() / full[4:].norm())
if not drift < 2.0**-7:
    fail(f"the bf16 mean is {drift:.2e} (relative L2) from the fp32 hierarchical mean")
results = topo.allgather_object(got)
if any(not torch.equal(r, got) for r in results):
    fail("the learners hold different bits")
print(f"OK rank {topo.rank} local {topo.local_rank} sent {sent} fp32 {fp32_crossed} "
      f"intra-node {topo.route(mine.to(topo.device)).intra}", flush=True)
topo.close()  # (a warm world runs this worker again in the same process: free what it made)
