"""The export's check: the written file, run as a user runs it, against the checkpoint.

Random raw features of two shapes (another batch and another length than the example the
ONNX exporter traced, so the dynamic axes are exercised) go through the exported file
(``torch.jit.load`` or onnxruntime) and through the checkpoint's own BLSTM the way
``hadpsgd.forward`` runs it (:func:`hadpsgd.export.graph.reference`). The largest absolute
difference of the scores must stay within the tolerance; the figures are kept for the report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hadpsgd.export.formats import Runner
from hadpsgd.export.graph import Scores, reference
from hadpsgd.forward import LoadedModel

SHAPES = ((1, 37), (3, 123))
"""``(batch, frames)`` of the two random inputs."""
TOLERANCE = 1e-3
"""The default largest absolute difference of a score (nats) the check accepts."""


@dataclass(frozen=True)
class Figure:
    """One input's comparison."""

    batch: int
    frames: int
    max_abs: float
    """Largest absolute difference of a score, exported against PyTorch."""
    argmax_agree: float
    """Fraction of frames whose best class is the same in both."""

    def describe(self) -> str:
        """One phrase: the shape and its figures."""
        return (f"batch {self.batch} x {self.frames} frames: max |diff| {self.max_abs:.2e}, "
                f"best class agrees on {100 * self.argmax_agree:.2f} % of frames")


@dataclass(frozen=True)
class Check:
    """The check's outcome."""

    figures: tuple[Figure, ...]
    tolerance: float

    @property
    def max_abs(self) -> float:
        """The largest difference over every input (NaN if any is)."""
        values = [f.max_abs for f in self.figures]
        return float("nan") if any(math.isnan(v) for v in values) else max(values)

    @property
    def passed(self) -> bool:
        """Whether every score agrees within the tolerance (a NaN never does)."""
        return all(f.max_abs <= self.tolerance for f in self.figures)


def random_features(batch: int, frames: int, scores: Scores, feat_dim: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Raw features whose normalised values are standard normal (as the model's inputs are)."""
    x = rng.standard_normal((batch, frames, feat_dim)).astype(np.float32)
    if scores.mean is not None and scores.std is not None:
        x = x * scores.std + scores.mean
    return x.astype(np.float32)


def check(run: Runner, loaded: LoadedModel, scores: Scores, tolerance: float = TOLERANCE,
          seed: int = 0) -> Check:
    """Compare the exported file's scores with the checkpoint's on :data:`SHAPES`."""
    rng = np.random.default_rng(seed)
    figures = []
    for batch, frames in SHAPES:
        feats = random_features(batch, frames, scores, loaded.input_dim, rng)
        got, want = run(feats), reference(loaded, scores, feats)
        if got.shape != want.shape:
            raise ValueError(f"the exported model returned shape {list(got.shape)} for input "
                             f"{list(feats.shape)}; PyTorch returned {list(want.shape)}")
        diff = np.abs(got.astype(np.float64) - want)
        # A NaN anywhere makes the difference NaN, which fails the check.
        max_abs = float(diff.max()) if not np.isnan(diff).any() else float("nan")
        agree = float((got.argmax(-1) == want.argmax(-1)).mean())
        figures.append(Figure(batch, frames, max_abs, agree))
    return Check(tuple(figures), tolerance)
