"""The decoding graph HCLG over phone-state classes, built with kaldifst.

The steps are Kaldi's ``prepare_lang.sh`` + ``mkgraph.sh`` for a context-independent model
(C is the identity: each phone's HMM does not depend on its neighbours):

* **L** (:func:`lexicon_fst`), Kaldi's ``L_disambig.fst``: phones in, words out, the word on
  its first phone; optional silence before the first word and after each word with
  probability ``silence_prob`` (0.5, as ``prepare_lang.sh``); a pronunciation that another
  repeats or extends ends with a disambiguation symbol ``#1, #2, ...`` and a self-loop
  ``#0:#0`` passes G's backoff symbol. Every pronunciation of a word costs 0.
* **G** (:meth:`examples.speechocean.lm.BigramLM.fst`): the word bigram.
* **LG** = ``minimize_encoded(determinize_star(L o G))`` (``fsttablecompose``,
  ``fstdeterminizestar --use-log=true``, ``fstminimizeencoded``), then the disambiguation
  symbols are made epsilon.
* **H** (:func:`hmm_fst`): each phone a 3-state left-to-right HMM with self-loops, input
  labels the classes + 1 (:mod:`examples.speechocean.phones`), output the phone on the
  first state's entry; self-loop probabilities per class from the training alignments'
  mean state durations, scaled by ``self_loop_scale`` (0.1, as ``mkgraph.sh``).
* **HCLG** = ``H o LG``, connected and sorted by input label. LG is deterministic on phones,
  so each state of HCLG enters each class's HMM by at most one arc; it keeps epsilon input
  arcs (an HMM's exit, a backoff), which ``hadpsgd.decode --graph`` takes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import kaldifst
import numpy as np

from examples.speechocean.lm import BigramLM
from examples.speechocean.phones import PHONES, SILENCE, STATES_PER_PHONE, state_class

EPS = 0
Lexicon = dict[str, list[tuple[str, ...]]]


@dataclass(frozen=True)
class Symbols:
    """The label spaces.

    Attributes:
        words: Word -> id (1-based; 0 is ``<eps>``), the graph's output labels.
        word_backoff: ``#0`` in G's input and L's output (never in LG's output).
        phone_disambig: ``#k`` -> L's input label, after the 40 phones (``#0`` first).
    """

    words: dict[str, int]
    word_backoff: int
    phone_disambig: dict[str, int]


def phone_id(phone: str) -> int:
    """L's input label of a phone (0 is epsilon)."""
    return PHONES.index(phone) + 1


def disambiguate(lexicon: Lexicon) -> list[tuple[str, tuple[str, ...], int]]:
    """``(word, phones, k)`` per pronunciation: ``k > 0`` when it needs ``#k`` at its end.

    A pronunciation needs one when another word's is the same (homophones get ``#1``,
    ``#2``, ... in turn) or begins with it (Kaldi's ``add_lex_disambig.pl``).
    """
    entries = [(w, p) for w in sorted(lexicon) for p in lexicon[w]]
    counts = Counter(p for _, p in entries)
    prefixes = {p[:n] for _, p in entries for n in range(1, len(p))}
    turn: Counter[tuple[str, ...]] = Counter()
    out = []
    for word, phones in entries:
        if counts[phones] > 1 or phones in prefixes:
            turn[phones] += 1
            out.append((word, phones, turn[phones]))
        else:
            out.append((word, phones, 0))
    return out


def symbols(lexicon: Lexicon) -> Symbols:
    """Word ids (sorted words) and the disambiguation symbols ``lexicon`` needs."""
    words = {w: i for i, w in enumerate(sorted(lexicon), start=1)}
    most = max((k for _, _, k in disambiguate(lexicon)), default=0)
    disambig = {f"#{k}": len(PHONES) + 1 + k for k in range(most + 1)}
    return Symbols(words, len(words) + 1, disambig)


def lexicon_fst(lexicon: Lexicon, syms: Symbols,
                silence_prob: float = 0.5) -> kaldifst.StdVectorFst:
    """L with optional silence and disambiguation symbols (module docstring)."""
    sil, no_sil = -math.log(silence_prob), -math.log(1.0 - silence_prob)
    fst = kaldifst.StdVectorFst()
    start, loop, after_word = fst.add_state(), fst.add_state(), fst.add_state()
    fst.start = start
    fst.set_final(loop, 0.0)
    sil_in = phone_id(SILENCE)
    fst.add_arc(start, kaldifst.StdArc(EPS, EPS, no_sil, loop))
    fst.add_arc(start, kaldifst.StdArc(sil_in, EPS, sil, loop))
    fst.add_arc(after_word, kaldifst.StdArc(sil_in, EPS, 0.0, loop))
    fst.add_arc(loop, kaldifst.StdArc(syms.phone_disambig["#0"], syms.word_backoff, 0.0, loop))
    for word, phones, k in disambiguate(lexicon):
        labels = [phone_id(p) for p in phones]
        if k:
            labels.append(syms.phone_disambig[f"#{k}"])
        state = loop
        for n, label in enumerate(labels[:-1]):
            nxt = fst.add_state()
            fst.add_arc(state, kaldifst.StdArc(label, syms.words[word] if n == 0 else EPS,
                                               0.0, nxt))
            state = nxt
        out = syms.words[word] if len(labels) == 1 else EPS
        fst.add_arc(state, kaldifst.StdArc(labels[-1], out, no_sil, loop))
        fst.add_arc(state, kaldifst.StdArc(labels[-1], out, sil, after_word))
    return fst


