"""Decode frame log-likelihoods and score them (``python -m hadpsgd.decode``).

usage: python -m hadpsgd.decode LOGLIKES [--refs utt-id|none|FILE] [--acoustic-scale A]
           [--beam B] [--self-loop-prob P | --durations-from TRAIN.h5] [--word-penalty W]
           [--graph HCLG.fst --words words.txt] [--hyps OUT.txt|-] [--json OUT.json|-]
           [--overwrite]

Through the digit-loop graph of the digit set by default, or a user's graph (``--graph``,
input labels class id + 1: :mod:`hadpsgd.decode.user_graph`). The word penalty's default
follows the kind of scores the input records (the forward pass's ``kind``): 4 for
pseudo-log-likelihoods, 0 for log-posteriors (:data:`hadpsgd.decode.graph.DEFAULT_WORD_PENALTY`).
Prints Kaldi ``compute-wer``'s summary (%WER, %SER, sentences scored) on stdout and the decode
time on stderr. Exit status 0, or 2 for a user's error (a missing or malformed file, a bad
flag), with one line naming it and the fix. docs/decode.md has the graph and the measurements
behind the defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import import_module
from pathlib import Path
from typing import Any

from hadpsgd.exit_codes import EXIT_OK, EXIT_USER_ERROR

# The digit set (examples/digits/build.py): digit d is classes 3d..3d+2, silence is 30.
NUM_CLASSES, STATES_PER_WORD, SILENCE_CLASS = 31, 3, 30
FRAME_SHIFT_S = 0.010
"""Seconds per frame (10 ms), for the real-time factor."""
_PROG = "python -m hadpsgd.decode"
STDOUT = "-"
"""``--hyps`` / ``--json`` value that writes to stdout (as Kaldi's tools read ``-``)."""
# Import name and PyPI name of each package the decoder needs (the "decode" extra).
_NEEDED = (("kaldifst", "kaldifst"), ("kaldi_decoder", "kaldi-decoder"),
           ("kaldialign", "kaldialign"), ("kaldiio", "kaldiio"))


class UsageError(ValueError):
    """A file or value the user gave cannot be used; the message names it and the fix."""


def _number(text: str) -> float:
    """``text`` as a float, or argparse's error naming it."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _positive(text: str) -> float:
    value = _number(text)
    # Finite too: an infinite scale or beam makes every cost infinite or NaN, and the search
    # then ends nowhere while still exiting 0.
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be positive and finite, got {text}")
    return value


def _probability(text: str) -> float:
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {text}")
    return value


def _finite(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line (defaults: docs/decode.md, *Tuning*)."""
    from hadpsgd.decode.graph import DEFAULT_SELF_LOOP_PROB, DEFAULT_SILENCE_PROB
    from hadpsgd.decode.search import DEFAULT_ACOUSTIC_SCALE, DEFAULT_BEAM, DEFAULT_MAX_ACTIVE

    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Viterbi-decode per-utterance frame log-likelihoods through the "
                    "connected-digit loop (or a user's --graph) and report the word error "
                    "rate.")
    parser.add_argument("loglikes", metavar="LOGLIKES",
                        help="the matrices [frames, classes]: a Kaldi rspecifier (ark:FILE.ark, "
                             "scp:FILE.scp, ark,scp:A.ark,A.scp) or an HDF5 file (datasets "
                             "loglikes or feats, offsets, utt_ids)")
    parser.add_argument("--refs", default=None, metavar="utt-id|none|FILE",
                        help="references: 'utt-id' takes the digits an utterance id ends with "
                             "(...-4821 is 4 8 2 1), FILE is a Kaldi text file ('utt word "
                             "word ...'), 'none' decodes without scoring (default: utt-id, "
                             "none with --graph)")
    parser.add_argument("--acoustic-scale", type=_positive, default=DEFAULT_ACOUSTIC_SCALE,
                        metavar="A", help="factor on the log-likelihoods against the graph's "
                                          f"log-probabilities (default {DEFAULT_ACOUSTIC_SCALE})")
    parser.add_argument("--beam", type=_positive, default=DEFAULT_BEAM, metavar="B",
                        help="search beam in cost units (negative scaled log-probability; "
                             f"default {DEFAULT_BEAM:g})")
    parser.add_argument("--max-active", type=int, default=DEFAULT_MAX_ACTIVE, metavar="N",
                        help="the most active graph states kept per frame (default "
                             f"{DEFAULT_MAX_ACTIVE})")
    loops = parser.add_mutually_exclusive_group()
    loops.add_argument("--self-loop-prob", type=_probability, default=None, metavar="P",
                       help="every HMM state's self-loop probability (mean stay 1/(1-P) "
                            f"frames; default {DEFAULT_SELF_LOOP_PROB})")
    loops.add_argument("--durations-from", metavar="TRAIN.h5",
                       help="estimate each class's self-loop probability from the mean state "
                            "durations of this feature file's frame labels instead")
    parser.add_argument("--silence-prob", type=_probability, default=None, metavar="S",
                        help="probability of silence before the first and after each word "
                             f"(default {DEFAULT_SILENCE_PROB})")
    parser.add_argument("--word-penalty", type=_finite, default=None, metavar="W",
                        help="cost added per word (positive: fewer insertions, more "
                             "deletions; default 4 for pseudo-log-likelihoods, 0 for "
                             "log-posteriors or scores of unknown kind)")
    parser.add_argument("--graph", metavar="HCLG.fst",
                        help="decode through this FST instead of the digit loop: input labels "
                             "class id + 1 (0: epsilon), output labels word ids of --words "
                             "(docs/kaldi.md)")
    parser.add_argument("--words", metavar="words.txt",
                        help="the graph's word symbol table ('word id' per line); with --graph")
    parser.add_argument("--hyps", metavar="OUT.txt",
                        help="write the hypotheses here as a Kaldi text file ('-': stdout, "
                             "and the score summary goes to stderr)")
    parser.add_argument("--json", metavar="OUT.json",
                        help="write the settings, scores (per utterance too) and timing here "
                             "('-': stdout, and the score summary goes to stderr)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --hyps / --json (refused otherwise)")
    return parser


