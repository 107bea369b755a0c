"""Features and frame labels of the digit set.

Features are Kaldi's: 40 log-mel filterbank energies per 25 ms frame every 10 ms at 16 kHz
(``compute-fbank-feats --num-mel-bins=40 --dither=0``) with deltas and delta-deltas
(``add-deltas``: 120 dims), then per-speaker mean and variance normalisation
(``apply-cmvn --norm-vars=true`` with speaker statistics). All three are kaldi-native-fbank's
ports of Kaldi's code, so a Kaldi recipe's features and these agree.

Labels (the layout ``hadpsgd.decode`` builds its graph for): each word's frames split into
three equal states, digit *d* being classes ``3d, 3d+1, 3d+2``, and every other frame
silence, class 30 (31 classes).
"""

from __future__ import annotations

from collections.abc import Sequence

import kaldi_native_fbank as knf
import numpy as np

from examples.digits.audio import SAMPLE_RATE, Utterance

NUM_DIGITS = 10
STATES_PER_WORD = 3
SILENCE_CLASS = NUM_DIGITS * STATES_PER_WORD
"""Class 30: every frame outside a word."""
NUM_CLASSES = SILENCE_CLASS + 1
NUM_MEL_BINS = 40
DELTA_ORDER = 2
FEAT_DIM = NUM_MEL_BINS * (DELTA_ORDER + 1)
FRAME_LENGTH = SAMPLE_RATE * 25 // 1000
"""Samples per frame (25 ms)."""
FRAME_SHIFT = SAMPLE_RATE * 10 // 1000
"""Samples between frame starts (10 ms)."""


def num_frames(num_samples: int) -> int:
    """Frames of a waveform: whole 25 ms windows only (Kaldi's ``--snip-edges=true``)."""
    return 0 if num_samples < FRAME_LENGTH else 1 + (num_samples - FRAME_LENGTH) // FRAME_SHIFT


def _fbank_options() -> knf.FbankOptions:
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = SAMPLE_RATE
    opts.frame_opts.frame_length_ms = 1000 * FRAME_LENGTH / SAMPLE_RATE
    opts.frame_opts.frame_shift_ms = 1000 * FRAME_SHIFT / SAMPLE_RATE
    opts.frame_opts.snip_edges = True
    opts.frame_opts.dither = 0.0  # the set has its own noise; this keeps builds reproducible
    opts.mel_opts.num_bins = NUM_MEL_BINS
    return opts


def log_mel_deltas(samples: np.ndarray) -> np.ndarray:
    """``[num_frames(len(samples)), 120]`` float32: 40 log-mel energies, their deltas, delta-deltas.

    Args:
        samples: The waveform at 16 kHz, floats in [-1, 1] (scaled to 16-bit range, as Kaldi
            reads a wav file).
    """
    fbank = knf.OnlineFbank(_fbank_options())
    fbank.accept_waveform(SAMPLE_RATE, (np.asarray(samples, np.float32) * 32768.0).tolist())
    fbank.input_finished()
    frames = fbank.num_frames_ready
    if frames == 0:
        return np.zeros((0, FEAT_DIM), np.float32)
    mel = np.stack([fbank.get_frame(t) for t in range(frames)]).astype(np.float32)
    # Kaldi's add-deltas defaults: order 2, a window of 2 frames either side.
    return knf.compute_deltas(knf.DeltaOptions(order=DELTA_ORDER, window=2), mel)


def frame_labels(utt: Utterance, frames: int) -> np.ndarray:
    """``[frames]`` int32 labels of ``utt``'s frames (the layout: the module docstring).

    A frame belongs to the word whose span holds its centre; a word's frames are cut into
    three runs as equal as whole frames allow (the earlier states get the remainder).

    Raises:
        ValueError: If a word is too short to have a frame for each of its states.
    """
    labels = np.full(frames, SILENCE_CLASS, np.int32)
    centres = np.arange(frames) * FRAME_SHIFT + FRAME_LENGTH // 2
    for digit, (start, stop) in zip(utt.digits, utt.spans, strict=True):
        mine = np.flatnonzero((centres >= start) & (centres < stop))
        if len(mine) < STATES_PER_WORD:
            raise ValueError(f"digit {digit} at samples {start}..{stop} covers {len(mine)} "
                             f"frame(s), fewer than its {STATES_PER_WORD} states")
        for state, part in enumerate(np.array_split(mine, STATES_PER_WORD)):
            labels[part] = STATES_PER_WORD * digit + state
    return labels


def speaker_cmvn(feats: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each matrix of one speaker less the speaker's mean, over the speaker's std, per dim.

    The statistics are summed over all of the speaker's frames (Kaldi's per-speaker
    ``compute-cmvn-stats --spk2utt``), then applied to every utterance.
    """
    stats = sum(knf.compute_cmvn_stats(np.asarray(f, np.float32)) for f in feats if len(f))
    if isinstance(stats, int):
        raise ValueError("a speaker with no frames cannot be normalised")
    opts = knf.CmvnOptions()
    opts.norm_vars = True
    return [knf.apply_cmvn(stats, opts, np.asarray(f, np.float32)) for f in feats]
