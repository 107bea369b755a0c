"""Names and version of the HDF5 feature format, shared by the reader and the writer.

Kept in a module of its own so that :mod:`hadpsgd.data.reader` and
:mod:`hadpsgd.data.writer` can both import it without importing each other.
"""

from __future__ import annotations

FORMAT_VERSION = 1
"""Version written to the ``format_version`` attribute; the reader accepts only this one."""

FEATS = "feats"
LABELS = "labels"
OFFSETS = "offsets"
UTT_IDS = "utt_ids"
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
