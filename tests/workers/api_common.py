"""What the public-API workers share: data, a model, a user's loop, replica digests.

Everything here is what a user of ``hadpsgd.Distributed`` writes: a torch dataset, an
``nn.Module``, an optimizer, and a loop of forward, backward and ``dist.step``.
"""

from __future__ import annotations

import hashlib
import itertools

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hadpsgd

FEATS, CLASSES = 6, 4


def dataset(n: int, seed: int = 11) -> TensorDataset:
    """``(x, y, index)`` samples of a fixed linear teacher, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATS, generator=gen)
    teacher = torch.randn(FEATS, CLASSES, generator=gen)
    y = (x @ teacher + 0.5 * torch.randn(n, CLASSES, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y, torch.arange(n))


def model(seed: int) -> nn.Module:
    """A small MLP whose initial weights follow ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATS, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def flat(module: nn.Module) -> torch.Tensor:
    """Every parameter, concatenated (a copy)."""
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def digest(module: nn.Module) -> str:
    """A hash of the parameters' bits."""
    return hashlib.sha256(flat(module).numpy().tobytes()).hexdigest()[:16]


def loader(dist: hadpsgd.Distributed, data: TensorDataset, batch: int,
           seed: int) -> tuple[DataLoader, hadpsgd.Sampler]:
    """The user's DataLoader over ``dist``'s sampler."""
    sampler = dist.sampler(len(data), batch, seed=seed)
    return DataLoader(data, batch_sampler=sampler), sampler


def train(dist: hadpsgd.Distributed, batches: DataLoader, sampler: hadpsgd.Sampler,
          steps: int | None, epochs: int = 100, seen: list[list[int]] | None = None,
          check: bool = False, wait: float = 0.0) -> None:
    """The user's loop: from the sampler's epoch on, until ``dist.steps == steps``.

    Args:
        seen: Per epoch, the sample indices this rank trained (appended to).
        check: After every step, every rank's replica must be bit-identical.
        wait: Seconds of extra work per step (an emulated slow learner).
    """
    import time

    for epoch in itertools.count(sampler.epoch):
        if epoch >= epochs or (steps is not None and dist.steps >= steps):
            return
        sampler.set_epoch(epoch)
        if seen is not None:
            seen.append([])
        for x, y, index in batches:
            loss = nn.functional.cross_entropy(dist.model(x), y)
            dist.zero_grad()
            dist.scale(loss).backward()
            result = dist.step(loss)
            assert result.finite and not result.skipped, result
            if seen is not None:
                seen[-1].extend(index.tolist())
            if wait:
                time.sleep(wait)
            if check:
                same(dist, f"{dist.algo} step {dist.steps}")
            if steps is not None and dist.steps >= steps:
                return


def same(dist: hadpsgd.Distributed, what: str) -> None:
    """Exit 1 unless every rank holds the same parameters."""
    digests = dist.topology.allgather_object(digest(dist.model))
    if len(set(digests)) != 1:
        fail(f"MISMATCH {what}: {digests}")


def fail(what: str) -> None:
    """Raise: hadpsgd.init's hook prints it and aborts the job at once (no peer waits)."""
    raise AssertionError(f"FAIL {what}")
