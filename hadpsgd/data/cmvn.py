"""Cepstral mean (and variance) normalisation, as Kaldi's ``compute-cmvn-stats`` / ``apply-cmvn``.

One implementation for the Kaldi import (:mod:`hadpsgd.data.kaldi`) and the forward pass over
raw Kaldi features (:mod:`hadpsgd.forward.features`), so that the two give the same frames.

Statistics are kept in Kaldi's layout, a ``[2, D + 1]`` float64 matrix per speaker (or
utterance): row 0 the sum of the frames with the frame count in its last column, row 1 the
sum of their squares. They come from one of two places:

* computed here from the features (per speaker: a pass over every utterance of the table
  first, as ``compute-cmvn-stats --spk2utt`` does; per utterance: the utterance itself);
* Kaldi's own, a table of such matrices (``scp:data/test/cmvn.scp``), keyed by speaker when an
  ``utt2spk`` is given and by utterance otherwise, as ``apply-cmvn`` reads them.

:func:`apply_cmvn` is Kaldi's ``ApplyCmvn``: the offset (and scale) in double precision, then
applied to the float32 frames. One departure: a dimension whose variance is below
:data:`MIN_VARIANCE` is only centred (Kaldi floors it at 1e-20 and multiplies by 1e10, which
turns float rounding into large values).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

PER_SPEAKER = "speaker"
PER_UTTERANCE = "utterance"
COMPUTED = "computed"
"""The ``stats`` of a :class:`Cmvn` whose statistics are computed from the features."""
MIN_VARIANCE = 1e-12
"""A dimension whose variance is below this is only centred, not scaled."""


class CmvnError(ValueError):
    """A CMVN input is missing or does not fit: the message names it and the fix."""


def read_utt2spk(path: str | os.PathLike[str]) -> dict[str, str]:
    """Kaldi's ``utt2spk``: one ``utterance speaker`` pair per line.

    Raises:
        CmvnError: For a missing file or a line that is not two fields, naming it.
    """
    where = Path(path)
    if not where.is_file():
        raise CmvnError(f"utt2spk {where} not found; pass the data directory's utt2spk "
                        "(one 'utterance speaker' line per utterance)")
    try:
        text = where.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise CmvnError(f"utt2spk {where} is not UTF-8 text ({err.reason} at byte {err.start}); "
                        "pass the data directory's utt2spk (one 'utterance speaker' line per "
                        "utterance)") from None
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2:
            raise CmvnError(f"{where}:{number}: expected 'utterance speaker', got {line!r}")
        if out.get(fields[0], fields[1]) != fields[1]:
            raise CmvnError(f"{where}:{number}: utterance {fields[0]!r} is given speaker "
                            f"{fields[1]!r} after {out[fields[0]]!r}; keep one line per "
                            "utterance (Kaldi's utils/fix_data_dir.sh)")
        out[fields[0]] = fields[1]
    return out


def accumulate(mat: np.ndarray, stats: np.ndarray | None = None) -> np.ndarray:
    """Kaldi's CMVN statistics of ``mat`` ``[frames, D]``, added to ``stats`` if given."""
    x = np.asarray(mat, dtype=np.float64)
    if stats is None:
        stats = np.zeros((2, x.shape[1] + 1), np.float64)
    stats[0, :-1] += x.sum(0)
    stats[1, :-1] += (x * x).sum(0)
    stats[0, -1] += len(x)
    return stats


def apply_cmvn(stats: np.ndarray, mat: np.ndarray, norm_vars: bool) -> np.ndarray:
    """``mat`` normalised with ``stats`` as Kaldi's ``apply-cmvn`` (float32 out).

    Raises:
        CmvnError: If the statistics do not fit the features or count under one frame.
    """
    feats = np.asarray(mat, dtype=np.float32)
    dim = feats.shape[1]
    if stats.shape != (2, dim + 1):
        raise CmvnError(f"CMVN statistics of shape {list(stats.shape)} do not fit "
                        f"{dim}-dim features (Kaldi's layout is [2, {dim + 1}])")
    count = float(stats[0, dim])
    if count < 1.0:  # apply-cmvn's own limit
        raise CmvnError(f"CMVN statistics count {count:g} frames; at least 1 is needed")
    mean = stats[0, :dim] / count
    if not norm_vars:
        return feats + (-mean).astype(np.float32)
    var = stats[1, :dim] / count - mean * mean
    scale = np.where(var < MIN_VARIANCE, 1.0, 1.0 / np.sqrt(np.maximum(var, MIN_VARIANCE)))
    offset = -(mean * scale)
    return feats * scale.astype(np.float32) + offset.astype(np.float32)


