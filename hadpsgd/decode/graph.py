"""The decoding graph: a digit loop over left-to-right HMMs, as one kaldifst transducer.

The graph plays the part of Kaldi's HCLG for the connected-digit task: every arc consumes one
frame (there are no epsilon arcs), its input label names the frame class it emits
(``class + 1``, :func:`input_label`) and its output label is a word, set on the arc that
enters the word's first state and epsilon (0) elsewhere. States::

    0              start (no frame consumed)
    1              leading silence (not final: an utterance has at least one word)
    2              silence after a word (final)
    3 + w*K + k    state k of word w's K-state HMM (its last state is final)

Arcs, with q_c = 1 - p_c the leaving probability of class c's state (p_c its self-loop):

* every emitting state loops to itself with ``p_c``; word states go on to the next state of
  the word with ``q_c``;
* start -> leading silence with ``s`` (the silence probability), start -> any word with
  ``(1 - s) / W``;
* leading silence -> any word with ``q_sil / W``;
* a word's last state -> silence with ``q_c * s``, -> any word (back to back) with
  ``q_c * (1 - s) / W``, and ends the utterance with final weight ``q_c * (1 - s)``;
* silence after a word -> any word with ``q_sil / W``, and ends with final weight ``q_sil``.

So the graph is the product of an HMM transition model (H), an optional-silence lexicon (L,
silence probability ``s`` = 0.5 as Kaldi's ``prepare_lang.sh``) and a uniform word loop (G,
1/W per word), with ``word_penalty`` added to the cost of every word entered (positive:
fewer words). Weights are tropical costs, i.e. negative natural-log probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import kaldifst
import numpy as np

START, LEADING_SILENCE, SILENCE = 0, 1, 2
"""The graph's three non-word states (see the module docstring)."""
_FIRST_WORD_STATE = 3

DEFAULT_SELF_LOOP_PROB = 0.9
"""A state's self-loop probability by default: a mean stay of 10 frames (100 ms), near the
mean state durations of the digit set's training labels (docs/decode.md)."""
DEFAULT_SILENCE_PROB = 0.5
"""The probability of (optional) silence before the first and after each word."""
DEFAULT_WORD_PENALTY = {"pseudo-log-likelihoods": 4.0, "log-posteriors": 0.0, None: 0.0}
"""``--word-penalty`` by default, by the kind of scores decoded (``None``: not recorded).

Pseudo-log-likelihoods (the forward pass's default output) decode best with a penalty of 4
(1.75 % WER on the tuning model against 2.22 % with none; every algorithm's mean over the 25
models of docs/results.md lower by 0.1 to 0.6 point); log-posteriors with none (1.87 %; 1.98 %
with 4). docs/decode.md, *The defaults and the kind of scores*.
"""


def input_label(cls: int) -> int:
    """The graph's input label for frame class ``cls``.

    ``kaldi_decoder.DecodableCtc`` reads input label ``k`` from matrix column ``k - 1`` and
    keeps label 0 for epsilon (checked by ``tests/unit/test_decode.py``), so class c is c + 1.
    """
    return cls + 1


@dataclass(frozen=True)
class DecodingGraph:
    """A built graph and what its labels mean.

    Attributes:
        fst: The transducer (input: :func:`input_label` of a class; output: word id).
        words: ``words[i - 1]`` is the word of output label ``i`` (0 is epsilon).
        word_classes: ``word_classes[i]`` are the frame classes of word ``i``'s HMM states.
        num_classes: The number of frame classes the graph reads (matrix columns).
        silence_class: The class of silence frames.
    """

    fst: kaldifst.StdVectorFst
    words: tuple[str, ...]
    word_classes: tuple[tuple[int, ...], ...]
    num_classes: int
    silence_class: int

    def word(self, olabel: int) -> str:
        """The word of output label ``olabel`` (1-based)."""
        return self.words[olabel - 1]


def word_classes(num_classes: int, states_per_word: int,
                 silence_class: int) -> tuple[tuple[int, ...], ...]:
    """Frame classes of each word's HMM: consecutive runs of the non-silence classes.

    With 31 classes, 3 states per word and silence 30 this is word d = classes 3d..3d+2,
    the layout of the digit set (``examples/digits/build.py``).

    Raises:
        ValueError: If the non-silence classes do not split into whole words.
    """
    if not 0 <= silence_class < num_classes:
        raise ValueError(f"silence class {silence_class} is not one of the {num_classes} "
                         f"classes; pass a silence class in [0, {num_classes})")
    if states_per_word < 1 or (num_classes - 1) % states_per_word:
        raise ValueError(f"{num_classes - 1} non-silence classes do not split into words of "
                         f"{states_per_word} states; check num_classes and states_per_word")
    speech = [c for c in range(num_classes) if c != silence_class]
    return tuple(tuple(speech[i:i + states_per_word])
                 for i in range(0, len(speech), states_per_word))


def _self_loop_probs(self_loop_prob: float | Sequence[float], num_classes: int) -> np.ndarray:
    if np.ndim(self_loop_prob) == 0:
        probs = np.full(num_classes, float(np.asarray(self_loop_prob)))
    else:
        probs = np.asarray(self_loop_prob, dtype=np.float64)
    if probs.shape != (num_classes,):
        raise ValueError(f"got {probs.size} self-loop probabilities for {num_classes} classes; "
                         "pass one number or one per class")
    if not np.all((probs > 0) & (probs < 1)):
        raise ValueError(f"self-loop probabilities must lie strictly between 0 and 1, got "
                         f"{probs.min():g}..{probs.max():g}")
    return probs