def _missing_packages() -> str | None:
    missing = []
    for module, package in _NEEDED:
        try:
            import_module(module)
        except ImportError:
            missing.append(package)
    if not missing:
        return None
    return (f"decoding needs {', '.join(missing)}: pip install 'hadpsgd[decode]' (or pip install "
            f"{' '.join(missing)})")


def _self_loop_probs(args: argparse.Namespace) -> Any:
    """``--self-loop-prob``, or per-class estimates from ``--durations-from``'s labels."""
    if args.durations_from is None:
        from hadpsgd.decode.graph import DEFAULT_SELF_LOOP_PROB

        return DEFAULT_SELF_LOOP_PROB if args.self_loop_prob is None else args.self_loop_prob
    import h5py
    import numpy as np

    from hadpsgd.decode.graph import estimate_self_loop_probs

    path = Path(args.durations_from)
    if not path.is_file() or not h5py.is_hdf5(path):
        raise UsageError(f"--durations-from {path}: not found or not HDF5; pass a feature file "
                         "with frame labels (e.g. the digit set's train.h5)")
    try:
        with h5py.File(path, "r") as h5:
            if "labels" not in h5 or "offsets" not in h5:
                raise UsageError(f"--durations-from {path} has no labels/offsets datasets; "
                                 "pass a feature file of hadpsgd's format")
            labels, offsets = np.asarray(h5["labels"][()]), np.asarray(h5["offsets"][()])
    except OSError as err:  # a damaged file behind a good signature
        raise UsageError(f"--durations-from {path} cannot be read ({err}); pass a feature file "
                         "with frame labels (e.g. the digit set's train.h5)") from None
    if labels.ndim != 1 or labels.dtype.kind not in "iu" or offsets.ndim != 1 \
            or offsets.dtype.kind not in "iu" or len(offsets) < 1 or offsets[0] != 0 \
            or offsets[-1] != len(labels) or (np.diff(offsets) < 0).any():
        raise UsageError(f"--durations-from {path}: labels must be one integer per frame and "
                         "offsets run from 0 to the frame count, non-decreasing (labels "
                         f"{labels.dtype}{list(labels.shape)}, offsets {offsets.dtype}"
                         f"{list(offsets.shape)}); pass a feature file of hadpsgd's format "
                         "(python -m hadpsgd.data validate FILE checks one)")
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise UsageError(f"--durations-from {path} has labels outside [0, {NUM_CLASSES}); "
                         "pass the digit set's training file")
    return estimate_self_loop_probs(labels, offsets, NUM_CLASSES)


