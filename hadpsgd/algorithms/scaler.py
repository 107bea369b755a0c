"""fp16's dynamic loss scale, decided by the verdict every learner of a step shares.

Mixed precision training (Micikevicius et al., 2018, section 3.2) multiplies the loss by a
scale ``S`` before backward so that small fp16 gradients do not flush to zero, divides the
gradients by ``S`` before the update, and adjusts ``S`` dynamically: a step whose gradient
overflowed (Inf or NaN) is skipped and ``S`` is halved; after ``growth_interval`` steps in a
row without overflow ``S`` doubles.

Why not ``torch.amp.GradScaler``: it looks for Inf in each optimizer's gradients on its own
(a second device synchronisation per step) and decides from *this* learner's gradients. Here
the verdict is the step's one synchronisation over the *reduced* gradient
(:meth:`hadpsgd.algorithms.gradsync.GradSync.check`): every learner that applies the same
reduced gradient (SSGD: the world; BMUF and H-ADPSGD: the super-learner) sees the same
finiteness, so each skips the same steps and halves and doubles its scale at the same steps
without another message, and the replicas never part on a skipped step. The scale is a host
float: deciding it needs nothing beyond that synchronisation.
"""

from __future__ import annotations

import math
from typing import Any

INIT_SCALE = 2.0**16
"""The starting scale (torch's GradScaler's): large, so the first steps find it from above."""
GROWTH_INTERVAL = 2000
"""Steps without overflow before the scale doubles (torch's GradScaler's)."""
MIN_SCALE = 1.0
"""A step that overflows at a scale this low is not the scale's doing: below it, an overflow
counts as a non-finite gradient (the loop's ``--max-nonfinite``), not as the scale's search."""


class LossScaler:
    """A dynamic loss scale (fp16), the same on every learner that shares a step's verdict.

    Args:
        init_scale: The scale of the first step.
        growth_interval: Steps without overflow after which the scale doubles.
        growth_factor: Multiplier after ``growth_interval`` good steps.
        backoff_factor: Multiplier after an overflow.
    """

    def __init__(self, init_scale: float = INIT_SCALE, growth_interval: int = GROWTH_INTERVAL,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5) -> None:
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"the loss scale must be positive and finite, got {init_scale}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        if not (growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError("growth_factor must be > 1 and backoff_factor in (0, 1), got "
                             f"{growth_factor} and {backoff_factor}")
        self.scale = float(init_scale)
        """The factor the next step's loss is multiplied by before backward."""
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.good_steps = 0
        """Steps in a row without overflow since the scale last changed."""
        self.overflow_steps = 0
        """Steps skipped because their (reduced) gradient overflowed at the scale."""

    def update(self, finite: bool) -> bool:
        """Take the step's shared verdict; True when the overflow was the scale's search.

        An overflow halves the scale (and resets the count of good steps); a good step
        counts towards doubling it. Returns False for a finite step, and for an overflow at
        a scale already at :data:`MIN_SCALE` or below (a gradient that is not finite at any
        sensible scale: the caller counts that one as non-finite).
        """
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
            return False
        searching = self.scale > MIN_SCALE
        self.scale *= self.backoff_factor
        self.good_steps = 0
        self.overflow_steps += 1
        return searching

    def state_dict(self) -> dict[str, Any]:
        """Plain data (checkpoints load with ``weights_only``)."""
        return {"scale": self.scale, "good_steps": self.good_steps,
                "overflow_steps": self.overflow_steps, "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (the growth interval is this run's)."""
        self.scale = float(state["scale"])
        self.good_steps = int(state.get("good_steps", 0))
        self.overflow_steps = int(state.get("overflow_steps", 0))


__all__ = ["GROWTH_INTERVAL", "INIT_SCALE", "MIN_SCALE", "LossScaler"]
