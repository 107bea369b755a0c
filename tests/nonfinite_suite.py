"""Non-finite gradients skipped together: one function of a world (MPI's or threads').

Rank 1's gradient is NaN at step 2 (0-based). Checks, on every learner: the learners that
share a reduction (all of them for ssgd; the super-learner for bmuf and adpsgd) skip that
step together and stay bit-identical; only rank 1 is marked as the origin; the parameters
stay finite; each step's ``StepResult`` (loss, finiteness, skipped) says so on every learner.
``tests/unit/test_nonfinite_threads.py`` runs it on threads (ssgd, bmuf, adpsgd).
"""

from __future__ import annotations

import hashlib
import math

import torch

from hadpsgd.algorithms import build
from hadpsgd.comm import World


def check_nonfinite(topo: World, algo_name: str) -> list[str]:
    """Run 5 steps with rank 1's gradient NaN at step 2; the failures seen (none: passed)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(12, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    options = {"sync_period": 2} if algo_name == "bmuf" else {}
    algo = build(algo_name, model, opt, topo, **options)

    def digest() -> str:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return hashlib.sha256(flat.numpy().tobytes()).hexdigest()

    nodes = topo.allgather_object(topo.node)  # node (super-learner) of every rank
    gen = torch.Generator().manual_seed(7 + topo.rank)
    failures: list[str] = []
    for step in range(5):
        x = torch.randn(8, 12, generator=gen)
        loss = model(x).pow(2).mean()
        if step == 2 and topo.rank == 1:
            loss = loss * float("nan")
        loss.backward()
        result = algo.step(loss.detach())
        algo.zero_grad()
        origin = topo.allgather_object(not result.local_finite)
        if step == 2 and origin != [r == 1 for r in range(topo.size)]:
            failures.append(f"step {step}: origins {origin}")
        if math.isfinite(result.loss) != (step != 2 or topo.rank != 1):
            failures.append(f"step {step}: loss {result.loss}")
        skipped = topo.allgather_object(algo.skipped_steps)
        # Who shares rank 1's reduction: everyone (ssgd), or rank 1's node (bmuf, adpsgd).
        sharing = (list(range(topo.size)) if algo_name == "ssgd"
                   else [r for r in range(topo.size) if nodes[r] == nodes[1]])
        want = [int(step >= 2 and r in sharing) for r in range(topo.size)]
        if skipped != want:
            failures.append(f"step {step}: skipped {skipped}, expected {want}")
        # The step's own verdict: this step skipped (and its reduced gradient non-finite) alike.
        now = step == 2 and topo.rank in sharing
        if (result.skipped, result.finite) != (now, not now):
            failures.append(f"step {step}: verdict {result}")
        digests = topo.allgather_object(digest())
        groups = [sharing] if algo_name == "ssgd" else [
            [r for r in range(topo.size) if nodes[r] == n] for n in range(topo.num_nodes)]
        for group in groups:
            if len({digests[r] for r in group}) != 1:
                failures.append(f"step {step}: replicas of {group} differ")
        if not all(math.isfinite(float(p.detach().sum())) for p in model.parameters()):
            failures.append(f"step {step}: non-finite parameters")
    algo.close()
    return failures