@contextmanager
def _writing(path: str, what: str) -> Iterator[Path]:
    """A temporary name beside ``path`` to write to, renamed into place when the body ends.

    A decode killed while writing leaves the old file or none, never a half-written one
    under the final name; a failure to write becomes a :class:`UsageError` naming it.
    """
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, final)
    except OSError as exc:
        raise UsageError(f"cannot write {what} {path} ({exc.strerror}); pass a writable "
                         "path") from None
    finally:
        tmp.unlink(missing_ok=True)


def _user_graph(args: argparse.Namespace) -> Any:
    """The user's ``--graph`` (None: the digit loop), after refusing flags that do not fit."""
    if args.graph is None:
        if args.words is not None:
            raise UsageError("--words goes with --graph (the digit loop's words are 0..9); "
                             "drop it, or pass the graph")
        return None
    if args.words is None:
        raise UsageError(f"--graph {args.graph} needs --words words.txt, the word symbol "
                         "table its output labels index")
    digit_only = [flag for flag, value in (
        ("--self-loop-prob", args.self_loop_prob), ("--durations-from", args.durations_from),
        ("--silence-prob", args.silence_prob), ("--word-penalty", args.word_penalty))
        if value is not None]
    if digit_only:
        raise UsageError(f"{', '.join(digit_only)} shape the digit-loop graph; a --graph "
                         "carries its own transition, silence and word costs (build them into "
                         "it); drop them")
    from hadpsgd.decode.user_graph import load_graph

    return load_graph(args.graph, args.words)


