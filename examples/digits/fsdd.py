"""Build a speaker-disjoint fold of the Free Spoken Digit Dataset in hadpsgd's feature format.

usage: python examples/digits/fsdd.py RECORDINGS OUTDIR [--fold A|C|D]

Human speech: FSDD (CC BY-SA 4.0; https://github.com/Jakobovski/free-spoken-digit-dataset,
its ``recordings/`` directory: 6 speakers x 10 digits x 50 takes, 8 kHz 16-bit WAV, one
isolated digit each). The data stays out of this repository: fetch it, then point this at
its recordings. Each fold trains on 4 speakers (2,000 recordings) and holds out the 2 others
(1,000, never heard in training): A holds out theo and yweweler, C george and lucas, D
jackson and nicolas (docs/results.md, *BMUF on unseen human voices*).

Features: 25 ms Hamming windows every 10 ms, a 256-point FFT, 40 mel bands from 20 Hz to
4 kHz, log, deltas and delta-deltas over +-2 frames (120 dims), per-speaker mean and
variance normalisation. Labels: the word's span (where a 10 ms moving mean of |x| exceeds
5 % of its maximum) in three equal states, digit d = classes 3d..3d+2, silence around it =
class 30 (31 classes: the layout ``python -m hadpsgd.decode`` decodes). Every utterance id
ends with its digit (``theo-0-17-0``), where ``hadpsgd.decode`` takes its reference; a Kaldi
``text`` file is written beside each split. NumPy and the standard library only.

``--speed-perturb 0.9,1.0,1.1`` adds Kaldi's 3-way speed perturbation to the training split
(as ``utils/data/perturb_data_dir_speed_3way.sh``: ``sox speed``, tempo and pitch together):
each recording again resampled to ``1 / factor`` of its length and read at 8 kHz, its labels
taken from the perturbed signal, its id prefixed ``sp0.9-`` (Kaldi's prefix), and each
perturbed copy of a speaker normalised as a speaker of its own, as Kaldi's ``sp0.9-speaker``.
The held-out split is never perturbed. Three times the training frames: more steps at 16
workers (issue 46).
"""

from __future__ import annotations

import argparse
import json
import sys
import wave
from collections.abc import Sequence
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a file: make ``hadpsgd`` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.digits.audio import resample_to  # noqa: E402
from hadpsgd.exit_codes import EXIT_OK, EXIT_USER_ERROR  # noqa: E402

PROG = "examples/digits/fsdd.py"
SPEAKERS = ("george", "jackson", "lucas", "nicolas", "theo", "yweweler")
FOLDS: dict[str, tuple[str, str]] = {"A": ("theo", "yweweler"), "C": ("george", "lucas"),
                                     "D": ("jackson", "nicolas")}
"""Fold -> its two held-out speakers."""
RATE, WIN, HOP, NFFT, MELS = 8000, 200, 80, 256, 40
FEAT_DIM, NUM_CLASSES, SILENCE_CLASS = 3 * MELS, 31, 30


