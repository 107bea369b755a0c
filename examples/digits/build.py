"""Build the connected-digit set: real speech from espeak-ng, in hadpsgd's feature format.

usage: python examples/digits/build.py OUTDIR [--train-speakers 32] [--heldout-speakers 12]
           [--utts-per-speaker 40] [--heldout-utts-per-speaker N] [--seed 0]

Strings of 2-5 digits spoken by synthetic speakers (espeak-ng voice x variant x rate x
pitch; the held-out speakers' voices and variants are never heard in training), with pauses,
per-word speed and gain, and noise at 5-25 dB SNR. Features: 40 log-mel + deltas +
delta-deltas (120 dims), 25 ms / 10 ms frames at 16 kHz, per-speaker mean and variance
normalisation (kaldi-native-fbank). Labels: each word's frames in three equal states, digit
d = classes 3d..3d+2, silence = class 30 (31 classes), the layout ``python -m hadpsgd.decode``
decodes. Writes OUTDIR/train.h5 and OUTDIR/heldout.h5 (hadpsgd's writer), and beside each a
Kaldi ``text`` file of its transcripts (train.text, heldout.text); every utterance id ends
with its digits (``ho003-en-gb-x-gbclan+f3-012-4821``), which is where ``hadpsgd.decode``
takes its references by default.

Needs the espeak-ng program (Debian/Ubuntu: ``apt-get install espeak-ng``) and
kaldi-native-fbank (``pip install 'hadpsgd[examples]'``). Exit status 0, or 2 when either is
missing or an option is wrong, with one line saying what to do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a file: make ``examples.digits`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hadpsgd.exit_codes import EXIT_OK, EXIT_USER_ERROR  # noqa: E402

PROG = "examples/digits/build.py"
MIN_DIGITS, MAX_DIGITS = 2, 5
"""Words per utterance."""
SPLITS = ("train", "heldout")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("outdir", type=Path, help="where train.h5 and heldout.h5 go (made if "
                                                  "missing)")
    parser.add_argument("--train-speakers", type=_count, default=32,
                        help="synthetic training speakers (default 32)")
    parser.add_argument("--heldout-speakers", type=_count, default=12,
                        help="held-out speakers, of voices and variants unseen in training "
                             "(default 12)")
    parser.add_argument("--utts-per-speaker", type=_count, default=40,
                        help="utterances per training speaker (default 40)")
    parser.add_argument("--heldout-utts-per-speaker", type=_count, default=None,
                        help="utterances per held-out speaker (default: half of "
                             "--utts-per-speaker)")
    parser.add_argument("--seed", type=int, default=0, help="the randomness (default 0)")
    return parser


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


def build_split(split: str, path: Path, speakers: int, utts: int, seed: int,
                espeak: str) -> tuple[int, int, int]:
    """Synthesise one split and write it; returns (utterances, frames, words)."""
    from examples.digits import voices
    from examples.digits.audio import utterance
    from examples.digits.features import (
        FEAT_DIM,
        NUM_CLASSES,
        SILENCE_CLASS,
        frame_labels,
        log_mel_deltas,
        speaker_cmvn,
    )
    from hadpsgd.data.writer import FeatureWriter

    index = SPLITS.index(split)
    pool = ((voices.TRAIN_VOICES, voices.TRAIN_VARIANTS) if split == "train"
            else (voices.HELDOUT_VOICES, voices.HELDOUT_VARIANTS))
    plan = voices.plan_speakers("tr" if split == "train" else "ho", speakers, *pool,
                                np.random.default_rng([seed, index]))
    text, frames, words = [], 0, 0
    with FeatureWriter(path, FEAT_DIM, NUM_CLASSES, silence_classes=(SILENCE_CLASS,)) as out:
        for number, speaker in enumerate(plan):
            # One generator per speaker: a speaker's audio does not depend on the others.
            rng = np.random.default_rng([seed, index, number])
            said = voices.speaker_words(espeak, speaker)
            ids, feats, labels = [], [], []
            for u in range(utts):
                digits = rng.integers(0, 10, int(rng.integers(MIN_DIGITS, MAX_DIGITS + 1)))
                utt = utterance(said, digits, rng)
                ids.append(f"{speaker.name}-{u:03d}-{''.join(map(str, utt.digits))}")
                feats.append(log_mel_deltas(utt.samples))
                labels.append(frame_labels(utt, len(feats[-1])))
                text.append(f"{ids[-1]} {' '.join(map(str, utt.digits))}")
                words += len(utt.digits)
            for utt_id, f, lab in zip(ids, speaker_cmvn(feats), labels, strict=True):
                out.append(utt_id, f, lab)
                frames += len(f)
        out.commit(attrs={"source": json.dumps({
            "builder": PROG, "split": split, "seed": seed, "speakers": [
                {"name": s.name, "voice": s.voice, "variant": s.variant, "rate": s.rate,
                 "pitch": s.pitch} for s in plan]})})
    path.with_suffix(".text").write_text("\n".join(text) + "\n", encoding="utf-8")
    return len(text), frames, words


def main(argv: list[str] | None = None) -> int:
    """Parse, check the tools, build both splits; the exit status."""
    args = build_parser().parse_args(argv)
    from examples.digits.voices import EspeakMissingError, find_espeak

    try:
        espeak = find_espeak()
    except EspeakMissingError as err:
        return _fail(str(err))
    try:
        import kaldi_native_fbank  # noqa: F401
    except ImportError:
        return _fail("the features need kaldi-native-fbank: pip install 'hadpsgd[examples]' "
                     "(or pip install kaldi-native-fbank)")
    if args.outdir.exists() and not args.outdir.is_dir():
        return _fail(f"{args.outdir} exists and is not a directory; name a directory")
    args.outdir.mkdir(parents=True, exist_ok=True)
    heldout_utts = args.heldout_utts_per_speaker or max(1, args.utts_per_speaker // 2)
    sizes = {"train": (args.train_speakers, args.utts_per_speaker),
             "heldout": (args.heldout_speakers, heldout_utts)}
    for split in SPLITS:
        start = time.perf_counter()
        path = args.outdir / f"{split}.h5"
        try:
            utts, frames, words = build_split(split, path, *sizes[split], args.seed, espeak)
        except RuntimeError as err:  # espeak-ng failed, e.g. its English voices are missing
            return _fail(f"{err}; check the espeak-ng installation (espeak-ng --voices=en)")
        print(f"{path}: {sizes[split][0]} speakers, {utts} utterances, {words} words, "
              f"{frames} frames ({frames / 360000:.2f} h) in {time.perf_counter() - start:.1f} s",
              flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
