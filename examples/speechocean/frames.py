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

import h5py
import numpy as np

from hadpsgd.data.priors import load_priors

BLOCK = 1 << 16
"""Frames read at a time (the whole test set is ~1M frames of 120 classes)."""


def frame_stats(ll: Path, feats: Path, priors: Path, prior_scale: float) -> dict[str, float]:
    """Accuracy, cross-entropy and mean posterior entropy of ``ll`` against ``feats``' labels.

    Args:
        ll: The forward pass's output (``loglikes``, ``offsets``, ``utt_ids``).
        feats: The feature file it was computed from (its ``labels`` align frame by frame).
        priors: The run's ``priors.json`` (what the forward pass subtracted).
        prior_scale: The exponent it subtracted them at (``--prior-scale``).

    Returns:
        ``frame_acc`` (the argmax is the aligned label), ``frame_nll`` (nats a frame),
        ``posterior_entropy`` (nats a frame) and ``frames``.

    Raises:
        ValueError: If the two files do not hold the same utterances frame by frame.
    """
    back = load_priors(priors).scaled_log(prior_scale)
    with h5py.File(ll, "r") as scores, h5py.File(feats, "r") as data:
        same = (np.array_equal(scores["offsets"][:], data["offsets"][:])
                and list(scores["utt_ids"][:]) == list(data["utt_ids"][:]))
        if not same:
            raise ValueError(f"{ll} and {feats} do not hold the same utterances frame by frame; "
                             "score the features the forward pass read")
        frames = int(scores["loglikes"].shape[0])
        right, nll, entropy = 0, 0.0, 0.0
        for lo in range(0, frames, BLOCK):
            hi = min(lo + BLOCK, frames)
            x = np.asarray(scores["loglikes"][lo:hi], dtype=np.float64) + back
            x -= np.logaddexp.reduce(x, axis=1, keepdims=True)  # exact up to rounding
            labels = np.asarray(data["labels"][lo:hi], dtype=np.int64)
            right += int((x.argmax(axis=1) == labels).sum())
            nll -= float(x[np.arange(hi - lo), labels].sum())
            entropy -= float((np.exp(x) * x).sum())
    n = max(frames, 1)
    return {"frame_acc": right / n, "frame_nll": nll / n, "posterior_entropy": entropy / n,
            "frames": frames}
