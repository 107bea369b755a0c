"""The control point: where all ranks agree on stop requests, non-finite steps and the log.

Every ``--control-every`` steps, every ``--log-every`` step and after each epoch, one small
allreduce of ``[loss, stop requests, non-finite events]`` at the same global step serves the
training log, the graceful stop and the non-finite limit at once. The agreed loss also feeds
the divergence guard, which every rank evaluates alike on the same agreed numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hadpsgd.comm import World
from hadpsgd.train.stop import StopFlag


class NonFiniteError(RuntimeError):
    """Too many steps with a non-finite loss or gradient; raised on every rank alike."""

    agreed = True
    """Raised on every rank alike, with the same message: rank 0 alone says it."""


class DivergedError(NonFiniteError):
    """The loss exploded relative to its start (it stays finite); raised on every rank alike."""


class DivergenceGuard:
    """Stops a run whose loss explodes while staying finite (the non-finite guard's blind spot).

    The reference is the starting loss: given (the trainer gives ``ln C``, the cross-entropy
    of a uniform guess over ``C`` classes, where a freshly initialised classifier starts; the
    same number on every rank without any communication, and known before the first step
    even to ADPSGD, whose learners agree only at meetings), or else the first agreed training
    loss. A held-out loss above ``max_ratio`` times it stops the run at once; the training
    loss, noisier, must stay above it at ``patience`` consecutive control points.

    Args:
        max_ratio: The allowed factor over the starting loss; 0 disables the guard.
        hint: The algorithm's own advice, added to the error message.
        patience: Consecutive control points over the limit before the training loss stops it.
        reference: The starting loss, if known in advance (with ``what`` saying what it is).
        what: How the message names ``reference``.
    """

    def __init__(self, max_ratio: float, hint: str = "", patience: int = 3,
                 reference: float | None = None, what: str = "") -> None:
        self.max_ratio = max_ratio
        self.hint = hint
        self.patience = patience
        self.fixed = reference is not None
        self.what = what
        self.start: float | None = reference
        """The reference: given, or the first agreed training loss of the run."""
        self.over = 0
        """Consecutive control points whose training loss was over the limit."""

    def training(self, loss: float, step: int) -> None:
        """Check an agreed training loss (the same value on every rank).

        Raises:
            DivergedError: After ``patience`` consecutive losses over the limit.
        """
        if not self.max_ratio or not math.isfinite(loss):
            return  # non-finite losses are the non-finite guard's
        if self.start is None:
            self.start = loss
            return
        self.over = self.over + 1 if loss > self.max_ratio * self.start else 0
        if self.over >= self.patience:
            self._fail(f"the training loss {loss:.4g} at step {step} ({self.over} control "
                       "points in a row)", loss)

    def heldout(self, loss: float, step: int) -> None:
        """Check an agreed held-out loss.

        Raises:
            DivergedError: If it is over the limit.
        """
        if not math.isfinite(loss):
            # Evaluation skips nothing: a NaN or infinite held-out loss is a model whose
            # weights are no longer finite (the held-out frames were checked at start-up).
            # No ratio describes it, and no later step recovers it.
            raise DivergedError(
                f"the run diverged: the held-out loss after step {step} is {loss} (the model "
                f"is no longer finite). {self.hint}Lower --lr or set --max-grad-norm, then "
                "start again (a resume would continue from the diverged model)")
        if self.max_ratio and self.start is not None and loss > self.max_ratio * self.start:
            self._fail(f"the held-out loss {loss:.4g} after step {step}", loss)

    def _fail(self, what: str, loss: float) -> None:
        raise DivergedError(
            f"the run diverged: {what} is {loss / self.start:.3g}x "
            f"{self.what or f'the starting training loss {self.start:.4g}'} (more than "
            f"--max-loss-ratio {self.max_ratio:g}). "
            f"{self.hint}Lower --lr or set --max-grad-norm, then start again (a resume would "
            "continue from the diverged model); --max-loss-ratio 0 disables this check."
        )

    def state_dict(self) -> dict[str, float | int | None]:
        """The reference loss and the current run of over-limit points."""
        return {"start": self.start, "over": self.over}

    def load_state_dict(self, state: dict[str, float | int | None]) -> None:
        """Restore :meth:`state_dict`."""
        start = state.get("start")
        if not self.fixed:
            self.start = None if start is None else float(start)
        self.over = int(state.get("over") or 0)


@dataclass
class Verdict:
    """What the ranks agreed at one control point."""

    mean_loss: float | None
    """The loss averaged over the ranks (None when no loss was given)."""
    stopped_by: str | None
    """Who asked to stop (``SIGTERM on rank 1``), or None to go on."""


class ControlPoint:
    """Agreement of all ranks on the state of the run.

    Args:
        topo: The learners.
        stop: Where this rank's stop requests (signals) are recorded.
        max_nonfinite: More non-finite events than this (over all ranks) stop the run.
    """

    def __init__(self, topo: World, stop: StopFlag, max_nonfinite: int) -> None:
        self.topo = topo
        self.stop = stop
        self.max_nonfinite = max_nonfinite
        self.nonfinite: list[tuple[int, str]] = []
        """This rank's own non-finite events: (global step, "loss" or "gradient")."""

    def note_nonfinite(self, step: int, what: str) -> None:
        """Record that this rank's ``what`` (``loss`` or ``gradient``) was non-finite."""
        self.nonfinite.append((step, what))

    def agree(self, loss: torch.Tensor | None) -> Verdict:
        """The agreement (every rank, same global step).

        Raises:
            NonFiniteError: On every rank, if the events exceed ``max_nonfinite``.
        """
        vec = torch.tensor([float(loss) if loss is not None else 0.0,
                            1.0 if self.stop.requested else 0.0, float(len(self.nonfinite))],
                           dtype=torch.float64)  # a host tensor: it takes the MPI path
        self.topo.allreduce_(vec, op="sum")
        if int(vec[2]) > self.max_nonfinite:
            self._fail(int(vec[2]))
        stopped_by = None
        if vec[1] > 0:
            # Rare: worth one more collective to say who asked.
            asked = self.topo.allgather_object(self.stop.signame)
            stopped_by = ", ".join(f"{sig} on rank {r}" for r, sig in enumerate(asked) if sig)
        mean = float(vec[0]) / self.topo.size if loss is not None else None
        return Verdict(mean, stopped_by)

    def _fail(self, total: int) -> None:
        events = self.topo.allgather_object(self.nonfinite)
        listed = sorted((step, rank, what) for rank, evs in enumerate(events)
                        for step, what in evs)
        shown = ", ".join(f"step {s} on rank {r} ({w})" for s, r, w in listed[:8])
        more = f" and {len(listed) - 8} more" if len(listed) > 8 else ""
        raise NonFiniteError(
            f"{total} non-finite loss/gradient events, more than --max-nonfinite "
            f"{self.max_nonfinite}: {shown}{more}. Those steps were skipped on every "
            "learner that shared them. Lower --lr, set --max-grad-norm, or check the data "
            "around those steps."
        )
