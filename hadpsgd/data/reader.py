"""Reading and validating the HDF5 feature format (docs/design.md, the feature format)."""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

import h5py
import numpy as np

from hadpsgd.data._schema import (
    FEATS,
    FIX_DAMAGED,
    FIX_FRAMES,
    FORMAT_VERSION,
    LABELS,
    NORM_MEAN,
    NORM_STD,
    OFFSETS,
    REQUIRED_ATTRS,
    REQUIRED_DATASETS,
    SILENCE_CLASSES,
    UTT_IDS,
    VALIDATE_COMMAND,
    VALIDATED,
    FeatureFileError,
    check_silence_classes,
    path_problem,
)
from hadpsgd.data.validate_stamp import (
    crc32_of,
    feats_sample_crc32,
    find_bad_labels,
    parse_stamp,
    revalidate,
    scan_labels,
    stamp,
    stamp_differences,
)

_FIX_WRITER = "rewrite it with hadpsgd.data.write_features (or re-run the import)"


class FeatureFile:
    """One split's feature file: metadata checked at open, frames read on demand.

    Everything that can be checked without reading the features is checked at construction
    (attributes, dataset shapes, the utterance index, every label: a minimum and maximum per
    block, cheap beside the features), so a malformed file fails before training starts.
    Non-finite feature values are found by :meth:`read`, or up front by
    :func:`hadpsgd.data.validate.scan_frames`. A file written by hadpsgd's writer (or checked
    by ``python -m hadpsgd.data validate``) carries a ``validated`` stamp: every frame
    finite, every label in range, with the shape and a fingerprint of the data
    (:mod:`hadpsgd.data.validate_stamp`). When the fingerprint matches, :attr:`stamped` tells
    callers to skip the frame scan, unless ``verify``; when it does not, the file was changed
    after it was checked and is refused, naming what changed and the command that re-checks
    it. A frame changed in place outside the fingerprint's sample is found when it is read.

    The HDF5 handle is opened lazily and re-opened in a process whose pid differs from the
    opener's: a handle inherited through ``fork`` (DataLoader workers) must not be shared, and
    pickling drops it, so a ``FeatureFile`` can be sent to spawned workers too.

    Args:
        path: The ``.h5`` file.
        expected_feat_dim: If given, the feature dimension the caller needs (the model's input
            size); a different one is an error.
        verify: Ignore the file's stamp: report :attr:`stamped` as False, so that the
            frames are scanned, and do not compare its fingerprint.

    Raises:
        FeatureFileError: If the file is missing, not HDF5 or malformed, a label is out of
            range, or the data differs from what its stamp vouches for; the message names the
            file, what is wrong and the fix.
    """

    def __init__(self, path: str | os.PathLike[str], expected_feat_dim: int | None = None,
                 verify: bool = False):
        self.path = Path(path)
        self.verify = verify
        self.stamped = False
        """Whether the file's stamp vouches for it as it is (and ``verify`` is off)."""
        self.old_stamp = False
        """Whether the file carries a stamp of an older hadpsgd (its shape only), which
        vouches for nothing: the file is checked like one without a stamp."""
        self.labels_crc32 = 0
        """CRC-32 of every label, computed at open (the stamp's fingerprint)."""
        self._h5: h5py.File | None = None
        self._pid: int | None = None
        self._datasets: tuple[h5py.Dataset, h5py.Dataset] | None = None
        self._utt_ids: list[str] | None = None
        h5 = self._open()
        try:
            self._validate(h5, expected_feat_dim)
        except (OSError, KeyError) as exc:
            # HDF5 reports damaged metadata or label chunks as OSError, or KeyError when an
            # object header cannot be read; either way the user must replace the file.
            raise self._error(f"cannot read the file's metadata or labels ({exc}); "
                              f"{FIX_DAMAGED}") from exc
        finally:
            # Close the validation handle: an open handle must not be inherited by forked
            # workers. The first read() opens a fresh one.
            h5.close()

    def _error(self, what: str) -> FeatureFileError:
        return FeatureFileError(f"{self.path}: {what}")

    def _open(self) -> h5py.File:
        problem = path_problem(self.path)
        if problem is not None:
            raise self._error(problem)
        try:
            # No chunk cache: HDF5 then reads just the requested rows of an (uncompressed) chunk
            # straight from the file. Measured on 4096x260 chunks, a random 21-frame read takes
            # ~10 us this way and ~0.5 ms through the default 1 MiB cache, which loads and
            # evicts whole 4 MiB chunks. Chunks are never re-read soon enough for a cache to pay.
            # No HDF5 file locking for reading: shared file systems (Lustre, NFS) often lack
            # the locks, and every rank opens the same files.
            return h5py.File(self.path, "r", rdcc_nbytes=0, locking=False)
        except OSError as exc:
            if "truncated file" in str(exc):
                # HDF5 compares the end-of-file address in the header with the actual size.
                raise self._error(f"not a readable HDF5 file: it is truncated ({exc}); "
                                  f"{FIX_DAMAGED}") from exc
            raise self._error(f"not a readable HDF5 file ({exc}); pass an .h5 file written by "
                              f"hadpsgd.data.write_features, or {FIX_DAMAGED}") from exc

    def _validate(self, h5: h5py.File, expected_feat_dim: int | None) -> None:
        for attr in REQUIRED_ATTRS:
            if attr not in h5.attrs:
                raise self._error(f"missing attribute '{attr}'; {_FIX_WRITER}")
        version = self._int_attr(h5, "format_version")
        if version != FORMAT_VERSION:
            raise self._error(f"unsupported format_version {version}; this hadpsgd reads "
                              f"format_version {FORMAT_VERSION}, {_FIX_WRITER}")
        for name in REQUIRED_DATASETS:
            if not isinstance(h5.get(name), h5py.Dataset):
                raise self._error(f"missing dataset '{name}'; {_FIX_WRITER}")
        feats, labels, offsets_ds = h5[FEATS], h5[LABELS], h5[OFFSETS]

        self.num_classes = self._int_attr(h5, "num_classes")
        self.feat_dim = self._int_attr(h5, "feat_dim")
        if self.num_classes < 1:
            raise self._error(f"attribute num_classes is {self.num_classes}, must be >= 1")
        if self.feat_dim < 1:
            raise self._error(f"attribute feat_dim is {self.feat_dim}, must be >= 1; "
                              f"{_FIX_WRITER}")
        if feats.ndim != 2 or feats.dtype.kind != "f":
            raise self._error(f"dataset 'feats' must be a 2-D float array [frames, dim], got "
                              f"shape {list(feats.shape)} dtype {feats.dtype}")
        if feats.shape[1] != self.feat_dim:
            raise self._error(f"feature-dim mismatch: attribute feat_dim={self.feat_dim} but "
                              f"dataset 'feats' has {feats.shape[1]} columns; {_FIX_WRITER}")
        if expected_feat_dim is not None and expected_feat_dim != self.feat_dim:
            raise self._error(f"feature-dim mismatch: the file has {self.feat_dim}-dim features "
                              f"but {expected_feat_dim} are expected; use matching data or a "
                              f"model built with input_dim={self.feat_dim}")
        self.num_frames = int(feats.shape[0])
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            raise self._error(f"dataset 'labels' must be a 1-D integer array, got shape "
                              f"{list(labels.shape)} dtype {labels.dtype}")
        if labels.shape[0] != self.num_frames:
            raise self._error(f"dataset 'labels' has {labels.shape[0]} entries but 'feats' has "
                              f"{self.num_frames} frames (one label per frame expected)")
        self._validate_offsets(offsets_ds)
        self._validate_not_empty()
        if h5py.check_string_dtype(h5[UTT_IDS].dtype) is None:
            raise self._error(f"dataset 'utt_ids' must hold strings, got dtype "
                              f"{h5[UTT_IDS].dtype}")
        if h5[UTT_IDS].shape != (self.num_utts,):
            raise self._error(f"dataset 'utt_ids' has shape {list(h5[UTT_IDS].shape)} but "
                              f"'offsets' describes {self.num_utts} utterances; {_FIX_WRITER}")
        found, self.old_stamp = parse_stamp(h5.attrs.get(VALIDATED))
        # Every label at every open, stamp or not: cheap (validate_stamp.scan_labels), and an
        # edit in place must not reach training as an index error.
        self.labels_crc32, low, high = scan_labels(labels, self.num_frames)
        if low < 0 or high >= self.num_classes:
            raise self._labels_error(h5, labels, low, high, vouched=found is not None)
        self.stamped = found is not None and not self.verify and self._check_stamp(h5, found)
        self._validate_norm(h5)
        self._validate_silence(h5)

    def _int_attr(self, h5: h5py.File, name: str) -> int:
        """A required attribute that must be one integer (an integral float is taken too).

        Files written by other tools (or edited by hand) may hold a string, an array or NaN
        there; ``int()`` of those raised a bare ValueError or TypeError with no file named.
        """
        value = h5.attrs[name]
        if isinstance(value, np.ndarray) and value.shape == ():
            value = value[()]
        if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            return int(value)
        if isinstance(value, (float, np.floating)) and np.isfinite(value) \
                and float(value).is_integer():
            return int(value)
        shown = value.item() if isinstance(value, np.generic) else value
        raise self._error(f"attribute '{name}' must be one integer, got {shown!r:.60}; "
                          f"{_FIX_WRITER}")

    def _validate_offsets(self, ds: h5py.Dataset) -> None:
        if ds.ndim != 1 or ds.dtype.kind not in "iu" or ds.shape[0] < 1:
            raise self._error(f"dataset 'offsets' must be a non-empty 1-D integer array, got "
                              f"shape {list(ds.shape)} dtype {ds.dtype}")
        offsets = ds[()].astype(np.int64)
        if offsets[0] != 0:
            raise self._error(f"offsets must start at 0, got {offsets[0]}; {_FIX_WRITER}")
        steps = np.diff(offsets)
        if (steps < 0).any():
            u = int(np.argmax(steps < 0))
            raise self._error(f"offsets are not monotonic non-decreasing: offsets[{u}]="
                              f"{offsets[u]} > offsets[{u + 1}]={offsets[u + 1]}; {_FIX_WRITER}")
        if offsets[-1] != self.num_frames:
            raise self._error(f"offsets end at {offsets[-1]} but 'feats' has {self.num_frames} "
                              f"frames (the last offset must equal the frame count); "
                              f"{_FIX_WRITER}")
        self.offsets: np.ndarray = offsets
        self.num_utts = len(offsets) - 1

    def _validate_not_empty(self) -> None:
        # A file without frames yields no chunk: training would run zero steps and the
        # held-out loss would average over nothing.
        if self.num_utts == 0:
            raise self._error("has no utterances; the import or generation that wrote it "
                              "found no data, regenerate it with the right inputs")
        if self.num_frames == 0:
            raise self._error(f"has no frames: its {self.num_utts} utterances are all empty; "
                              f"regenerate it with the right inputs")

    def _check_stamp(self, h5: h5py.File, found: dict[str, Any]) -> bool:
        """The stamp's shape and fingerprint match the file; refused (raises) if not."""
        try:
            now = self.current_stamp(h5[FEATS])
        except OSError as exc:  # a damaged chunk under a sampled frame
            raise self._error(f"cannot read the feature frames its validated stamp samples "
                              f"({exc}); {FIX_DAMAGED}") from exc
        changed = stamp_differences(found, now)
        if changed:
            raise self._error(
                f"was changed after it was validated: {'; '.join(changed)}, so its validated "
                f"stamp no longer vouches for its frames and labels. If the change was meant, "
                f"{revalidate(self.path)}; if not, copy the file again or regenerate it")
        return True

    def current_stamp(self, feats: h5py.Dataset | None = None) -> dict[str, Any]:
        """The stamp that would vouch for the file as it is now (the caller checked it).

        Args:
            feats: An open ``feats`` dataset of this file (default: this process's handle).
        """
        return stamp(self.num_frames, self.num_utts, self.num_classes, self.feat_dim,
                     labels_crc32=self.labels_crc32, offsets_crc32=crc32_of(self.offsets),
                     feats_sample_crc32=feats_sample_crc32(
                         self.feats_dataset if feats is None else feats))

    def _labels_error(self, h5: h5py.File, ds: h5py.Dataset, low: int, high: int,
                      vouched: bool) -> FeatureFileError:
        """The error for labels outside the range: the first one, how many, their span."""
        first, value, count = find_bad_labels(ds, self.num_frames, self.num_classes)
        utt = self.utterance_of(first)
        name = str(h5[UTT_IDS].asstr()[utt])
        changed = ("the file was changed after it was validated (its stamp vouched for every "
                   "label); " if vouched else "")
        return self._error(
            f"label {value} at frame {first} (utterance {utt}, {name!r}) is outside [0, "
            f"num_classes={self.num_classes}): {count} frame{'s' if count != 1 else ''} out "
            f"of range, the labels span [{low}, {high}]; {changed}the num_classes attribute "
            f"is too small or the labels are corrupt: fix them (or re-run the import), then "
            f"check the file with {VALIDATE_COMMAND} {self.path}")

    def _validate_silence(self, h5: h5py.File) -> None:
        self.silence_classes: tuple[int, ...] = ()
        if SILENCE_CLASSES not in h5.attrs:
            return
        raw = np.atleast_1d(np.asarray(h5.attrs[SILENCE_CLASSES]))
        fix = "rewrite it with python -m hadpsgd.data mark-silence"
        if raw.ndim != 1 or raw.dtype.kind not in "iu":
            raise self._error(f"attribute {SILENCE_CLASSES} must be a list of class ids, got "
                              f"{raw.tolist()!r}; {fix}")
        try:
            self.silence_classes = check_silence_classes(raw.tolist(), self.num_classes)
        except ValueError as err:
            raise self._error(f"attribute {SILENCE_CLASSES}: {err}; {fix}") from err

    def _validate_norm(self, h5: h5py.File) -> None:
        self.norm_mean: np.ndarray | None = None
        self.norm_std: np.ndarray | None = None
        self._inv_std: np.ndarray | None = None
        has_mean, has_std = NORM_MEAN in h5, NORM_STD in h5
        if not (has_mean or has_std):
            return
        if has_mean != has_std:
            raise self._error("'norm/mean' and 'norm/std' must be present together")
        mean, std = h5[NORM_MEAN][()], h5[NORM_STD][()]
        for name, arr in (("norm/mean", mean), ("norm/std", std)):
            if arr.shape != (self.feat_dim,):
                raise self._error(f"norm shape mismatch: '{name}' has shape {list(arr.shape)}, "
                                  f"expected [{self.feat_dim}] (feat_dim)")
        mean, std = mean.astype(np.float32), std.astype(np.float32)
        if not (np.isfinite(mean).all() and np.isfinite(std).all() and (std > 0).all()):
            raise self._error("'norm/mean' must be finite and 'norm/std' finite and > 0")
        self.norm_mean, self.norm_std = mean, std
        # Multiplying by a precomputed reciprocal is cheaper than dividing every read.
        self._inv_std = (1.0 / std).astype(np.float32)

    def utterance_of(self, frame: int) -> int:
        """Index of the utterance that holds global frame ``frame``."""
        # side="right" skips zero-length utterances that share the same offset.
        return int(np.searchsorted(self.offsets, frame, side="right")) - 1

    @property
    def feats_dataset(self) -> h5py.Dataset:
        """This process's handle on the stored (unnormalised) ``feats``, for bulk scans."""
        self._handle()
        assert self._datasets is not None  # set by _handle
        return self._datasets[0]

    @property
    def utt_ids(self) -> list[str]:
        """Utterance names, in file order (read on first access)."""
        if self._utt_ids is None:
            self._utt_ids = [str(s) for s in self._handle()[UTT_IDS].asstr()[()]]
        return self._utt_ids

    def _handle(self) -> h5py.File:
        pid = os.getpid()
        if self._h5 is None or self._pid != pid:
            # A handle inherited from the parent process is dropped, never used or closed here.
            self._h5 = self._open()
            self._pid = pid
            # Looking a dataset up by name costs about as much as a small read: do it once.
            self._datasets = (self._h5[FEATS], self._h5[LABELS])
        return self._h5

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Read the contiguous global frame range ``[start, stop)``.

        Args:
            start: First frame.
            stop: One past the last frame; ``start <= stop <= num_frames``.

        Returns:
            ``(feats, labels)``: float32 ``[n, feat_dim]`` (normalised with ``norm/mean`` and
            ``norm/std`` when the file has them) and int64 ``[n]``.

        Raises:
            IndexError: If the range is outside the file.
            FeatureFileError: If a frame in the range holds NaN or Inf.
        """
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self.num_frames:
            raise IndexError(f"{self.path}: frame range [{start}, {stop}) is outside "
                             f"[0, {self.num_frames})")
        self._handle()
        feats_ds, labels_ds = self._datasets
        feats = np.asarray(feats_ds[start:stop], dtype=np.float32)
        labels = labels_ds[start:stop].astype(np.int64)
        finite = np.isfinite(feats)
        if not finite.all():
            frame = start + int(np.argmax(~finite.all(axis=1)))
            utt = self.utterance_of(frame)
            # A stamped file skipped the scan before training: it was changed after it was
            # checked, and the fix must say how to check it again.
            changed = ("the file was changed after it was validated (its stamp vouched for "
                       "every frame); " if self.stamped else "")
            raise self._error(
                f"non-finite feature value (NaN or Inf) at frame {frame} in the frame range "
                f"[{start}, {stop}), utterance {utt} ({self.utt_ids[utt]!r}); {changed}"
                f"{FIX_FRAMES}; {VALIDATE_COMMAND} {self.path} checks every frame")
        if self.norm_mean is not None:
            feats -= self.norm_mean
            feats *= self._inv_std
        return feats, labels

    def close(self) -> None:
        """Close this process's HDF5 handle (a later :meth:`read` reopens it)."""
        if self._h5 is not None and self._pid == os.getpid():
            self._h5.close()
        self._h5 = None
        self._pid = None
        self._datasets = None

    def __getstate__(self) -> dict[str, Any]:
        # h5py handles cannot be pickled; the receiving process opens its own.
        state = self.__dict__.copy()
        state["_h5"] = state["_pid"] = state["_datasets"] = None
        return state

    def __enter__(self) -> FeatureFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"FeatureFile({str(self.path)!r}, utts={self.num_utts}, "
                f"frames={self.num_frames}, feat_dim={self.feat_dim}, "
                f"num_classes={self.num_classes})")
