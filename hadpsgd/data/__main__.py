"""``python -m hadpsgd.data info FILE ...``: what a feature file holds, checked.

For each file: utterances, frames, feature dimension, classes, the label histogram (and the
classes no frame carries), the frames per utterance, the normalisation statistics, and how
many ``--chunk-len`` chunks training cuts from it, and the class priors a decoder divides by
(:mod:`hadpsgd.data.priors`: add-one smoothed; the text shows the most and least probable
classes, ``--json`` the whole vector), whether its ``validated`` stamp vouches for it, and
its import record (:mod:`hadpsgd.data.pipeline`: the Kaldi sources, the CMVN, the norm/
statistics and where the class count came from), which the forward pass redoes on raw
features.
Opening the file validates it as training does (structure, every label in range, the stamp's
fingerprint), and a file that fails exits 2 with the problem named; ``--json`` prints one
JSON object per file instead.

``python -m hadpsgd.data validate FILE ...`` checks every label and frame of a file, whatever
its stamp says, and stamps it anew: what a file changed in place needs before training
trusts it again (:func:`hadpsgd.data.validate.validate_file`).

``python -m hadpsgd.data mark-silence FILE CLASS ...`` records which classes are silence in a
file written by another tool (its ``silence_classes`` attribute), so that held-out evaluation
reports the accuracy on speech frames beside frame accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from hadpsgd.data._schema import VALIDATE_COMMAND
from hadpsgd.data.loader import ChunkDataset
from hadpsgd.data.pipeline import CmvnRecord, read_record
from hadpsgd.data.priors import SMOOTHING, count_file_labels, smooth
from hadpsgd.data.reader import FeatureFile, FeatureFileError
from hadpsgd.data.validate import validate_file
from hadpsgd.data.writer import mark_silence

_SHOWN = 10  # classes listed by count, most and least frequent
_SHOWN_PRIORS = 5  # classes listed by prior, most and least probable


def describe(path: str, chunk_len: int = 21) -> dict[str, Any]:
    """The summary of one feature file (see the module docstring).

    Raises:
        FeatureFileError: If the file is missing or malformed, naming the problem.
    """
    dataset = ChunkDataset(path, chunk_len)  # opening validates, as for training
    with dataset.file as ff:
        # Labels only, a block at a time: the features of a real corpus do not fit in memory.
        counts = count_file_labels(ff)
        lengths = np.diff(ff.offsets)
        order = np.argsort(-counts, kind="stable")
        out: dict[str, Any] = {
            "file": str(path), "utterances": ff.num_utts, "frames": ff.num_frames,
            "feat_dim": ff.feat_dim, "num_classes": ff.num_classes,
            "frames_per_utterance": {"min": int(lengths.min()), "median": float(
                np.median(lengths)), "max": int(lengths.max())},
            "chunks": len(dataset), "chunk_len": chunk_len,
            "classes_without_frames": [int(c) for c in np.flatnonzero(counts == 0)],
            "most_frequent": [[int(c), int(counts[c])] for c in order[:_SHOWN]],
            "least_frequent": [[int(c), int(counts[c])] for c in order[::-1][:_SHOWN]
                               if counts[c] > 0],
            "normalisation": None,
            "silence_classes": list(ff.silence_classes),
            # "matches": training skips the frame scan; a stamp that no longer matches the
            # data was refused when the file opened.
            "stamp": "matches" if ff.stamped else "older" if ff.old_stamp else "none",
            "silence_fraction": (float(counts[list(ff.silence_classes)].sum() / counts.sum())
                                 if ff.silence_classes else None),
        }
        priors = smooth(counts)
        out["priors"] = {
            "smoothing": SMOOTHING,
            "most_probable": [[int(c), float(priors[c])] for c in order[:_SHOWN_PRIORS]],
            "least_probable": [[int(c), float(priors[c])] for c in order[::-1][:_SHOWN_PRIORS]],
            "vector": priors.tolist()}
        if ff.norm_mean is not None and ff.norm_std is not None:
            out["normalisation"] = {
                "mean_range": [float(ff.norm_mean.min()), float(ff.norm_mean.max())],
                "std_range": [float(ff.norm_std.min()), float(ff.norm_std.max())]}
    record = read_record(path)  # after the file closed: h5py opens it again, read-only
    out["import"] = asdict(record) if record is not None else None
    return out


def _import_lines(record: dict[str, Any] | None) -> list[str]:
    """The import record in the text summary: sources, CMVN, norm/, the class count's source."""
    if record is None:
        return ["  import: no record (not written by python -m hadpsgd.data.kaldi): the "
                "features are taken as stored"]
    cmvn = record["cmvn"]
    cmvn_text = "none" if cmvn is None else CmvnRecord(**cmvn).describe() + (
        f", utt2spk {cmvn['utt2spk']}" if cmvn.get("utt2spk") else "")
    return [f"  import: {record['tool']} from {record['features']}, alignments "
            f"{record['alignments']}",
            f"    CMVN: {cmvn_text}; norm/: {record['norm']}",
            f"    classes: {record['num_classes']}, from {record['classes_from']}"]


