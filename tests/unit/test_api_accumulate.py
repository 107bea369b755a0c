"""``Distributed.no_sync()``: gradients accumulated over micro-batches, reduced once (issue 60
item 6), on the in-process world (threads as learners, ``hadpsgd.comm.threads``) with the
overlapped reduction on, where a bucket's mean would otherwise start in the first pass."""

from __future__ import annotations

import torch
from torch import nn

from hadpsgd import Distributed
from hadpsgd.comm import World
from hadpsgd.comm.threads import ThreadJob

LR, MICRO = 0.1, 3


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(MICRO)]


def _model() -> nn.Module:
    # Values from a generator of its own: learners are threads here, and torch's global
    # generator, seeded by each, would interleave their draws.
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def test_no_sync_accumulates_micro_batches_and_reduces_their_sum_once() -> None:
    def learner(w: World) -> tuple[list[torch.Tensor], bool, float, float]:
        model = _model()
        dist = Distributed(model, torch.optim.SGD(model.parameters(), lr=LR), "ssgd",
                           topology=w, overlap="on", grad_bucket_mb=1e-4)
        xs = _batches(w.rank)
        with dist.no_sync():  # local: nothing is reduced here
            for x in xs[:-1]:
                (model(x).pow(2).mean() / MICRO).backward()
        (model(xs[-1]).pow(2).mean() / MICRO).backward()  # this pass reduces the sum
        dist.step()
        params = [p.detach().clone() for p in model.parameters()]
        accumulated = dist.metrics()["grad_wire_bytes"]
        dist.zero_grad()
        model(xs[0]).pow(2).mean().backward()  # one pass, one reduction: the bytes of one
        dist.step()
        single = dist.metrics()["grad_wire_bytes"] - accumulated
        overlapped = dist.algorithm.gradsync.overlapped
        dist.close()
        return params, overlapped, accumulated, single

    results = ThreadJob(2).run(learner)
    assert all(r[1] for r in results)  # the hooks' path was taken
    # One reduction for the three passes (without no_sync: three, each of a partial sum;
    # the mean is linear, so only the bytes tell)
    assert all(r[2] == r[3] > 0 for r in results), [r[2:] for r in results]
    # The reference, from the definition: one model, the gradient of each learner's mean
    # micro-batch loss, averaged over the learners, one SGD step.
    ref = _model()
    loss = sum(ref(x).pow(2).mean() / MICRO for r in range(2) for x in _batches(r)) / 2
    loss.backward()
    want = [(p - LR * p.grad).detach() for p in ref.parameters()]
    for params, *_ in results:
        for got, exp in zip(params, want, strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)


def test_a_second_backward_without_no_sync_is_refused_not_silently_lost() -> None:
    # With the overlapped reduction a bucket's mean starts after the first pass; a second
    # pass's gradients then landed after it (or not, by a race), each learner keeping its own
    # part: replicas that part silently. Now the second pass raises, naming no_sync.
    import pytest

    def learner(w: World) -> str:
        model = _model()
        dist = Distributed(model, torch.optim.SGD(model.parameters(), lr=LR), "ssgd",
                           topology=w, overlap="on", grad_bucket_mb=1e-4)
        xs = _batches(w.rank)
        model(xs[0]).pow(2).mean().backward()
        with pytest.raises(RuntimeError, match="no_sync") as refused:
            model(xs[1]).pow(2).mean().backward()
        dist.close()
        return str(refused.value)

    for said in ThreadJob(2).run(learner):
        assert "second backward pass before the step" in said
