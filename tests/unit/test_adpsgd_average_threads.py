"""ADPSGD's average of the replicas (evaluation, checkpoints) on learners as threads: counted
as bytes between nodes, taken again only where a replica changed, and agreed when only some
learners stepped (issue 57: on two emulated hosts the averages at every epoch's evaluation and
checkpoint were most of what H-ADPSGD put on the link, and nobody counted them)."""

from __future__ import annotations

import torch

from hadpsgd.algorithms import build
from hadpsgd.algorithms.gradsync import internode_share
from hadpsgd.comm import World
from hadpsgd.comm.threads import ThreadJob


def _averages(topo: World) -> list[str]:
    torch.manual_seed(topo.rank)  # replicas that differ: their average is not any of them
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = build("adpsgd", model, opt, topo)
    failures: list[str] = []
    one = internode_share(sum(p.numel() * 4 for p in model.parameters()), topo)

    def step() -> None:
        model(torch.randn(4, 6)).pow(2).mean().backward()
        algo.step()
        algo.zero_grad()

    try:
        algo.sync()
        if algo.sync_bytes != one:
            failures.append(f"first average: {algo.sync_bytes} bytes counted, {one} crossed")
        with algo.evaluation_parameters() as m:
            first = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        algo.sync()  # nothing stepped: the evaluation's checkpoint takes the same average
        algo.sync()
        if algo.sync_bytes != one:
            failures.append(f"unchanged replicas averaged again: {algo.sync_bytes} bytes")
        everyone = topo.allgather_object(first)
        if any(not torch.equal(everyone[0], e) for e in everyone):
            failures.append("the learners' averages differ")
        if topo.rank == 1:  # only one learner steps: every learner must average again
            step()
        algo.sync()
        if algo.sync_bytes != 2 * one:
            failures.append(f"after one learner's step: {algo.sync_bytes} bytes, want {2 * one}")
        with algo.evaluation_parameters() as m:
            second = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        if torch.equal(first, second):
            failures.append("the average after a step is the one before it")
    finally:
        algo.close()
    sent, received = algo.internode_bytes()
    if sent < algo.sync_bytes or received < algo.sync_bytes:
        failures.append(f"internode_bytes {sent, received} leave out the averages")
    return failures


def test_the_average_is_counted_taken_once_and_agreed():
    failures = ThreadJob(3, 1, timeout=60).run(_averages)
    assert failures == [[], [], []], failures