class Cmvn:
    """Per-speaker or per-utterance CMVN of a feature table, statistics computed or Kaldi's.

    Args:
        per: :data:`PER_SPEAKER` or :data:`PER_UTTERANCE`.
        norm_vars: Normalise the variance too (``apply-cmvn --norm-vars=true``).
        utt2spk: The speakers of the utterances (per speaker only).
        stats: :data:`COMPUTED`, or Kaldi's statistics as an rspecifier (``scp:cmvn.scp``).
        kaldiio: The kaldiio module (needed to read Kaldi's statistics).

    Raises:
        CmvnError: For per-speaker CMVN without ``utt2spk``, or a statistics table that
            cannot be read.
    """

    def __init__(self, per: str, norm_vars: bool, utt2spk: dict[str, str] | None = None,
                 stats: str = COMPUTED, kaldiio: Any = None) -> None:
        if per == PER_SPEAKER and utt2spk is None:
            raise CmvnError("per-speaker CMVN needs the utterances' speakers (utt2spk)")
        self.per, self.norm_vars, self.utt2spk, self.source = per, norm_vars, utt2spk, stats
        self._computed: dict[str, np.ndarray] = {}
        self._table: Any = None
        if stats != COMPUTED:
            self._table = _open_table(kaldiio, stats)
        self.ready = not self.needs_pass
        """Whether the statistics are there to apply (after :meth:`accumulate` of every
        utterance, where :attr:`needs_pass`)."""

    @property
    def needs_pass(self) -> bool:
        """Whether every utterance must be accumulated before the first is normalised."""
        return self.per == PER_SPEAKER and self._table is None

    def key(self, utt: str) -> str | None:
        """The statistics' key of ``utt`` (its speaker, or itself); None if it has none."""
        if self.per == PER_UTTERANCE:
            return utt
        assert self.utt2spk is not None
        return self.utt2spk.get(utt)

    def accumulate(self, utt: str, mat: np.ndarray) -> None:
        """Add one utterance to its speaker's statistics (a speaker-less one is left out)."""
        spk = self.key(utt)
        if spk is not None and self.needs_pass:
            self._computed[spk] = accumulate(mat, self._computed.get(spk))

    def has(self, utt: str) -> bool:
        """Whether ``utt`` has statistics to be normalised with."""
        key = self.key(utt)
        if key is None:
            return False
        if self._table is not None:
            return key in self._table
        return self.per == PER_UTTERANCE or key in self._computed

    def apply(self, utt: str, mat: np.ndarray) -> np.ndarray:
        """``mat`` normalised with the statistics of ``utt``'s speaker (or itself).

        Raises:
            CmvnError: If ``utt`` has no speaker or no statistics, naming it.
        """
        key = self.key(utt)
        if key is None:
            raise CmvnError(f"utterance {utt!r} is not in utt2spk; give every utterance its "
                            "speaker")
        if self._table is not None:
            if key not in self._table:
                raise CmvnError(f"{self.source} holds no statistics for {self.per} {key!r} "
                                f"(utterance {utt!r}); pass the cmvn.scp of these features' "
                                "data directory")
            stats = np.asarray(self._table[key], dtype=np.float64)
        elif self.per == PER_UTTERANCE:
            stats = accumulate(mat)
        else:
            stats = self._computed[key]
        return apply_cmvn(stats, mat, self.norm_vars)


def _open_table(kaldiio: Any, rspec: str) -> Any:
    """Kaldi's statistics table: an scp read at random, an archive read whole (it is small)."""
    if kaldiio is None:
        raise CmvnError("reading Kaldi's CMVN statistics needs kaldiio: pip install kaldiio")
    try:
        spec = kaldiio.utils.parse_specifier(rspec)
        if spec["scp"] is not None:
            return kaldiio.load_scp(spec["scp"])
        return dict(kaldiio.ReadHelper(rspec))
    except (OSError, ValueError, KeyError) as err:
        raise CmvnError(f"CMVN statistics {rspec} cannot be read ({err}); pass Kaldi's "
                        "cmvn.scp as scp:data/DIR/cmvn.scp (compute-cmvn-stats output)") from None
