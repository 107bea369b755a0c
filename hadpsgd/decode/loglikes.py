"""Per-utterance log-likelihood matrices: from a Kaldi table (kaldiio) or an HDF5 file.

Sources:

* a Kaldi rspecifier, ``ark:FILE.ark`` or ``scp:FILE.scp`` (options such as ``ark,t:`` are
  kept), read through kaldiio; ``ark,scp:A.ark,A.scp`` -- the wspecifier a writer was given --
  reads the ``.scp`` (random access, the same matrices); a plain path ending in ``.ark`` /
  ``.scp`` is read as such; ``ark:-`` (standard input) and ``ark:COMMAND |`` work as in
  Kaldi;
* an HDF5 file (``.h5`` / ``.hdf5``, or any file with the HDF5 signature) in the forward
  tool's layout: ``loglikes`` ``[frames, classes]`` float32 of all utterances concatenated,
  ``offsets`` ``[utts+1]`` int64, ``utt_ids`` strings. A feature file of hadpsgd's format
  (``feats`` instead of ``loglikes``) is read the same way, so a test can write one with
  :func:`hadpsgd.data.write_features`.

Every matrix is checked for its shape and for NaN / +inf (``-inf``, a zero probability, is
allowed) before it is decoded; a problem is a :class:`LoglikesError` naming the source, the
utterance and the fix.

What the matrices hold, log-posteriors or pseudo-log-likelihoods (:attr:`LoglikesReader.kind`),
is read from the HDF5 file's ``kind`` attribute or, for a Kaldi table, from the sidecar
``python -m hadpsgd.forward`` writes beside each file it names: ``FILE.json``
(:func:`sidecar_of`, e.g. ``ll.scp.json``), whose ``bytes`` must still be the file's size (a
file written again by another tool leaves a stale sidecar, which is then not believed).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

LOGLIKES, FEATS, OFFSETS, UTT_IDS = "loglikes", "feats", "offsets", "utt_ids"
POSTERIORS, PSEUDO = "log-posteriors", "pseudo-log-likelihoods"
"""The two kinds of scores (the ``kind`` attribute and sidecar field of the forward pass)."""
_RSPECIFIER = re.compile(r"^(?P<kind>ark|scp)(?P<opts>(,[a-z]+)*):(?P<path>.*)$")
_BOTH = re.compile(r"^ark,scp(?P<opts>(,[a-z]+)*):(?P<ark>[^,]+),(?P<scp>.+)$")
DIGITS = ("the digit graph needs {n} (30 digit states + silence); pass the output of a model "
          "trained on the digit set")
"""Why the digit graph needs its width (:func:`check_matrix`'s ``needs``)."""
LEARNT = ("the first utterance had {n}; one source holds the output of one model")
"""The width of a source whose first utterance set it (no width asked for)."""


class LoglikesError(ValueError):
    """The log-likelihood input is missing or malformed; the message says how to fix it."""


def _kaldiio() -> Any:
    # Imported on use, as hadpsgd.data.kaldi does: only Kaldi-table input needs it.
    try:
        import kaldiio
    except ImportError:
        raise LoglikesError("reading Kaldi archives needs kaldiio: pip install kaldiio "
                            "(or pass an HDF5 file)") from None
    return kaldiio


def _rspecifier(source: str) -> tuple[str, Path] | None:
    """The kaldiio rspecifier and the file it reads, or None if ``source`` is not Kaldi."""
    both = _BOTH.match(source)
    if both:
        return f"scp{both['opts']}:{both['scp']}", Path(both['scp'])
    match = _RSPECIFIER.match(source)
    if match:
        return source, Path(match["path"])
    if source.endswith((".ark", ".scp")):
        kind = source.rsplit(".", 1)[1]
        return f"{kind}:{source}", Path(source)
    return None


def _check_file(path: Path, kaldi: bool) -> None:
    if kaldi and (str(path) == "-" or str(path).rstrip().endswith("|")):
        return  # standard input or a command (ark:cmd |): kaldiio reports its own failure
    if not path.exists():
        raise LoglikesError(f"log-likelihoods {path} not found; check the path (write it "
                            "with python -m hadpsgd.forward)")
    if path.is_dir():
        raise LoglikesError(f"log-likelihoods {path} is a directory; pass the .ark, .scp or "
                            ".h5 file in it")


def sidecar_of(path: str | os.PathLike[str]) -> Path:
    """The sidecar the forward pass writes beside a Kaldi output file: ``FILE.json``."""
    return Path(f"{os.fspath(path)}.json")


def _sidecar_kind(path: Path) -> tuple[str | None, str, float | None]:
    """The kind a file's sidecar records, where that came from, and the priors' exponent.

    The second item says why the kind is unknown where it is; the third is None where the
    sidecar records no exponent.
    """
    sidecar = sidecar_of(path)
    if not sidecar.is_file():
        return None, f"unknown (no {sidecar.name} beside it)", None
    try:
        info = json.loads(sidecar.read_text(encoding="utf-8"))
        kind, size = info.get("kind"), info.get("bytes")
    except (OSError, ValueError, AttributeError):
        return None, f"unknown ({sidecar} is not the forward pass's sidecar)", None
    if kind not in (POSTERIORS, PSEUDO):
        return None, f"unknown ({sidecar} names no kind)", None
    if size != path.stat().st_size:
        return None, (f"unknown ({sidecar} describes a file of {size} bytes, {path.name} has "
                      f"{path.stat().st_size}: written again since)"), None
    return kind, f"{sidecar.name}", _prior_scale(kind, info.get("prior_scale"))


def _prior_scale(kind: Any, value: Any) -> float | None:
    """The priors' exponent recorded with pseudo-log-likelihoods (None if absent or odd).

    ``hadpsgd.forward --prior-scale`` records it; files written before it have none, and
    log-posteriors subtract no priors, so neither has an exponent to report.
    """
    if kind != PSEUDO or isinstance(value, bool):
        return None
    try:
        scale = float(value)
    except (TypeError, ValueError):
        return None
    return scale if np.isfinite(scale) else None


def check_matrix(utt: str, matrix: Any, num_classes: int, source: str,
                 needs: str = DIGITS) -> np.ndarray:
    """``matrix`` as a float32 ``[frames, num_classes]`` array, or a :class:`LoglikesError`.

    ``needs`` says in words why the width must be ``num_classes`` (for the message).
    """
    array = np.asarray(matrix)
    if array.ndim != 2 or array.dtype.kind != "f":
        raise LoglikesError(f"utterance {utt!r} in {source} is not a float matrix (shape "
                            f"{list(array.shape)}, dtype {array.dtype}); pass the acoustic "
                            "model's per-frame log-likelihoods")
    if array.shape[1] != num_classes:
        raise LoglikesError(f"utterance {utt!r} in {source} has {array.shape[1]} classes per "
                            f"frame, {needs.format(n=num_classes)}")
    if np.isnan(array).any() or np.isposinf(array).any():
        raise LoglikesError(f"utterance {utt!r} in {source} holds NaN or +inf; re-run the "
                            "forward pass (a diverged model?) or drop that utterance")
    return array.astype(np.float32, copy=False)


class LoglikesReader:
    """Iterates ``(utterance id, [frames, num_classes] float32)`` pairs of one source.

    Args:
        source: A Kaldi rspecifier or an HDF5 file (see the module docstring).
        num_classes: The number of columns every matrix must have; None: the first
            matrix's (an HDF5 file's from its shape), every other one alike.

    Raises:
        LoglikesError: If the source is missing or its layout is wrong (at construction for
            the file and the HDF5 layout, at iteration for a matrix).
    """

    def __init__(self, source: str | os.PathLike[str], num_classes: int | None):
        self.source = os.fspath(source)
        self.num_classes = num_classes
        self._needs = DIGITS if num_classes is not None else LEARNT
        kaldi = _rspecifier(self.source)
        path = kaldi[1] if kaldi else Path(self.source)
        _check_file(path, kaldi is not None)
        self._rspecifier = kaldi[0] if kaldi else None
        self._offsets = np.zeros(1, dtype=np.int64)
        self._utt_ids: list[str] = []
        self._dataset = ""
        self.kind: str | None = None
        """``log-posteriors``, ``pseudo-log-likelihoods``, or None if not recorded."""
        self.kind_from = "unknown (a stream)"
        """Where :attr:`kind` was read, or why it is unknown."""
        self.prior_scale: float | None = None
        """The priors' exponent the pseudo-log-likelihoods were written with, if recorded."""
        if self._rspecifier is None:
            self._open_hdf5(path)
        elif path.is_file():
            self.kind, self.kind_from, self.prior_scale = _sidecar_kind(path)

    def _open_hdf5(self, path: Path) -> None:
        if not h5py.is_hdf5(path):
            raise LoglikesError(f"log-likelihoods {path} is neither HDF5 nor a Kaldi table; "
                                "pass an .h5 file, ark:FILE.ark or scp:FILE.scp")
        with h5py.File(path, "r") as h5:
            self._dataset = LOGLIKES if LOGLIKES in h5 else FEATS
            missing = [n for n in (self._dataset, OFFSETS, UTT_IDS) if n not in h5]
            if missing:
                raise LoglikesError(f"{path} lacks dataset(s) {', '.join(missing)}; the layout "
                                    f"is {LOGLIKES} [frames, classes], {OFFSETS} [utts+1], "
                                    f"{UTT_IDS} [utts] (python -m hadpsgd.forward writes it)")
            shape = h5[self._dataset].shape
            offsets = np.asarray(h5[OFFSETS][:], dtype=np.int64)
            ids = [u.decode() if isinstance(u, bytes) else str(u) for u in h5[UTT_IDS][:]]
            kind = h5.attrs.get("kind")
            self.prior_scale = _prior_scale(kind, h5.attrs.get("prior_scale"))
        if kind in (POSTERIORS, PSEUDO):
            self.kind, self.kind_from = str(kind), f"the 'kind' attribute of {path.name}"
        else:
            self.kind_from = f"unknown (no 'kind' attribute in {path.name})"
        if self.num_classes is None and len(shape) == 2:
            self.num_classes = int(shape[1])
        if len(shape) != 2 or shape[1] != self.num_classes:
            raise LoglikesError(f"{path}: {self._dataset} has shape {list(shape)}, the digit "
                                f"graph needs [frames, {self.num_classes}] (30 digit states + "
                                "silence); pass the output of a model trained on the digit set")
        if (offsets.ndim != 1 or len(offsets) != len(ids) + 1 or offsets[0] != 0
                or offsets[-1] != shape[0] or np.any(np.diff(offsets) < 0)):
            raise LoglikesError(f"{path}: {OFFSETS} does not cut {shape[0]} frames into "
                                f"{len(ids)} utterances (it must run from 0 to the frame "
                                "count, non-decreasing, one more entry than utt_ids); "
                                "rewrite the file")
        self._offsets, self._utt_ids = offsets, ids

    def __len__(self) -> int:
        """Utterances in an HDF5 source; 0 for a Kaldi table (not known before reading)."""
        return len(self._utt_ids)

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        if self._rspecifier is not None:
            yield from self._iter_kaldi(self._rspecifier)
            return
        with h5py.File(self.source, "r") as h5:
            data = h5[self._dataset]
            for u, utt in enumerate(self._utt_ids):
                matrix = data[self._offsets[u]:self._offsets[u + 1]]
                yield utt, self._checked(utt, matrix)

    def _iter_kaldi(self, rspecifier: str) -> Iterator[tuple[str, np.ndarray]]:
        kaldiio = _kaldiio()
        try:
            with kaldiio.ReadHelper(rspecifier) as reader:
                for utt, matrix in reader:
                    yield utt, self._checked(utt, matrix)
        except LoglikesError:
            raise
        except (OSError, ValueError, RuntimeError, EOFError) as exc:
            # kaldiio reports a truncated or foreign file with a bare parse error.
            reason = " ".join(str(exc).split())  # kaldiio's messages span lines
            raise LoglikesError(f"cannot read {self.source} as a Kaldi table ({reason}); check "
                                "that it is a binary or text archive of float matrices") from None

    def _checked(self, utt: str, matrix: Any) -> np.ndarray:
        if self.num_classes is None:  # the first matrix sets the width
            width = np.shape(matrix)
            self.num_classes = int(width[1]) if len(width) == 2 else 0
        return check_matrix(utt, matrix, self.num_classes, self.source, self._needs)