def hmm_fst(self_loop_probs: Sequence[float] | np.ndarray,
            self_loop_scale: float = 0.1) -> kaldifst.StdVectorFst:
    """H: classes + 1 in, phones out (module docstring); ``self_loop_probs`` per class."""
    fst = kaldifst.StdVectorFst()
    hub = fst.add_state()
    fst.start = hub
    fst.set_final(hub, 0.0)
    for phone in PHONES:
        previous = hub
        for k in range(STATES_PER_PHONE):
            cls = state_class(phone, k)
            p = float(self_loop_probs[cls])
            state = fst.add_state()
            enter = 0.0 if k == 0 else -self_loop_scale * math.log(1.0 - float(
                self_loop_probs[cls - 1]))
            fst.add_arc(previous, kaldifst.StdArc(cls + 1, phone_id(phone) if k == 0 else EPS,
                                                  enter, state))
            fst.add_arc(state, kaldifst.StdArc(cls + 1, EPS, -self_loop_scale * math.log(p),
                                               state))
            previous = state
        last = float(self_loop_probs[state_class(phone, STATES_PER_PHONE - 1)])
        fst.add_arc(previous, kaldifst.StdArc(EPS, EPS, -self_loop_scale * math.log(1.0 - last),
                                              hub))
    return fst


def compose_lg(lexicon: Lexicon, lm: BigramLM, syms: Symbols,
               silence_prob: float = 0.5) -> kaldifst.StdVectorFst:
    """``LG`` determinized and minimized, its disambiguation symbols made epsilon."""
    lex = lexicon_fst(lexicon, syms, silence_prob)
    kaldifst.arcsort(lex, sort_type="olabel")
    grammar = lm.fst(syms.words, syms.word_backoff)
    lg = kaldifst.StdVectorFst(kaldifst.compose(lex, grammar))
    kaldifst.determinize_star(lg, use_log=True)
    kaldifst.minimize_encoded(lg)
    disambig = set(syms.phone_disambig.values())
    return _drop_disambig(lg, disambig)


def _drop_disambig(fst: kaldifst.StdVectorFst, labels: set[int]) -> kaldifst.StdVectorFst:
    """A copy of ``fst`` with the input labels in ``labels`` made epsilon."""
    out = kaldifst.StdVectorFst()
    for _ in kaldifst.StateIterator(fst):
        out.add_state()
    out.start = fst.start
    for state in kaldifst.StateIterator(fst):
        final = fst.final(state)
        if final != kaldifst.TropicalWeight.zero:
            out.set_final(state, final)
        for arc in kaldifst.ArcIterator(fst, state):
            out.add_arc(state, kaldifst.StdArc(EPS if arc.ilabel in labels else arc.ilabel,
                                               arc.olabel, arc.weight, arc.nextstate))
    return out


def build_hclg(lexicon: Lexicon, lm: BigramLM, self_loop_probs: Sequence[float] | np.ndarray,
               silence_prob: float = 0.5,
               self_loop_scale: float = 0.1) -> tuple[kaldifst.StdVectorFst, Symbols]:
    """HCLG (input: class + 1; output: word id) and its symbols (module docstring)."""
    syms = symbols(lexicon)
    lg = compose_lg(lexicon, lm, syms, silence_prob)
    kaldifst.arcsort(lg, sort_type="ilabel")
    hmm = hmm_fst(self_loop_probs, self_loop_scale)
    kaldifst.arcsort(hmm, sort_type="olabel")
    hclg = kaldifst.StdVectorFst(kaldifst.compose(hmm, lg))
    kaldifst.connect(hclg)
    kaldifst.arcsort(hclg, sort_type="ilabel")
    return hclg, syms


def write_words(syms: Symbols, path: Path) -> None:
    """``words.txt`` (``<eps> 0``, then ``word id``), as ``hadpsgd.decode --words`` reads it."""
    lines = ["<eps> 0", *(f"{w} {i}" for w, i in sorted(syms.words.items(), key=lambda x: x[1]))]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def num_arcs(fst: kaldifst.StdFst) -> tuple[int, int]:
    """``(states, arcs)`` of an FST."""
    states = arcs = 0
    for state in kaldifst.StateIterator(fst):
        states += 1
        arcs += sum(1 for _ in kaldifst.ArcIterator(fst, state))
    return states, arcs
