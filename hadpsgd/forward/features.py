"""The utterances to run the model on: our HDF5 feature file, or a Kaldi table via kaldiio.

An HDF5 file knows every utterance's length up front and reads any of them at will; its own
normalisation statistics (``norm/``) are applied on read, as in training. A Kaldi table
(``scp:feats.scp``, ``ark:feats.ark``, ``ark:cmd |``) is read as kaldiio gives it, then given
what the training file's import did to its features: the recorded CMVN
(:mod:`hadpsgd.forward.pipeline`: ``--utt2spk``, ``--cmvn``, or a refusal), then the statistics
training used (``--norm``), applied as the reader applies ``norm/``. Under mpirun its lengths
are learnt in one pass on rank 0 (an ``scp`` is then read at random, an ``ark`` streamed again
by every rank); one process streams it once, so ``ark:-`` (standard input) works there. A
per-speaker CMVN computed here reads the table once more first, for the speakers' statistics.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hadpsgd.data import FeatureFile, FeatureFileError
from hadpsgd.data.cmvn import Cmvn
from hadpsgd.forward import pipeline
from hadpsgd.forward.model import ForwardError

# A Kaldi rspecifier: "scp:..." / "ark:..." with options ("ark,t:", "scp,p:").
_RSPEC = re.compile(r"^(ark|scp)(,[a-z]+)*:")

Norm = tuple[np.ndarray, np.ndarray] | None


def is_kaldi(spec: str) -> bool:
    """Whether ``--features`` names a Kaldi table rather than an HDF5 file."""
    return bool(_RSPEC.match(spec))


def _kaldiio() -> Any:
    try:
        import kaldiio
    except ImportError:
        raise ForwardError("reading Kaldi features needs kaldiio: pip install 'hadpsgd[kaldi]' "
                           "(or pip install kaldiio), or convert them with python -m "
                           "hadpsgd.data.kaldi") from None
    return kaldiio


class Features:
    """Utterances in input order: ``index`` (ids and lengths, when known) and ``read``."""

    feat_dim: int
    num_classes: int | None = None
    """The file's class count (an HDF5 file's; a Kaldi table has none)."""
    index: list[tuple[str, int]] | None = None
    """``(utterance id, frames)`` of every utterance in order, if known."""
    name: str

    def read(self, first: int = 0, stop: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """``(id, float32 [frames, feat_dim])`` of utterances ``first`` .. ``stop`` - 1."""
        raise NotImplementedError


class H5Features(Features):
    """An HDF5 feature file (:class:`hadpsgd.data.FeatureFile`)."""

    def __init__(self, path: str) -> None:
        self.file = FeatureFile(path)
        self.name = str(path)
        self.feat_dim, self.num_classes = self.file.feat_dim, self.file.num_classes
        lengths = np.diff(self.file.offsets)
        self.index = list(zip(self.file.utt_ids, map(int, lengths), strict=True))

    def read(self, first: int = 0, stop: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """The utterances ``first`` .. ``stop`` - 1, normalised as in training."""
        offsets, ids = self.file.offsets, self.file.utt_ids
        for u in range(first, self.file.num_utts if stop is None else stop):
            yield ids[u], self.file.read(int(offsets[u]), int(offsets[u + 1]))[0]


class KaldiFeatures(Features):
    """A Kaldi table read through kaldiio, given ``cmvn``, then ``norm`` (mean, std), if given."""

    def __init__(self, rspec: str, norm: Norm, cmvn: Cmvn | None = None) -> None:
        self.kaldiio = _kaldiio()
        self.rspec, self.name, self.norm, self.cmvn = rspec, rspec, norm, cmvn
        # As FeatureFile.read applies norm/: the same frames as an import of these features.
        self._inv_std = None if norm is None else (1.0 / norm[1]).astype(np.float32)
        self.feat_dim = 0  # known once the first utterance is read
        self._stream: Iterator[tuple[str, np.ndarray]] | None = None
        self._peeked: tuple[str, np.ndarray] | None = None
        spec = self.kaldiio.utils.parse_specifier(rspec)
        self.scp: str | None = spec["scp"]
        self.stdin = spec["ark"] == "-"

    def peek_dim(self) -> int:
        """Open the stream and read the first utterance's dimension (kept for :meth:`read`)."""
        self._ensure_cmvn()
        self._stream = self._table()
        self._peeked = next(self._stream, None)
        if self._peeked is None:
            raise ForwardError(f"--features {self.rspec} holds no utterance; check the table")
        self.feat_dim = self._dim(*self._peeked)
        self._check_norm()
        return self.feat_dim

    def _dim(self, utt: str, mat: np.ndarray) -> int:
        if mat.ndim != 2:
            raise ForwardError(f"--features {self.rspec}: utterance {utt!r} is not a matrix "
                               f"(shape {list(mat.shape)}); pass a feature table")
        return int(mat.shape[1])

    def learn_index(self) -> list[tuple[str, int]]:
        """Every utterance's id and length, in one pass over the table."""
        index: list[tuple[str, int]] = []
        for utt, raw in self._all():
            if not index:
                self.feat_dim = self._dim(utt, np.asarray(raw))
            index.append((utt, len(raw)))
            self._accumulate(utt, raw)  # the same pass gives the speakers' statistics
        if not index:
            raise ForwardError(f"--features {self.rspec} holds no utterance; check the table")
        if self.cmvn is not None:
            self.cmvn.ready = True
        self.index = index
        self._check_norm()
        return index

    def _accumulate(self, utt: str, raw: Any) -> None:
        """Add an utterance to its speaker's statistics, where they are computed here."""
        if self.cmvn is None or self.cmvn.ready:
            return
        if self.cmvn.key(utt) is None:
            raise ForwardError(f"--features {self.rspec}: utterance {utt!r} is not in "
                               "--utt2spk; pass the utt2spk of these features")
        self.cmvn.accumulate(utt, np.asarray(raw))

    def _ensure_cmvn(self) -> None:
        """The speakers' statistics, in a pass of their own if not learnt yet."""
        if self.cmvn is None or self.cmvn.ready:
            return
        for utt, raw in self._table():
            self._accumulate(utt, raw)
        self.cmvn.ready = True

    def _unreadable(self, err: BaseException) -> ForwardError:
        reason = (str(err).strip().replace("\n", "; ") or type(err).__name__)
        return ForwardError(f"--features {self.rspec} cannot be read ({reason}); check the "
                            "rspecifier and the files it names (an scp's relative paths are "
                            "taken from the current directory)")

    def _table(self) -> Iterator[tuple[str, np.ndarray]]:
        """The table's utterances, read by kaldiio, a damaged one a :class:`ForwardError`.

        kaldiio reports damage with a bare ``Exception`` ("File format is wrong?"), an
        ``AssertionError`` (an scp offset past its archive's end), ``ValueError`` or
        ``OSError``; errors of the caller's loop body do not pass through here.
        """
        try:
            yield from self.kaldiio.ReadHelper(self.rspec)
        except Exception as err:  # noqa: BLE001 - kaldiio's errors have no common class
            raise self._unreadable(err) from None

    def _check_norm(self) -> None:
        if self.norm is not None and self.norm[0].shape != (self.feat_dim,):
            raise ForwardError(f"--norm: the statistics have dimension {self.norm[0].shape[0]} "
                               f"but {self.rspec} has {self.feat_dim}-dim features; pass the "
                               "statistics of these features' training set")

    def _all(self) -> Iterator[tuple[str, np.ndarray]]:
        if self._stream is not None:  # the stream peek_dim opened, its first item put back
            stream, first = self._stream, self._peeked
            self._stream = self._peeked = None
            if first is not None:
                yield first
            yield from stream
            return
        yield from self._table()

    def _prepared(self, utt: str, raw: Any) -> np.ndarray:
        mat = np.asarray(raw, dtype=np.float32)
        if self._dim(utt, mat) != self.feat_dim:
            raise ForwardError(f"--features {self.rspec}: utterance {utt!r} has "
                               f"{mat.shape[1]}-dim features, the first had {self.feat_dim}; "
                               "one table must hold one kind of features")
        if not np.isfinite(mat).all():
            raise ForwardError(f"--features {self.rspec}: utterance {utt!r} holds NaN or Inf; "
                               "fix or drop it")
        if self.cmvn is not None:
            mat = pipeline.prepare(self.cmvn, utt, mat)
        if self.norm is not None:
            mat = mat - self.norm[0]
            mat *= self._inv_std
        return mat

    def read(self, first: int = 0, stop: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """The utterances ``first`` .. ``stop`` - 1 (an scp at random, an ark streamed)."""
        self._ensure_cmvn()
        if self.scp is not None and self.index is not None:
            table = self.kaldiio.load_scp(self.scp)  # random access: only this range is read
            for utt, _ in self.index[first:stop]:
                try:
                    raw = table[utt]
                except Exception as err:  # noqa: BLE001 - as in _table
                    raise self._unreadable(err) from None
                yield utt, self._prepared(utt, raw)
            return
        for position, (utt, raw) in enumerate(self._all()):
            if stop is not None and position >= stop:
                return
            if position >= first:
                yield utt, self._prepared(utt, raw)


def training_norm(train_file: str | None, features: str) -> tuple[Norm, str]:
    """``--norm auto`` for a Kaldi table: the statistics of the training file the run named.

    Raises:
        ForwardError: If the training file is not here (its statistics are then unknown).
    """
    if train_file is not None and Path(train_file).is_file():
        try:
            ff = FeatureFile(train_file)
        except FeatureFileError as err:
            raise ForwardError(f"--norm auto: {err}; pass --norm FILE or --norm none") from None
        if ff.norm_mean is None or ff.norm_std is None:
            return None, f"none (the training file {train_file} has no norm/)"
        return (ff.norm_mean, ff.norm_std), f"the training file's, {train_file}"
    raise ForwardError(f"--norm auto: the training file {train_file} that the checkpoint's "
                       f"config names is not here, so the normalisation the model expects of "
                       f"{features} is unknown; pass --norm TRAIN.h5 (or an .npz with mean and "
                       "std), or --norm none if training used unnormalised features")


def open_features(spec: str, norm: str, train_file: str | None, utt2spk: str | None = None,
                  cmvn: str | None = None) -> tuple[Features, str]:
    """The features ``--features`` names and a description of their normalisation.

    Args:
        spec: ``--features``.
        norm: ``--norm``.
        train_file: The training file the checkpoint names (its ``norm/`` and import record).
        utt2spk: ``--utt2spk`` (Kaldi input whose training import had per-speaker CMVN).
        cmvn: ``--cmvn`` (Kaldi's statistics, or ``applied``).

    Raises:
        ForwardError: For a missing or malformed input, a ``--norm`` that does not apply, or
            a CMVN the training import had and the flags do not redo (or the reverse).
    """
    record, where = pipeline.training_record(train_file, norm)
    if not is_kaldi(spec):
        if norm != "auto":
            raise ForwardError(f"--norm {norm} applies to Kaldi features only: an .h5 file's "
                               f"own norm/ statistics are applied as in training; drop --norm")
        if utt2spk is not None or cmvn is not None:
            raise ForwardError("--utt2spk and --cmvn apply to Kaldi features only: an .h5 "
                               "file's CMVN was applied at its import; drop them")
        try:
            h5 = H5Features(spec)
        except FeatureFileError as err:
            raise ForwardError(f"--features {err}; pass an .h5 feature file or a Kaldi "
                               "rspecifier (scp:feats.scp, ark:feats.ark)") from None
        pipeline.check_h5(spec, record, where)
        return h5, _h5_norm(h5, train_file)
    applier, cmvn_line = pipeline.plan(spec, record, where, utt2spk, cmvn, _kaldiio())
    if norm == "none":
        return KaldiFeatures(spec, None, applier), f"{cmvn_line}, then none (--norm none)"
    if norm == "auto":
        stats, described = training_norm(train_file, spec)
        return KaldiFeatures(spec, stats, applier), f"{cmvn_line}, then {described}"
    from hadpsgd.data.kaldi import load_norm

    try:
        return KaldiFeatures(spec, load_norm(norm), applier), f"{cmvn_line}, then from {norm}"
    except (ValueError, OSError) as err:
        raise ForwardError(f"--norm {norm}: {err}; pass a feature file with norm/ or an .npz "
                           "with mean and std") from None


def _h5_norm(h5: H5Features, train_file: str | None) -> str:
    """An ``.h5`` input's statistics in words, and whether they are the training file's."""
    own = h5.file.norm_mean
    if own is None:
        return "none (no norm/)"
    if train_file is None or not Path(train_file).is_file() \
            or Path(train_file).resolve() == h5.file.path.resolve():
        return "the file's norm/"
    try:
        train = FeatureFile(train_file)
    except FeatureFileError:
        return "the file's norm/"
    if train.norm_mean is None or (np.array_equal(own, train.norm_mean)
                                   and np.array_equal(h5.file.norm_std, train.norm_std)):
        return "the file's norm/ (the training file's)"
    return (f"the file's norm/, NOT the training file's ({train_file}): the model saw frames "
            "normalised otherwise; import this split with --like TRAIN.h5 to share them")
