"""One host synchronisation a step on the NCCL route (issue 44 item 8(c)).

Where the gradient means ran deferred on NCCL's stream, ``GradSync.finish`` makes the stream
wait for them and ``GradSync.check`` makes the one host wait (under the deadline) for them and
for the step's finiteness and norm together, instead of a host wait in each. The NCCL side
(``NCCLIntra.join(host_wait=False)`` / ``settle``) is tested in test_torch_intra.py; two GPUs
would run it for real (tests/gpu/test_gpu_comm.py's NCCL tests).
"""

import math

import pytest
import torch

from hadpsgd.algorithms.gradsync import GradSync


class Learners:
    """What GradSync reads of a Topology, recording the deferred means' join and settle."""

    size = local_size = 2
    thread_multiple = True
    timeout = 5.0

    def __init__(self, owed: bool = True) -> None:
        self.calls: list[str] = []
        self.owed = owed

    def grad_pipeline(self) -> None:
        """One node: no pipeline."""

    def join_deferred(self, host_wait: bool = True) -> None:
        self.calls.append(f"join host_wait={host_wait}")

    def settle_deferred(self) -> bool:
        self.calls.append("settle")
        return self.owed


@pytest.mark.parametrize("owed", [True, False])
def test_finish_joins_without_a_host_wait_and_check_settles_once(owed):
    # owed=False: the join had waited after all; check() then reads with a plain sync.
    topo = Learners(owed)
    model = torch.nn.Linear(3, 2)
    model(torch.ones(4, 3)).sum().backward()
    sync = GradSync(list(model.parameters()), topo, lambda: None)  # type: ignore[arg-type]
    try:
        sync._deferred = True  # as if a bucket's mean had been queued on NCCL's stream
        sync.finish()
        assert topo.calls == ["join host_wait=False"]
        got = sync.check(norm=True, loss=torch.tensor(2.5))
        assert topo.calls == ["join host_wait=False", "settle"]
        want = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        assert got.finite and got.local_finite and got.loss == 2.5
        assert math.isclose(got.norm, want, rel_tol=1e-6)
        sync.check(norm=False)  # nothing deferred since: no wait owed, no settle
        assert topo.calls == ["join host_wait=False", "settle"]
    finally:
        sync.close()
