"""A user's decoding graph (``--graph HCLG.fst --words words.txt``), checked against the model.

The convention is the digit graph's (:func:`hadpsgd.decode.graph.input_label`): an arc that
consumes a frame has input label ``class + 1``, i.e. ``pdf-id + 1`` for a model trained on
Kaldi pdf-ids; input label 0 is epsilon (consumes no frame); output labels are word ids of
``words.txt``. A Kaldi ``HCLG.fst`` has *transition-ids* as input labels (several per pdf;
``latgen-faster-mapped`` maps them to pdfs while decoding): relabel it once with the
transition-id -> pdf-id + 1 pairs of its model (docs/kaldi.md), or decode with Kaldi.

The whole graph is read once to check it (about 3 s per million arcs): an input label above
the model's class count, or an output label not in ``words.txt``, is refused by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import kaldifst


class GraphError(ValueError):
    """The graph or its word list cannot be used: the message names it and the fix."""


@dataclass(frozen=True)
class UserGraph:
    """A user's graph and its words.

    Attributes:
        fst: The graph (a vector or const FST, as written by OpenFst or Kaldi).
        words: Word of each output label (``words.txt``).
        max_ilabel: The largest input label: the model needs at least this many classes.
        path: Where the graph was read from.
        num_classes: The model's class count (matrix columns), once :meth:`fitted`.
    """

    fst: kaldifst.StdFst
    words: dict[int, str]
    max_ilabel: int
    path: str
    num_classes: int = 0

    def word(self, olabel: int) -> str:
        """The word of output label ``olabel``."""
        return self.words[olabel]

    def fitted(self, num_classes: int) -> UserGraph:
        """This graph for a model of ``num_classes`` classes.

        Raises:
            GraphError: If an input label names a class the model does not have.
        """
        if self.max_ilabel > num_classes:
            raise GraphError(
                f"--graph {self.path}: input label {self.max_ilabel} names class "
                f"{self.max_ilabel - 1} (labels are class id + 1), but the model has "
                f"{num_classes} classes (labels 1..{num_classes}); build the graph for this "
                "model's tree, or relabel a Kaldi HCLG from transition-ids to pdf-id + 1 "
                "(docs/kaldi.md)")
        return UserGraph(self.fst, self.words, self.max_ilabel, self.path, num_classes)


def read_words(path: str | os.PathLike[str]) -> dict[int, str]:
    """Kaldi's ``words.txt``: ``word id`` per line.

    Raises:
        GraphError: For a missing file, a malformed line or an id given twice.
    """
    where = Path(path)
    if not where.is_file():
        raise GraphError(f"--words {where} not found; pass the words.txt of the graph's lang "
                         "directory (data/lang/words.txt)")
    out: dict[int, str] = {}
    try:
        text = where.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise GraphError(f"--words {where} is not UTF-8 text ({err.reason} at byte {err.start}); "
                         "pass the words.txt of the graph's lang directory "
                         "(data/lang/words.txt)") from None
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or not fields[1].isdigit():
            raise GraphError(f"--words {where}:{number}: expected 'word id', got {line!r}")
        ident = int(fields[1])
        if ident in out:
            raise GraphError(f"--words {where}:{number}: id {ident} given twice")
        out[ident] = fields[0]
    return out


def load_graph(graph: str | os.PathLike[str],
               words: str | os.PathLike[str]) -> UserGraph:
    """Read and check a user's graph and its word list.

    Raises:
        GraphError: For a missing or unreadable graph, one without a start state, or an
            output label that ``words.txt`` lacks.
    """
    where = Path(graph)
    if not where.is_file():
        raise GraphError(f"--graph {where} not found; pass an FST (HCLG.fst) whose input "
                         "labels are class id + 1")
    names = read_words(words)
    fst = kaldifst.StdFst.read(str(where))  # vector or const, as the file says
    if fst is None:
        raise GraphError(f"--graph {where} is not an FST OpenFst can read (see the error "
                         "above); pass a binary FST written by fstcompile or Kaldi")
    if fst.start < 0:
        raise GraphError(f"--graph {where} has no start state; pass a non-empty graph")
    max_in = 0
    missing: set[int] = set()
    for state in kaldifst.StateIterator(fst):
        for arc in kaldifst.ArcIterator(fst, state):
            max_in = max(max_in, arc.ilabel)
            if arc.olabel and arc.olabel not in names:
                missing.add(arc.olabel)
    if missing:
        shown = ", ".join(map(str, sorted(missing)[:5]))
        raise GraphError(f"--graph {where}: output label(s) {shown}"
                         f"{' ...' if len(missing) > 5 else ''} are not in --words {words}; "
                         "pass the words.txt the graph was built with")
    return UserGraph(fst, names, max_in, str(where))
