"""The ``validated`` stamp: what a file's check vouches for, and how a reader tells it still does.

A file written by :class:`hadpsgd.data.FeatureWriter` (or checked by ``python -m hadpsgd.data
validate``) carries a stamp: every frame finite and every label in range, for this shape and
this data. A reader that trusts it skips the frame scan before training, so the stamp must
not outlive an edit in place: it records a *fingerprint* of what was checked, recomputed at
every open and compared (:func:`stamp`).

The fingerprint is what a reader can recompute for little cost on a Switchboard-size file
(10^8 frames): a CRC-32 of every label and offset (both read at open anyway, for the range
and index checks; CRC-32 runs at about 4 GB/s, a tenth of a second for 400 MB of labels) and
of :data:`SAMPLE_FRAMES` feature frames (one small read each). The features themselves
(100 GB) are too large to checksum at open: a frame changed outside the sample is found when
it is read (:meth:`hadpsgd.data.FeatureFile.read`). Content, not HDF5's modification times:
those change with every copy of a file and not at all when data is rewritten in place (only
an object's header carries a time, and writing into a chunk leaves the header alone).

Kept apart from the reader and the writer, which both import it (as they do
:mod:`hadpsgd.data._schema`), so that neither imports the other.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hadpsgd.data._schema import VALIDATE_COMMAND

__all__ = ["LABEL_BLOCK", "SAMPLE_FRAMES", "STAMP_VERSION", "crc32_of", "feats_sample_crc32",
           "find_bad_labels", "parse_stamp", "revalidate", "sample_frames", "scan_labels",
           "stamp", "stamp_differences"]

STAMP_VERSION = 2
"""Version of the stamp a reader trusts. Version 1 (no ``version`` key) recorded the shape
only, so an edit in place kept it valid: such a stamp vouches for nothing any more."""
SAMPLE_FRAMES = 16
"""Frames of ``feats`` whose bytes the fingerprint covers (:func:`sample_frames`)."""
LABEL_BLOCK = 1 << 22
"""Labels are read in blocks of this many frames (16 MiB of int32): bounded memory."""

_WORDS = {"frames": "frames", "utts": "utterances", "num_classes": "num_classes",
          "feat_dim": "feat_dim", "labels_crc32": "the labels' checksum",
          "offsets_crc32": "the offsets' checksum",
          "feats_sample_crc32": f"the checksum of {SAMPLE_FRAMES} sampled feature frames"}


def stamp(frames: int, utts: int, num_classes: int, feat_dim: int, *, labels_crc32: int,
          offsets_crc32: int, feats_sample_crc32: int) -> dict[str, Any]:
    """The stamp of a checked file of this shape and content (what a reader compares).

    Args:
        frames: ``T``.
        utts: ``U``.
        num_classes: The ``num_classes`` attribute.
        feat_dim: ``D``.
        labels_crc32: :func:`crc32_of` every label, in file order.
        offsets_crc32: :func:`crc32_of` the offsets (as int64).
        feats_sample_crc32: :func:`feats_sample_crc32` of ``feats``.
    """
    return {"version": STAMP_VERSION, "finite": True, "labels_in_range": True,
            "frames": int(frames), "utts": int(utts), "num_classes": int(num_classes),
            "feat_dim": int(feat_dim), "labels_crc32": int(labels_crc32),
            "offsets_crc32": int(offsets_crc32), "feats_sample_crc32": int(feats_sample_crc32)}


def parse_stamp(raw: object) -> tuple[dict[str, Any] | None, bool]:
    """A file's ``validated`` attribute as ``(stamp that vouches, is an older stamp)``.

    Anything but this version's stamp vouches for nothing (the file is then checked like one
    without a stamp); the flag tells an older hadpsgd's stamp apart, so a caller can say why.
    """
    if raw is None:
        return None, False
    try:
        found = json.loads(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None, False
    if not isinstance(found, dict):
        return None, False
    if found.get("version") != STAMP_VERSION:
        return None, True
    return found, False


def stamp_differences(found: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What the file holds now that its stamp ``found`` does not vouch for, in words."""
    return [f"{word} {now[key]} (the stamp has {found.get(key)})" if "crc" not in key
            else f"{word} differs" for key, word in _WORDS.items() if found.get(key) != now[key]]


def revalidate(path: Path) -> str:
    """The fix for a file changed after it was stamped: the command, with the path."""
    return (f"re-validate it with {VALIDATE_COMMAND} {path} (it checks every frame and label, "
            "then stamps the file anew)")


def crc32_of(values: np.ndarray, crc: int = 0) -> int:
    """CRC-32 of ``values``' bytes in little-endian order (the same on every machine).

    Args:
        values: Any numeric array (a block of a dataset).
        crc: The CRC of the blocks before, to go on from (CRC-32 runs over a stream).
    """
    little = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    return zlib.crc32(little, crc)


def sample_frames(num_frames: int) -> list[int]:
    """The frames the fingerprint reads: evenly spaced, the first and the last included."""
    if num_frames <= 0:
        return []
    spots = np.linspace(0, num_frames - 1, min(num_frames, SAMPLE_FRAMES)).round()
    return [int(f) for f in np.unique(spots.astype(np.int64))]


def feats_sample_crc32(feats: h5py.Dataset) -> int:
    """CRC-32 of the stored bytes of ``feats``' :func:`sample_frames` (one read)."""
    rows = sample_frames(int(feats.shape[0]))
    return crc32_of(feats[rows] if rows else feats[:0])


def scan_labels(labels: h5py.Dataset, num_frames: int) -> tuple[int, int, int]:
    """One pass over every label, in blocks: ``(CRC-32, smallest, largest)``.

    A minimum and a maximum per block, not a mask: about 12 GB/s against 2 GB/s here, so a
    reader checks the range at every open, stamp or not (an edit in place must not reach
    training as an index error). ``num_frames`` must be at least 1.
    """
    crc, low, high = 0, 0, 0
    for lo in range(0, num_frames, LABEL_BLOCK):
        block = labels[lo:lo + LABEL_BLOCK]
        crc = crc32_of(block, crc)
        b_low, b_high = int(block.min()), int(block.max())
        low, high = (b_low, b_high) if lo == 0 else (min(low, b_low), max(high, b_high))
    return crc, low, high


def find_bad_labels(labels: h5py.Dataset, num_frames: int,
                    num_classes: int) -> tuple[int, int, int]:
    """``(first frame, its label, how many)`` of the labels outside ``[0, num_classes)``.

    The second pass of a failed :func:`scan_labels` (the first frame is -1 if none is).
    """
    first, value, count = -1, 0, 0
    for lo in range(0, num_frames, LABEL_BLOCK):
        block = labels[lo:lo + LABEL_BLOCK]
        bad = (block < 0) | (block >= num_classes)
        n = int(np.count_nonzero(bad))
        if n and first < 0:
            first = lo + int(np.argmax(bad))
            value = int(block[first - lo])
        count += n
    return first, value, count
