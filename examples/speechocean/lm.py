"""A word bigram language model from the training transcripts, and its grammar FST G.

Estimation (no SRILM, no KenLM: counts and two formulas):

* unigram, add-``alpha`` (Laplace with ``alpha = 1``) over the decoding vocabulary and
  ``</s>``: ``P1(w) = (c(w) + alpha) / (N + alpha * |V|)``, so every word of the vocabulary,
  seen in training or not, has a probability;
* bigram, interpolated absolute discounting (``D = 0.5`` by default, taken off every seen
  bigram count): ``P(w | h) = max(c(h, w) - D, 0) / c(h) + D * n(h) / c(h) * P1(w)``, with
  ``n(h)`` the number of distinct words seen after ``h``; histories are the words and
  ``<s>``.

It is stored, as an ARPA file stores an interpolated model, in backoff form: a seen bigram
keeps its interpolated probability, an unseen one is ``bow(h) * P1(w)`` with the backoff
weight ``bow(h) = (1 - sum_seen P(w | h)) / (1 - sum_seen P1(w))`` that makes every
history's distribution sum to 1 (:meth:`BigramLM.prob`). :meth:`BigramLM.fst` writes it as
Kaldi's ``arpa2fst`` would: one state per history with its seen bigrams, a backoff arc
(input ``#0``, output epsilon, cost ``-ln bow(h)``) to the unigram state, ``</s>`` as the
final weight; costs are natural-log negatives (tropical weights).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import kaldifst

BOS, EOS = "<s>", "</s>"


@dataclass
class BigramLM:
    """The model (see the module docstring).

    Attributes:
        vocab: The decoding vocabulary, in word-id order (id = index + 1).
        alpha: The unigram's add-alpha.
        discount: The bigram's absolute discount.
    """

    vocab: list[str]
    alpha: float = 1.0
    discount: float = 0.5
    unigrams: Counter[str] = field(default_factory=Counter)
    bigrams: dict[str, Counter[str]] = field(default_factory=dict)

    @classmethod
    def estimate(cls, sentences: Iterable[Sequence[str]], vocab: Iterable[str],
                 alpha: float = 1.0, discount: float = 0.5) -> BigramLM:
        """Count ``sentences`` (words outside ``vocab`` are dropped from them first).

        Raises:
            ValueError: For ``alpha <= 0`` or a discount outside (0, 1).
        """
        if alpha <= 0 or not 0 < discount < 1:
            raise ValueError(f"need alpha > 0 and 0 < discount < 1, got {alpha}, {discount}")
        words = sorted(set(vocab) - {BOS, EOS})
        known = set(words)
        model = cls(words, alpha, discount)
        for sentence in sentences:
            seq = [BOS, *(w for w in sentence if w in known), EOS]
            model.unigrams.update(seq[1:])
            for h, w in zip(seq[:-1], seq[1:], strict=True):
                model.bigrams.setdefault(h, Counter())[w] += 1
        return model

    def p_unigram(self, word: str) -> float:
        """``P1(word)`` over the vocabulary and ``</s>``."""
        total = sum(self.unigrams.values()) + self.alpha * (len(self.vocab) + 1)
        return (self.unigrams[word] + self.alpha) / total

    def seen(self, history: str) -> dict[str, float]:
        """The interpolated probabilities of the words seen after ``history``."""
        after = self.bigrams.get(history)
        if not after:
            return {}
        count = sum(after.values())
        mass = self.discount * len(after) / count
        return {w: (c - self.discount) / count + mass * self.p_unigram(w)
                for w, c in after.items()}

    def backoff(self, history: str) -> float:
        """``bow(history)``: the weight of the unigram for words unseen after ``history``."""
        seen = self.seen(history)
        if not seen:
            return 1.0
        return (1.0 - sum(seen.values())) / (1.0 - sum(map(self.p_unigram, seen)))

    def prob(self, word: str, history: str) -> float:
        """``P(word | history)`` of the backoff model (``word`` may be ``</s>``)."""
        seen = self.seen(history)
        if word in seen:
            return seen[word]
        return self.backoff(history) * self.p_unigram(word)

    def perplexity(self, sentences: Iterable[Sequence[str]]) -> tuple[float, int]:
        """``(perplexity, words scored)`` over ``sentences`` (``</s>`` counted; OOVs skipped)."""
        known = set(self.vocab)
        logprob, count = 0.0, 0
        for sentence in sentences:
            seq = [BOS, *(w for w in sentence if w in known), EOS]
            for h, w in zip(seq[:-1], seq[1:], strict=True):
                logprob += math.log(self.prob(w, h))
                count += 1
        return math.exp(-logprob / max(1, count)), count

    def fst(self, word_ids: dict[str, int], backoff_label: int) -> kaldifst.StdVectorFst:
        """G: the model as a transducer over word ids (backoff arcs ``#0:eps``).

        Args:
            word_ids: Word -> label (``words.txt``), for every word of the vocabulary.
            backoff_label: The input label of backoff arcs (``#0``: epsilon in the output,
                so the graph's determinization cannot merge a backoff path with a seen one).
        """
        g = kaldifst.StdVectorFst()
        unigram = g.add_state()
        states = {BOS: g.add_state()}
        g.start = states[BOS]
        for h in sorted(self.bigrams):
            if h != BOS and h in word_ids:
                states[h] = g.add_state()

        def target(word: str) -> int:
            return states.get(word, unigram)

        def cost(prob: float) -> float:
            return -math.log(prob)

        for w in self.vocab:
            g.add_arc(unigram, kaldifst.StdArc(word_ids[w], word_ids[w],
                                               cost(self.p_unigram(w)), target(w)))
        g.set_final(unigram, cost(self.p_unigram(EOS)))
        for h, state in states.items():
            for w, p in sorted(self.seen(h).items()):
                if w == EOS:
                    g.set_final(state, cost(p))
                else:
                    g.add_arc(state, kaldifst.StdArc(word_ids[w], word_ids[w], cost(p),
                                                     target(w)))
            g.add_arc(state, kaldifst.StdArc(backoff_label, 0, cost(self.backoff(h)),
                                             unigram))
        kaldifst.arcsort(g, sort_type="ilabel")
        return g
