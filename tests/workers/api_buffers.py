"""Worker: a model with BatchNorm under each algorithm, its buffers kept in agreement.

Usage: ``api_buffers.py [phase ...]`` on 4 ranks, 2 nodes of 2, with phases ``ssgd``,
``bmuf``, ``adpsgd`` and ``off`` (default: all, in one job). Each prints ``OK <phase> rank R``
or raises (the job then aborts with the reason). On a machine with a GPU the learners compute
there (tests/gpu/test_gpu_buffers.py), the buffers' memory on the device.

The model's first layer is a BatchNorm over the input, so its running statistics depend on
the data alone and each algorithm's are computed here again from every rank's batches
(plain torch BatchNorms); a second BatchNorm, after a trained layer, is checked for agreement
only.

- ssgd: after every step every rank's buffers are rank 0's, bit for bit (its own BatchNorm
  over its own batches); the construction made them rank 0's too.
- bmuf: inside a super-learner the buffers agree after every step (the mean of its
  learners'); at a block boundary every rank's are the mean of every learner's, and
  ``evaluation_model()`` holds that mean mid-block while the nodes' own differ; a state
  saved mid-block resumes bit for bit, buffers included.
- adpsgd: a super-learner's learners agree after every step; ``evaluation_model()`` holds
  the mean of every learner's on every rank, its integer buffers rank 0's.
- off: ``sync_buffers=False``: each learner keeps its own under every algorithm.
"""

from __future__ import annotations

import copy
import hashlib
import io
import sys

import torch
from api_common import CLASSES, FEATS, fail
from torch import nn

import hadpsgd

STEPS, TAU = 6, 3
DEVICE = torch.device("cpu")
"""Where the learners compute (the topology's: a GPU where there is one)."""


def bn_model(seed: int) -> nn.Module:
    """A small MLP with a BatchNorm on its input and one after its hidden layer."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.BatchNorm1d(FEATS), nn.Linear(FEATS, 16), nn.BatchNorm1d(16),
                         nn.Tanh(), nn.Linear(16, CLASSES))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of ``step``: statistics of its own (scale and shift by rank)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(4, FEATS, generator=gen) * (1 + rank) + rank
    return x.to(DEVICE), torch.randint(0, CLASSES, (4,), generator=gen).to(DEVICE)


def norm() -> nn.BatchNorm1d:
    """A reference input BatchNorm where the learners compute (the same kernels and bits)."""
    return nn.BatchNorm1d(FEATS).to(DEVICE)


def make(topo: hadpsgd.Topology, algo: str, **options: object) -> hadpsgd.Distributed:
    net = bn_model(100 + topo.rank).to(topo.device)
    net[0].running_mean.fill_(float(topo.rank))  # construction must make them rank 0's
    return hadpsgd.Distributed(net, torch.optim.SGD(net.parameters(), lr=0.05), algo,
                               topology=topo, **options)


def step(dist: hadpsgd.Distributed) -> None:
    x, y = batch(dist.topology.rank, dist.steps)
    loss = nn.functional.cross_entropy(dist.model(x), y)
    dist.zero_grad()
    loss.backward()
    dist.step(loss)


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().cpu().clone() for name, b in model.named_buffers()}


def digest(model: nn.Module) -> str:
    """A hash of every buffer's bits."""
    h = hashlib.sha256()
    for b in buffers(model).values():
        h.update(b.numpy().tobytes())
    return h.hexdigest()[:16]


def digests(topo: hadpsgd.Topology, model: nn.Module) -> list[str]:
    return topo.allgather_object(digest(model))


def node_means(steps: int, tau: int | None) -> list[nn.BatchNorm1d]:
    """The input BatchNorm of each node: its learners' mean every step, the nodes' every tau.

    The real means are sums divided by 2 (of two learners, of two nodes), as here.
    """
    nodes = [norm() for _ in range(2)]
    for s in range(steps):
        for node, bn in enumerate(nodes):
            members = [copy.deepcopy(bn) for _ in range(2)]
            for local, member in enumerate(members):
                member(batch(2 * node + local, s)[0])
            bn.running_mean.copy_((members[0].running_mean + members[1].running_mean) / 2)
            bn.running_var.copy_((members[0].running_var + members[1].running_var) / 2)
            bn.num_batches_tracked.copy_(members[0].num_batches_tracked)
        if tau is not None and (s + 1) % tau == 0:
            for name in ("running_mean", "running_var"):
                mean = (getattr(nodes[0], name) + getattr(nodes[1], name)) / 2
                for bn in nodes:
                    getattr(bn, name).copy_(mean)
    return nodes


def close_to(mine: nn.Module, ref: nn.Module, what: str) -> None:
    for name, b in buffers(ref).items():
        got = buffers(mine)[name]
        if not torch.allclose(got.double(), b.double(), rtol=1e-6, atol=1e-7):
            fail(f"{what}: {name} is {got}, expected {b}")


