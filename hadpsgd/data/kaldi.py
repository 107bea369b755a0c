"""Import Kaldi features and pdf-id alignments (``python -m hadpsgd.data.kaldi``).

Every transformation between the raw Kaldi features and the stored frames (per-speaker or
per-utterance CMVN and its options, the normalisation statistics, where the class count came
from) is recorded in the file's ``pipeline`` attribute (:mod:`hadpsgd.data.pipeline`), so
that the forward pass can redo it on raw features, or refuse. docs/kaldi.md has the route.

Needs the optional dependency kaldiio (``pip install hadpsgd[kaldi]``); the rest of
:mod:`hadpsgd.data` does not import this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import zipfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hadpsgd.data._schema import PIPELINE
from hadpsgd.data.kaldi_plan import (
    check_like_cmvn,
    check_out,
    checked_norm,
    class_count,
    plan_cmvn,
    read_table,
    rspecifier,  # noqa: F401 - re-exported: importers name it from here
)
from hadpsgd.data.pdfs import TREE_INFO_HOW, check_pdf_ids
from hadpsgd.data.pipeline import ImportRecord
from hadpsgd.data.reader import FeatureFile
from hadpsgd.data.writer import FeatureWriter

log = logging.getLogger(__name__)

# hadpsgd.exit_codes' numbers (the data layer sits below it and imports nothing of it).
_EXIT_OK, _EXIT_FAILED, _EXIT_USER_ERROR = 0, 1, 2
# Problems of the input the user named, not failures of this program: one line, exit 2.
_USER_ERRORS = (ImportError, ValueError, FileNotFoundError, IsADirectoryError,
                NotADirectoryError, PermissionError)

# What to pass instead of a --feats table that cannot be read.
_FEATS_FIX = ("pass a feats.scp whose archives are there, or an archive of float matrices "
              "(ark:feats.ark)")
# How many skipped utterance ids per reason the summary lists.
_MAX_LISTED = 10


def _kaldiio() -> Any:
    try:
        import kaldiio
    except ImportError:
        raise ImportError("importing Kaldi data needs kaldiio: pip install 'hadpsgd[kaldi]' "
                          "(or pip install kaldiio)") from None
    return kaldiio


def _load_alignments(kaldiio: Any, alignments: str) -> dict[str, np.ndarray]:
    result: dict[str, np.ndarray] = {}
    for utt, ali in read_table(kaldiio, alignments, "--alignments",
                               "pass pdf-id alignments (ali-to-pdf output: ark:ali.ark, or "
                               "ark,t:ali.txt of 'utterance pdf-id pdf-id ...' lines)"):
        ali = np.asarray(ali)
        if ali.ndim != 1 or ali.dtype.kind not in "iu":
            raise ValueError(f"alignment of {utt!r} in {alignments} is not an integer vector "
                             f"(shape {list(ali.shape)}, dtype {ali.dtype}); pass pdf-id "
                             f"alignments (ali-to-pdf output)")
        result[utt] = ali
    return result


def load_norm(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """Normalisation statistics from a feature file (``norm/``) or an ``.npz`` (mean, std).

    Raises:
        ValueError: If the file has none, naming it.
    """
    where = Path(path)
    if where.suffix == ".npz":
        try:
            with np.load(where) as data:
                if "mean" not in data or "std" not in data:
                    raise ValueError(f"{where}: an .npz of normalisation statistics needs "
                                     "arrays 'mean' and 'std'")
                mean, std = data["mean"], data["std"]
        except (zipfile.BadZipFile, EOFError) as err:  # a damaged or cut-short archive
            raise ValueError(f"{where}: not a readable .npz ({err}); save it again with "
                             "numpy.savez(path, mean=..., std=...)") from None
        return checked_norm(mean, std, where)
    ff = FeatureFile(where)
    if ff.norm_mean is None or ff.norm_std is None:
        raise ValueError(f"{where} has no normalisation statistics (norm/mean, norm/std); "
                         "import the training set without --no-norm")
    return ff.norm_mean, ff.norm_std


def import_kaldi(
    feats_scp: str, alignments: str, out: str | os.PathLike[str],
    num_classes: int | None = None, compute_norm: bool = True, *,
    like: str | os.PathLike[str] | None = None,
    norm_from: str | os.PathLike[str] | None = None,
    utt2spk: str | os.PathLike[str] | None = None, cmvn_vars: bool = False,
    cmvn_stats: str | None = None, cmvn_per_utt: bool = False,
    tree_info: str | os.PathLike[str] | None = None,
    silence_classes: Sequence[int] | None = None, overwrite: bool = True,
) -> dict[str, Any]:
    """Convert a Kaldi feature table and its pdf-id alignments to one feature file.

    Utterances are written in the order of the feature source. Utterances without an
    alignment (or without a speaker or CMVN statistics), whose frame count differs from the
    alignment length, whose feature dimension differs from the first utterance's, or with
    non-finite features are skipped and counted. The output is written atomically (a failed
    import leaves no file under ``out``), with the ``pipeline`` record of what was done.

    Args:
        feats_scp: Features: a ``feats.scp`` path, or any rspecifier (``scp:...``,
            ``ark:...``, a pipeline such as ``ark:apply-cmvn ... scp:feats.scp ark:- |``).
        alignments: pdf-id alignments: ``ark:ali.ark``, ``scp:ali.scp``, or a plain ``.ark``
            / ``.scp`` path (or any kaldiio rspecifier, e.g. ``ark:gunzip -c ali.gz |``).
        out: Output ``.h5`` file.
        num_classes: Number of pdfs (``--num-pdfs``); default ``tree_info``'s or ``like``'s,
            else the largest pdf-id + 1.
        compute_norm: Store per-dimension mean and std of the written frames as ``norm/``.
        like: The training set's feature file: a held-out split takes its class count and
            its normalisation statistics (so both splits are normalised alike), and must
            have its CMVN.
        norm_from: Store these statistics instead (a feature file or an ``.npz`` with
            ``mean`` and ``std``).
        utt2spk: Kaldi's ``utt2spk``: per-speaker CMVN before anything else.
        cmvn_vars: With a CMVN, normalise the variance too (else the mean only).
        cmvn_stats: Kaldi's CMVN statistics (``scp:cmvn.scp``), by speaker with ``utt2spk``,
            by utterance without; default: computed from the features.
        cmvn_per_utt: Per-utterance CMVN with statistics computed from each utterance.
        tree_info: The text output of Kaldi's ``tree-info`` or ``am-info``: the number of pdfs.
        silence_classes: The pdf-ids of the silence phones, recorded in the file so that
            evaluation reports speech-frame accuracy apart; default ``like``'s, else none.
        overwrite: Replace an ``out`` that is there (the command line's ``--overwrite``;
            without it the command refuses such a file, naming it).

    Returns:
        Summary: ``utts``, ``frames``, ``feat_dim``, ``num_classes``, ``classes_from``,
        ``cmvn``, ``out``, ``norm`` (where the statistics came from), ``skipped`` (count per
        reason), ``skipped_utts`` (up to 10 ids per reason) and ``unused_alignments``
        (alignments with no features).

    Raises:
        ImportError: If kaldiio is not installed.
        ValueError: If no utterance can be imported, pdf-ids are negative or not below the
            class count, the flags contradict each other, or ``like`` disagrees.
    """
    kaldiio = _kaldiio()
    cmvn, cmvn_record = plan_cmvn(kaldiio, utt2spk, cmvn_stats, cmvn_per_utt, cmvn_vars)
    template = FeatureFile(like) if like is not None else None
    num_classes, classes_from = class_count(num_classes, tree_info, template)
    norm: tuple[np.ndarray, np.ndarray] | None = None
    norm_source = "computed on these frames" if compute_norm else "none"
    if like is not None and template is not None:
        check_like_cmvn(like, cmvn_record)
        if silence_classes is None:
            silence_classes = template.silence_classes
        if compute_norm and norm_from is None:
            norm_from = like
    if norm_from is not None and compute_norm:
        norm = load_norm(norm_from)
        norm_source = f"from {norm_from}"
    ali = _load_alignments(kaldiio, alignments)
    if any(len(a) for a in ali.values()):  # before any feature is read: no work is lost
        num_classes = check_pdf_ids(ali, alignments, num_classes, classes_from)
    check_out(out, overwrite)  # after the checks of the input, before any feature is read
    if cmvn is not None and cmvn.needs_pass:  # first pass: the speakers' statistics
        # Every utterance of a speaker, as compute-cmvn-stats.
        for utt, mat in read_table(kaldiio, feats_scp, "--feats", _FEATS_FIX):
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
        for utt, raw in read_table(kaldiio, feats_scp, "--feats", _FEATS_FIX):
            seen.add(utt)
            if utt not in ali:
                skip(utt, "no alignment")
                continue
            if cmvn is not None and cmvn.key(utt) is None:
                skip(utt, "not in utt2spk")
                continue
            if cmvn is not None and not cmvn.has(utt):
                skip(utt, "no CMVN statistics")
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
                   "classes_from": classes_from, "norm": norm_source,
                   "cmvn": cmvn_record.describe() if cmvn_record is not None else "none"}
        if compute_norm and norm is None:
            norm = writer.running_norm()
        record = ImportRecord(features=feats_scp, alignments=alignments, cmvn=cmvn_record,
                              norm=norm_source, num_classes=writer.num_classes,
                              classes_from=classes_from)
        writer.commit(norm if compute_norm else None, attrs={PIPELINE: record.to_json()})
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


def _count(text: str) -> int:
    """``--num-pdfs N``: a whole number >= 1 (argparse names the flag on a ValueError)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (the tree's pdfs), got "
                                         f"{text}")
    return value


