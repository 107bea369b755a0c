"""BMUF-Adam invariants derived from the paper (bmuf-adam, section 2), not from the code.

With a constant gradient ``g`` every mini-batch is the same, so the paper's stationarity
assumption holds exactly and its bookkeeping can be checked without a reference run:

- Adam's bias-corrected moments stay exactly ``g`` and ``g * g`` across any number of block
  syncs (Eq. 16-18 with ``k += eta * rho``: the moments are those of ``k`` mini-batches).
- Every local Adam step then moves the model by the same vector ``s = -alpha g / (|g| + eps)``,
  so the start point of each block lies exactly ``k`` steps from the initial model: the
  equivalent mini-batches of the start point (Eq. 4: ``Delta_n`` is ``rho_n`` of them) equal
  Adam's ``k``. Nesterov's start ``theta_bar + eta Delta_n`` (Eq. 9) is ``eta rho_n`` beyond the
  average, the classical ``theta_n = theta_bar + eta Delta_{n-1}`` (Eq. 6) ``eta rho_{n-1}``.
- SGD's momentum buffer (``buf = mu buf + g``, torch's convention) after ``K`` mini-batches is
  ``g (1 - mu^K) / (1 - mu)``; the correction keeps it at the ``K`` of the start point.

The topology is one process (no communication), with the block momentum set explicitly.
"""

from __future__ import annotations

import pytest
import torch

from hadpsgd.algorithms import BMUF
from tests.unit.test_bmuf_config import OneLearner

G = torch.tensor([0.7, -1.3, 0.05, 2.0, -0.4], dtype=torch.float64)
ALPHA, EPS, TAU, ETA, SYNCS = 0.01, 1e-8, 8, 0.75, 20


