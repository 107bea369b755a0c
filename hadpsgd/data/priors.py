"""Class priors: how often each class is the label of a training frame.

A hybrid acoustic model's softmax estimates the posterior ``p(s|x)``; an HMM decoder wants a
likelihood ``p(x|s)``, which is ``p(s|x) / p(s)`` up to a factor the same for every state.
So decoding subtracts the log prior of each class from the network's log-posterior (the
*pseudo-log-likelihood*, :mod:`hadpsgd.forward`). The priors are the label frequencies of the
training file, counted once (``RUN/priors.json``, written at a run's fresh start).

Smoothing: **add-one** (Laplace), ``p(s) = (count(s) + 1) / (frames + classes)``. A class that
no training frame carries would otherwise have the prior 0 and an infinite
pseudo-log-likelihood; with add-one it gets the smallest prior of all, and for every class
with data the change is below ``1 / frames``.

File formats read by :func:`load_priors`: the JSON this module writes (``format``,
``source``, ``num_classes``, ``frames``, ``smoothing``, ``counts``, ``priors``: the counts
are the truth, the priors are derived from them), a Kaldi-style text vector of counts
(``[ 120 3 0 ... ]``, as ``analyze-counts`` writes), smoothed the same way, or a feature
file, whose labels are counted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hadpsgd.data._schema import LABELS
from hadpsgd.data.reader import FeatureFile

PRIORS_FILE = "priors.json"
"""The priors' file name in a run directory."""
FORMAT = "hadpsgd-priors/1"
SMOOTHING = "add-one: (count + 1) / (frames + num_classes)"
_BLOCK = 1 << 22  # labels read per block: a real corpus's labels need not fit in memory


class PriorsError(ValueError):
    """A priors file that cannot be used; the message names it and the fix."""


@dataclass(frozen=True)
class Priors:
    """Label counts of a training file and the smoothed priors they give."""

    counts: np.ndarray
    """Frames per class, ``[num_classes]`` (float64: a Kaldi vector may hold fractions)."""
    source: str
    """Where the counts come from (the training file, or the file they were read from)."""
    read_from: str = ""
    """The file the user named (``--priors FILE``: a priors JSON, a Kaldi vector of counts),
    when it is not ``source`` itself: a run's ``priors.json`` records the training file as
    its source, and an error must name the file that was passed."""

    def describe(self) -> str:
        """The file the priors were read from, and the counts' source where it differs."""
        if not self.read_from or self.read_from == self.source:
            return self.source
        return f"{self.read_from} (counted from {self.source})"

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.counts)

    @property
    def frames(self) -> float:
        """Frames counted."""
        return float(self.counts.sum())

    @property
    def priors(self) -> np.ndarray:
        """The add-one smoothed priors, float64, positive, summing to one."""
        return smooth(self.counts)

    def scaled_log(self, scale: float = 1.0) -> np.ndarray:
        """``scale * log(priors)``, what forward and export subtract (``--prior-scale``)."""
        return scale * np.log(self.priors)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of ``RUN/priors.json``."""
        counts = [int(c) if float(c).is_integer() else float(c) for c in self.counts]
        frames = self.frames
        return {"format": FORMAT, "source": self.source, "num_classes": self.num_classes,
                "frames": int(frames) if frames.is_integer() else frames,
                "smoothing": SMOOTHING, "counts": counts, "priors": self.priors.tolist()}


def smooth(counts: np.ndarray) -> np.ndarray:
    """Add-one smoothed priors of ``counts`` (see the module docstring)."""
    counts = np.asarray(counts, dtype=np.float64)
    return (counts + 1.0) / (counts.sum() + len(counts))


def count_labels(path: str | os.PathLike[str]) -> np.ndarray:
    """Frames per class of a feature file's labels, read block by block (int64).

    Raises:
        FeatureFileError: If the file is missing or malformed (it is validated on open).
    """
    return count_file_labels(FeatureFile(path))


def count_file_labels(ff: FeatureFile) -> np.ndarray:
    """Frames per class of the opened (validated) feature file ``ff``, block by block."""
    counts = np.zeros(ff.num_classes, np.int64)
    with h5py.File(ff.path, "r", locking=False) as h5:
        labels = h5[LABELS]
        for start in range(0, ff.num_frames, _BLOCK):
            block = labels[start:start + _BLOCK].astype(np.int64)
            counts += np.bincount(block, minlength=ff.num_classes)[:ff.num_classes]
    return counts


def priors_of(path: str | os.PathLike[str]) -> Priors:
    """The priors of a feature file's labels (every class counted, none left out)."""
    return Priors(count_labels(path).astype(np.float64), str(Path(path).resolve()))


def save_priors(priors: Priors, path: str | os.PathLike[str]) -> Path:
    """Write ``priors`` as JSON to ``path`` atomically (a crash leaves no half file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(priors.to_json(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _checked(counts: np.ndarray, path: Path) -> np.ndarray:
    if counts.ndim != 1 or len(counts) == 0:
        raise PriorsError(f"{path}: the counts must be a non-empty vector, one per class")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise PriorsError(f"{path}: the counts must be finite and >= 0; recount them "
                          "(python -m hadpsgd.data info TRAIN.h5 --json has the vector)")
    return counts


def load_priors(path: str | os.PathLike[str]) -> Priors:
    """Read a priors JSON written by :func:`save_priors`, or a Kaldi text vector of counts.

    A feature file (``.h5``) is counted instead: the priors of a run that has no
    ``priors.json`` (started before runs wrote one) come from its training file.

    Raises:
        PriorsError: If the file is missing or holds neither, naming it.
        FeatureFileError: If an ``.h5`` file is malformed, naming it.
    """
    path = Path(path)
    if path.suffix in (".h5", ".hdf5"):
        return replace(priors_of(path), read_from=str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PriorsError(f"priors file {path} cannot be read ({err}); pass a priors.json "
                          "of a run directory or a Kaldi text vector of counts") from None
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
            counts = np.asarray(obj["counts"], dtype=np.float64)
        except (ValueError, KeyError, TypeError) as err:
            raise PriorsError(f"priors file {path} is not a priors JSON with a 'counts' "
                              f"vector ({err}); write it again with hadpsgd.data.priors") \
                from None
        return Priors(_checked(counts, path), str(obj.get("source", path)), str(path))
    try:
        counts = np.asarray(text.replace("[", " ").replace("]", " ").split(), dtype=np.float64)
    except ValueError:
        raise PriorsError(f"priors file {path} is neither a priors JSON nor a text vector of "
                          "counts ('[ 120 3 ... ]'); pass RUN/priors.json or the output of "
                          "Kaldi's analyze-counts") from None
    return Priors(_checked(counts, path), str(path.resolve()), str(path))


__all__ = ["FORMAT", "PRIORS_FILE", "SMOOTHING", "Priors", "PriorsError", "count_file_labels",
           "count_labels", "load_priors", "priors_of", "save_priors", "smooth"]
