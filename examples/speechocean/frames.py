"""Frame-level scores of a test decode: accuracy, cross-entropy and posterior entropy.

The study's WER rests on ~4,000 words; the same utterances carry ~240,000 aligned frames
(the builder's forced alignment), so the frame view of the same new voices is a far less
noisy second reading of one model, and it shows what WER alone cannot: whether a model that
decodes worse is less accurate frame by frame or only less sure (issue 57: the sparse code's
models are flatter at the same frame accuracy).

The scores are ``hadpsgd.forward``'s pseudo-log-likelihoods ``log p(s|x) - P log p(s)``, so
adding the run's ``P log p(s)`` back gives the log-posteriors the network output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hadpsgd.data.priors import load_priors

BLOCK = 1 << 16
"""Frames read at a time (the whole test set is ~1M frames of 120 classes)."""


def frame_stats(ll: Path, feats: Path, priors: Path, prior_scale: float) -> dict[str, Any]:
    """Accuracy, cross-entropy and mean posterior entropy of ``ll`` against ``feats``' labels.

    Args:
        ll: The forward pass's output (``loglikes``, ``offsets``, ``utt_ids``).
        feats: The feature file it was computed from (its ``labels`` align frame by frame).
        priors: The run's ``priors.json`` (what the forward pass subtracted).
        prior_scale: The exponent it subtracted them at (``--prior-scale``).

    Returns:
        ``frame_acc`` (the argmax is the aligned label), ``score_acc`` (the same of the
        scores as written, the posteriors divided by the priors: what the decoder weighs),
        ``frame_nll`` and ``posterior_entropy`` (nats a frame), ``frames``,
        ``class_recall`` (the mean over the classes present of each one's recall) and
        ``recall_by_frequency``: the same mean over each third of those classes ordered by
        their training frames, rarest first (a code that starves small gradients shows in
        the rare third first).

    Raises:
        ValueError: If the two files do not hold the same utterances frame by frame.
    """
    loaded = load_priors(priors)
    back = loaded.scaled_log(prior_scale)
    classes = loaded.num_classes
    hits, seen = np.zeros(classes, np.int64), np.zeros(classes, np.int64)
    with h5py.File(ll, "r") as scores, h5py.File(feats, "r") as data:
        same = (np.array_equal(scores["offsets"][:], data["offsets"][:])
                and list(scores["utt_ids"][:]) == list(data["utt_ids"][:]))
        if not same:
            raise ValueError(f"{ll} and {feats} do not hold the same utterances frame by frame; "
                             "score the features the forward pass read")
        frames = int(scores["loglikes"].shape[0])
        right, scored, nll, entropy = 0, 0, 0.0, 0.0
        for lo in range(0, frames, BLOCK):
            hi = min(lo + BLOCK, frames)
            raw = np.asarray(scores["loglikes"][lo:hi], dtype=np.float64)
            labels = np.asarray(data["labels"][lo:hi], dtype=np.int64)
            scored += int((raw.argmax(axis=1) == labels).sum())
            x = raw + back
            x -= np.logaddexp.reduce(x, axis=1, keepdims=True)  # exact up to rounding
            good = x.argmax(axis=1) == labels
            right += int(good.sum())
            seen += np.bincount(labels, minlength=classes)
            hits += np.bincount(labels[good], minlength=classes)
            nll -= float(x[np.arange(hi - lo), labels].sum())
            entropy -= float((np.exp(x) * x).sum())
    n = max(frames, 1)
    present = np.flatnonzero(seen > 0)
    recall = hits[present] / seen[present]
    thirds = np.array_split(np.argsort(loaded.counts[present], kind="stable"), 3)
    return {"frame_acc": right / n, "score_acc": scored / n, "frame_nll": nll / n,
            "posterior_entropy": entropy / n, "frames": frames,
            "class_recall": float(recall.mean()) if present.size else 0.0,
            "recall_by_frequency": [float(recall[t].mean()) if t.size else 0.0
                                    for t in thirds]}
