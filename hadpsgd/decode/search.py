"""Viterbi beam search of one utterance's log-likelihoods through the graph (kaldi-decoder).

``kaldi_decoder.FasterDecoder`` is Kaldi's ``FasterDecoder`` (token passing with a beam and
a cap on active states); ``kaldi_decoder.DecodableCtc`` hands it the frames. Despite its
name, DecodableCtc is only a matrix lookup: ``log_likelihood(t, k)`` is ``matrix[t, k - 1]``
(label 0 being epsilon, which the decoder never asks for) -- verified by decoding one-frame
matrices through a one-arc-per-label graph (``tests/unit/test_decode.py``,
``test_decodable_reads_label_k_from_column_k_minus_1``). It does not scale the values, so
the acoustic scale is applied to the matrix here, as Kaldi's ``DecodableMatrixScaled`` does.
The decoder adds ``-scaled log-likelihood`` to the graph's cost on every arc it takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import kaldi_decoder
import kaldifst
import numpy as np

DEFAULT_ACOUSTIC_SCALE = 0.1
"""Kaldi's usual scale for hybrid models; measured against others in docs/decode.md."""
DEFAULT_BEAM = 16.0
"""Kaldi's default decoding beam (``FasterDecoderOptions``), in cost units."""
DEFAULT_MAX_ACTIVE = 7000
"""Kaldi's ``decode.sh`` default; the digit graph has 33 states, so it never binds there."""


class Graph(Protocol):
    """What the search needs of a graph: the digit loop's or a user's (``--graph``)."""

    @property
    def fst(self) -> Any:
        """The FST: input label class + 1 (0: epsilon), output label a word id."""

    @property
    def num_classes(self) -> int:
        """Matrix columns the graph reads."""

    def word(self, olabel: int) -> str:
        """The word of an output label."""


@dataclass(frozen=True)
class Hypothesis:
    """One utterance's best path.

    Attributes:
        words: The recognised words.
        graph_cost: The path's graph cost (negative log transition/grammar probability).
        acoustic_cost: The path's negative scaled log-likelihood.
        reached_final: Whether the path ends in a final state; if not (the beam lost every
            final state at the last frame), the best partial path is returned.
    """

    words: tuple[str, ...]
    graph_cost: float
    acoustic_cost: float
    reached_final: bool


class Decoder:
    """Decodes utterances one by one through a graph (:class:`Graph`).

    Args:
        graph: The digit graph (:class:`hadpsgd.decode.graph.DecodingGraph`) or a user's
            (:class:`hadpsgd.decode.user_graph.UserGraph`); kept alive here: the decoder
            holds only a reference to its FST.
        acoustic_scale: Factor on the log-likelihoods before they meet the graph's costs.
        beam: Pruning beam in cost units.
        max_active: The most tokens kept per frame.

    Raises:
        ValueError: For a non-positive scale, beam or max_active.
    """

    def __init__(self, graph: Graph, acoustic_scale: float = DEFAULT_ACOUSTIC_SCALE,
                 beam: float = DEFAULT_BEAM, max_active: int = DEFAULT_MAX_ACTIVE):
        for name, value in (("acoustic scale", acoustic_scale), ("beam", beam),
                            ("max active", max_active)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.graph = graph
        self.acoustic_scale = acoustic_scale
        options = kaldi_decoder.FasterDecoderOptions(beam=beam, max_active=max_active)
        self._decoder = kaldi_decoder.FasterDecoder(graph.fst, options)

    def decode(self, loglikes: np.ndarray) -> Hypothesis:
        """The best word sequence for one utterance.

        Args:
            loglikes: ``[frames, num_classes]`` log-posteriors or pseudo-log-likelihoods.

        Raises:
            ValueError: If the matrix does not have the graph's number of columns.
        """
        if loglikes.ndim != 2 or loglikes.shape[1] != self.graph.num_classes:
            raise ValueError(f"log-likelihood matrix of shape {list(loglikes.shape)}; the "
                             f"graph reads [frames, {self.graph.num_classes}]")
        if loglikes.shape[0] == 0:
            # DecodableCtc takes the address of element (0, 0): never give it an empty matrix.
            return Hypothesis(words=(), graph_cost=0.0, acoustic_cost=0.0, reached_final=False)
        scaled = np.ascontiguousarray(loglikes * self.acoustic_scale, dtype=np.float32)
        self._decoder.decode(kaldi_decoder.DecodableCtc(scaled))
        final = self._decoder.reached_final()
        ok, lattice = self._decoder.get_best_path(use_final_probs=final)
        if not ok:
            return Hypothesis(words=(), graph_cost=float("inf"), acoustic_cost=float("inf"),
                              reached_final=False)
        linear, _, olabels, weight = kaldifst.get_linear_symbol_sequence(lattice)
        if not linear:
            # FasterDecoder's best path is one path already; this is only a safeguard.
            linear, _, olabels, weight = kaldifst.get_linear_symbol_sequence(
                kaldifst.shortest_path(lattice))
        return Hypothesis(words=tuple(self.graph.word(o) for o in olabels),
                          graph_cost=float(weight.value1), acoustic_cost=float(weight.value2),
                          reached_final=final)
