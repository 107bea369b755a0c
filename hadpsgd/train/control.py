"""The control point: where all ranks agree on stop requests, non-finite steps and the log.

Every ``--control-every`` steps, every ``--log-every`` step and after each epoch, one small
allreduce of ``[loss, stop requests, non-finite events]`` at the same global step serves the
training log, the graceful stop and the non-finite limit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hadpsgd.comm import Topology
from hadpsgd.train.stop import StopFlag


class NonFiniteError(RuntimeError):
    """Too many steps with a non-finite loss or gradient; raised on every rank alike."""


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

    def __init__(self, topo: Topology, stop: StopFlag, max_nonfinite: int) -> None:
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
