"""examples/own_model.py's scoring: greedy CTC to classes, classes to digit words."""

from __future__ import annotations

import sys

import torch

from tests._mpi import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import own_model  # noqa: E402


def _logits(symbols: list[int], num: int = 32) -> torch.Tensor:
    out = torch.full((len(symbols), num), -5.0)
    out[torch.arange(len(symbols)), torch.tensor(symbols)] = 5.0
    return out


def test_greedy_ctc_merges_runs_and_drops_blanks():
    # Symbols are classes + 1; 0 is the blank. "7 7 0 7" is two 6s (the blank splits them).
    logits = _logits([0, 7, 7, 8, 0, 9, 9, 31, 0, 7, 0, 7])
    assert own_model.greedy_classes(logits) == [6, 7, 8, 30, 6, 6]


def test_a_word_starts_where_a_digits_first_state_follows_anything_else():
    words = own_model.digit_words
    assert words([30, 24, 25, 26, 30, 9, 10, 11, 30]) == ["8", "3"]
    assert words([6, 7, 8, 6, 7, 8]) == ["2", "2"]  # back to back: two words
    assert words([6, 6, 7, 8]) == ["2"]  # a first state split by a blank: one word
    assert words([30, 7, 8, 30]) == []  # no first state, no word (a deletion)
    assert words([0, 1, 2, 3, 30]) == ["0", "1"]
