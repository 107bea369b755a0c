"""Features and the HDF5 sets: Kaldi's fbank + deltas, per-speaker CMVN, hadpsgd's writer.

The features are the digit sets' (:mod:`examples.digits.features`): 40 log-mel energies per
25 ms frame every 10 ms (``compute-fbank-feats --num-mel-bins=40 --dither=0``), deltas and
delta-deltas (``add-deltas``: 120 dims), then mean and variance normalisation with each
speaker's statistics (``apply-cmvn --norm-vars=true``), all through kaldi-native-fbank. The
labels are the phone-state classes of the forced alignment
(:func:`examples.speechocean.align.frame_labels`). An utterance whose alignment failed is left
out of the set, and counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import numpy as np

from examples.digits.features import FEAT_DIM, log_mel_deltas, speaker_cmvn
from examples.speechocean.align import Alignment, frame_labels
from examples.speechocean.corpus import Utterance, read_wav, write_text
from examples.speechocean.phones import NUM_CLASSES, SILENCE_CLASSES


@dataclass
class SplitSummary:
    """What :func:`write_split` wrote.

    Attributes:
        utts: Utterances written.
        frames: Frames written.
        speakers: Speakers written.
        failed: Utterances left out because their alignment failed.
        frame_gap: Most frames by which pocketsphinx's count exceeded the features' (or fell
            short: negative).
        silence: Share of the frames labelled silence.
    """

    utts: int = 0
    frames: int = 0
    speakers: int = 0
    failed: int = 0
    frame_gap: int = 0
    silence: float = 0.0


def features(wav: Path) -> np.ndarray:
    """``[frames, 120]`` float32 log-mel + deltas + delta-deltas of a 16 kHz WAV (no CMVN)."""
    samples = np.frombuffer(read_wav(wav), dtype="<i2").astype(np.float32) / 32768.0
    return log_mel_deltas(samples)


def write_split(path: Path, utts: Sequence[Utterance], alignments: dict[str, Alignment],
                source: dict[str, object],
                progress: Callable[[int, int], None] | None = None) -> SplitSummary:
    """Write one split's HDF5 file and, beside it, its Kaldi ``text`` (``NAME.text``).

    Args:
        path: The ``.h5`` file (replaced when complete).
        utts: The split's utterances.
        alignments: Their alignments (by utterance id).
        source: Recorded in the file's ``source`` attribute (JSON).
        progress: Called with (utterances done, utterances) after each speaker.
    """
    from hadpsgd.data.writer import FeatureWriter

    summary = SplitSummary()
    kept: list[Utterance] = []
    silence = 0
    ordered = sorted(utts, key=lambda u: (u.speaker, u.utt_id))
    with FeatureWriter(path, FEAT_DIM, NUM_CLASSES, silence_classes=SILENCE_CLASSES) as out:
        for _speaker, group in groupby(ordered, key=lambda u: u.speaker):
            mine = [u for u in group if alignments[u.utt_id].error is None]
            if not mine:
                continue
            feats = [features(u.wav) for u in mine]
            for utt, normed in zip(mine, speaker_cmvn(feats), strict=True):
                ali = alignments[utt.utt_id]
                gap = ali.frames - len(normed)
                if abs(gap) > abs(summary.frame_gap):
                    summary.frame_gap = gap
                labels = frame_labels(ali, len(normed))
                silence += int(np.isin(labels, SILENCE_CLASSES).sum())
                out.append(utt.utt_id, normed, labels)
                summary.frames += len(normed)
                kept.append(utt)
            summary.speakers += 1
            if progress:
                progress(len(kept), len(ordered))
        out.commit(attrs={"source": json.dumps(source)})
    summary.utts = len(kept)
    summary.failed = len(ordered) - len(kept)
    summary.silence = silence / max(1, summary.frames)
    write_text(kept, path.with_suffix(".text"))
    return summary
