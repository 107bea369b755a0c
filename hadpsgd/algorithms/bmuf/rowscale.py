"""Rows on a sparse wire: each row of a parameter chosen and sized on its own scale.

``--wire signtopk`` chooses the largest values of every 4,096 of the flat model and sends
each as its sign with the chunk's one magnitude. A chunk spans many rows of a weight matrix
(the output layer's 120 classes of 64 weights, an LSTM's gate units), and the rows whose
progress is small, the rare classes' first, are chosen last: on speechocean762 the rarest
third of the classes lost 4.6 points of frame recall against SSGD where the most frequent
lost 0.7 (docs/results.md, issue 57).

``--bmuf-wire-scale rows`` divides each row's progress by that row's scale before the wire
chooses and codes it, and multiplies the mean by it after: the choice is then by size
against the row's own, and a chosen value comes back at its row's magnitude. The scale is
the root of an exponential average of the row's mean square of the *averaged* progress (the
mean that arrived, the same on every node), so it costs no byte and every node divides by
the same scale. A row chosen more than its share grows its scale and is chosen less, so the
rows tend to an equal share of the places, and as the worker's rounding stays with it
(``--bmuf-residual model``) or in its error feedback, what each row sends over time is its
own progress. A parameter's rows are its first dimension (a vector is one row); a row's
scale is kept at least :data:`FLOOR` of its parameter's, so a row nothing was sent for is
not blown up without bound, and the scales of a fragment are divided by their root mean
square, so the wire's own numbers keep their size. Until a row's average has a value
(the first sync) the scale is 1 throughout.
"""

from __future__ import annotations

from typing import Any

import torch

from hadpsgd.algorithms.bmuf.moments import Slots

Flat = dict[torch.dtype, torch.Tensor]

DECAY = 0.9
"""The exponential average's decay per sync: about ten syncs' worth (a row gets ~2.7 % of
its places a sync, so ten syncs see a few of each row's values)."""
FLOOR = 0.1
"""A row's scale is at least this share of its parameter's (a rare row is boosted at most
ten times in the choice)."""


class RowScales:
    """The rows' mean squares of the averaged progress, and the scales drawn from them.

    Args:
        params: The flat parameter buffers per dtype (shapes and devices of the state).
    """

    def __init__(self, params: Flat) -> None:
        self.mean_square: Flat = {d: torch.zeros_like(b) for d, b in params.items()}
        """Per dtype, per element: its row's exponential average of the mean square."""

    def scale(self, slots: Slots, dtype: torch.dtype, lo: int, hi: int) -> torch.Tensor:
        """The scale of every element of ``[lo, hi)`` (whole parameters ``slots``)."""
        ms = self.mean_square[dtype][lo:hi]
        rms = ms.sqrt()
        for p, off in slots:
            part = rms[off - lo:off - lo + p.numel()]
            own = part.pow(2).mean().sqrt()
            if own > 0:  # relative to its parameter's, which keeps the wire's own scale
                part.div_(own).clamp_(min=FLOOR)
            else:        # nothing sent for it yet
                part.fill_(1.0)
        return rms

    def update(self, slots: Slots, dtype: torch.dtype, lo: int, mean: torch.Tensor) -> None:
        """Fold in ``mean``, the averaged progress of ``slots`` from ``lo``, row by row."""
        for p, off in slots:
            n = p.numel()
            rows = p.shape[0] if p.dim() > 1 else 1
            square = mean[off - lo:off - lo + n].view(rows, -1).pow(2).mean(dim=1, keepdim=True)
            ema = self.mean_square[dtype][off:off + n].view(rows, -1)
            ema.mul_(DECAY).add_(square.expand_as(ema), alpha=1 - DECAY)

    def state_dict(self) -> dict[str, Any]:
        """The averages (the same on every learner)."""
        return {str(d): t.clone() for d, t in self.mean_square.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        for dtype, t in self.mean_square.items():
            if str(dtype) in state:
                t.copy_(state[str(dtype)].to(t.device, t.dtype))


__all__ = ["DECAY", "FLOOR", "RowScales"]
