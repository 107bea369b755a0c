"""Faults injected at the world's face (``hadpsgd/comm/faulty.py``), on learners as threads.

The wrapper hands every call through unchanged but the ones an injection names; there it
raises the learner's own error, a deadline's ``CommTimeoutError``, makes the learner's
contribution NaN, or delays it. Checked without a launch: a wrapped world with nothing due
trains bit-identically to the bare one (a delay too); a learner's own error at a collective
ends every learner at once with that error, not at the deadline; a NaN contribution to
SSGD's gradient mean is skipped by every learner alike (replicas bit-identical, finite); a
deadline in ADPSGD's gossip thread reaches the main thread as the gossip thread's failure
(what ``HADPSGD_FAULT``'s ``raise-gossip`` now goes through, instead of a hook in the
algorithm).
"""

from __future__ import annotations

import hashlib
import math
import threading

import pytest
import torch

from hadpsgd.algorithms import build
from hadpsgd.comm import CommTimeoutError, World
from hadpsgd.comm.faulty import FaultyWorld, InjectedCommFault, Injection
from hadpsgd.comm.threads import ThreadJob

_INIT = threading.Lock()


def _digest(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _train(world: World, algo_name: str, steps: int = 4) -> tuple[str, list[bool]]:
    """``steps`` steps of a small model on this learner's own batches: digest, skips."""
    with _INIT:  # torch's generator is the process's: one learner draws at a time
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 3))
    options = {"sync_period": 2} if algo_name == "bmuf" else {}
    algo = build(algo_name, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                 world, **options)
    gen = torch.Generator().manual_seed(5 + world.rank)
    skips = []
    try:
        for _ in range(steps):
            loss = model(torch.randn(6, 12, generator=gen)).pow(2).mean()
            loss.backward()
            skips.append(algo.step(loss.detach()).skipped)
            algo.zero_grad()
    finally:
        algo.close()
    return _digest(model), skips


@pytest.mark.parametrize("algo_name", ["ssgd", "bmuf"])
def test_nothing_due_and_a_delay_change_no_bit(algo_name: str) -> None:
    bare = ThreadJob(4, 2, timeout=60).run(lambda w: _train(w, algo_name))
    wrapped = ThreadJob(4, 2, timeout=60).run(lambda w: _train(FaultyWorld(w, [
        Injection("allreduce_", call=3, kind="delay", seconds=0.05),
        Injection("intra_allreduce_", call=2, kind="delay", seconds=0.05)]
        if w.rank == 1 else []), algo_name))
    assert wrapped == bare


def test_a_learners_own_error_at_a_collective_ends_every_learner_with_it() -> None:
    def learner(w: World) -> object:
        return _train(FaultyWorld(w, [Injection("allreduce_", call=2)] if w.rank == 1 else []),
                      "ssgd")

    # The peers are released by the failing learner, not by their deadline (an hour here):
    # the job ends with rank 1's own error, its call named.
    with pytest.raises(InjectedCommFault, match=r"allreduce_ \(call 2\) on rank 1"):
        ThreadJob(3, 1, timeout=3600).run(learner)


def test_a_deadline_injected_is_the_deadlines_error_naming_the_call() -> None:
    def learner(w: World) -> object:
        world = FaultyWorld(w, [Injection("barrier", kind="timeout")] if w.rank == 0 else [])
        world.barrier()

    with pytest.raises(CommTimeoutError, match=r"rank 0: barrier \(call 1\) did not complete"):
        ThreadJob(2, 1, timeout=3600).run(learner)


def test_a_nan_contribution_to_the_gradient_mean_is_skipped_by_everyone_alike() -> None:
    # SSGD's first allreduce_ of a step is its gradient bucket on this model (checked: the
    # step is skipped). Rank 2's third step contributes NaN: every learner skips that step.
    def learner(w: World) -> tuple[str, list[bool], list[int]]:
        inj = [Injection("allreduce_", call=3, kind="nan")] if w.rank == 2 else []
        world = FaultyWorld(w, inj)
        digest, skips = _train(world, "ssgd")
        return digest, skips, [i.fired for i in inj][0] if inj else []

    every = ThreadJob(3, 1, timeout=60).run(learner)
    assert every[2][2] == [3]  # it fired, once
    assert {d for d, _, _ in every} == {every[0][0]}, "the replicas differ"
    skips = [s for _, s, _ in every]
    assert skips[0] == skips[1] == skips[2] and sum(skips[0]) == 1, skips


def test_a_deadline_in_the_gossip_thread_is_the_main_threads_gossip_failure() -> None:
    def learner(w: World) -> None:
        world = FaultyWorld(w, [Injection("exchange", kind="timeout")] if w.rank == 0 else [])
        _train(world, "adpsgd", steps=400)  # until the gossip's first exchange has failed

    with pytest.raises(CommTimeoutError, match=r"gossip thread failed: rank 0: exchange"):
        ThreadJob(2, 1, timeout=60).run(learner)


def test_a_planned_fault_names_an_op_and_kind_it_knows() -> None:
    with pytest.raises(ValueError, match="op 'allreduce' is unknown; choose one of allreduce_"):
        Injection("allreduce")
    with pytest.raises(ValueError, match="kind 'crash' is unknown; choose one of raise"):
        Injection("barrier", kind="crash")
    with pytest.raises(ValueError, match="call must be >= 1"):
        Injection("barrier", call=0)


def test_everything_else_is_the_inner_worlds() -> None:
    def learner(w: World) -> tuple[int, int, bool]:
        world = FaultyWorld(w, [])
        return world.rank, world.num_nodes, math.isclose(
            float(world.allreduce_(torch.tensor([float(w.rank)]), op="sum")), 3.0)

    assert ThreadJob(3, 1, timeout=60).run(learner) == [(0, 3, True), (1, 3, True),
                                                         (2, 3, True)]
