"""What a Kaldi import will do, decided from its flags before any frame is read.

The CMVN (:func:`plan_cmvn`), the class count and where it comes from (:func:`class_count`),
and the check that a held-out split gets the CMVN of the training file it is imported
``--like`` (:func:`check_like_cmvn`). Apart from :mod:`hadpsgd.data.kaldi`, which reads and
writes, so that each stays one job.
"""

from __future__ import annotations

import os
import re
from typing import Any

from hadpsgd.data.cmvn import COMPUTED, PER_SPEAKER, PER_UTTERANCE, Cmvn, read_utt2spk
from hadpsgd.data.pdfs import read_num_pdfs
from hadpsgd.data.pipeline import CmvnRecord, cmvn_flags, read_record
from hadpsgd.data.reader import FeatureFile

# Kaldi rspecifier prefix such as "ark:", "scp:", "ark,t:" or "scp,p:".
_RSPECIFIER = re.compile(r"^(ark|scp)(,[a-z]+)*:")


def rspecifier(source: str) -> str:
    """Normalise a feature or alignment source to a Kaldi rspecifier.

    ``ark:...`` / ``scp:...`` (with options such as ``ark,t:``) are kept; a plain path is read
    as a table index if it ends in ``.scp`` and as an archive otherwise.
    """
    if _RSPECIFIER.match(source):
        return source
    return f"scp:{source}" if source.endswith(".scp") else f"ark:{source}"


def plan_cmvn(kaldiio: Any, utt2spk: str | os.PathLike[str] | None, stats: str | None,
              per_utt: bool, norm_vars: bool) -> tuple[Cmvn | None, CmvnRecord | None]:
    """The CMVN the flags ask for, and its record (None, None: no CMVN).

    Raises:
        ValueError: For flags that contradict each other or ask for nothing to apply.
    """
    if utt2spk is not None and per_utt:
        raise ValueError("--utt2spk (per-speaker CMVN) and --cmvn-per-utt exclude each other; "
                         "drop one")
    if utt2spk is None and stats is None and not per_utt:
        if norm_vars:
            raise ValueError("--cmvn-vars names no CMVN to apply; add --utt2spk UTT2SPK (per "
                             "speaker), --cmvn-per-utt, or --cmvn scp:cmvn.scp")
        return None, None
    per = PER_SPEAKER if utt2spk is not None else PER_UTTERANCE
    source = rspecifier(stats) if stats is not None else COMPUTED
    speakers = read_utt2spk(utt2spk) if utt2spk is not None else None
    return (Cmvn(per, norm_vars, speakers, source, kaldiio),
            CmvnRecord(per, norm_vars, source, None if utt2spk is None else str(utt2spk)))


def class_count(num_classes: int | None, tree_info: str | os.PathLike[str] | None,
                 template: FeatureFile | None) -> tuple[int | None, str]:
    """The class count and where it came from (None: the alignments' largest pdf-id + 1).

    Raises:
        ValueError: If the sources given disagree, or ``tree_info`` names no count.
    """
    source = f"--num-pdfs {num_classes}"
    if tree_info is not None:
        pdfs = read_num_pdfs(tree_info)
        if num_classes is not None and num_classes != pdfs:
            raise ValueError(f"--num-pdfs {num_classes} disagrees with --tree-info {tree_info} "
                             f"({pdfs} pdfs); drop one of them")
        num_classes, source = pdfs, f"--tree-info {tree_info} (num-pdfs {pdfs})"
    if template is not None:
        if num_classes is not None and num_classes != template.num_classes:
            raise ValueError(f"{source} disagrees with {template.path} "
                             f"({template.num_classes} classes); drop one of them")
        num_classes, source = template.num_classes, f"--like {template.path}"
    if num_classes is None:
        source = "the largest pdf-id + 1 (no --num-pdfs or --tree-info)"
    return num_classes, source


def check_like_cmvn(like: str | os.PathLike[str], ours: CmvnRecord | None) -> None:
    """Refuse a split whose CMVN would differ from that of the ``--like`` file."""
    theirs = read_record(like)
    if theirs is None:
        return
    same = ours is None if theirs.cmvn is None else theirs.cmvn.same_transform(ours)
    if not same:
        mine = ours.describe() if ours is not None else "no CMVN"
        raise ValueError(f"--like {like} was imported with {theirs.describe_cmvn()}, this split "
                         f"would get {mine}; import it with the same CMVN flags "
                         f"({cmvn_flags(theirs.cmvn)}), naming this split's own utt2spk "
                         "or cmvn.scp")