def _class_list(text: str) -> list[int]:
    """``--silence-classes 0,1,2`` as ints (argparse turns the ValueError into a usage error)."""
    return [int(part) for part in text.split(",") if part.strip()]


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m hadpsgd.data.kaldi",
                                description="Convert Kaldi features + pdf alignments to the "
                                            "hadpsgd HDF5 feature format, recording every "
                                            "transformation (docs/kaldi.md).")
    p.add_argument("--feats", "--feats-scp", dest="feats", required=True,
                   help="features: feats.scp, or any rspecifier, e.g. "
                        "'ark:copy-feats scp:feats.scp ark:- |'")
    p.add_argument("--alignments", required=True,
                   help="pdf-id alignments: ark:ali.ark, scp:ali.scp, a .ark/.scp path or a "
                        "pipeline, e.g. 'ark:ali-to-pdf final.mdl \"ark:gunzip -c ali.*.gz|\" "
                        "ark:- |'")
    p.add_argument("--like", type=Path, default=None, metavar="TRAIN.h5",
                   help="the training set's file: take its class count and normalisation "
                        "statistics, and check its CMVN (import held-out splits with it)")
    p.add_argument("--num-pdfs", "--num-classes", dest="num_classes", type=_count, default=None,
                   metavar="N", help="number of pdfs of the tree (default: --tree-info's, "
                                     "--like's, else the largest pdf-id + 1)")
    p.add_argument("--tree-info", type=Path, default=None, metavar="FILE",
                   help=f"take the number of pdfs from Kaldi's output saved to FILE: "
                        f"{TREE_INFO_HOW}")
    p.add_argument("--norm-from", type=Path, default=None, metavar="FILE",
                   help="store these normalisation statistics (a feature file, or an .npz "
                        "with 'mean' and 'std') instead of computing them")
    p.add_argument("--utt2spk", type=Path, default=None,
                   help="Kaldi utt2spk: per-speaker CMVN first (statistics over each "
                        "speaker's utterances, or Kaldi's with --cmvn)")
    p.add_argument("--cmvn", default=None, metavar="RSPECIFIER",
                   help="Kaldi's CMVN statistics (scp:data/train/cmvn.scp, compute-cmvn-stats "
                        "output): by speaker with --utt2spk, by utterance without")
    p.add_argument("--cmvn-per-utt", action="store_true",
                   help="per-utterance CMVN, statistics computed from each utterance")
    p.add_argument("--cmvn-vars", action="store_true",
                   help="with a CMVN, normalise the variance too (apply-cmvn --norm-vars)")
    p.add_argument("--silence-classes", type=_class_list, default=None, metavar="A,B,...",
                   help="pdf-ids of the silence phones (e.g. from show-transitions phones.txt "
                        "final.mdl), recorded so that evaluation reports the accuracy on "
                        "speech frames too (default: --like's, else none)")
    p.add_argument("--out", type=Path, required=True, help="output .h5 file")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --out that is already there (default: refuse it, naming "
                        "it); the file is replaced when the new one is complete")
    p.add_argument("--no-norm", action="store_true",
                   help="do not store normalisation statistics (norm/mean, norm/std)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line: import a Kaldi feature table and alignments into one ``.h5`` file.

    Returns:
        The exit code: 0 imported; 2 a user's error (a bad flag, a missing file, a negative
        or too large pdf-id, no utterance whose alignment fits its features), one line naming
        the utterance or file and the fix; 1 a failure while writing.
    """
    cli = parser()
    args = cli.parse_args(argv)
    try:
        summary = import_kaldi(args.feats, args.alignments, args.out,
                               num_classes=args.num_classes, compute_norm=not args.no_norm,
                               like=args.like, norm_from=args.norm_from, utt2spk=args.utt2spk,
                               cmvn_vars=args.cmvn_vars, cmvn_stats=args.cmvn,
                               cmvn_per_utt=args.cmvn_per_utt, tree_info=args.tree_info,
                               silence_classes=args.silence_classes,
                               overwrite=args.overwrite)
    except _USER_ERRORS as exc:  # the input or a flag: one line naming it and the fix
        print(f"{cli.prog}: error: {exc}", file=sys.stderr)
        return _EXIT_USER_ERROR
    except OSError as exc:  # writing failed (a full disk, an I/O error): not the input's fault
        print(f"{cli.prog}: error: {exc}", file=sys.stderr)
        return _EXIT_FAILED
    print(f"wrote {summary['out']}: {summary['utts']} utterances, {summary['frames']} frames, "
          f"feat_dim {summary['feat_dim']}, {summary['num_classes']} classes (from "
          f"{summary['classes_from']}), CMVN: {summary['cmvn']}, normalisation "
          f"{summary['norm']}")
    for reason, count in summary["skipped"].items():
        print(f"skipped {count} ({reason}): {', '.join(summary['skipped_utts'][reason])}"
              f"{' ...' if count > _MAX_LISTED else ''}")
    if summary["unused_alignments"]:
        print(f"{summary['unused_alignments']} alignment(s) had no features")
    if args.num_classes is None and args.tree_info is None and args.like is None:
        print(f"note: the class count is the largest pdf-id + 1; the tree may have more pdfs "
              f"than these alignments use: pass --num-pdfs N or --tree-info FILE "
              f"({TREE_INFO_HOW})")
    return _EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