def ssgd(topo: hadpsgd.Topology) -> None:
    dist = make(topo, "ssgd")
    if float(dist.model[0].running_mean.abs().max()) != 0.0:
        fail("ssgd: the construction did not give rank 0's buffers")
    ref = norm()  # rank 0's: its own batches only
    for s in range(STEPS):
        step(dist)
        ref(batch(0, s)[0])
        if len(set(digests(topo, dist.model))) != 1:
            fail(f"ssgd: buffers differ across ranks after step {s + 1}")
        if buffers(dist.model[0]).keys() != buffers(ref).keys() or not all(
                torch.equal(a, b) for a, b in zip(buffers(dist.model[0]).values(),
                                                  buffers(ref).values(), strict=True)):
            fail(f"ssgd: the buffers after step {s + 1} are not rank 0's")
    with dist.evaluation_model() as m:
        if m is not dist.model or len(set(digests(topo, m))) != 1:
            fail("ssgd: the evaluation model's buffers differ")
    dist.close()


def _per_node(topo: hadpsgd.Topology, model: nn.Module, what: str) -> list[str]:
    every = digests(topo, model)
    if every[0] != every[1] or every[2] != every[3]:
        fail(f"{what}: the learners of a super-learner differ: {every}")
    return every


def bmuf(topo: hadpsgd.Topology) -> None:
    dist = make(topo, "bmuf", sync_period=TAU)
    for _ in range(STEPS):
        step(dist)
        _per_node(topo, dist.model, f"bmuf step {dist.steps}")
    if len(set(digests(topo, dist.model))) != 1:
        fail("bmuf: buffers differ across ranks at a block boundary")
    close_to(dist.model[0], node_means(STEPS, TAU)[0], "bmuf at the block boundary")
    boundary = digest(dist.model)
    step(dist)  # mid-block: the nodes' own differ, the global model's stay the boundary's
    if len(set(_per_node(topo, dist.model, "bmuf mid-block"))) != 2:
        fail("bmuf: the nodes' buffers should differ mid-block")
    with dist.evaluation_model() as m:
        if digest(m) != boundary:
            fail("bmuf: the evaluation model's buffers are not the last block sync's mean")
    close_to(dist.model[0], node_means(STEPS + 1, TAU)[topo.node], "bmuf mid-block")
    # Rank 0's state for everyone (one file, as with DDP): its model is node 0's, so node
    # 1's buffers must come from its part of the state.
    saved = io.BytesIO()
    torch.save(topo.bcast_object(dist.state_dict(gather=True)), saved)
    for _ in range(TAU):
        step(dist)
    straight = (digest(dist.model), dist.model[2].running_var.clone())
    with dist.evaluation_model() as m:
        straight_global = digest(m)
    dist.finish()  # the closing sync averages the partial block's buffers too
    if len(set(digests(topo, dist.model))) != 1:
        fail("bmuf: buffers differ across ranks after finish()")
    dist.close()
    # A resume mid-block continues bit for bit, buffers included (local and global).
    dist = make(topo, "bmuf", sync_period=TAU)
    saved.seek(0)
    dist.load_state_dict(torch.load(saved, weights_only=True))
    for _ in range(TAU):
        step(dist)
    with dist.evaluation_model() as m:
        resumed_global = digest(m)
    if (digest(dist.model), resumed_global) != (straight[0], straight_global):
        fail(f"bmuf: the resumed buffers differ on rank {topo.rank}: running_var "
             f"{dist.model[2].running_var} against {straight[1]}")
    dist.close()


def adpsgd(topo: hadpsgd.Topology) -> None:
    dist = make(topo, "adpsgd")
    for _ in range(STEPS):
        step(dist)
        _per_node(topo, dist.model, f"adpsgd step {dist.steps}")
    close_to(dist.model[0], node_means(STEPS, None)[topo.node], "adpsgd's super-learner")
    every = topo.allgather_object(buffers(dist.model))
    with dist.evaluation_model() as m:
        if len(set(digests(topo, m))) != 1:
            fail("adpsgd: the evaluation model's buffers differ across ranks")
        for name, b in buffers(m).items():
            values = torch.stack([mine[name] for mine in every])
            want = values[0] if not b.is_floating_point() else values.double().mean(0)
            if not torch.allclose(b.double(), want.double(), rtol=1e-6, atol=1e-7):
                fail(f"adpsgd: the evaluation model's {name} is {b}, not the mean {want}")
    dist.close()


def off(topo: hadpsgd.Topology) -> None:
    for algo, extra in (("ssgd", {}), ("bmuf", {"sync_period": TAU}), ("adpsgd", {})):
        dist = make(topo, algo, sync_buffers=False, **extra)
        if dist.options.sync_buffers or dist.algorithm.syncs_buffers:
            fail(f"{algo}: sync_buffers=False was not taken")
        for _ in range(STEPS):
            step(dist)
        if len(set(digests(topo, dist.model))) != topo.size:
            fail(f"{algo} sync_buffers=False: the learners' buffers should all differ")
        own = digest(dist.model)
        with dist.evaluation_model() as m:
            if digest(m) != own:
                fail(f"{algo} sync_buffers=False: the evaluation model's buffers are not "
                     "the learner's own")
        dist.close()


PHASES = {"ssgd": ssgd, "bmuf": bmuf, "adpsgd": adpsgd, "off": off}

if __name__ == "__main__":
    topology = hadpsgd.init()
    DEVICE = topology.device
    assert (topology.size, topology.num_nodes) == (4, 2), "run on 4 ranks, 2 nodes of 2"
    for phase in sys.argv[1:] or PHASES:
        PHASES[phase](topology)
        print(f"OK {phase} rank {topology.rank}", flush=True)
