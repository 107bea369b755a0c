"""A checkpoint's model as TorchScript or ONNX, checked (``python -m hadpsgd.export``).

The layer sits beside ``forward``, whose loading (:mod:`hadpsgd.forward.model`), checkpoint
averaging (:mod:`hadpsgd.forward.average`) and scores it reuses: the exported graph
(:mod:`hadpsgd.export.graph`) takes raw features and returns what ``hadpsgd.forward`` writes,
each file is written by :mod:`hadpsgd.export.formats` and checked against the checkpoint by
:mod:`hadpsgd.export.check`. docs/export.md has the commands and the figures of a check.
"""

from hadpsgd.export.check import Check, check
from hadpsgd.export.graph import Deployable, Scores, reference

__all__ = ["Check", "Deployable", "Scores", "check", "reference"]
