"""Import Kaldi features and pdf-id alignments (``python -m hadpsgd.data.kaldi``).

Needs the optional dependency kaldiio (``pip install hadpsgd[kaldi]``); the rest of
:mod:`hadpsgd.data` does not import this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hadpsgd.data.reader import FeatureFile
from hadpsgd.data.writer import FeatureWriter

log = logging.getLogger(__name__)

# hadpsgd.exit_codes' numbers (the data layer sits below it and imports nothing of it).
_EXIT_OK, _EXIT_FAILED, _EXIT_USER_ERROR = 0, 1, 2
# Problems of the input the user named, not failures of this program: one line, exit 2.
_USER_ERRORS = (ImportError, ValueError, FileNotFoundError, IsADirectoryError,
                NotADirectoryError, PermissionError)

# Kaldi rspecifier prefix such as "ark:", "scp:", "ark,t:" or "scp,p:".
_RSPECIFIER = re.compile(r"^(ark|scp)(,[a-z]+)*:")
# How many skipped utterance ids per reason the summary lists.
_MAX_LISTED = 10


def _kaldiio() -> Any:
    try:
        import kaldiio
    except ImportError:
        raise ImportError("importing Kaldi data needs kaldiio: pip install 'hadpsgd[kaldi]' "
                          "(or pip install kaldiio)") from None
    return kaldiio


def rspecifier(source: str) -> str:
    """Normalise a feature or alignment source to a Kaldi rspecifier.

    ``ark:...`` / ``scp:...`` (with options such as ``ark,t:``) are kept; a plain path is read
    as a table index if it ends in ``.scp`` and as an archive otherwise.
    """
    if _RSPECIFIER.match(source):
        return source
    return f"scp:{source}" if source.endswith(".scp") else f"ark:{source}"


def _load_alignments(kaldiio: Any, alignments: str) -> dict[str, np.ndarray]:
    result: dict[str, np.ndarray] = {}
    with kaldiio.ReadHelper(rspecifier(alignments)) as reader:
        for utt, ali in reader:
            ali = np.asarray(ali)
            if ali.ndim != 1 or ali.dtype.kind not in "iu":
                raise ValueError(f"alignment of {utt!r} in {alignments} is not an integer vector "
                                 f"(shape {list(ali.shape)}, dtype {ali.dtype}); pass pdf-id "
                                 f"alignments (ali-to-pdf output)")
            result[utt] = ali
    return result


def check_pdf_ids(ali: dict[str, np.ndarray], alignments: str,
                  num_classes: int | None) -> int:
    """The class count the alignments need, after refusing a pdf-id out of range.

    Raises:
        ValueError: For a negative pdf-id or one not below ``num_classes``, naming the
            utterance, the frame and the fix.
    """
    filled = {utt: labels for utt, labels in ali.items() if len(labels)}
    for utt, labels in filled.items():
        if labels.min() < 0:
            frame = int(np.argmax(labels < 0))
            raise ValueError(f"{alignments}: utterance {utt!r} has pdf-id {int(labels[frame])} "
                             f"at frame {frame}; pdf-ids are 0 or more: pass pdf-id alignments "
                             "(ali-to-pdf final.mdl 'ark:gunzip -c ali.*.gz|' ark:-), not "
                             "transition-ids or phones")
    top = max((int(labels.max()) for labels in filled.values()), default=-1)
    if num_classes is None:
        return top + 1
    if top >= num_classes:
        utt = next(u for u, labels in filled.items() if labels.max() == top)
        frame = int(np.argmax(filled[utt] == top))
        raise ValueError(f"{alignments}: utterance {utt!r} has pdf-id {top} at frame {frame}, "
                         f"not below --num-classes {num_classes}; raise it to at least "
                         f"{top + 1}")
    return num_classes


def read_utt2spk(path: str | os.PathLike[str]) -> dict[str, str]:
    """Kaldi's ``utt2spk``: one ``utterance speaker`` pair per line.

    Raises:
        ValueError: For a line that is not two fields, naming the file and line.
    """
    out: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ValueError(f"{path}:{number}: expected 'utterance speaker', got {line!r}")
        out[fields[0]] = fields[1]
    return out


def load_norm(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """Normalisation statistics from a feature file (``norm/``) or an ``.npz`` (mean, std).

    Raises:
        ValueError: If the file has none, naming it.
    """
    where = Path(path)
    if where.suffix == ".npz":
        with np.load(where) as data:
            if "mean" not in data or "std" not in data:
                raise ValueError(f"{where}: an .npz of normalisation statistics needs arrays "
                                 "'mean' and 'std'")
            return data["mean"].astype(np.float32), data["std"].astype(np.float32)
    ff = FeatureFile(where)
    if ff.norm_mean is None or ff.norm_std is None:
        raise ValueError(f"{where} has no normalisation statistics (norm/mean, norm/std); "
                         "import the training set without --no-norm")
    return ff.norm_mean, ff.norm_std


class SpeakerCMVN:
    """Per-speaker cepstral mean (and variance) normalisation, as Kaldi's apply-cmvn.

    Statistics are accumulated over every frame of a speaker's utterances in a first pass over
    the features; :meth:`apply` then normalises an utterance with its speaker's.
    """

    def __init__(self, utt2spk: dict[str, str], norm_vars: bool) -> None:
        self.utt2spk = utt2spk
        self.norm_vars = norm_vars
        self.stats: dict[str, list[Any]] = {}

    def accumulate(self, utt: str, mat: np.ndarray) -> None:
        """Add one utterance's frames to its speaker's statistics."""
        spk = self.utt2spk.get(utt)
        if spk is None:
            return
        x = mat.astype(np.float64)
        acc = self.stats.setdefault(spk, [0, 0.0, 0.0])
        acc[0] += len(x)
        acc[1] = acc[1] + x.sum(0)
        acc[2] = acc[2] + (x * x).sum(0)

    def apply(self, utt: str, mat: np.ndarray) -> np.ndarray:
        """The utterance normalised with its speaker's statistics."""
        n, total, squares = self.stats[self.utt2spk[utt]]
        mean = total / max(n, 1)
        out = mat.astype(np.float64) - mean
        if self.norm_vars:
            std = np.sqrt(np.maximum(squares / max(n, 1) - mean * mean, 0.0))
            out /= np.where(std < 1e-6, 1.0, std)
        return out.astype(np.float32)


