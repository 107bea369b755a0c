"""The study's frame-level scores of a test decode, against a reference worked frame by frame."""

from __future__ import annotations

import math

import h5py
import numpy as np
import pytest

from examples.speechocean.frames import frame_stats
from hadpsgd.data.priors import Priors, save_priors
from hadpsgd.data.writer import FeatureWriter

CLASSES = 5
COUNTS = [50.0, 10.0, 0.0, 25.0, 15.0]
"""Training frames of each class (the priors' counts)."""
PRIORS = [(c + 1) / (sum(COUNTS) + CLASSES) for c in COUNTS]
"""The priors by add-one smoothing, from the priors' documented formula."""


def _files(tmp_path, prior_scale: float, lengths=(4, 7, 3)):
    """Features with labels, the priors, and pseudo-log-likelihoods as the forward writes them."""
    rng = np.random.default_rng(0)
    priors = save_priors(Priors(np.array(COUNTS), "train.h5"), tmp_path / "priors.json")
    ids = [f"utt{i}" for i in range(len(lengths))]
    labels = [rng.integers(0, CLASSES, n) for n in lengths]
    logits = [rng.normal(0, 2, (n, CLASSES)) for n in lengths]
    with FeatureWriter(tmp_path / "test.h5", 3, CLASSES) as w:
        for u, lab in zip(ids, labels, strict=True):
            w.append(u, np.zeros((len(lab), 3), np.float32), lab)
    posts = []
    with h5py.File(tmp_path / "ll.h5", "w") as h5:
        rows = []
        for z in logits:
            log_post = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            posts.append(log_post)
            rows.append(log_post - prior_scale * np.log(PRIORS))
        h5["loglikes"] = np.concatenate(rows).astype(np.float32)
        h5["offsets"] = np.cumsum([0, *lengths])
        h5.create_dataset("utt_ids", data=ids, dtype=h5py.string_dtype())
    return priors, np.concatenate(labels), np.concatenate(posts)


@pytest.mark.parametrize("prior_scale", [1.0, 0.5, 0.0])
def test_frame_scores_match_a_frame_by_frame_reference(tmp_path, prior_scale):
    priors, labels, log_post = _files(tmp_path, prior_scale)
    got = frame_stats(tmp_path / "ll.h5", tmp_path / "test.h5", priors, prior_scale)
    right = nll = ent = scored = 0.0
    for t, label in enumerate(labels):
        probs = [math.exp(v) for v in log_post[t]]
        right += max(range(CLASSES), key=lambda c: probs[c]) == label
        # The decoder's view: each posterior over its prior raised to the exponent.
        scored += max(range(CLASSES), key=lambda c: probs[c] / PRIORS[c] ** prior_scale) == label
        nll += -log_post[t][label]
        ent += -sum(q * math.log(q) for q in probs)
    n = len(labels)
    assert got["frames"] == n
    assert got["frame_acc"] == pytest.approx(right / n)
    assert got["score_acc"] == pytest.approx(scored / n)
    assert got["frame_nll"] == pytest.approx(nll / n, rel=1e-5)
    assert got["posterior_entropy"] == pytest.approx(ent / n, rel=1e-5)
    assert 0 < got["posterior_entropy"] < math.log(CLASSES)
    # Per class: frames whose argmax is the class, over the class's frames; classes absent
    # from the test labels do not count; thirds by training count (10 < 15 < 25 < 50, 0).
    recall = {}
    for c in range(CLASSES):
        frames = [t for t, label in enumerate(labels) if label == c]
        if frames:
            recall[c] = sum(int(np.argmax(log_post[t]) == c) for t in frames) / len(frames)
    assert got["class_recall"] == pytest.approx(sum(recall.values()) / len(recall))
    by_count = sorted(recall, key=lambda c: COUNTS[c])
    sizes = [len(by_count) // 3 + (i < len(by_count) % 3) for i in range(3)]  # larger first
    thirds = [by_count[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(3)]
    assert got["recall_by_frequency"] == pytest.approx(
        [sum(recall[c] for c in t) / len(t) for t in thirds])


def test_scores_of_other_utterances_are_refused(tmp_path):
    priors, _, _ = _files(tmp_path, 1.0)
    with FeatureWriter(tmp_path / "other.h5", 3, CLASSES) as w:
        w.append("utt0", np.zeros((4, 3), np.float32), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="do not hold the same utterances"):
        frame_stats(tmp_path / "ll.h5", tmp_path / "other.h5", priors, 1.0)