def _text(info: dict[str, Any]) -> str:
    lines = [f"{info['file']}: {info['utterances']} utterances, {info['frames']} frames, "
             f"feat_dim {info['feat_dim']}, {info['num_classes']} classes"]
    fpu = info["frames_per_utterance"]
    lines.append(f"  frames per utterance: min {fpu['min']}, median {fpu['median']:g}, "
                 f"max {fpu['max']}; {info['chunks']} training chunks of {info['chunk_len']} "
                 "(the tails included)")
    top = ", ".join(f"{c}: {n}" for c, n in info["most_frequent"])
    lines.append(f"  labels, most frequent (class: frames): {top}")
    low = ", ".join(f"{c}: {n}" for c, n in info["least_frequent"])
    lines.append(f"  labels, least frequent: {low}")
    sil = info["silence_classes"]
    lines.append(f"  silence classes: {', '.join(map(str, sil))} ({info['silence_fraction']:.1%} "
                 "of the frames; evaluation reports speech-frame accuracy apart)" if sil else
                 "  silence classes: none named (python -m hadpsgd.data mark-silence FILE "
                 "CLASS... names them)")
    empty = info["classes_without_frames"]
    lines.append(f"  classes without frames: {len(empty)}"
                 + (f" ({', '.join(map(str, empty[:20]))}{' ...' if len(empty) > 20 else ''})"
                    if empty else ""))
    pri = info["priors"]
    lines.append("  priors (add-one smoothed), most probable: "
                 + ", ".join(f"{c}: {p:.4g}" for c, p in pri["most_probable"])
                 + "; least probable: "
                 + ", ".join(f"{c}: {p:.4g}" for c, p in pri["least_probable"]))
    lines.append({
        "matches": "  validated stamp: matches the data (training skips the frame scan)",
        "older": "  validated stamp: an older hadpsgd's, without a fingerprint: training scans "
                 f"every frame at start ({VALIDATE_COMMAND} FILE stamps it anew)",
        "none": "  validated stamp: none: training scans every frame at start "
                f"({VALIDATE_COMMAND} FILE checks and stamps it)"}[info["stamp"]])
    norm = info["normalisation"]
    lines.append("  normalisation: none (features are used as stored)" if norm is None else
                 f"  normalisation: mean in [{norm['mean_range'][0]:.4g}, "
                 f"{norm['mean_range'][1]:.4g}], std in [{norm['std_range'][0]:.4g}, "
                 f"{norm['std_range'][1]:.4g}] (applied on read)")
    lines += _import_lines(info["import"])
    return "\n".join(lines)


def _chunk_len(text: str) -> int:
    """``info --chunk-len``: a whole number >= 1 (argparse names the flag otherwise)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Command line; returns the exit code (2 for a missing or malformed file)."""
    parser = argparse.ArgumentParser(prog="python -m hadpsgd.data", allow_abbrev=False,
                                     description="Inspect and validate hadpsgd HDF5 "
                                                 "feature files.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="utterances, frames, classes, label histogram, "
                                       "normalisation of each file")
    info.add_argument("files", nargs="+", metavar="FILE")
    info.add_argument("--chunk-len", type=_chunk_len, default=21,
                      help="training chunk length to count chunks for (default 21)")
    info.add_argument("--json", action="store_true", help="one JSON object per file")
    check = sub.add_parser("validate", help="check every frame and label of each file, its "
                                            "stamp ignored, and stamp it anew (after a change)")
    check.add_argument("files", nargs="+", metavar="FILE")
    mark = sub.add_parser("mark-silence", help="record which classes of a feature file are "
                                               "silence (its silence_classes attribute)")
    mark.add_argument("file", metavar="FILE")
    mark.add_argument("classes", nargs="*", type=int, metavar="CLASS",
                      help="class ids of silence (none: remove the attribute)")
    args = parser.parse_args(argv)
    if args.command == "mark-silence":
        return _mark(args.file, args.classes)
    if args.command == "validate":
        return _validate(args.files)
    status = 0
    for path in args.files:
        try:
            summary = describe(path, args.chunk_len)
        except FeatureFileError as err:
            print(f"hadpsgd.data: error: {err}", file=sys.stderr)
            status = 2
            continue
        print(json.dumps(summary) if args.json else _text(summary))
    return status


def _validate(paths: list[str]) -> int:
    """``validate``: every file checked in full and stamped; 2 if any fails."""
    status = 0
    for path in paths:
        try:
            ff, _ = validate_file(path)
        except FeatureFileError as err:
            print(f"hadpsgd.data: error: {err}", file=sys.stderr)
            status = 2
            continue
        print(f"{path}: valid: {ff.num_utts} utterances, {ff.num_frames} frames, every frame "
              f"finite, every label in [0, {ff.num_classes}); stamped (training trusts it)")
    return status


def _mark(path: str, classes: list[int]) -> int:
    """``mark-silence``: stamp the attribute after the file opened as training would."""
    try:
        FeatureFile(path).close()
        recorded = mark_silence(path, classes)
    except (FeatureFileError, ValueError, OSError) as err:
        print(f"hadpsgd.data: error: {path}: {err}", file=sys.stderr)
        return 2
    print(f"{path}: silence classes {', '.join(map(str, recorded)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
