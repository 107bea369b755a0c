"""Worker: each algorithm through ``hadpsgd.Distributed`` on 4 ranks (2 nodes of 2).

Usage: ``api_algorithms.py TMPDIR [phase ...]`` with phases ``ssgd``, ``fp16``, ``bmuf``,
``adpsgd`` (default: all, in one job: one start-up for all). Each phase prints ``OK <phase>
rank R`` or raises (the job then aborts with the reason).

- ssgd: replicas bit-identical after every step, and the result equal to one plain-torch
  process with the 4 learners' batches together (hadpsgd's sampler order, written out here).
- fp16: an overflow on one learner is skipped by every learner and halves everyone's scale.
- bmuf: 2k steps equal k steps, state_dict through a file saved by rank 0 alone, load_state
  into a fresh model (other weights), k steps: bit for bit, local and global model.
- adpsgd: the shared pool trains every sample of each of 2 epochs exactly once across the
  learners, while the slower super-learner takes fewer batches.
- schedule: a per-step ``OneCycleLR(total_steps=epochs * len(sampler))`` under ADPSGD, stepped
  by ``sampler.step_scheduler``: the fast super-learner takes more than ``len(sampler)``
  batches an epoch (stepped once per batch, the schedule would raise on it), yet every
  learner ends each epoch at the same step of the schedule and the same rate.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np
import torch
from api_common import dataset, digest, fail, flat, loader, model, same, train
from torch import nn

import hadpsgd


def ssgd(topo: hadpsgd.Topology, tmp: Path) -> None:
    data = dataset(83)  # 5 steps of 4 x 4 per epoch; 3 samples left out
    net = model(100 + topo.rank)  # different on every rank: the broadcast makes them rank 0's
    dist = hadpsgd.Distributed(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                               "ssgd", topology=topo)
    start = flat(dist.model)
    batches, sampler = loader(dist, data, 4, seed=5)
    train(dist, batches, sampler, steps=None, epochs=2, check=True)
    # The reference: one process, plain torch, the global batch of every step at once.
    ref = model(0)
    nn.utils.vector_to_parameters(start.clone(), ref.parameters())  # it aliases the vector
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = 4 * topo.size
    for epoch in range(2):
        order = np.random.default_rng([5, epoch]).permutation(len(data))
        for s in range(len(data) // g):
            x, y, _ = data[order[s * g:(s + 1) * g]]
            opt.zero_grad()
            nn.functional.cross_entropy(ref(x), y).backward()
            opt.step()
    mine, theirs = flat(dist.model), flat(ref)
    if not torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6):
        fail(f"ssgd differs from the big-batch process by {(mine - theirs).abs().max()}")
    if torch.allclose(start, mine):
        fail("ssgd did not move the model")
    dist.close()


def fp16(topo: hadpsgd.Topology, tmp: Path) -> None:
    net = model(0)
    dist = hadpsgd.Distributed(net, torch.optim.SGD(net.parameters(), lr=0.05), "ssgd",
                               topology=topo, precision="fp16")
    if dist.loss_scale != 2.0**16:
        fail(f"fp16 starts at scale {dist.loss_scale}")
    batches, sampler = loader(dist, dataset(64), 4, seed=1)
    sampler.set_epoch(0)
    for i, (x, y, _) in enumerate(batches):
        with dist.autocast():
            logits = dist.model(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        scaled = dist.scale(loss)
        if i == 1 and topo.rank == 3:
            scaled = scaled * 2.0**40  # this learner's fp16 gradient overflows
        dist.zero_grad()
        scaled.backward()
        result = dist.step(loss)
        if i == 1 and not (result.skipped and result.overflow
                           and result.local_finite == (topo.rank != 3)):
            fail(f"fp16 overflow on rank 3 gave {result} on rank {topo.rank}")
        if i != 1 and result.skipped:
            fail(f"fp16 step {i} skipped: {result}")
        if i == 3:
            break
    scales = topo.allgather_object(dist.metrics()["loss_scale"])
    if scales != [2.0**15] * topo.size or dist.metrics()["overflow_steps"] != 1:
        fail(f"fp16 scales after one overflow: {scales}, metrics {dist.metrics()}")
    same(dist, "fp16")
    dist.close()


def _bmuf(seed: int, topo: hadpsgd.Topology) -> tuple[hadpsgd.Distributed, object, object]:
    net = model(seed)
    opt = torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.5, 0.999))
    dist = hadpsgd.Distributed(net, opt, "bmuf", topology=topo, sync_period=3)
    batches, sampler = loader(dist, dataset(100), 3, seed=7)  # 8 steps per epoch
    return dist, batches, sampler


def bmuf(topo: hadpsgd.Topology, tmp: Path) -> None:
    k = 7  # mid-block (tau 3) and mid-epoch (8 steps); 2k crosses the epoch's end
    dist, batches, sampler = _bmuf(0, topo)
    train(dist, batches, sampler, steps=2 * k)
    straight = flat(dist.model)
    with dist.evaluation_model() as m:
        straight_global = flat(m)
    if dist.metrics()["wire_bytes"] <= 0:
        fail(f"bmuf sent nothing across nodes: {dist.metrics()}")
    # Mid-block, the two super-learners' local models differ: the state needs both parts.
    if len(set(topo.allgather_object(digest(dist.model)))) != 2:
        fail("bmuf: the nodes' local models should differ mid-block")
    dist.close()

    dist, batches, sampler = _bmuf(0, topo)
    train(dist, batches, sampler, steps=k)
    gathered = dist.state_dict(gather=True)  # collective; rank 0's holds every node's part
    if topo.rank == 0 and sorted(gathered["nodes"]) != list(range(topo.num_nodes)):
        fail(f"state_dict(gather=True) on rank 0 holds nodes {sorted(gathered['nodes'])}")
    state = dist.state_dict()  # sharded, the default: each node's own part
    if sorted(state["nodes"]) != [topo.node]:
        fail(f"state_dict() on rank {topo.rank} holds nodes {sorted(state['nodes'])}")
    path = tmp / f"bmuf-node{topo.node}.pt"  # one file per node, written by its leader
    if topo.local_rank == 0:
        torch.save({"mine": "the user's own entries", "hadpsgd": state}, path)
    topo.barrier()
    dist.close()

    dist, batches, sampler = _bmuf(1, topo)  # other weights: the load must restore them
    dist.load_state_dict(torch.load(path, weights_only=True)["hadpsgd"])
    if (sampler.epoch, dist.steps) != (0, k):
        fail(f"bmuf resumed at epoch {sampler.epoch}, step {dist.steps}")
    train(dist, batches, sampler, steps=2 * k)
    with dist.evaluation_model() as m:
        resumed_global = flat(m)
    if not (torch.equal(flat(dist.model), straight) and torch.equal(resumed_global,
                                                                    straight_global)):
        fail(f"bmuf resume is not exact on rank {topo.rank}: local "
             f"{(flat(dist.model) - straight).abs().max()}, global "
             f"{(resumed_global - straight_global).abs().max()}")
    dist.close()


def adpsgd(topo: hadpsgd.Topology, tmp: Path) -> None:
    net = model(0)
    dist = hadpsgd.Distributed(net, torch.optim.SGD(net.parameters(), lr=0.05), "adpsgd",
                               topology=topo)
    data = dataset(130)  # 16 shard steps of 2 x 4: 32 slots of 2 batches per epoch
    batches, sampler = loader(dist, data, 2, seed=3)
    if not isinstance(sampler, hadpsgd.PoolSampler):
        fail(f"adpsgd across nodes gave {type(sampler).__name__}")
    seen: list[list[int]] = []
    # Node 1 is slower: it should take fewer batches, and nobody waits for it.
    train(dist, batches, sampler, steps=None, epochs=2, seen=seen,
          wait=0.1 if topo.node == 1 else 0.0)
    every = topo.gather_object(seen)
    if topo.rank == 0:
        used = (len(data) // (2 * topo.size)) * 2 * topo.size
        for epoch in range(2):
            counts = collections.Counter(i for mine in every for i in mine[epoch])
            if len(counts) != used or set(counts.values()) != {1}:
                fail(f"adpsgd epoch {epoch}: {len(counts)} distinct samples of {used}, "
                     f"trained {sorted(set(counts.values()))} times")
        taken = [len(mine[0]) // 2 for mine in every]
        print(f"adpsgd batches per learner in epoch 0: {taken}", flush=True)
        if not sum(taken[2:]) < sum(taken[:2]):
            fail(f"adpsgd: the slow super-learner took as many batches: {taken}")
    if sampler.state_dict() != {"epoch": 2, "slot": 0}:
        fail(f"adpsgd pool after 2 epochs: {sampler.state_dict()}")
    with dist.evaluation_model() as m:
        if len(set(topo.allgather_object(digest(m)))) != 1:
            fail("adpsgd's evaluation model is not the same average everywhere")
    figures = dist.metrics()
    if not {"exchanges_per_step", "staleness", "consensus_distance"} <= set(figures):
        fail(f"adpsgd figures: {figures}")
    dist.close()


def schedule(topo: hadpsgd.Topology, tmp: Path) -> None:
    import time

    net = model(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    dist = hadpsgd.Distributed(net, opt, "adpsgd", topology=topo)
    batches, sampler = loader(dist, dataset(130), 2, seed=3)
    epochs = 2
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1,
                                                total_steps=epochs * len(sampler))
    mine, ends = [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        mine.append(0)
        for x, y, _ in batches:
            loss = nn.functional.cross_entropy(dist.model(x), y)
            dist.zero_grad()
            loss.backward()
            dist.step(loss)
            sampler.step_scheduler(sched)
            mine[-1] += 1
            if topo.node == 1:
                time.sleep(0.1)  # the slow super-learner
        sampler.step_scheduler(sched)  # the pool is empty: the epoch's end, on every learner
        ends.append((sched.last_epoch, opt.param_groups[0]["lr"]))
    every = topo.allgather_object((mine, ends))
    if topo.rank == 0:
        print(f"schedule: batches per learner and epoch {[m for m, _ in every]}, "
              f"(schedule step, lr) at each epoch's end {every[0][1]}", flush=True)
        if len({repr(e) for _, e in every}) != 1:
            fail(f"schedule: the learners end their epochs at different rates: {every}")
        if [step for step, _ in every[0][1]] != [len(sampler) * (e + 1) for e in range(epochs)]:
            fail(f"schedule: epochs end at schedule steps {every[0][1]}, not "
                 f"{len(sampler)} an epoch")
        if max(m[0] for m, _ in every) <= len(sampler):
            fail(f"schedule: no learner took more than len(sampler) {len(sampler)} batches: "
                 f"the case is not tested ({every})")
    dist.close()


PHASES = {"ssgd": ssgd, "fp16": fp16, "bmuf": bmuf, "adpsgd": adpsgd, "schedule": schedule}

if __name__ == "__main__":
    tmp = Path(sys.argv[1])
    topology = hadpsgd.init()
    assert (topology.size, topology.num_nodes) == (4, 2), "run on 4 ranks, 2 nodes of 2"
    for name in sys.argv[2:] or PHASES:
        PHASES[name](topology, tmp)
        print(f"OK {name} rank {topology.rank}", flush=True)
