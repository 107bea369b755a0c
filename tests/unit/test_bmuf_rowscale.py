"""``--bmuf-wire-scale rows``: each row's scale from its averaged progress (issue 57 screen)."""

from __future__ import annotations

import torch
from torch import nn

from hadpsgd.algorithms.bmuf.rowscale import DECAY, FLOOR, RowScales


def _slots() -> tuple[dict[torch.dtype, torch.Tensor], list[tuple[nn.Parameter, int]]]:
    flat = torch.zeros(3 * 4 + 2)
    w = nn.Parameter(torch.empty(3, 4))
    b = nn.Parameter(torch.empty(2))
    return {torch.float32: flat}, [(w, 0), (b, 12)]


def test_scale_is_one_before_anything_arrived() -> None:
    params, slots = _slots()
    rows = RowScales(params)
    assert torch.equal(rows.scale(slots, torch.float32, 0, 14), torch.ones(14))


def test_scale_follows_each_rows_root_mean_square_within_its_parameter() -> None:
    params, slots = _slots()
    rows = RowScales(params)
    mean = torch.zeros(14)
    mean[0:4] = 4.0      # row 0: rms 4
    mean[4:8] = 2.0      # row 1: rms 2
    mean[8:12] = 0.0     # row 2: nothing sent
    mean[12:14] = 7.0    # the vector: one row
    rows.update(slots, torch.float32, 0, mean)
    s = rows.scale(slots, torch.float32, 0, 14)
    # Independent reference: the weight's rms over its 12 values is sqrt((16 + 4 + 0) / 3).
    own = ((16.0 + 4.0) / 3) ** 0.5
    assert torch.allclose(s[0:4], torch.full((4,), 4.0 / own))
    assert torch.allclose(s[4:8], torch.full((4,), 2.0 / own))
    assert torch.allclose(s[8:12], torch.full((4,), FLOOR))   # floored, not zero
    assert torch.allclose(s[12:14], torch.ones(2))            # a vector is its own scale


def test_average_decays_and_round_trips() -> None:
    params, slots = _slots()
    rows = RowScales(params)
    rows.update(slots, torch.float32, 0, torch.ones(14))
    rows.update(slots, torch.float32, 0, torch.zeros(14))
    expected = (1 - DECAY) * DECAY
    assert torch.allclose(rows.mean_square[torch.float32], torch.full((14,), expected))
    again = RowScales(params)
    again.load_state_dict(rows.state_dict())
    assert torch.equal(again.mean_square[torch.float32], rows.mean_square[torch.float32])
