"""The class count of a Kaldi model (its number of pdfs) and pdf-id alignments checked against it.

A Kaldi tree has ``num-pdfs`` leaves; a hybrid network's output layer has one class per pdf.
Kaldi prints the count with ``tree-info exp/tri3/tree`` (``num-pdfs 1928``) or ``am-info
exp/tri3/final.mdl`` (``number of pdfs 1928``); :func:`read_num_pdfs` reads either output
saved to a file. Without it the count would be the largest pdf-id seen + 1, which is short
of the tree's whenever the last pdfs have no frame in these alignments.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

# "num-pdfs 1928" (tree-info), "number of pdfs 1928" (am-info, gmm-info), "num-pdfs: 1928".
_NUM_PDFS = re.compile(r"^\s*(?:num-pdfs|number of pdfs)\s*:?\s*(\d+)\s*$", re.MULTILINE)
TREE_INFO_HOW = "tree-info exp/tri3/tree > tree-info.txt (or am-info exp/tri3/final.mdl)"
"""The Kaldi command that writes what :func:`read_num_pdfs` reads (for messages)."""


def parse_num_pdfs(text: str, where: str) -> int:
    """The number of pdfs in the text output of ``tree-info`` or ``am-info``.

    Raises:
        ValueError: If the text names none, or two different counts, naming ``where``.
    """
    found = {int(m) for m in _NUM_PDFS.findall(text)}
    if len(found) != 1 or min(found) < 1:
        what = "no 'num-pdfs N' line" if not found else f"counts {sorted(found)}"
        raise ValueError(f"{where}: {what}; save the output of {TREE_INFO_HOW} and pass it")
    return found.pop()


def read_num_pdfs(path: str | os.PathLike[str]) -> int:
    """:func:`parse_num_pdfs` of a file.

    Raises:
        ValueError: If the file is missing or names no count.
    """
    where = Path(path)
    if not where.is_file():
        raise ValueError(f"--tree-info {where} not found; write it with {TREE_INFO_HOW}")
    return parse_num_pdfs(where.read_text(errors="replace"), f"--tree-info {where}")


def check_pdf_ids(ali: dict[str, np.ndarray], alignments: str, num_classes: int | None,
                  given_by: str = "--num-pdfs") -> int:
    """The class count the alignments need, after refusing a pdf-id out of range.

    Args:
        ali: pdf-id alignments by utterance.
        alignments: Their source, for messages.
        num_classes: The count to check against (None: the largest pdf-id + 1).
        given_by: Where ``num_classes`` came from, for messages (``--num-pdfs 1928``).

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
                         f"not below the {num_classes} classes of {given_by}: the alignments "
                         f"need at least {top + 1}; they come from another tree than the count "
                         f"(give that tree's count: {TREE_INFO_HOW}, or align with the tree "
                         "counted)")
    return num_classes
