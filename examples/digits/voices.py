"""espeak-ng as the digit set's speakers: who speaks, and each speaker's ten words.

A synthetic speaker is an espeak-ng voice (an English accent) with a variant (a voice
quality: ``m1``..``m5``, ``f1``..``f4``), a speaking rate and a pitch. The held-out speakers
use accents *and* variants that no training speaker has, so the held-out set measures
speaker-independent recognition, not memory of the training voices.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from examples.digits.audio import SAMPLE_RATE, resample, voiced_span

ESPEAK = "espeak-ng"
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
"""The spoken word of digit d is ``WORDS[d]``."""

# espeak-ng's own (formant) English voices; the mbrola ones ("mb/...") need another program.
TRAIN_VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-us-nyc")
HELDOUT_VOICES = ("en-gb-x-gbclan", "en-gb-x-gbcwmd")
TRAIN_VARIANTS = ("m1", "m2", "m3", "m4", "f1", "f2")
HELDOUT_VARIANTS = ("m5", "f3", "f4")
RATES_WPM = (125, 195)
"""Range of the speaking rate (espeak-ng ``-s``, words per minute; its default is 175)."""
PITCHES = (25, 75)
"""Range of the base pitch (espeak-ng ``-p``, 0..99; its default is 50)."""

INSTALL_HINT = ("the digit set is synthesised with the espeak-ng program, which was not found "
                "on PATH; install it from your system's packages (Debian/Ubuntu: "
                "apt-get install espeak-ng; Fedora: dnf install espeak-ng; macOS: brew install "
                "espeak-ng) and run again")


class EspeakMissingError(RuntimeError):
    """The espeak-ng program is not installed; the message says how to install it."""


def find_espeak() -> str:
    """The path of the espeak-ng program.

    Raises:
        EspeakMissingError: If it is not on ``PATH``.
    """
    path = shutil.which(ESPEAK)
    if path is None:
        raise EspeakMissingError(INSTALL_HINT)
    return path


@dataclass(frozen=True)
class Speaker:
    """One synthetic speaker."""

    name: str
    """Its id, the prefix of its utterance ids (``tr007-en-gb+m3``)."""
    voice: str
    """espeak-ng voice (language and accent)."""
    variant: str
    """espeak-ng voice variant (voice quality)."""
    rate: int
    """Speaking rate in words per minute."""
    pitch: int
    """Base pitch, 0..99."""


def plan_speakers(prefix: str, count: int, voices: Sequence[str], variants: Sequence[str],
                  rng: np.random.Generator) -> list[Speaker]:
    """``count`` speakers over the grid of ``voices`` x ``variants``, each with its rate and pitch.

    The grid is visited in a random order and again from the start when ``count`` exceeds it,
    so the speakers spread over every accent and voice quality; a combination met twice
    differs in rate and pitch.
    """
    grid = [(v, q) for v in voices for q in variants]
    order = rng.permutation(len(grid))
    speakers = []
    for i in range(count):
        voice, variant = grid[order[i % len(grid)]]
        speakers.append(Speaker(
            name=f"{prefix}{i:03d}-{voice}+{variant}", voice=voice, variant=variant,
            rate=int(rng.integers(RATES_WPM[0], RATES_WPM[1] + 1)),
            pitch=int(rng.integers(PITCHES[0], PITCHES[1] + 1))))
    return speakers


def _read_wav(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise RuntimeError(f"{ESPEAK} wrote {w.getnchannels()} channel(s) of "
                               f"{8 * w.getsampwidth()}-bit samples; expected 16-bit mono")
        data = w.readframes(w.getnframes())
        rate = w.getframerate()
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0, rate


def synthesize(espeak: str, speaker: Speaker, text: str, workdir: Path) -> np.ndarray:
    """``text`` spoken by ``speaker``: float samples in [-1, 1] at :data:`SAMPLE_RATE`.

    Raises:
        RuntimeError: If espeak-ng fails (e.g. the voice is not installed), with its message.
    """
    out = workdir / "say.wav"  # one word at a time per directory
    cmd = [espeak, "-v", f"{speaker.voice}+{speaker.variant}", "-s", str(speaker.rate),
           "-p", str(speaker.pitch), "-w", str(out), text]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): "
                           f"{done.stderr.strip() or 'no output file'}")
    samples, rate = _read_wav(out)
    out.unlink()
    return resample(samples, rate, SAMPLE_RATE)


def speaker_words(espeak: str, speaker: Speaker) -> list[np.ndarray]:
    """The ten digit words as ``speaker`` says them, each cut to its voiced span (16 kHz).

    Each word is synthesised alone, so its boundaries are known exactly; an utterance is
    then put together from them (:func:`examples.digits.audio.utterance`).

    Raises:
        RuntimeError: If espeak-ng fails or a word comes out silent.
    """
    words = []
    with tempfile.TemporaryDirectory(prefix="digits-") as tmp:
        for word in WORDS:
            samples = synthesize(espeak, speaker, word, Path(tmp))
            start, stop = voiced_span(samples)
            if stop - start < SAMPLE_RATE // 20:
                raise RuntimeError(f"{ESPEAK} voice {speaker.voice}+{speaker.variant} said "
                                   f"{word!r} in under 50 ms of sound; is the voice installed?")
            words.append(samples[start:stop].copy())
    return words
