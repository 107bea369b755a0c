"""A model's buffers (BatchNorm) in one memory, and the messages that keep them in agreement.

Without processes: the layout and its views, what each agreement sends (a recording
topology of 2 nodes of 2), the option in every spelling, and the algorithms on one learner.
The agreement across real ranks is tests/mpi/test_buffers.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hadpsgd
from hadpsgd.algorithms import BMUF, SSGD
from hadpsgd.algorithms.buffers import ModelBuffers
from hadpsgd.api import OptionError
from hadpsgd.config import parse_config
from tests.fakes import OneLearner


class Recording(OneLearner):
    """Two nodes of two learners whose collectives change nothing and are written down."""

    rank, size, local_rank, local_size, node, num_nodes = 0, 4, 0, 2, 0, 2

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.dtype, int]] = []

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        self.calls.append(("broadcast", tensor.dtype, tensor.numel()))
        return tensor

    def allreduce_(self, tensor: torch.Tensor, op: str = "avg") -> torch.Tensor:
        self.calls.append((f"world {op}", tensor.dtype, tensor.numel()))
        return tensor

    def intra_allreduce_(self, tensor: torch.Tensor, op: str = "avg") -> torch.Tensor:
        self.calls.append((f"node {op}", tensor.dtype, tensor.numel()))
        return tensor

    def inter_allreduce_(self, tensor: torch.Tensor, op: str = "avg") -> torch.Tensor:
        self.calls.append((f"nodes {op}", tensor.dtype, tensor.numel()))
        return tensor


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(5), nn.Linear(5, 3), nn.BatchNorm1d(3))


def test_buffers_live_in_one_memory_that_batchnorm_updates_in_place():
    net = _bn_model()
    reference = nn.BatchNorm1d(5)
    bufs = ModelBuffers(net, OneLearner())
    (memory,) = bufs.memories
    assert sorted(bufs.names) == sorted(name for name, _ in net.named_buffers())
    # Every buffer is a view of the memory: the float ones in one region, the counters after.
    for b in net.buffers():
        assert b.untyped_storage().data_ptr() == memory.data.untyped_storage().data_ptr()
    ((dtype, lo, hi),) = memory.regions
    assert dtype == torch.float32 and lo == 0 and memory.rest[0] == hi
    x = torch.randn(8, 5)
    net(x)
    reference(x)
    state = bufs.state()
    assert torch.equal(state["0.running_mean"], reference.running_mean)
    assert int(state["0.num_batches_tracked"]) == 1
    # The float region holds both BatchNorms' statistics (padding between them).
    (floats,) = memory.floats(memory.data)
    assert torch.equal(floats[:5], reference.running_mean)


def test_each_agreement_is_one_message_per_region():
    topo = Recording()
    bufs = ModelBuffers(_bn_model(), topo)
    (memory,) = bufs.memories
    bufs.broadcast()  # SSGD: the whole memory, as bytes, in one broadcast
    assert topo.calls == [("broadcast", torch.uint8, memory.data.numel())]
    floats = memory.regions[0][2] // 4
    topo.calls.clear()
    bufs.mean("node")  # inside a super-learner: the floats' mean alone
    assert topo.calls == [("node avg", torch.float32, floats)]
    topo.calls.clear()
    bufs.mean("nodes")  # across nodes: the floats' mean, the counters from rank 0
    rest = memory.rest[1] - memory.rest[0]
    assert topo.calls == [("nodes avg", torch.float32, floats), ("broadcast", torch.uint8, rest)]
    topo.calls.clear()
    copy = bufs.copy()
    bufs.mean("world", copy)
    assert topo.calls == [("world avg", torch.float32, floats), ("broadcast", torch.uint8, rest)]


def test_a_model_without_buffers_sends_nothing():
    # hadpsgd's BLSTM has no buffers: its step is as it was, with no message added.
    topo = Recording()
    bufs = ModelBuffers(nn.LSTM(4, 3), topo)
    assert not bufs and bufs.memories == []
    bufs.broadcast()
    bufs.mean("node")
    bufs.mean("nodes")
    assert topo.calls == []
    net = nn.Linear(3, 2)
    algo = SSGD(net, torch.optim.SGD(net.parameters(), lr=0.1), OneLearner())
    assert not algo.syncs_buffers


def test_a_replaced_buffer_is_put_back_in_place_and_one_of_another_shape_refused():
    net = _bn_model()
    bufs = ModelBuffers(net, OneLearner())
    net[0].running_mean = torch.full((5,), 3.0)  # the user's code assigns a new tensor
    bufs.check()
    assert torch.equal(bufs.state()["0.running_mean"], torch.full((5,), 3.0))
    net[0].running_mean.add_(1.0)  # and it is the memory again
    assert torch.equal(bufs.state()["0.running_mean"], torch.full((5,), 4.0))
    net[0].running_mean = torch.zeros(6)
    with pytest.raises(ValueError, match=r"buffer 0.running_mean .*sync_buffers=False"):
        bufs.check()


def test_swapped_buffers_come_back():
    net = _bn_model()
    bufs = ModelBuffers(net, OneLearner())
    other = bufs.copy()
    other[0].zero_()
    before = bufs.state()
    with bufs.swapped(other):
        assert float(net[0].running_var.abs().sum()) == 0.0
    after = bufs.state()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("algo", ["ssgd", "bmuf", "adpsgd"])
def test_the_option_in_every_spelling(algo):
    cfg = parse_config(["--algo", algo, "--no-sync-buffers"])
    assert cfg.algo_options().sync_buffers is False
    assert parse_config(["--algo", algo]).algo_options().sync_buffers is True
    with pytest.raises(OptionError, match="sync_buffers must be bool") as err:
        hadpsgd.Distributed(_bn_model(), torch.optim.SGD(_bn_model().parameters(), lr=0.1),
                            algo, topology=OneLearner(), sync_buffers="no")
    assert err.value.option == "sync_buffers"


def test_ssgd_and_bmuf_on_one_learner():
    for algo, options in (("ssgd", {}), ("bmuf", {"sync_period": 2})):
        net = _bn_model()
        dist = hadpsgd.Distributed(net, torch.optim.SGD(net.parameters(), lr=0.1), algo,
                                   topology=OneLearner(), **options)
        assert dist.algorithm.syncs_buffers
        for _ in range(3):
            loss = net(torch.randn(8, 5)).pow(2).mean()
            dist.zero_grad()
            loss.backward()
            dist.step(loss)
        live = {k: v.clone() for k, v in net.named_buffers()}
        with dist.evaluation_model() as model:
            counted = int(model[0].num_batches_tracked)
        # BMUF's global model holds the buffers of its last block sync (step 2), SSGD's
        # replica its own; the local ones are back after.
        assert counted == (2 if algo == "bmuf" else 3)
        assert all(torch.equal(live[k], v) for k, v in net.named_buffers())
        if algo == "bmuf":
            saved = dist.state_dict()["algorithm"]["bmuf"]["buffers"]
            assert int(saved["0.num_batches_tracked"]) == 2
            assert isinstance(dist.algorithm, BMUF)
        dist.close()
