"""What an import did to the features: the ``pipeline`` record of a feature file.

The Kaldi importer (:mod:`hadpsgd.data.kaldi`) writes, as the file attribute ``pipeline``
(JSON), every transformation between the raw Kaldi features and the stored frames, and where
the class count came from::

    {"format": "hadpsgd-pipeline/1", "tool": "hadpsgd.data.kaldi",
     "features": "scp:data/train/feats.scp", "alignments": "ark:...",
     "cmvn": {"per": "speaker", "norm_vars": false, "stats": "computed",
              "utt2spk": "data/train/utt2spk"},            (null: none)
     "norm": "computed on these frames",                     (norm/, applied on read)
     "num_classes": 1928, "classes_from": "--tree-info exp/tri3/tree-info.txt (num-pdfs)"}

Training names its training file in the checkpoint's configuration (``data.train``), which
is how the forward pass finds the file's ``norm/`` statistics: it finds this record the same
way, and redoes the CMVN on raw Kaldi features, or refuses (:mod:`hadpsgd.forward.features`).
Training itself refuses a held-out file whose CMVN differs from the training file's
(:func:`cmvn_mismatch`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import h5py

from hadpsgd.data._schema import PIPELINE, FeatureFileError
from hadpsgd.data.cmvn import COMPUTED, PER_SPEAKER, PER_UTTERANCE

FORMAT = "hadpsgd-pipeline/1"
TOOL = "hadpsgd.data.kaldi"


@dataclass(frozen=True)
class CmvnRecord:
    """The per-speaker or per-utterance CMVN an import applied."""

    per: str
    """``speaker`` or ``utterance``."""
    norm_vars: bool
    """Whether the variance was normalised too (else the mean only)."""
    stats: str = COMPUTED
    """``computed`` (from the features), or Kaldi's statistics table that was given."""
    utt2spk: str | None = None
    """The ``utt2spk`` file of a per-speaker CMVN."""

    def describe(self) -> str:
        """One phrase: what was done, with which statistics."""
        what = "means and variances" if self.norm_vars else "means only"
        where = ("statistics computed from the features" if self.stats == COMPUTED
                 else f"Kaldi's statistics {self.stats}")
        return f"per-{self.per} CMVN ({what}; {where})"

    def same_transform(self, other: CmvnRecord | None) -> bool:
        """Whether ``other`` normalises alike (the statistics' source may differ)."""
        return other is not None and (self.per, self.norm_vars) == (other.per, other.norm_vars)


@dataclass(frozen=True)
class ImportRecord:
    """Every transformation of one import (see the module docstring)."""

    features: str
    alignments: str
    cmvn: CmvnRecord | None
    norm: str
    num_classes: int
    classes_from: str
    tool: str = TOOL

    @property
    def features_command(self) -> bool:
        """Whether the features were read through a command (``ark:apply-cmvn ... |``)."""
        return self.features.rstrip().endswith("|")

    def describe_cmvn(self) -> str:
        """The CMVN in one phrase (``no CMVN`` when there was none)."""
        return self.cmvn.describe() if self.cmvn is not None else "no CMVN"

    def to_json(self) -> str:
        """The attribute's text."""
        return json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> ImportRecord:
        """Parse an attribute written by :meth:`to_json`.

        Raises:
            FeatureFileError: For a record of another format or a malformed one, naming
                ``where`` (a :class:`ValueError`).
        """
        try:
            raw: dict[str, Any] = json.loads(text)
            if raw.pop("format", None) != FORMAT:
                raise ValueError(f"not {FORMAT}")
            cmvn = raw.pop("cmvn")
            record = cls(cmvn=CmvnRecord(**cmvn) if cmvn is not None else None, **raw)
        except (TypeError, ValueError, KeyError) as err:
            raise FeatureFileError(f"{where}: its '{PIPELINE}' attribute is not a record this "
                             f"hadpsgd reads ({err}); re-run the import") from None
        if record.cmvn is not None and record.cmvn.per not in (PER_SPEAKER, PER_UTTERANCE):
            raise FeatureFileError(f"{where}: its '{PIPELINE}' attribute names CMVN per "
                             f"{record.cmvn.per!r}; re-run the import")
        return record


def read_record(path: str | os.PathLike[str]) -> ImportRecord | None:
    """The import record of a feature file, or None if it has none (not a Kaldi import).

    Raises:
        FeatureFileError: For a record this hadpsgd cannot read, naming the file.
        OSError: If the file cannot be opened (the caller has validated it).
    """
    with h5py.File(Path(path), "r", locking=False) as h5:
        text = h5.attrs.get(PIPELINE)
    if text is None:
        return None
    return ImportRecord.from_json(text.decode() if isinstance(text, bytes) else str(text),
                                  str(path))


def cmvn_mismatch(train: str | os.PathLike[str],
                  other: str | os.PathLike[str]) -> str | None:
    """Why ``other`` was not normalised like ``train`` at import, or None if it was.

    Files without a record (not imported by :mod:`hadpsgd.data.kaldi`) are not compared.
    """
    a, b = read_record(train), read_record(other)
    if a is None or b is None:
        return None
    if a.cmvn is None and b.cmvn is None:
        return None
    if a.cmvn is not None and a.cmvn.same_transform(b.cmvn):
        return None
    return (f"{other} was imported with {b.describe_cmvn()} but {train} with "
            f"{a.describe_cmvn()}: the model would see features normalised otherwise than "
            f"in training; re-import {other} with the training set's CMVN flags "
            f"({cmvn_flags(a.cmvn)})")


def cmvn_flags(cmvn: CmvnRecord | None) -> str:
    """The importer's flags that give ``cmvn`` (for messages)."""
    if cmvn is None:
        return "no --utt2spk, --cmvn or --cmvn-per-utt"
    flags = ["--utt2spk UTT2SPK"] if cmvn.per == PER_SPEAKER else ["--cmvn-per-utt"]
    if cmvn.stats != COMPUTED:
        flags = [f for f in flags if f != "--cmvn-per-utt"] + ["--cmvn scp:CMVN.scp"]
    if cmvn.norm_vars:
        flags.append("--cmvn-vars")
    return " ".join(flags)
