"""Check forced alignments against the audio: word boundaries against frame energy.

usage: python examples/speechocean/check_align.py CORPUS OUTDIR [--sample 200] [--seed 0]

pocketsphinx's en-us model is a native adult model; the corpus is non-native speech, half of
it children's. Before trusting its labels, this compares a sample of the alignments in
``OUTDIR/align.jsonl`` with an energy detector run on the same 25 ms / 10 ms frames:

- the detector: a frame is loud when its log energy is above the utterance's floor (10th
  percentile) by a quarter of the floor-to-peak (95th percentile) range, at least 6 dB;
  speech starts at the first run of 5 loud frames and ends at the last;
- onset and offset: the first word's start and the last word's end against the detector's,
  in ms (positive: the alignment is later);
- agreement: the share of frames on which "inside a word" and "loud" agree;
- the energy of frames aligned as silence against those aligned as speech (dB);
- suspects: an onset or offset more than 200 ms off, a word squeezed to one frame per HMM
  state (the aligner's shortest path: often a word not said), or a word over 1.5 s.

Also: failures, seconds per utterance, distinct tied states (senones), phones, silence share
over all cached alignments. Prints a JSON report; ``--worst N`` lists the N worst utterances.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a file: make ``examples.speechocean`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.speechocean.align import Alignment, AlignmentCache, word_spans  # noqa: E402
from examples.speechocean.corpus import (  # noqa: E402
    SPLITS,
    corpus_root,
    read_split,
    read_wav,
)

FRAME, SHIFT = 400, 160
MIN_RUN = 5
FAR_MS = 200


def log_energy(samples: np.ndarray) -> np.ndarray:
    """``[frames]`` log energy (dB) of 25 ms frames every 10 ms (Kaldi's framing)."""
    count = 0 if len(samples) < FRAME else 1 + (len(samples) - FRAME) // SHIFT
    idx = np.arange(FRAME)[None, :] + SHIFT * np.arange(count)[:, None]
    frames = samples[idx].astype(np.float64)
    return 10 * np.log10(np.mean(frames ** 2, axis=1) + 1e-3)


def loud_span(energy: np.ndarray) -> tuple[np.ndarray, int, int]:
    """The detector: ``(loud [frames] bool, first speech frame, end frame)``."""
    floor, peak = np.percentile(energy, 10), np.percentile(energy, 95)
    loud = energy > floor + max(6.0, 0.25 * (peak - floor))
    runs = np.convolve(loud.astype(int), np.ones(MIN_RUN, int), "valid") == MIN_RUN
    starts = np.flatnonzero(runs)
    if not len(starts):
        return loud, 0, len(energy)
    return loud, int(starts[0]), int(starts[-1] + MIN_RUN)


def check_one(ali: Alignment, samples: np.ndarray) -> dict[str, object]:
    """One utterance's measures (see the module docstring)."""
    energy = log_energy(samples)
    loud, first, end = loud_span(energy)
    spans = word_spans(ali)
    inside = np.zeros(len(energy), bool)
    for _, s, e in spans:
        inside[s:e] = True
    squeezed = []
    for word, s, e in spans:
        states = sum(1 for _p, _k, _n, st, _ln in ali.states if s <= st < e)
        if e - s <= states:
            squeezed.append(word)
    long_words = [w for w, s, e in spans if e - s > 150]
    silence = energy[~inside].mean() if (~inside).any() else float("nan")
    speech = energy[inside].mean() if inside.any() else float("nan")
    return {"utt": ali.utt_id,
            "onset_ms": 10 * (spans[0][1] - first) if spans else None,
            "offset_ms": 10 * (spans[-1][2] - end) if spans else None,
            "agreement": float(np.mean(inside == loud)),
            "speech_minus_silence_db": float(speech - silence),
            "squeezed": squeezed, "long": long_words}


def summarise(rows: list[dict[str, object]]) -> dict[str, object]:
    """Medians, percentiles and counts over the checked utterances."""
    def stats(key: str) -> dict[str, float]:
        values = np.array([r[key] for r in rows if r[key] is not None], float)
        mag = np.abs(values)
        return {"median": float(np.median(values)), "median_abs": float(np.median(mag)),
                "p90_abs": float(np.percentile(mag, 90)),
                f"over_{FAR_MS}ms": int((mag > FAR_MS).sum())}

    return {"checked": len(rows), "onset_ms": stats("onset_ms"),
            "offset_ms": stats("offset_ms"),
            "agreement_median": float(np.median([r["agreement"] for r in rows])),
            "speech_minus_silence_db_median": float(np.median(
                [r["speech_minus_silence_db"] for r in rows])),
            "utts_with_squeezed_word": sum(1 for r in rows if r["squeezed"]),
            "squeezed_words": sum(len(r["squeezed"]) for r in rows),
            "utts_with_long_word": sum(1 for r in rows if r["long"])}


def cache_stats(cache: AlignmentCache) -> dict[str, object]:
    """Failures, time, senones, phones and silence share over every cached alignment."""
    good = [a for a in cache.items.values() if a.error is None]
    senones = {s[2] for a in good for s in a.states}
    phone_frames: Counter[str] = Counter()
    for a in good:
        for phone, _k, _n, _start, length in a.states:
            phone_frames[phone] += length
    total = sum(phone_frames.values())
    return {"alignments": len(cache.items), "failed": len(cache.items) - len(good),
            "seconds_per_utt": float(np.mean([a.seconds for a in cache.items.values()])),
            "senones": len(senones), "phones": len(phone_frames),
            "silence_share": phone_frames["SIL"] / max(1, total)}


def main(argv: list[str] | None = None) -> int:
    """Check a sample; print the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("corpus", type=Path)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--sample", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worst", type=int, default=10)
    args = parser.parse_args(argv)
    root = corpus_root(args.corpus, args.outdir)
    cache = AlignmentCache(args.outdir / "align.jsonl")
    utts = {u.utt_id: u for split in SPLITS for u in read_split(root, split)}
    ids = sorted(k for k, a in cache.items.items() if a.error is None and k in utts)
    rng = np.random.default_rng(args.seed)
    picked = sorted(rng.choice(ids, size=min(args.sample, len(ids)), replace=False).tolist())
    rows = []
    for utt_id in picked:
        samples = np.frombuffer(read_wav(utts[utt_id].wav), dtype="<i2")
        rows.append(check_one(cache.items[utt_id], samples))
    worst = sorted(rows, key=lambda r: -max(abs(r["onset_ms"] or 0), abs(r["offset_ms"] or 0)))
    report = {"cache": cache_stats(cache), "sample": summarise(rows),
              "worst": worst[:args.worst]}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
