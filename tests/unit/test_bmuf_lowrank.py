"""``--bmuf-low-rank``: a block's progress as PowerSGD factors, checked against the paper.

The references are Algorithm 1 of Vogels et al. (2019) written out here with plain torch on
the nodes' mean (``P = M Q``, ``P^ = orth(P)``, ``Q = M^T P^``, send ``P^ Q^T``, the node
keeps ``M - P^ Q^T``), never the module's own steps. Nodes are threads with a barrier-made
mean, so the cross-node means are exact and in node order. A node's next delta carries what
it kept (its model holds it), as :meth:`LowRankDelta.keep` arranges in a run.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hadpsgd.algorithms.bmuf.lowrank import LOW_RANK_SEED, LowRankDelta, matrices
from hadpsgd.algorithms.bmuf.options import BMUFOptions
from hadpsgd.cli import ConfigError


class _Nodes:
    """The mean across ``n`` node threads: each hands in its tensor, all get the mean."""

    def __init__(self, n: int) -> None:
        self.n, self.barrier = n, threading.Barrier(n)
        self.box: dict[int, torch.Tensor] = {}
        self.calls: list[tuple[str, int, bool]] = []

    def mean(self, node: int) -> object:
        def mean_(key: str, t: torch.Tensor, feedback: bool) -> torch.Tensor:
            self.box[node] = t.clone()
            if node == 0:
                self.calls.append((key, t.numel(), feedback))
            self.barrier.wait()
            total = sum(self.box[i] for i in range(self.n)) / self.n
            self.barrier.wait()
            t.copy_(total)
            return t
        return mean_


def _layout(rank: int) -> tuple[list[tuple[torch.nn.Parameter, int]], int]:
    """A fragment: a 12 x 5 matrix, a bias of 12, a 3-D weight (8 x 2 x 3), a 2 x 2 one."""
    shapes = [(12, 5), (12,), (8, 2, 3), (2, 2)]
    slots, at = [], 100  # the fragment starts at 100 in the flat buffer
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape))
        slots.append((p, at))
        at += p.numel()
    return slots, at - 100


def _run(deltas: list[list[torch.Tensor]], rank: int
         ) -> tuple[list[list[torch.Tensor]], list[LowRankDelta], _Nodes, list[torch.Tensor]]:
    """Each node's coder through rounds of its own progress: what every node was sent, the
    coders, the mean's calls and what each node's model holds at the end (beyond the global
    model).

    As in a run, a node's delta of a block is its new progress plus what the factors left of
    its last one (added to its model by ``keep``).
    """
    slots, numel = _layout(rank)
    nodes = _Nodes(len(deltas))
    coders = [LowRankDelta(rank, matrices(slots, 100, rank), numel, torch.float32,
                           torch.device("cpu")) for _ in deltas]
    out: list[list[torch.Tensor]] = [[] for _ in deltas]
    models = [torch.zeros(numel) for _ in deltas]

    def node(i: int) -> None:
        model = models[i]  # beyond the global model: progress since the block's start
        for d in deltas[i]:
            model += d
            part = model.clone()
            coders[i].mean_(part, nodes.mean(i), "fragment0")
            out[i].append(part)
            model.zero_()
            coders[i].keep(model)  # the next block starts at the global model + what is left

    threads = [threading.Thread(target=node, args=(i,)) for i in range(len(deltas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, coders, nodes, models


def test_only_matrices_whose_factors_are_smaller_go_as_factors() -> None:
    slots, _ = _layout(2)
    mats = matrices(slots, 100, 2)
    # 12 x 5: 2 (12 + 5) = 34 < 60; 8 x 6: 28 < 48; 2 x 2: 8 >= 4 stays dense; bias: a vector.
    assert [(m.start, m.rows, m.cols) for m in mats] == [(0, 12, 5), (72, 8, 6)]
    assert len(matrices(slots, 100, 3)) == 2  # 3 x 17 = 51 < 60, 3 x 14 = 42 < 48
    assert matrices(slots, 100, 4) == []  # 4 x 17 = 68 >= 60, 4 x 14 = 56 >= 48


def test_one_block_is_the_papers_power_step_on_the_nodes_mean() -> None:
    torch.manual_seed(0)
    numel = _layout(2)[1]
    deltas = [[torch.randn(numel)] for _ in range(3)]
    out, coders, nodes, models = _run(deltas, 2)
    mean = sum(d[0] for d in deltas) / 3
    gen = torch.Generator().manual_seed(LOW_RANK_SEED)
    expect = mean.clone()
    for start, rows, cols in ((0, 12, 5), (72, 8, 6)):
        q0 = torch.randn(cols, 2, generator=gen, dtype=torch.float64).float()
        m = mean[start:start + rows * cols].view(rows, cols)
        p_hat = torch.linalg.qr((m @ q0).double()).Q.float()
        q = m.T @ p_hat
        expect[start:start + rows * cols] = (p_hat @ q.T).reshape(-1)
    for i in range(3):
        torch.testing.assert_close(out[i][0], expect, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[i][0], out[0][0])  # bit-identical on every node
        # Each node's model holds what the factors left of its own delta.
        assert coders[i].left is None
        for (start, rows, cols) in ((0, 12, 5), (72, 8, 6)):
            span = slice(start, start + rows * cols)
            torch.testing.assert_close(models[i][span], (deltas[i][0] - expect)[span],
                                       rtol=1e-5, atol=1e-5)
    # The vectors and the small matrix went with the wire (feedback), the factors without.
    assert nodes.calls == [("fragment0-rest", 12 + 4, True), ("fragment0-P", 2 * (12 + 8), False),
                           ("fragment0-Q", 2 * (5 + 6), False)]


def test_a_delta_of_the_factors_rank_crosses_whole() -> None:
    torch.manual_seed(1)
    numel = _layout(2)[1]
    d = torch.randn(numel)
    d[:60] = (torch.randn(12, 2) @ torch.randn(2, 5)).reshape(-1)
    d[72:120] = (torch.randn(8, 1) @ torch.randn(1, 6)).reshape(-1)
    out, _, _, models = _run([[d], [d]], 2)
    torch.testing.assert_close(out[0][0], d, rtol=1e-4, atol=1e-5)
    assert models[0][:60].abs().max() < 1e-4 and models[0][72:120].abs().max() < 1e-4


def test_nothing_is_lost_for_good() -> None:
    """Over K blocks what a node was sent plus what it still holds is all its progress."""
    torch.manual_seed(2)
    numel = _layout(1)[1]
    deltas = [[torch.randn(numel) for _ in range(6)] for _ in range(2)]
    out, _, _, held = _run(deltas, 1)
    mats = matrices(_layout(1)[0], 100, 1)
    for i in range(2):
        sent, own = sum(out[i]), sum(deltas[i])
        for m in mats:
            span = slice(m.start, m.start + m.rows * m.cols)
            torch.testing.assert_close(sent[span] + held[i][span], own[span], rtol=1e-4,
                                       atol=1e-4)
    # Both nodes were sent the same: the mean of their progress less the mean of what they hold.
    for m in mats:
        span = slice(m.start, m.start + m.rows * m.cols)
        torch.testing.assert_close(
            sum(out[0])[span], ((sum(deltas[0]) + sum(deltas[1])) / 2)[span]
            - ((held[0] + held[1]) / 2)[span], rtol=1e-4, atol=1e-4)


def test_the_state_resumes_the_next_block_exactly() -> None:
    torch.manual_seed(3)
    slots, numel = _layout(2)
    deltas = [torch.randn(numel) for _ in range(3)]
    nodes = _Nodes(1)

    def blocks(coder: LowRankDelta, model: torch.Tensor, ds: list[torch.Tensor],
               stop_before_keep: bool = False) -> list[torch.Tensor]:
        sent = []
        for k, d in enumerate(ds):
            model += d
            part = model.clone()
            coder.mean_(part, nodes.mean(0), "fragment0")
            sent.append(part)
            model.zero_()
            if not (stop_before_keep and k == len(ds) - 1):
                coder.keep(model)
        return sent

    def coder(rank: int = 2) -> LowRankDelta:
        return LowRankDelta(rank, matrices(slots, 100, rank), numel, torch.float32,
                            torch.device("cpu"))

    full = blocks(coder(), torch.zeros(numel), deltas)
    first = coder()
    blocks(first, torch.zeros(numel), deltas[:2], stop_before_keep=True)  # saved mid-way
    state = first.state_dict()
    assert state["left"] is not None  # a mean arrived, not yet kept: it must travel
    again = coder()
    again.load_state_dict(state)
    model = torch.zeros(numel)
    again.keep(model)
    assert torch.equal(blocks(again, model, deltas[2:])[0], full[2])
    with pytest.raises(ValueError, match="another layout or rank"):
        coder(3).load_state_dict(state)


@pytest.mark.parametrize("values, match", [
    (dict(low_rank=-1), "--bmuf-low-rank must be >= 0"),
    (dict(low_rank=2, wire="sign"), "too coarse"),
])
def test_bad_low_rank_options_name_the_flag(values: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        BMUFOptions(**values)
