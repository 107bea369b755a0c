"""Decoding and scoring: frame log-likelihoods to digit strings and a word error rate.

``python -m hadpsgd.decode LOGLIKES --refs utt-id`` (docs/decode.md). The graph
(:mod:`~hadpsgd.decode.graph`), the search (:mod:`~hadpsgd.decode.search`), the scoring
(:mod:`~hadpsgd.decode.wer`) and the input (:mod:`~hadpsgd.decode.loglikes`) are apart; none
imports torch.

The names below load on first use (PEP 562): kaldifst, kaldi-decoder and kaldialign are the
optional ``decode`` extra, and ``python -m hadpsgd.decode`` imports this package before its
``main`` can say which of them is missing.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hadpsgd.decode.graph import DecodingGraph, build_graph, estimate_self_loop_probs
    from hadpsgd.decode.search import Decoder, Hypothesis
    from hadpsgd.decode.wer import Score, score

_HOME = {"DecodingGraph": "graph", "build_graph": "graph", "estimate_self_loop_probs": "graph",
         "Decoder": "search", "Hypothesis": "search", "Score": "wer", "score": "wer"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(import_module(f"hadpsgd.decode.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Decoder", "DecodingGraph", "Hypothesis", "Score", "build_graph",
           "estimate_self_loop_probs", "score"]
