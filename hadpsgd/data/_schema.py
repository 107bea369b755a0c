"""The HDF5 feature format (docs/design.md, the feature format): one file per split.

=============  ============================  ==================================================
dataset        dtype / shape                 meaning
=============  ============================  ==================================================
``feats``      float32 ``[T, D]``, chunked   all utterances' frames, concatenated
``labels``     int32 ``[T]``                 frame targets in ``[0, num_classes)``
``offsets``    int64 ``[U+1]``               utterance u is ``feats[offsets[u]:offsets[u+1]]``
``utt_ids``    variable-length str ``[U]``   utterance names
``norm/mean``  float32 ``[D]`` (optional)    subtracted from every frame on read
``norm/std``   float32 ``[D]`` (optional)    every frame is divided by it on read
=============  ============================  ==================================================

File attributes: ``num_classes``, ``feat_dim``, ``format_version`` (= :data:`FORMAT_VERSION`);
optional ``silence_classes`` (int32 ``[S]``): the classes that are silence, so evaluation can
report the accuracy on speech frames apart (:data:`SILENCE_CLASSES`); optional ``pipeline``
(JSON): what the Kaldi import did to the features (:data:`PIPELINE`).

Its names and version live here, shared by the reader and the writer; kept in a module of
its own so that :mod:`hadpsgd.data.reader` and
:mod:`hadpsgd.data.writer` can both import it without importing each other.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

FORMAT_VERSION = 1
"""Version written to the ``format_version`` attribute; the reader accepts only this one."""

FEATS = "feats"
LABELS = "labels"
OFFSETS = "offsets"
UTT_IDS = "utt_ids"
VALIDATED = "validated"
"""File attribute: the stamp (JSON, :mod:`hadpsgd.data.validate_stamp`) that every frame was
finite and every label in range when the writer wrote the file (or ``python -m hadpsgd.data
validate`` checked it), with the shape and a fingerprint of the data it vouches for."""
SILENCE_CLASSES = "silence_classes"
"""Optional file attribute: the class ids of silence (a Kaldi silence phone has several pdfs).
A quarter of a speech corpus's frames can be silence, which frame accuracy then mostly
measures; held-out evaluation reports the accuracy over the other frames beside it."""
PIPELINE = "pipeline"
"""Optional file attribute: the Kaldi import's record of every transformation of the raw
features (CMVN, normalisation statistics, class count), JSON (:mod:`hadpsgd.data.pipeline`)."""
NORM_MEAN = "norm/mean"
NORM_STD = "norm/std"
REQUIRED_DATASETS = (FEATS, LABELS, OFFSETS, UTT_IDS)
REQUIRED_ATTRS = ("format_version", "num_classes", "feat_dim")


class FeatureFileError(ValueError):
    """A feature file is missing, malformed or holds invalid values.

    The message always names the file and says what is wrong (and how to fix it when the
    fix is obvious). A subclass of :class:`ValueError`, so callers that validate inputs
    generically still catch it.
    """


FIX_FRAMES = ("fix or drop that utterance and rewrite the file (hadpsgd.data.write_features "
              "refuses non-finite values), or re-run the import")
FIX_DAMAGED = "the file is damaged or was cut short; copy it again or regenerate it"
VALIDATE_COMMAND = "python -m hadpsgd.data validate"
"""The command that checks every frame and label of a file and stamps it anew."""


def path_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a feature file, or ``None`` if it looks readable.

    Checked before HDF5 sees the path, whose own messages for these cases are obscure
    ("file signature not found", "errno = 21").

    Args:
        path: The file a user passed.

    Returns:
        A message fragment naming the problem and the fix (without the path), or ``None``.
    """
    if not path.exists():
        return ("feature file does not exist (check the path, or generate one with "
                "python -m hadpsgd.data.synth)")
    if path.is_dir():
        return "is a directory, not a feature file; pass the .h5 file inside it"
    if not path.is_file():
        return "is not a regular file; pass an .h5 feature file"
    # os.access answers for the real user, as open() would; root passes regardless of mode.
    if not os.access(path, os.R_OK):
        return ("permission denied: this user cannot read the file; make it readable "
                "(chmod a+r) or run as a user who can")
    if path.stat().st_size == 0:
        return f"the file is empty (0 bytes); {FIX_DAMAGED}"
    return None


def check_silence_classes(classes: Sequence[int], num_classes: int) -> tuple[int, ...]:
    """``classes`` as sorted distinct ints, each in ``[0, num_classes)``.

    Raises:
        ValueError: Naming the class outside the range.
    """
    out = tuple(sorted({int(c) for c in classes}))
    bad = [c for c in out if not 0 <= c < num_classes]
    if bad:
        raise ValueError(f"silence classes {bad} are outside [0, num_classes={num_classes}); "
                         "give the class ids of silence in the labels")
    return out
