"""Waveforms of the digit set: resampling, a word's voiced span, an utterance from words.

An utterance is its words' waveforms laid end to end with random pauses between them (some
words back to back), each word sped up or slowed down and made louder or softer on its own,
and white noise over the whole at a random signal-to-noise ratio. Where every word lies is
kept (:class:`Utterance`), so the frame labels follow from it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16000
"""Samples per second of every waveform here (espeak-ng speaks at 22050: resampled)."""

LEAD_S = (0.15, 0.5)
"""Range of the silence before the first word and after the last, in seconds."""
GAP_S = (0.05, 0.35)
"""Range of a pause between two words, in seconds."""
BACK_TO_BACK = 0.4
"""Probability that a word follows the previous one with no pause (connected speech)."""
SPEED = (0.9, 1.1)
"""Range of each word's speed factor (resampling: duration and pitch change together)."""
GAIN_DB = (-6.0, 3.0)
"""Range of each word's gain."""
SNR_DB = (5.0, 25.0)
"""Range of the utterance's signal-to-noise ratio (speech power over noise power)."""
VOICED_FLOOR_DB = -35.0
"""A 10 ms frame is voiced when its energy is within this of the word's loudest frame."""


def resample_to(x: np.ndarray, length: int) -> np.ndarray:
    """``x`` band-limited to and resampled at ``length`` samples over the same duration.

    Done in the frequency domain (the spectrum cut or zero-padded, as
    ``scipy.signal.resample`` does): exact for a band-limited signal, and the cut removes
    what would alias when going down. The signal is taken as periodic, which the
    near-silent ends of a word's span make harmless.
    """
    if length < 1:
        raise ValueError(f"cannot resample to {length} samples")
    n = len(x)
    spectrum = np.fft.rfft(x)
    bins = length // 2 + 1
    if bins <= len(spectrum):
        spectrum = spectrum[:bins]
    else:
        spectrum = np.concatenate([spectrum, np.zeros(bins - len(spectrum), spectrum.dtype)])
    return (np.fft.irfft(spectrum, length) * (length / n)).astype(np.float32)


def resample(x: np.ndarray, rate: int, new_rate: int) -> np.ndarray:
    """``x`` sampled at ``rate`` resampled to ``new_rate`` (:func:`resample_to`)."""
    if rate == new_rate:
        return x.astype(np.float32, copy=False)
    return resample_to(x, max(1, round(len(x) * new_rate / rate)))


def voiced_span(x: np.ndarray, floor_db: float = VOICED_FLOOR_DB) -> tuple[int, int]:
    """``(start, stop)`` samples from the first to the last voiced 10 ms frame of ``x``.

    espeak-ng pads a word with silence; labels must mark only the sound as the word.
    ``(0, 0)`` for a silent signal.
    """
    hop = SAMPLE_RATE // 100
    frames = len(x) // hop
    if frames == 0:
        return 0, 0
    energy = np.square(x[:frames * hop].astype(np.float64)).reshape(frames, hop).sum(axis=1)
    if energy.max() <= 0:
        return 0, 0
    voiced = np.flatnonzero(energy >= energy.max() * 10 ** (floor_db / 10))
    return int(voiced[0]) * hop, (int(voiced[-1]) + 1) * hop


@dataclass(frozen=True)
class Utterance:
    """A waveform and where its words are."""

    samples: np.ndarray
    """float32 ``[n]`` at :data:`SAMPLE_RATE`, noise included."""
    digits: tuple[int, ...]
    """The digits spoken, in order."""
    spans: tuple[tuple[int, int], ...]
    """Per word, its ``(start, stop)`` samples."""


def _seconds(rng: np.random.Generator, bounds: tuple[float, float]) -> int:
    return round(rng.uniform(*bounds) * SAMPLE_RATE)


def utterance(words: Sequence[np.ndarray], digits: Sequence[int],
              rng: np.random.Generator) -> Utterance:
    """The digit string ``digits`` spoken with the word waveforms ``words`` (digit d: words[d]).

    Args:
        words: One waveform per digit, each its voiced span only.
        digits: The digits to say, at least one.
        rng: The randomness of pauses, speed, gain and noise.
    """
    if len(digits) == 0:
        raise ValueError("an utterance needs at least one digit")
    pieces = [np.zeros(_seconds(rng, LEAD_S), np.float32)]
    spans, at = [], len(pieces[0])
    for i, digit in enumerate(digits):
        if i and rng.random() >= BACK_TO_BACK:
            pieces.append(np.zeros(_seconds(rng, GAP_S), np.float32))
            at += len(pieces[-1])
        word = words[digit]
        word = resample_to(word, max(1, round(len(word) / rng.uniform(*SPEED))))
        word *= np.float32(10 ** (rng.uniform(*GAIN_DB) / 20))
        pieces.append(word)
        spans.append((at, at + len(word)))
        at += len(word)
    pieces.append(np.zeros(_seconds(rng, LEAD_S), np.float32))
    samples = np.concatenate(pieces)
    speech_power = np.mean(np.concatenate([np.square(samples[a:b]) for a, b in spans]))
    noise_power = speech_power / 10 ** (rng.uniform(*SNR_DB) / 10)
    samples += rng.normal(0.0, np.sqrt(noise_power), len(samples)).astype(np.float32)
    return Utterance(samples=samples, digits=tuple(int(d) for d in digits), spans=tuple(spans))