def _settings_line(kind: str | None, kind_from: str, scale: float, penalty: float,
                   defaulted: bool, user: bool, prior_scale: float | None = None) -> str:
    """What the scores are and which scale and penalty they get, for stderr.

    The priors' exponent is named where the file records it, so that a decode of
    ``hadpsgd.forward --prior-scale 0.5`` output cannot pass for one of the default's.
    """
    what = kind or "kind unknown"
    if prior_scale is not None:
        what += f" at the priors' exponent {prior_scale:g}"
    line = f"scores: {what} ({kind_from}); acoustic scale {scale:g}"
    if user:
        return line
    line += f", word penalty {penalty:g}"
    if defaulted:
        line += (" (the default for this kind)" if kind else
                 " (pass --word-penalty 4 if these are pseudo-log-likelihoods)")
    return line


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from hadpsgd.decode.graph import DEFAULT_SILENCE_PROB, DEFAULT_WORD_PENALTY, build_graph
    from hadpsgd.decode.loglikes import LoglikesReader
    from hadpsgd.decode.search import Decoder
    from hadpsgd.decode.wer import (
        format_text,
        read_text,
        reference_from_utt_id,
        score,
        write_text,
    )

    if args.hyps == STDOUT and args.json == STDOUT:
        raise UsageError("--hyps - and --json - would both write to stdout; send one of "
                         "them to a file")
    for path, flag in ((args.hyps, "--hyps"), (args.json, "--json")):
        if path == STDOUT:
            continue
        # Found before decoding, not after it.
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"{flag} {path}: its directory does not exist; create it first")
        if path is not None and Path(path).exists() and not args.overwrite:
            raise UsageError(f"{flag} {path} already exists; pass --overwrite to replace it, "
                             "or write elsewhere")
    user = _user_graph(args)
    refs_mode = args.refs or ("none" if user is not None else "utt-id")
    refs = read_text(refs_mode) if refs_mode not in ("utt-id", "none") else {}
    reader = LoglikesReader(args.loglikes, None if user is not None else NUM_CLASSES)
    penalty = (args.word_penalty if args.word_penalty is not None
               else DEFAULT_WORD_PENALTY[reader.kind])
    silence_prob = DEFAULT_SILENCE_PROB if args.silence_prob is None else args.silence_prob
    decoder = None
    if user is None:
        graph = build_graph(NUM_CLASSES, STATES_PER_WORD, SILENCE_CLASS,
                            self_loop_prob=_self_loop_probs(args), silence_prob=silence_prob,
                            word_penalty=penalty)
        decoder = Decoder(graph, args.acoustic_scale, args.beam, args.max_active)
    elif reader.num_classes is not None:  # an HDF5 file: the graph is checked before decoding
        decoder = Decoder(user.fitted(reader.num_classes), args.acoustic_scale, args.beam,
                          args.max_active)
    print(_settings_line(reader.kind, reader.kind_from, args.acoustic_scale, penalty,
                         args.word_penalty is None, user is not None, reader.prior_scale),
          file=sys.stderr)
    hyps: dict[str, tuple[str, ...]] = {}
    not_final: list[str] = []
    frames, seconds = 0, 0.0
    bar = tqdm(total=len(reader) or None, unit="utt", file=sys.stderr, desc="decode",
               disable=not sys.stderr.isatty())
    with bar:
        for utt, matrix in reader:
            if utt in hyps:
                raise UsageError(f"utterance {utt!r} appears twice in {args.loglikes}; write "
                                 "each utterance once")
            if refs_mode == "utt-id":
                refs[utt] = reference_from_utt_id(utt)  # fails at the first id without digits
            if decoder is None:  # a Kaldi table: its first matrix tells the model's classes
                decoder = Decoder(user.fitted(matrix.shape[1]), args.acoustic_scale,
                                  args.beam, args.max_active)
            start = time.perf_counter()
            hyp = decoder.decode(matrix)
            seconds += time.perf_counter() - start
            hyps[utt], frames = hyp.words, frames + len(matrix)
            if not hyp.reached_final:
                not_final.append(utt)
            bar.update()
    if not hyps:
        raise UsageError(f"{args.loglikes} holds no utterance; check the forward pass's output")
    if args.hyps == STDOUT:
        sys.stdout.write(format_text(hyps))
        sys.stdout.flush()
    elif args.hyps:
        with _writing(args.hyps, "hypotheses") as tmp:
            write_text(tmp, hyps)
    result = score(refs, hyps) if refs_mode != "none" else None
    if result is not None:
        # stdout carries a file's contents when one of them is '-': keep it that file alone.
        to_stdout = STDOUT in (args.hyps, args.json)
        print(result.summary(), file=sys.stderr if to_stdout else sys.stdout)
    per_utt_ms = 1000.0 * seconds / len(hyps)
    rtf = seconds / (frames * FRAME_SHIFT_S) if frames else 0.0
    print(f"decoded {len(hyps)} utterances ({frames} frames) in {seconds:.2f} s: "
          f"{per_utt_ms:.2f} ms per utterance, real-time factor {rtf:.5f}", file=sys.stderr)
    if not_final:
        print(f"warning: {len(not_final)} utterance(s) reached no final state within the beam "
              f"(e.g. {not_final[0]}); their best partial path was used; try a larger --beam",
              file=sys.stderr)
    if args.json:
        digits = user is None
        report = {"loglikes": args.loglikes, "refs": refs_mode,
                  "kind": reader.kind, "kind_from": reader.kind_from,
                  "prior_scale": reader.prior_scale,
                  "settings": {"acoustic_scale": args.acoustic_scale, "beam": args.beam,
                               "max_active": args.max_active,
                               "graph": args.graph, "words": args.words,
                               "self_loop_prob": _self_loop_probs(args) if digits
                               and args.durations_from is None else None,
                               "durations_from": args.durations_from,
                               "silence_prob": silence_prob if digits else None,
                               "word_penalty": penalty if digits else None},
                  "utterances": len(hyps), "frames": frames, "decode_seconds": seconds,
                  "ms_per_utterance": per_utt_ms, "real_time_factor": rtf,
                  "not_final": not_final,
                  "score": result.to_dict() if result is not None else None}
        text = json.dumps(report, indent=1) + "\n"
        if args.json == STDOUT:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            with _writing(args.json, "report") as tmp:
                tmp.write_text(text, encoding="utf-8")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the decoder; returns the exit status (argparse exits 2 itself on a bad flag)."""
    missing = _missing_packages()
    if missing:
        print(f"{_PROG}: error: {missing}", file=sys.stderr)
        return EXIT_USER_ERROR
    args = build_parser().parse_args(argv)
    if args.max_active < 1:
        print(f"{_PROG}: error: --max-active must be at least 1, got {args.max_active}",
              file=sys.stderr)
        return EXIT_USER_ERROR
    from hadpsgd.decode.loglikes import LoglikesError
    from hadpsgd.decode.user_graph import GraphError
    from hadpsgd.decode.wer import ReferencesError

    try:
        return _run(args)
    except (UsageError, LoglikesError, ReferencesError, GraphError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