class Linear(torch.nn.Module):
    """f(theta) = g . theta: the gradient is g at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros_like(G))

    def forward(self) -> torch.Tensor:
        return (self.theta * G).sum()


def _step(model: Linear, algo: BMUF) -> None:
    model().backward()
    algo.step()
    algo.zero_grad()


@pytest.mark.parametrize("nesterov", [True, False], ids=["nbm", "cbm"])
@pytest.mark.parametrize("beta1", [0.5, 0.9])
def test_constant_gradient_adam_moments_and_start_point_agree(nesterov, beta1):
    model = Linear()
    opt = torch.optim.Adam(model.parameters(), lr=ALPHA, betas=(beta1, 0.99), eps=EPS)
    algo = BMUF(model, opt, OneLearner(), sync_period=TAU, block_momentum=ETA,
                nesterov=nesterov, adam_moments="corrected")
    s = -ALPHA * G / (G.abs() + EPS)  # one Adam step with m_hat = g, v_hat = g^2
    rho_prev = rho = 0.0
    for n in range(1, SYNCS + 1):
        for _ in range(TAU):
            _step(model, algo)
        assert algo.num_syncs == n
        rho_prev, rho = rho, ETA * rho + TAU                       # Eq. 4
        st = opt.state[model.theta]
        k = float(st["step"])
        m_hat = st["exp_avg"] / (1 - beta1 ** k)
        v_hat = st["exp_avg_sq"] / (1 - 0.99 ** k)
        torch.testing.assert_close(m_hat, G, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(v_hat, G * G, rtol=1e-6, atol=1e-9)
        # the start point of the next block is k equivalent mini-batches from theta_0
        torch.testing.assert_close(model.theta.detach(), k * s, rtol=1e-6, atol=1e-9)
        extra = ETA * (rho if nesterov else rho_prev)
        # (torch keeps Adam's step in float32: k is exact to its precision)
        assert k == pytest.approx(n * TAU + sum_extra(n, nesterov), rel=1e-6)
        assert extra >= 0


def sum_extra(n: int, nesterov: bool) -> float:
    """Sum over blocks 1..n of eta * rho_i (Nesterov) or eta * rho_{i-1} (classical)."""
    rho, total = 0.0, 0.0
    for _ in range(n):
        prev, rho = rho, ETA * rho + TAU
        total += ETA * (rho if nesterov else prev)
    return total


def test_constant_gradient_average_moments_leave_the_start_point_behind():
    """Eq. 13 (average) keeps k: the moments are stale for the start point (the paper's point),
    which the invariant above detects; it is not vacuous."""
    model = Linear()
    opt = torch.optim.Adam(model.parameters(), lr=ALPHA, betas=(0.5, 0.99), eps=EPS)
    algo = BMUF(model, opt, OneLearner(), sync_period=TAU, block_momentum=ETA,
                adam_moments="average")
    s = -ALPHA * G / (G.abs() + EPS)
    for _ in range(3 * TAU):
        _step(model, algo)
    k = float(opt.state[model.theta]["step"])
    assert k == 3 * TAU
    assert not torch.allclose(model.theta.detach(), k * s, rtol=1e-3)


@pytest.mark.parametrize("nesterov", [True, False], ids=["nbm", "cbm"])
def test_constant_gradient_sgd_momentum_buffer_follows_the_start_point(nesterov):
    mu = 0.9
    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=ALPHA, momentum=mu)
    algo = BMUF(model, opt, OneLearner(), sync_period=TAU, block_momentum=ETA,
                nesterov=nesterov, adam_moments="corrected")
    for n in range(1, 6):
        for _ in range(TAU):
            _step(model, algo)
        big_k = n * TAU + sum_extra(n, nesterov)  # mini-batches behind the start point
        buf = opt.state[model.theta]["momentum_buffer"]
        torch.testing.assert_close(buf, G * (1 - mu ** big_k) / (1 - mu), rtol=1e-9,
                                   atol=1e-12)


@pytest.mark.parametrize("moments", ["keep", "reset"])
def test_warmup_moments_keep_or_reset(moments):
    model = Linear()
    opt = torch.optim.Adam(model.parameters(), lr=ALPHA, betas=(0.5, 0.99), eps=EPS)
    algo = BMUF(model, opt, OneLearner(), sync_period=TAU, block_momentum=ETA,
                warmup_steps=3, warmup_moments=moments)
    for _ in range(3):
        _step(model, algo)
    assert algo.started
    st = opt.state[model.theta]
    if moments == "reset":  # a fresh Adam: zero buffers, k = 0
        assert float(st["step"]) == 0.0 and not st["exp_avg"].any()
        assert not st["exp_avg_sq"].any()
    else:
        assert float(st["step"]) == 3.0
        torch.testing.assert_close(st["exp_avg"], G * (1 - 0.5 ** 3))
    # either way BMUF then keeps the bias-corrected moments exact
    for _ in range(2 * TAU):
        _step(model, algo)
    k = float(st["step"])
    torch.testing.assert_close(st["exp_avg"] / (1 - 0.5 ** k), G, rtol=1e-6, atol=1e-9)


class FourWorkers(OneLearner):
    """Four identical workers of one learner each: every mean is the value itself."""

    size, num_nodes = 4, 4

    def grad_pipeline(self) -> None:
        """No pipelined route: the means stay the fake's own."""


@pytest.mark.parametrize("warmup_lr, factor", [("worker", 1.0), ("world", 4.0),
                                               (None, 1.0)])  # the default at 4 workers
def test_warmup_steps_at_the_worker_or_the_world_rate(warmup_lr, factor):
    # SGD without momentum moves by lr * g a step: the warm-up's steps at the world's rate
    # (N = 4 workers' batch, --bmuf-worker-lr single) are N such steps each, then BMUF's
    # workers step at their own rate again, which the schedule set and still finds.
    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=ALPHA)
    algo = BMUF(model, opt, FourWorkers(), sync_period=TAU, block_momentum=ETA,
                adam_moments="local", warmup_steps=3, warmup_lr=warmup_lr)
    for _ in range(3):
        _step(model, algo)
    assert algo.started
    torch.testing.assert_close(model.theta.detach(), -3 * factor * ALPHA * G)
    assert opt.param_groups[0]["lr"] == ALPHA
    _step(model, algo)
    torch.testing.assert_close(model.theta.detach(), -(3 * factor + 1) * ALPHA * G)


def test_sync_keeps_the_block_running_and_finish_closes_it():
    model = Linear()
    opt = torch.optim.Adam(model.parameters(), lr=ALPHA, betas=(0.5, 0.99), eps=EPS)
    algo = BMUF(model, opt, OneLearner(), sync_period=TAU, block_momentum=ETA)
    for _ in range(TAU + 3):
        _step(model, algo)
    before = model.theta.detach().clone()
    algo.sync()
    assert algo.num_syncs == 1 and algo.block_steps == 3
    assert torch.equal(model.theta.detach(), before)
    algo.finish()
    assert algo.num_syncs == 2 and algo.block_steps == 0
