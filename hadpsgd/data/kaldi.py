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
from pathlib import Path
from typing import Any

import numpy as np

from hadpsgd.data.writer import FeatureWriter

log = logging.getLogger(__name__)

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


def alignment_rspecifier(alignments: str) -> str:
    """Normalise an alignment source to a Kaldi rspecifier.

    ``ark:...`` / ``scp:...`` (with options such as ``ark,t:``) are kept; a plain path is read
    as a table index if it ends in ``.scp`` and as an archive otherwise.
    """
    if _RSPECIFIER.match(alignments):
        return alignments
    return f"scp:{alignments}" if alignments.endswith(".scp") else f"ark:{alignments}"


def _load_alignments(kaldiio: Any, alignments: str) -> dict[str, np.ndarray]:
    result: dict[str, np.ndarray] = {}
    with kaldiio.ReadHelper(alignment_rspecifier(alignments)) as reader:
        for utt, ali in reader:
            ali = np.asarray(ali)
            if ali.ndim != 1 or ali.dtype.kind not in "iu":
                raise ValueError(f"alignment of {utt!r} in {alignments} is not an integer vector "
                                 f"(shape {list(ali.shape)}, dtype {ali.dtype}); pass pdf-id "
                                 f"alignments (ali-to-pdf output)")
            result[utt] = ali
    return result


def import_kaldi(
    feats_scp: str, alignments: str, out: str | os.PathLike[str],
    num_classes: int | None = None, compute_norm: bool = True,
) -> dict[str, Any]:
    """Convert a Kaldi feature table and its pdf-id alignments to one feature file.

    Utterances are written in the order of ``feats_scp``. Utterances without an alignment,
    whose frame count differs from the alignment length, whose feature dimension differs from
    the first utterance's, or with non-finite features are skipped and counted. The output is
    written atomically (a failed import leaves no file under ``out``).

    Args:
        feats_scp: Feature ``.scp`` (a leading ``scp:`` is accepted).
        alignments: pdf-id alignments: ``ark:ali.ark``, ``scp:ali.scp``, or a plain ``.ark``
            / ``.scp`` path (or any kaldiio rspecifier, e.g. ``ark:gunzip -c ali.gz |``).
        out: Output ``.h5`` file.
        num_classes: Number of pdfs; default the largest pdf-id in the alignments + 1.
        compute_norm: Store per-dimension mean and std of the written frames as ``norm/``.

    Returns:
        Summary: ``utts``, ``frames``, ``feat_dim``, ``num_classes``, ``out``, ``skipped``
        (count per reason), ``skipped_utts`` (up to 10 ids per reason) and
        ``unused_alignments`` (alignments with no features).

    Raises:
        ImportError: If kaldiio is not installed.
        ValueError: If no utterance can be imported, pdf-ids are negative or not below
            ``num_classes``.
    """
    kaldiio = _kaldiio()
    scp = feats_scp[4:] if feats_scp.startswith("scp:") else feats_scp
    feats = kaldiio.load_scp(scp)
    ali = _load_alignments(kaldiio, alignments)
    paired = [utt for utt in feats if utt in ali]
    if paired:
        low = min(int(ali[u].min()) for u in paired if len(ali[u]))
        high = max(int(ali[u].max()) for u in paired if len(ali[u]))
        if low < 0:
            raise ValueError(f"{alignments}: negative pdf-id {low}; pass pdf-id alignments")
        if num_classes is None:
            num_classes = high + 1
        elif high >= num_classes:
            raise ValueError(f"{alignments}: pdf-id {high} is not below --num-classes "
                             f"{num_classes}; raise it to at least {high + 1}")

    skipped: Counter[str] = Counter()
    skipped_utts: dict[str, list[str]] = {}

    def skip(utt: str, reason: str) -> None:
        skipped[reason] += 1
        skipped_utts.setdefault(reason, [])
        if len(skipped_utts[reason]) < _MAX_LISTED:
            skipped_utts[reason].append(utt)

    writer: FeatureWriter | None = None
    try:
        for utt in feats:
            if utt not in ali:
                skip(utt, "no alignment")
                continue
            mat = np.asarray(feats[utt])
            if mat.ndim != 2:
                skip(utt, "features not a matrix")
                continue
            if mat.shape[0] != len(ali[utt]):
                skip(utt, "length mismatch")
                continue
            if writer is not None and mat.shape[1] != writer.feat_dim:
                skip(utt, "feature dimension differs")
                continue
            if not np.isfinite(mat).all():
                skip(utt, "non-finite features")
                continue
            if writer is None:
                assert num_classes is not None  # set above: this utterance is paired
                writer = FeatureWriter(out, mat.shape[1], num_classes)
            writer.append(utt, mat, ali[utt])
        if writer is None:
            raise ValueError(f"no utterance of {feats_scp} could be imported ({len(feats)} in "
                             f"the table, skipped: {dict(skipped) or 'none'}); check that the "
                             f"alignments {alignments} belong to these features")
        summary = {"out": str(out), "utts": writer.num_utts, "frames": writer.num_frames,
                   "feat_dim": writer.feat_dim, "num_classes": writer.num_classes}
        writer.commit(writer.running_norm() if compute_norm else None)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    summary.update(skipped=dict(skipped), skipped_utts=skipped_utts,
                   unused_alignments=len(set(ali) - set(paired)))
    if skipped:
        log.warning("%s: skipped %d utterance(s): %s", feats_scp, sum(skipped.values()),
                    dict(skipped))
    return summary


def main(argv: list[str] | None = None) -> int:
    """Command line: import a Kaldi feature table and alignments into one ``.h5`` file."""
    parser = argparse.ArgumentParser(prog="python -m hadpsgd.data.kaldi",
                                     description="Convert Kaldi features + pdf alignments to "
                                                 "the hadpsgd HDF5 feature format.")
    parser.add_argument("--feats-scp", required=True, help="feature table (feats.scp)")
    parser.add_argument("--alignments", required=True,
                        help="pdf-id alignments: ark:ali.ark, scp:ali.scp or a .ark/.scp path")
    parser.add_argument("--num-classes", type=int, default=None,
                        help="number of pdfs (default: largest pdf-id + 1)")
    parser.add_argument("--out", type=Path, required=True, help="output .h5 file")
    parser.add_argument("--no-norm", action="store_true",
                        help="do not store normalisation statistics (norm/mean, norm/std)")
    args = parser.parse_args(argv)
    try:
        summary = import_kaldi(args.feats_scp, args.alignments, args.out,
                               num_classes=args.num_classes, compute_norm=not args.no_norm)
    except (ImportError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {summary['out']}: {summary['utts']} utterances, {summary['frames']} frames, "
          f"feat_dim {summary['feat_dim']}, {summary['num_classes']} classes")
    for reason, count in summary["skipped"].items():
        print(f"skipped {count} ({reason}): {', '.join(summary['skipped_utts'][reason])}"
              f"{' ...' if count > _MAX_LISTED else ''}")
    if summary["unused_alignments"]:
        print(f"{summary['unused_alignments']} alignment(s) had no features")
    return 0


if __name__ == "__main__":
    sys.exit(main())