def build_graph(num_classes: int = 31, states_per_word: int = 3, silence_class: int = 30,
                self_loop_prob: float | Sequence[float] = DEFAULT_SELF_LOOP_PROB,
                silence_prob: float = DEFAULT_SILENCE_PROB, word_penalty: float = 0.0,
                words: Sequence[str] | None = None) -> DecodingGraph:
    """Build the digit-loop decoding graph (layout and weights: the module docstring).

    Args:
        num_classes: Frame classes (matrix columns).
        states_per_word: HMM states per word.
        silence_class: The silence class.
        self_loop_prob: Every state's self-loop probability, or one per class (e.g. from
            :func:`estimate_self_loop_probs`).
        silence_prob: Probability of silence before the first and after each word.
        word_penalty: Cost (negative log-probability) added per word; positive means fewer.
        words: The words' names in class order; default ``"0"``, ``"1"``, ... .

    Raises:
        ValueError: For an inconsistent layout or a probability outside (0, 1).
    """
    groups = word_classes(num_classes, states_per_word, silence_class)
    names = tuple(words) if words is not None else tuple(str(i) for i in range(len(groups)))
    if len(names) != len(groups):
        raise ValueError(f"{len(names)} word names for {len(groups)} words")
    if not 0 < silence_prob < 1:
        raise ValueError(f"silence probability must lie strictly between 0 and 1, got "
                         f"{silence_prob:g}")
    loop = _self_loop_probs(self_loop_prob, num_classes)

    def cost(prob: float) -> float:
        return -math.log(prob)

    enter = -math.log(1.0 / len(groups)) + word_penalty  # G's uniform word cost + penalty
    q_sil = 1.0 - loop[silence_class]
    fst = kaldifst.StdVectorFst()
    for _ in range(_FIRST_WORD_STATE + len(groups) * states_per_word):
        fst.add_state()
    fst.start = START

    def first(w: int) -> int:
        return _FIRST_WORD_STATE + w * states_per_word

    def enter_words(src: int, base_cost: float) -> None:
        for w, classes in enumerate(groups):
            fst.add_arc(src, kaldifst.StdArc(input_label(classes[0]), w + 1,
                                             base_cost + enter, first(w)))

    sil_in = input_label(silence_class)
    fst.add_arc(START, kaldifst.StdArc(sil_in, 0, cost(silence_prob), LEADING_SILENCE))
    enter_words(START, cost(1.0 - silence_prob))
    for sil in (LEADING_SILENCE, SILENCE):
        fst.add_arc(sil, kaldifst.StdArc(sil_in, 0, cost(loop[silence_class]), sil))
        enter_words(sil, cost(q_sil))
    fst.set_final(SILENCE, cost(q_sil))
    for w, classes in enumerate(groups):
        for k, cls in enumerate(classes):
            state = first(w) + k
            fst.add_arc(state, kaldifst.StdArc(input_label(cls), 0, cost(loop[cls]), state))
            leave = cost(1.0 - loop[cls])
            if k + 1 < len(classes):
                fst.add_arc(state, kaldifst.StdArc(input_label(classes[k + 1]), 0, leave,
                                                   state + 1))
                continue
            fst.add_arc(state, kaldifst.StdArc(sil_in, 0, leave + cost(silence_prob), SILENCE))
            enter_words(state, leave + cost(1.0 - silence_prob))
            fst.set_final(state, leave + cost(1.0 - silence_prob))
    # Sorted input labels let the decoder find a state's arcs for a label by search; Kaldi's
    # tools sort HCLG the same way.
    kaldifst.arcsort(fst, sort_type="ilabel")
    return DecodingGraph(fst=fst, words=names, word_classes=groups, num_classes=num_classes,
                         silence_class=silence_class)


def estimate_self_loop_probs(labels: np.ndarray, offsets: np.ndarray,
                             num_classes: int) -> np.ndarray:
    """Per-class self-loop probabilities from the mean state durations of frame labels.

    A state with self-loop probability p stays a geometric number of frames with mean
    1 / (1 - p); so p_c = 1 - 1 / mean run length of class c. Runs are cut at utterance
    boundaries. A class never seen gets :data:`DEFAULT_SELF_LOOP_PROB`; p is kept in [0.01, 0.99]
    so that every state can be both stayed in and left.

    Args:
        labels: ``[T]`` frame classes of all utterances, concatenated.
        offsets: ``[U+1]`` utterance boundaries into ``labels``.
        num_classes: Number of classes.

    Returns:
        ``[num_classes]`` float64 probabilities.
    """
    labels = np.asarray(labels, dtype=np.int64)
    boundary = np.zeros(len(labels), dtype=bool)
    if len(labels):
        boundary[0] = True
        boundary[1:] = labels[1:] != labels[:-1]
        inner = np.asarray(offsets, dtype=np.int64)[1:-1]
        boundary[inner[inner < len(labels)]] = True
    run_starts = np.flatnonzero(boundary)
    run_lengths = np.diff(np.append(run_starts, len(labels)))
    run_classes = labels[run_starts]
    frames = np.bincount(run_classes, weights=run_lengths, minlength=num_classes)
    runs = np.bincount(run_classes, minlength=num_classes)
    probs = np.full(num_classes, DEFAULT_SELF_LOOP_PROB)
    seen = runs > 0
    probs[seen] = 1.0 - runs[seen] / frames[seen]
    return np.clip(probs, 0.01, 0.99)
