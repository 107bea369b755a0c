"""Which path a tensor takes, decided the same way on every rank (no GPU needed)."""

import torch

from hadpsgd.comm.hierarchical import Route, device_direct, route
from hadpsgd.comm.init import agree_routes
from hadpsgd.comm.nccl import NCCL_GRACE_S, nccl_timeout


def test_device_tensors_go_straight_to_a_cuda_aware_mpi_without_nccl():
    # The BMUF-Adam layout (--ranks-per-node 1) has no NCCL group: a CUDA-aware MPI must
    # still get the device buffers as they are, not copies through the host.
    assert route("cuda", torch.float32, "mpi", None, True) == Route(
        "mpi (device buffers)", "mpi (device buffers)")
    assert device_direct(torch.float32, "mpi", True)
    # ...but not where MPI is not CUDA-aware, lacks the dtype, or gloo runs the node.
    assert route("cuda", torch.float32, "mpi", None, False) == Route("mpi via host",
                                                                     "mpi via host")
    assert not device_direct(torch.bfloat16, "mpi", True)
    assert route("cuda", torch.bfloat16, "mpi", None, True).inter == "mpi via host"
    assert not device_direct(torch.float32, "gloo", True)
    # With NCCL inside the node, only the inter-node leg asks about CUDA-awareness.
    assert route("cuda", torch.float32, "mpi", "nccl", True) == Route("nccl",
                                                                      "mpi (device buffers)")
    assert route("cpu", torch.float32, "mpi", "nccl", True) == Route("mpi", "mpi")


def test_the_world_agrees_on_nccl_and_cuda_awareness():
    # One node that cannot run NCCL turns it off everywhere (message sizes would differ).
    assert agree_routes([("", True), ("", True)]) == ([], True)
    reasons, aware = agree_routes([("", True), ("ranks share a GPU", True),
                                   ("ranks share a GPU", True)])
    assert reasons == ["ranks share a GPU"] and aware
    # One rank whose MPI is not CUDA-aware makes every rank stage.
    assert agree_routes([("", True), ("", False)]) == ([], False)


def test_nccl_waits_longer_than_hadpsgd():
    # hadpsgd's watchdog must name the missing peer before torch's NCCL watchdog kills us.
    for deadline in (5.0, 60.0, 300.0, 30 * 86_400.0):
        assert nccl_timeout(deadline).total_seconds() >= deadline + NCCL_GRACE_S
    # No deadline (HADPSGD_TIMEOUT=inf) is a long one, not an OverflowError.
    assert nccl_timeout(float("inf")).total_seconds() > 30 * 86_400.0
