"""The start-up line's count of torch.distributed groups (NCCL communicators on GPUs)."""

from __future__ import annotations

from types import SimpleNamespace

from hadpsgd.comm.topology import Topology


def _topology(intra: object, device_intra: object, host_link: object = None,
              twins: tuple = ()) -> SimpleNamespace:
    reducer = SimpleNamespace(intra=intra, device_intra=device_intra, host_link=host_link)
    topo = SimpleNamespace(reducer=reducer, _links=list(twins))
    topo._torch_backends = lambda: Topology._torch_backends(topo)
    return topo


def _group(name: str) -> SimpleNamespace:
    return SimpleNamespace(name=name, pg=object())


def test_mpi_alone_holds_no_group():
    mpi = SimpleNamespace(name="mpi")  # an MPI backend: no torch process group
    assert Topology.torch_groups(_topology(mpi, None)) == []


def test_each_group_is_counted_once_with_what_it_carries():
    nccl, host = _group("nccl"), _group("nccl")
    twin = SimpleNamespace(local=_group("nccl"))
    topo = _topology(SimpleNamespace(name="mpi"), nccl, SimpleNamespace(local=host), [twin])
    assert Topology.torch_groups(topo) == [("nccl", "node's device tensors"),
                                           ("nccl", "host link"),
                                           ("nccl", "a channel's host link")]
    gloo = _group("gloo")  # one backend for host and device tensors: one group
    assert Topology.torch_groups(_topology(gloo, gloo)) == [("gloo", "node")]


def test_a_member_alone_on_its_host_holds_no_host_group():
    topo = _topology(SimpleNamespace(name="mpi"), None, SimpleNamespace(local=None))
    assert Topology.torch_groups(topo) == []


def test_the_groups_device_memory_is_summed_where_known():
    """NCCL's buffers (each communicator's fall in free GPU memory at set-up, measured by
    NCCLIntra) are summed for the start-up line; groups that measured none add nothing."""
    node, host = _group("nccl"), _group("nccl")
    node.device_bytes, host.device_bytes = 3 * 2**28, 2**28
    topo = _topology(SimpleNamespace(name="mpi"), node, SimpleNamespace(local=host))
    assert Topology.torch_group_bytes(topo) == 2**30
    gloo = _group("gloo")  # on host tensors: no device memory measured
    assert Topology.torch_group_bytes(_topology(gloo, gloo)) is None
    mpi = SimpleNamespace(name="mpi")
    assert Topology.torch_group_bytes(_topology(mpi, None)) is None


def test_free_device_memory_is_none_without_cuda():
    import torch

    from hadpsgd.comm.nccl import _free_device_bytes

    if torch.cuda.is_available():
        assert _free_device_bytes(torch.device("cuda", 0)) > 0
    else:
        assert _free_device_bytes(torch.device("cuda", 0)) is None
