"""CHOCO-SGD's per-edge estimates (hadpsgd.algorithms.choco), two ends of an edge in-process."""

from __future__ import annotations

import pytest
import torch

from hadpsgd.algorithms.choco import ChocoEdges
from hadpsgd.comm.codec import payload_bytes

WIRE = "topk:0.015625"


def _round(a: ChocoEdges, b: ChocoEdges, xa: torch.Tensor, xb: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One exchange between ends 0 and 1 of an edge, as the gossip thread runs it."""
    ma, mb = a.message(1, xa), b.message(0, xb)
    da = a.mix(1, ma, mb, torch.empty_like(xa))
    db = b.mix(0, mb, ma, torch.empty_like(xb))
    return da, db


def test_ends_stay_mirrored_and_deltas_are_exact_negations():
    torch.manual_seed(0)
    n = 10_000
    x0 = torch.randn(n)
    a, b = ChocoEdges(n, torch.float32, WIRE, 0.3), ChocoEdges(n, torch.float32, WIRE, 0.3)
    a.seed([1], x0)
    b.seed([0], x0)
    xa, xb = x0 + 0.1 * torch.randn(n), x0 + 0.1 * torch.randn(n)
    for _ in range(20):
        total = xa + xb
        da, db = _round(a, b, xa, xb)
        assert torch.equal(da, -db)  # the pair's sum moves by nothing, bit for bit
        xa, xb = xa + da, xb + db
        assert torch.allclose(xa + xb, total, atol=1e-6)
        xa, xb = xa - 0.01 * torch.randn(n), xb - 0.01 * torch.randn(n)  # local steps
    # each end's (mine, theirs) is the other's (theirs, mine), to the bit
    assert torch.equal(a.edges[1][0], b.edges[0][1]) and torch.equal(a.edges[1][1], b.edges[0][0])
    assert payload_bytes(n, WIRE) * 100 < 4 * n  # what one message costs against fp32


def test_estimates_catch_up_and_the_pair_meets_at_its_mean():
    # No local steps: the estimates take in what they lack, chunk by chunk, and the two
    # models meet at their mean (a small step, as CHOCO-SGD needs for a 1/64 code).
    torch.manual_seed(1)
    n = 4096
    x0 = torch.zeros(n)
    a, b = ChocoEdges(n, torch.float32, WIRE, 0.05), ChocoEdges(n, torch.float32, WIRE, 0.05)
    a.seed([1], x0)
    b.seed([0], x0)
    xa, xb = torch.randn(n), torch.randn(n)
    mean, gap0 = (xa + xb) / 2, float((xa - xb).abs().max())
    for _ in range(3000):
        da, db = _round(a, b, xa, xb)
        xa, xb = xa + da, xb + db
    assert torch.allclose((xa + xb) / 2, mean, atol=1e-4)
    assert float((xa - xb).abs().max()) < 0.05 * gap0
    assert float((a.edges[1][0] - xa).abs().max()) < 0.05 * gap0  # the estimate caught up


def test_start_from_a_dense_exchange_and_the_step_bounds():
    n = 64
    a = ChocoEdges(n, torch.float32, WIRE, 1.0)
    assert not a.holds(3)
    own, other = torch.zeros(n), torch.ones(n)
    delta = a.start(3, own, other, torch.empty(n))
    assert a.holds(3) and torch.equal(delta, torch.full((n,), 0.5))  # plain gossip's half
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="gossip step"):
            ChocoEdges(n, torch.float32, WIRE, bad)