def import_kaldi(
    feats_scp: str, alignments: str, out: str | os.PathLike[str],
    num_classes: int | None = None, compute_norm: bool = True, *,
    like: str | os.PathLike[str] | None = None,
    norm_from: str | os.PathLike[str] | None = None,
    utt2spk: str | os.PathLike[str] | None = None, cmvn_vars: bool = False,
    silence_classes: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Convert a Kaldi feature table and its pdf-id alignments to one feature file.

    Utterances are written in the order of the feature source. Utterances without an
    alignment (or, with ``utt2spk``, without a speaker), whose frame count differs from the
    alignment length, whose feature dimension differs from the first utterance's, or with
    non-finite features are skipped and counted. The output is written atomically (a failed
    import leaves no file under ``out``).

    Args:
        feats_scp: Features: a ``feats.scp`` path, or any rspecifier (``scp:...``,
            ``ark:...``, a pipeline such as ``ark:apply-cmvn ... scp:feats.scp ark:- |``).
        alignments: pdf-id alignments: ``ark:ali.ark``, ``scp:ali.scp``, or a plain ``.ark``
            / ``.scp`` path (or any kaldiio rspecifier, e.g. ``ark:gunzip -c ali.gz |``).
        out: Output ``.h5`` file.
        num_classes: Number of pdfs; default ``like``'s, else the largest pdf-id + 1.
        compute_norm: Store per-dimension mean and std of the written frames as ``norm/``.
        like: The training set's feature file: a held-out split takes its class count and
            its normalisation statistics (so both splits are normalised alike).
        norm_from: Store these statistics instead (a feature file or an ``.npz`` with
            ``mean`` and ``std``).
        utt2spk: Kaldi's ``utt2spk``: per-speaker mean normalisation before anything else.
        cmvn_vars: With ``utt2spk``, normalise the per-speaker variance too.
        silence_classes: The pdf-ids of the silence phones, recorded in the file so that
            evaluation reports speech-frame accuracy apart; default ``like``'s, else none.

    Returns:
        Summary: ``utts``, ``frames``, ``feat_dim``, ``num_classes``, ``out``, ``norm``
        (where the statistics came from), ``skipped`` (count per reason), ``skipped_utts``
        (up to 10 ids per reason) and ``unused_alignments`` (alignments with no features).

    Raises:
        ImportError: If kaldiio is not installed.
        ValueError: If no utterance can be imported, pdf-ids are negative or not below
            ``num_classes``, or ``like`` disagrees with ``num_classes``.
    """
    kaldiio = _kaldiio()
    rspec = rspecifier(feats_scp)
    ali = _load_alignments(kaldiio, alignments)
    norm: tuple[np.ndarray, np.ndarray] | None = None
    norm_source = "computed on these frames" if compute_norm else "none"
    if like is not None:
        template = FeatureFile(like)
        if num_classes is not None and num_classes != template.num_classes:
            raise ValueError(f"--num-classes {num_classes} disagrees with {like} "
                             f"({template.num_classes} classes); drop one of them")
        num_classes = template.num_classes
        if silence_classes is None:
            silence_classes = template.silence_classes
        if compute_norm and norm_from is None:
            norm_from = like
    if norm_from is not None and compute_norm:
        norm = load_norm(norm_from)
        norm_source = f"from {norm_from}"
    if any(len(a) for a in ali.values()):  # before any feature is read: no work is lost
        num_classes = check_pdf_ids(ali, alignments, num_classes)
    speakers = read_utt2spk(utt2spk) if utt2spk is not None else None
    cmvn = SpeakerCMVN(speakers, cmvn_vars) if speakers is not None else None
    if cmvn is not None:  # first pass: the speakers' statistics
        with kaldiio.ReadHelper(rspec) as reader:
            for utt, mat in reader:  # every utterance of a speaker, as compute-cmvn-stats
                cmvn.accumulate(utt, np.asarray(mat))

    skipped: Counter[str] = Counter()
    skipped_utts: dict[str, list[str]] = {}
    example: dict[str, str] = {}  # the first skipped utterance of each reason, in detail

    def skip(utt: str, reason: str, detail: str = "") -> None:
        skipped[reason] += 1
        skipped_utts.setdefault(reason, [])
        example.setdefault(reason, f"{utt!r}{f' ({detail})' if detail else ''}")
        if len(skipped_utts[reason]) < _MAX_LISTED:
            skipped_utts[reason].append(utt)

    writer: FeatureWriter | None = None
    seen: set[str] = set()
    try:
        with kaldiio.ReadHelper(rspec) as reader:
            for utt, raw in reader:
                seen.add(utt)
                if utt not in ali:
                    skip(utt, "no alignment")
                    continue
                if speakers is not None and utt not in speakers:
                    skip(utt, "not in utt2spk")
                    continue
                mat, labels = np.asarray(raw), ali[utt]
                if mat.ndim != 2:
                    skip(utt, "features not a matrix")
                    continue
                if mat.shape[0] != len(labels):
                    skip(utt, "length mismatch",
                         f"{mat.shape[0]} feature frames, {len(labels)} alignment frames")
                    continue
                if writer is not None and mat.shape[1] != writer.feat_dim:
                    skip(utt, "feature dimension differs")
                    continue
                if not np.isfinite(mat).all():
                    skip(utt, "non-finite features")
                    continue
                if writer is None:
                    assert num_classes is not None  # this utterance has an alignment
                    if norm is not None and (norm[0].shape != (mat.shape[1],)
                                             or norm[1].shape != (mat.shape[1],)):
                        # Before anything is written, not after the whole table was read.
                        raise ValueError(f"normalisation statistics {norm_source} have "
                                         f"dimension {norm[0].shape[0]}, the features "
                                         f"{mat.shape[1]}")
                    writer = FeatureWriter(out, mat.shape[1], num_classes,
                                           silence_classes=silence_classes or ())
                writer.append(utt, cmvn.apply(utt, mat) if cmvn is not None else mat, labels)
        if writer is None:
            named = "; ".join(f"{reason}: {count}, e.g. {example[reason]}"
                              for reason, count in skipped.items()) or "none"
            raise ValueError(f"no utterance of {feats_scp} could be imported ({len(seen)} in "
                             f"the table; skipped: {named}); check that the alignments "
                             f"{alignments} belong to these features (the same utterance ids, "
                             "made from these very features at their frame rate)")
        summary = {"out": str(out), "utts": writer.num_utts, "frames": writer.num_frames,
                   "feat_dim": writer.feat_dim, "num_classes": writer.num_classes,
                   "norm": norm_source}
        if compute_norm and norm is None:
            norm = writer.running_norm()
        writer.commit(norm if compute_norm else None)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    summary.update(skipped=dict(skipped), skipped_utts=skipped_utts,
                   unused_alignments=len(set(ali) - seen))
    if skipped:
        log.warning("%s: skipped %d utterance(s): %s", feats_scp, sum(skipped.values()),
                    dict(skipped))
    return summary


def _class_list(text: str) -> list[int]:
    """``--silence-classes 0,1,2`` as ints (argparse turns the ValueError into a usage error)."""
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    """Command line: import a Kaldi feature table and alignments into one ``.h5`` file.

    Returns:
        The exit code: 0 imported; 2 a user's error (a bad flag, a missing file, a negative
        or too large pdf-id, no utterance whose alignment fits its features), one line naming
        the utterance or file and the fix; 1 a failure while writing.
    """
    parser = argparse.ArgumentParser(prog="python -m hadpsgd.data.kaldi",
                                     description="Convert Kaldi features + pdf alignments to "
                                                 "the hadpsgd HDF5 feature format.")
    parser.add_argument("--feats", "--feats-scp", dest="feats", required=True,
                        help="features: feats.scp, or any rspecifier, e.g. "
                             "'ark:apply-cmvn ... scp:feats.scp ark:- |'")
    parser.add_argument("--alignments", required=True,
                        help="pdf-id alignments: ark:ali.ark, scp:ali.scp, a .ark/.scp path or "
                             "a pipeline, e.g. 'ark:ali-to-pdf final.mdl \"ark:gunzip -c "
                             "ali.*.gz|\" ark:- |'")
    parser.add_argument("--like", type=Path, default=None, metavar="TRAIN.h5",
                        help="the training set's file: take its class count and normalisation "
                             "statistics (import held-out splits with it)")
    parser.add_argument("--num-classes", type=int, default=None,
                        help="number of pdfs (default: --like's, else largest pdf-id + 1)")
    parser.add_argument("--norm-from", type=Path, default=None, metavar="FILE",
                        help="store these normalisation statistics (a feature file, or an "
                             ".npz with 'mean' and 'std') instead of computing them")
    parser.add_argument("--utt2spk", type=Path, default=None,
                        help="Kaldi utt2spk: per-speaker mean normalisation (CMVN) first")
    parser.add_argument("--cmvn-vars", action="store_true",
                        help="with --utt2spk, normalise the per-speaker variance too")
    parser.add_argument("--silence-classes", type=_class_list, default=None, metavar="A,B,...",
                        help="pdf-ids of the silence phones (e.g. from show-transitions "
                             "phones.txt final.mdl), recorded so that evaluation reports the "
                             "accuracy on speech frames too (default: --like's, else none)")
    parser.add_argument("--out", type=Path, required=True, help="output .h5 file")
    parser.add_argument("--no-norm", action="store_true",
                        help="do not store normalisation statistics (norm/mean, norm/std)")
    args = parser.parse_args(argv)
    try:
        summary = import_kaldi(args.feats, args.alignments, args.out,
                               num_classes=args.num_classes, compute_norm=not args.no_norm,
                               like=args.like, norm_from=args.norm_from, utt2spk=args.utt2spk,
                               cmvn_vars=args.cmvn_vars, silence_classes=args.silence_classes)
    except _USER_ERRORS as exc:  # the input or a flag: one line naming it and the fix
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return _EXIT_USER_ERROR
    except OSError as exc:  # writing failed (a full disk, an I/O error): not the input's fault
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return _EXIT_FAILED
    print(f"wrote {summary['out']}: {summary['utts']} utterances, {summary['frames']} frames, "
          f"feat_dim {summary['feat_dim']}, {summary['num_classes']} classes, normalisation "
          f"{summary['norm']}")
    for reason, count in summary["skipped"].items():
        print(f"skipped {count} ({reason}): {', '.join(summary['skipped_utts'][reason])}"
              f"{' ...' if count > _MAX_LISTED else ''}")
    if summary["unused_alignments"]:
        print(f"{summary['unused_alignments']} alignment(s) had no features")
    return _EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
