"""The learning-rate recipe of the h-adpsgd paper (section 3): scale, warm up, anneal."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    """Per-epoch learning rate.

    ``peak = base_lr * global_batch / base_batch`` (linear scaling). During the first
    ``warmup_epochs`` epochs the rate rises linearly, ``peak * (e + 1) / warmup_epochs`` in
    epoch ``e`` (0-based), so the last warm-up epoch trains at the peak; every later epoch is
    ``anneal`` times the one before. Without warm-up, epoch 0 trains at the peak. The paper's
    example: base 0.1 at batch 256, global batch 2560, 10 warm-up epochs gives 0.1, 0.2, ...,
    1.0, then 1.0/sqrt(2), 0.5, ...

    Where the first warm-up epoch's rate is above ``base_lr`` (a global batch larger than
    ``base_batch`` with few warm-up epochs), that epoch climbs to it step by step from
    ``base_lr`` (:meth:`lr_at`, with ``gradual``): the rate tuned at the base batch is the
    one known to be safe on the first steps, where the model changes fastest (Goyal et al.
    2017's gradual warm-up). Measured on speechocean762: 16 learners x 32 chunks at the
    scaled 2.0 from the first step diverged in 30 steps (docs/results.md).

    Attributes:
        base_lr: Rate at ``base_batch``.
        base_batch: Global batch the base rate was tuned for.
        global_batch: This run's global batch.
        warmup_epochs: Epochs of linear warm-up (0 for none).
        anneal: Per-epoch factor after the warm-up (``1/sqrt(2)`` in the paper).
        gradual: Climb from ``base_lr`` through the first warm-up epoch where its rate is
            above it.
    """

    base_lr: float
    base_batch: int
    global_batch: int
    warmup_epochs: int = 10
    anneal: float = 1 / math.sqrt(2)
    gradual: bool = True

    @property
    def peak(self) -> float:
        """The linearly scaled rate."""
        return self.base_lr * self.global_batch / self.base_batch

    def lr(self, epoch: int) -> float:
        """Learning rate for (0-based) ``epoch``."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch < self.warmup_epochs:
            return self.peak * (epoch + 1) / self.warmup_epochs
        after = epoch - max(self.warmup_epochs - 1, 0)
        return self.peak * self.anneal ** after

    @property
    def climbs(self) -> bool:
        """Whether the first epoch's rate changes within it (the gradual start)."""
        return self.gradual and self.warmup_epochs > 0 and self.lr(0) > self.base_lr

    def lr_at(self, epoch: int, fraction: float) -> float:
        """Learning rate ``fraction`` (0 to 1) of the way through (0-based) ``epoch``.

        The epoch's own rate, except in the first epoch of a schedule that :attr:`climbs`:
        there it rises linearly from ``base_lr`` at the first step to the epoch's rate at
        its end.
        """
        rate = self.lr(epoch)
        if epoch > 0 or not self.climbs:
            return rate
        return self.base_lr + (rate - self.base_lr) * min(max(fraction, 0.0), 1.0)


def set_lr(optimizer: object, lr: float) -> None:
    """Set ``lr`` on every parameter group of a ``torch.optim`` optimizer."""
    for group in optimizer.param_groups:  # type: ignore[attr-defined]
        group["lr"] = lr
