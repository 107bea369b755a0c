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

    Attributes:
        base_lr: Rate at ``base_batch``.
        base_batch: Global batch the base rate was tuned for.
        global_batch: This run's global batch.
        warmup_epochs: Epochs of linear warm-up (0 for none).
        anneal: Per-epoch factor after the warm-up (``1/sqrt(2)`` in the paper).
    """

    base_lr: float
    base_batch: int
    global_batch: int
    warmup_epochs: int = 10
    anneal: float = 1 / math.sqrt(2)

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


def set_lr(optimizer: object, lr: float) -> None:
    """Set ``lr`` on every parameter group of a ``torch.optim`` optimizer."""
    for group in optimizer.param_groups:  # type: ignore[attr-defined]
        group["lr"] = lr
