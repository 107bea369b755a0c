"""Writing the HDF5 feature format (docs/design.md), atomically and incrementally."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import h5py
import numpy as np

from hadpsgd.data._schema import (
    FEATS,
    FORMAT_VERSION,
    LABELS,
    NORM_MEAN,
    NORM_STD,
    OFFSETS,
    SILENCE_CLASSES,
    UTT_IDS,
    VALIDATED,
    check_silence_classes,
)
from hadpsgd.data.validate_stamp import crc32_of, feats_sample_crc32, stamp

# Dimensions whose spread is below this are treated as constant: dividing by a ~0 std would
# turn any held-out deviation into a huge value, so such dims get std 1 (they are only centred).
_MIN_STD = 1e-6


class FeatureWriter:
    """Appends utterances to a new feature file; the file appears under its name only on commit.

    Data goes to a temporary file in the destination directory and is moved over ``path``
    with :func:`os.replace` by :meth:`commit`, so a crashed or aborted writer never leaves a
    half-written file under the real name. Utterances are appended one at a time, so files
    larger than memory can be written (the Kaldi importer relies on this). Running
    per-dimension mean and variance are kept for :meth:`running_norm`.

    Used as a context manager, an exception aborts (the temporary file is removed) and a normal
    exit commits without normalisation statistics unless :meth:`commit` was already called.

    Args:
        path: Destination file.
        feat_dim: Feature dimension D of every utterance.
        num_classes: Labels must lie in ``[0, num_classes)``.
        chunk_frames: Frames per HDF5 chunk of ``feats``.
        silence_classes: The classes that are silence (the ``silence_classes`` attribute;
            evaluation then reports the accuracy on the other, speech frames too).
    """

    def __init__(
        self, path: str | os.PathLike[str], feat_dim: int, num_classes: int,
        chunk_frames: int = 4096, silence_classes: Sequence[int] = (),
    ) -> None:
        for name, value in (("feat_dim", feat_dim), ("num_classes", num_classes),
                            ("chunk_frames", chunk_frames)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.path = Path(path)
        self.feat_dim = int(feat_dim)
        self.num_classes = int(num_classes)
        self.silence_classes = check_silence_classes(silence_classes, self.num_classes)
        if not self.path.parent.is_dir():
            raise ValueError(f"cannot write {self.path}: directory {self.path.parent} "
                             "does not exist")
        # A unique hidden name next to the target: same filesystem, so os.replace is atomic.
        # (Not tempfile.mkstemp: its 0600 mode would stick to the final file.)
        self._tmp = self.path.parent / f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        chunk_bytes = chunk_frames * self.feat_dim * 4
        # Appends touch the last, partly filled chunk again and again; a chunk cache that holds
        # a few chunks avoids re-reading it from disk on every append.
        cache = max(1 << 20, 4 * chunk_bytes)
        self._h5: h5py.File | None = h5py.File(self._tmp, "w", rdcc_nbytes=cache)
        self._feats = self._h5.create_dataset(
            FEATS, shape=(0, self.feat_dim), maxshape=(None, self.feat_dim), dtype=np.float32,
            chunks=(chunk_frames, self.feat_dim),
        )
        self._labels = self._h5.create_dataset(
            LABELS, shape=(0,), maxshape=(None,), dtype=np.int32, chunks=(max(chunk_frames, 1024),)
        )
        self._offsets = [0]
        self._utt_ids: list[str] = []
        self._seen: set[str] = set()
        self._mean = np.zeros(self.feat_dim, np.float64)
        self._m2 = np.zeros(self.feat_dim, np.float64)
        # The stamp's checksum of every label, kept as they are appended (CRC-32 streams).
        self._labels_crc = 0

    @property
    def num_frames(self) -> int:
        """Frames appended so far."""
        return self._offsets[-1]

    @property
    def num_utts(self) -> int:
        """Utterances appended so far."""
        return len(self._utt_ids)

    def append(self, utt_id: str, feats: np.ndarray, labels: np.ndarray) -> None:
        """Append one utterance.

        Args:
            utt_id: Utterance name; must be unique in the file.
            feats: ``[n, feat_dim]`` finite features (any float dtype; stored as float32).
            labels: ``[n]`` integer labels in ``[0, num_classes)``.

        Raises:
            ValueError: If the utterance is inconsistent; nothing is written then.
        """
        if self._h5 is None:
            raise ValueError(f"writer for {self.path} is already closed")
        feats = np.asarray(feats)
        labels = np.asarray(labels)
        where = f"utterance {utt_id!r}"
        if not isinstance(utt_id, str):
            raise ValueError(f"{where}: utterance id must be a str, got {type(utt_id).__name__}")
        if utt_id in self._seen:
            raise ValueError(f"{where}: duplicate utterance id")
        if feats.ndim != 2 or feats.shape[1] != self.feat_dim:
            raise ValueError(f"{where}: feats must have shape [frames, {self.feat_dim}], "
                             f"got {list(feats.shape)}")
        if not np.issubdtype(feats.dtype, np.floating):
            raise ValueError(f"{where}: feats must be floating point, got {feats.dtype}")
        if labels.ndim != 1 or len(labels) != len(feats):
            raise ValueError(f"{where}: labels must have shape [{len(feats)}] (one per frame), "
                             f"got {list(labels.shape)}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"{where}: labels must be integers, got {labels.dtype}")
        feats32 = feats.astype(np.float32, copy=False)
        if not np.isfinite(feats32).all():
            raise ValueError(f"{where}: feats contain NaN or Inf (or overflow float32)")
        if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(f"{where}: labels span [{labels.min()}, {labels.max()}], outside "
                             f"[0, {self.num_classes}); raise num_classes or fix the labels")
        n, start = len(feats32), self._offsets[-1]
        if n:
            self._feats.resize(start + n, axis=0)
            self._feats[start:] = feats32
            stored = labels.astype(np.int32)
            self._labels.resize(start + n, axis=0)
            self._labels[start:] = stored
            self._labels_crc = crc32_of(stored, self._labels_crc)
            self._update_stats(feats32, start, n)
        self._offsets.append(start + n)
        self._utt_ids.append(utt_id)
        self._seen.add(utt_id)

    def _update_stats(self, x: np.ndarray, n_a: int, n_b: int) -> None:
        # Chan et al.'s pairwise merge of (count, mean, M2): numerically stable in one pass,
        # unlike accumulating sum and sum of squares.
        mean_b = x.mean(axis=0, dtype=np.float64)
        m2_b = np.square(x - mean_b).sum(axis=0)
        delta = mean_b - self._mean
        total = n_a + n_b
        self._mean += delta * (n_b / total)
        self._m2 += m2_b + np.square(delta) * (n_a * n_b / total)

    def running_norm(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-dimension mean and standard deviation of all frames appended so far (float32)."""
        if self.num_frames == 0:
            raise ValueError(f"no frames written to {self.path}: cannot compute normalisation")
        std = np.sqrt(self._m2 / self.num_frames)
        std[std < _MIN_STD] = 1.0
        return self._mean.astype(np.float32), std.astype(np.float32)

    def commit(self, norm: tuple[np.ndarray, np.ndarray] | None = None,
               attrs: dict[str, str] | None = None) -> None:
        """Write the index and attributes and move the file to its final name.

        Args:
            norm: Optional ``(mean, std)``, each ``[feat_dim]``, stored as ``norm/mean`` and
                ``norm/std``; readers normalise frames with them.
            attrs: More file attributes, e.g. the Kaldi import's ``pipeline`` record; in the
                file when it appears under its name, never after.

        Raises:
            ValueError: If no utterance was appended or ``norm`` is malformed; the temporary
                file is removed.
        """
        if self._h5 is None:
            raise ValueError(f"writer for {self.path} is already closed")
        try:
            if not self._utt_ids:
                raise ValueError(f"no utterances to write to {self.path}")
            h5 = self._h5
            offsets = np.asarray(self._offsets, dtype=np.int64)
            h5.create_dataset(OFFSETS, data=offsets)
            h5.create_dataset(UTT_IDS, data=self._utt_ids,
                              dtype=h5py.string_dtype(encoding="utf-8"))
            h5.attrs["format_version"] = FORMAT_VERSION
            h5.attrs["num_classes"] = self.num_classes
            h5.attrs["feat_dim"] = self.feat_dim
            if self.silence_classes:
                h5.attrs[SILENCE_CLASSES] = np.asarray(self.silence_classes, dtype=np.int32)
            h5.attrs.update(attrs or {})
            # append() checked every frame and label: say so, for the readers to trust, with
            # the fingerprint that tells them whether the data is still what was checked.
            h5.attrs[VALIDATED] = json.dumps(stamp(
                self.num_frames, self.num_utts, self.num_classes, self.feat_dim,
                labels_crc32=self._labels_crc, offsets_crc32=crc32_of(offsets),
                feats_sample_crc32=feats_sample_crc32(self._feats)))
            if norm is not None:
                mean, std = _check_norm(norm[0], norm[1], self.feat_dim)
                h5.create_dataset(NORM_MEAN, data=mean)
                h5.create_dataset(NORM_STD, data=std)
            h5.close()
            self._h5 = None
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Discard everything written; the destination path is left untouched."""
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> FeatureWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif self._h5 is not None:
            self.commit()


def _check_norm(mean: np.ndarray, std: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    mean = np.asarray(mean, dtype=np.float32)
    std = np.asarray(std, dtype=np.float32)
    if mean.shape != (dim,) or std.shape != (dim,):
        raise ValueError(f"norm mean/std must both have shape [{dim}], got "
                         f"{list(mean.shape)} and {list(std.shape)}")
    if not (np.isfinite(mean).all() and np.isfinite(std).all() and (std > 0).all()):
        raise ValueError("norm mean must be finite and norm std finite and > 0")
    return mean, std


def write_features(
    path: str | os.PathLike[str],
    feats: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    utt_ids: Sequence[str],
    num_classes: int,
    norm_mean: np.ndarray | None = None,
    norm_std: np.ndarray | None = None,
    chunk_frames: int = 4096,
    silence_classes: Sequence[int] = (),
) -> None:
    """Write utterances held in memory to one feature file, atomically.

    Args:
        path: Destination file; replaced atomically if it exists.
        feats: One ``[n_u, D]`` float array per utterance (same D for all).
        labels: One ``[n_u]`` integer array per utterance, values in ``[0, num_classes)``.
        utt_ids: One unique name per utterance.
        num_classes: Number of classes (stored as the ``num_classes`` attribute).
        norm_mean: Optional per-dimension mean ``[D]`` (give together with ``norm_std``).
        norm_std: Optional per-dimension standard deviation ``[D]``, all > 0.
        chunk_frames: Frames per HDF5 chunk of ``feats`` (capped at the total frame count so
            small files stay small).
        silence_classes: The classes that are silence (see :class:`FeatureWriter`).

    Raises:
        ValueError: If the inputs are inconsistent (lengths, shapes, label range, norm).
    """
    if not (len(feats) == len(labels) == len(utt_ids)):
        raise ValueError(f"feats, labels and utt_ids must have the same length, got "
                         f"{len(feats)}, {len(labels)} and {len(utt_ids)}")
    if len(feats) == 0:
        raise ValueError(f"no utterances to write to {path}")
    if (norm_mean is None) != (norm_std is None):
        raise ValueError("give both norm_mean and norm_std, or neither")
    first = np.asarray(feats[0])
    if first.ndim != 2:
        raise ValueError(f"feats must be 2-D [frames, dim] arrays, got shape {list(first.shape)} "
                         f"for utterance {utt_ids[0]!r}")
    total = sum(len(f) for f in feats)
    writer = FeatureWriter(path, first.shape[1], num_classes,
                           chunk_frames=max(1, min(int(chunk_frames), total)),
                           silence_classes=silence_classes)
    with writer:
        for utt, f, lab in zip(utt_ids, feats, labels, strict=True):
            writer.append(utt, f, lab)
        writer.commit(None if norm_mean is None else (norm_mean, norm_std))


def mark_silence(path: str | os.PathLike[str], classes: Sequence[int]) -> tuple[int, ...]:
    """Record in an existing feature file which classes are silence (its attribute only).

    For files written by other tools: the frames and the writer's stamp are untouched (the
    attribute is no part of the stamp's fingerprint), and an empty ``classes`` removes it.

    Returns:
        The classes recorded.

    Raises:
        ValueError: If a class is outside the file's ``[0, num_classes)``.
    """
    with h5py.File(path, "r+") as h5:
        recorded = check_silence_classes(classes, int(h5.attrs["num_classes"]))
        if recorded:
            h5.attrs[SILENCE_CLASSES] = np.asarray(recorded, dtype=np.int32)
        elif SILENCE_CLASSES in h5.attrs:
            del h5.attrs[SILENCE_CLASSES]
    return recorded