def mel_filters() -> np.ndarray:
    """``[MELS, NFFT // 2 + 1]`` triangular filters, equally spaced in mel, 20 Hz to 4 kHz."""
    def mel(f: np.ndarray) -> np.ndarray:
        return 1127.0 * np.log1p(f / 700.0)

    edges = np.linspace(mel(np.array(20.0)), mel(np.array(RATE / 2)), MELS + 2)
    bins = mel(np.arange(NFFT // 2 + 1) * RATE / NFFT)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    return np.maximum(0.0, np.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)))


def frames_of(x: np.ndarray) -> int:
    """Frames of ``len(x)`` samples (a short recording is padded to one frame)."""
    return 1 + max(0, len(x) - WIN) // HOP


def log_mel_deltas(x: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """``[frames, 120]``: log mel energies, their deltas and delta-deltas."""
    x = np.pad(x, (0, max(0, WIN - len(x))))
    n = frames_of(x)
    idx = np.arange(WIN)[None, :] + HOP * np.arange(n)[:, None]
    spec = np.abs(np.fft.rfft(x[idx] * np.hamming(WIN), NFFT)) ** 2
    logmel = np.log(spec @ filters.T + 1e-10)
    return np.concatenate([logmel, _deltas(logmel), _deltas(_deltas(logmel))], axis=1)


def _deltas(f: np.ndarray, width: int = 2) -> np.ndarray:
    """The regression deltas over +-``width`` frames (edges repeated)."""
    padded = np.pad(f, ((width, width), (0, 0)), mode="edge")
    num = sum(k * (padded[width + k:len(f) + width + k] - padded[width - k:len(f) + width - k])
              for k in range(1, width + 1))
    return num / (2 * sum(k * k for k in range(1, width + 1)))


def frame_labels(x: np.ndarray, digit: int) -> np.ndarray:
    """Silence, then the word's span in three equal states, then silence."""
    n = frames_of(x)
    env = np.convolve(np.abs(x), np.ones(HOP) / HOP, mode="same")
    loud = np.flatnonzero(env > 0.05 * env.max()) if env.max() > 0 else np.arange(len(x))
    centres = np.arange(n) * HOP + WIN // 2
    inside = np.flatnonzero((centres >= loud[0]) & (centres <= loud[-1]))
    labels = np.full(n, SILENCE_CLASS, dtype=np.int64)
    if len(inside) == 0:  # a word shorter than a frame: its nearest frame
        inside = np.array([min(n - 1, int((loud[0] + loud[-1]) // 2 // HOP))])
    for state, part in enumerate(np.array_split(inside, 3)):
        labels[part] = 3 * digit + state
    return labels


def read(path: Path) -> np.ndarray:
    """A 16-bit mono WAV's samples in [-1, 1)."""
    with wave.open(str(path)) as w:
        if w.getframerate() != RATE or w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError(f"{path}: expected 8 kHz 16-bit mono, got {w.getframerate()} Hz, "
                             f"{8 * w.getsampwidth()}-bit, {w.getnchannels()} channel(s)")
        data = w.readframes(w.getnframes())
    return np.frombuffer(data, dtype="<i2").astype(np.float64) / 32768.0


def speed(x: np.ndarray, factor: float) -> np.ndarray:
    """``x`` played ``factor`` times as fast (``sox speed``): ``1 / factor`` of its length."""
    if factor == 1.0:
        return x
    return resample_to(x, max(1, round(len(x) / factor))).astype(np.float64)


def _prefix(factor: float) -> str:
    """Kaldi's id prefix of a speed-perturbed copy (``sp0.9-``); none at 1.0."""
    return "" if factor == 1.0 else f"sp{factor:g}-"


def build_split(files: Sequence[Path], path: Path, split: str, fold: str,
                factors: Sequence[float] = (1.0,)) -> tuple[int, int]:
    """Features and labels of ``files`` into ``path`` (and its ``.text``); (utterances, frames).

    Each of ``factors`` other than 1.0 adds a speed-perturbed copy of every recording
    (:func:`speed`), normalised as a speaker of its own.
    """
    from hadpsgd.data.writer import FeatureWriter

    filters = mel_filters()
    by_speaker: dict[str, list[Path]] = {}
    for f in files:
        by_speaker.setdefault(f.stem.split("_")[1], []).append(f)
    text, frames = [], 0
    groups = [(factor, speaker) for factor in factors for speaker in sorted(by_speaker)]
    with FeatureWriter(path, FEAT_DIM, NUM_CLASSES, silence_classes=(SILENCE_CLASS,)) as out:
        for factor, speaker in groups:
            ids, feats, labels = [], [], []
            for f in sorted(by_speaker[speaker]):
                digit, _, take = f.stem.split("_")
                x = speed(read(f), factor)
                ids.append(f"{_prefix(factor)}{speaker}-{take}-{digit}")
                feats.append(log_mel_deltas(x, filters))
                labels.append(frame_labels(x, int(digit)))
                text.append(f"{ids[-1]} {digit}")
            stacked = np.concatenate(feats)
            mean, std = stacked.mean(0), stacked.std(0) + 1e-5  # per-speaker normalisation
            for utt_id, feat, lab in zip(ids, feats, labels, strict=True):
                out.append(utt_id, ((feat - mean) / std).astype(np.float32), lab)
                frames += len(feat)
        out.commit(attrs={"source": json.dumps({"builder": PROG, "set": "FSDD", "fold": fold,
                                                "split": split, "speed_perturb": list(factors),
                                                "speakers": sorted(by_speaker)})})
    path.with_suffix(".text").write_text("\n".join(text) + "\n", encoding="utf-8")
    return len(text), frames


def main(argv: Sequence[str] | None = None) -> int:
    """Build OUTDIR/train.h5 and OUTDIR/heldout.h5 of one fold."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("recordings", type=Path, help="FSDD's recordings/ directory")
    p.add_argument("outdir", type=Path, help="where train.h5 and heldout.h5 go (made if missing)")
    p.add_argument("--fold", choices=sorted(FOLDS), default="A",
                   help="which two speakers are held out (default A: theo and yweweler)")
    p.add_argument("--speed-perturb", default="1.0", metavar="F,F,...",
                   help="speed factors of the training split, e.g. 0.9,1.0,1.1 (Kaldi's 3-way "
                        "perturbation); default 1.0, none")
    a = p.parse_args(argv)
    try:
        factors = tuple(float(f) for f in a.speed_perturb.split(","))
    except ValueError:
        factors = ()
    if not factors or not all(0.5 <= f <= 2.0 for f in factors) or len(set(factors)) < len(
            factors):
        print(f"{PROG}: error: --speed-perturb {a.speed_perturb!r}: give distinct factors "
              "between 0.5 and 2, comma-separated, e.g. 0.9,1.0,1.1", file=sys.stderr)
        return EXIT_USER_ERROR
    files = sorted(a.recordings.glob("*_*_*.wav"))
    if not files:
        print(f"{PROG}: error: no FSDD recordings (DIGIT_SPEAKER_TAKE.wav) in {a.recordings}; "
              "point it at the recordings/ directory of a checkout of "
              "https://github.com/Jakobovski/free-spoken-digit-dataset", file=sys.stderr)
        return EXIT_USER_ERROR
    held = FOLDS[a.fold]
    a.outdir.mkdir(parents=True, exist_ok=True)
    for split, chosen in (("train", [f for f in files if f.stem.split("_")[1] not in held]),
                          ("heldout", [f for f in files if f.stem.split("_")[1] in held])):
        utts, frames = build_split(chosen, a.outdir / f"{split}.h5", split, a.fold,
                                   factors if split == "train" else (1.0,))
        print(f"{PROG}: {split}: {utts} utterances, {frames} frames -> {a.outdir}/{split}.h5")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
