import pytest
import torch

from hadpsgd.comm.hierarchical import route
from hadpsgd.comm.mpi import cuda_support
from hadpsgd.comm.staging import STAGE_CHUNK_BYTES, Stager, host_dtype


def test_staged_chunks_cover_everything_in_order():
    stager = Stager(pin=False)
    t = torch.arange(1003, dtype=torch.float32)
    seen: list[int] = []

    def op(buf: torch.Tensor) -> None:  # stands in for an in-place MPI call on host memory
        seen.append(buf.numel())
        buf *= 2

    stager.run_staged(t, op, chunk_elems=100)
    assert seen == [100] * 10 + [3]
    assert torch.equal(t, torch.arange(1003, dtype=torch.float32) * 2)


def test_default_chunk_pipelines_a_bucket():
    # A 16 MiB bucket goes in several chunks (the copies of one overlap the MPI work of the
    # next on a GPU): the stager must not hand MPI the whole bucket at once.
    stager = Stager(pin=False)
    t = torch.zeros(4 * 2**20, dtype=torch.float32)
    seen: list[int] = []
    stager.run_staged(t, lambda b: seen.append(b.numel()))
    assert len(seen) == 16 * 2**20 // STAGE_CHUNK_BYTES
    assert sum(seen) == t.numel()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_reduced_in_float32_on_the_host(dtype):
    stager = Stager(pin=False)
    t = torch.full((300,), 0.5, dtype=dtype)
    dtypes = []

    def op(buf: torch.Tensor) -> None:
        dtypes.append(buf.dtype)
        buf += 1.25

    stager.run_staged(t, op, chunk_elems=128)
    assert dtypes == [torch.float32] * 3
    assert t.dtype == dtype and torch.equal(t, torch.full((300,), 1.75, dtype=dtype))
    assert host_dtype(torch.float64) == torch.float64


def test_routes_keep_host_tensors_off_nccl():
    """Which path each collective takes, by where its tensor lives (the GPU run's routing).

    The loop's control vector, the evaluation totals and ADPSGD's flag are float64 host
    tensors; gradients and models are float32 (or half) device tensors.
    """
    f64, f32 = torch.float64, torch.float32
    # NCCL present: host tensors go to MPI, device tensors to NCCL.
    assert route("cpu", f64, "mpi", "nccl", False) == ("mpi", "mpi")
    assert route("cuda", f32, "mpi", "nccl", False) == ("nccl", "mpi via host")
    assert route("cuda", f32, "mpi", "nccl", True) == ("nccl", "mpi (device buffers)")
    # NCCL keeps half precision on the device; only the MPI step between nodes upcasts.
    assert route("cuda", torch.bfloat16, "mpi", "nccl", True) == ("nccl", "mpi via host")
    # No NCCL (ranks share a GPU, or --intra-backend mpi): device tensors are staged.
    assert route("cuda", f32, "mpi", None, False) == ("mpi via host", "mpi via host")
    assert route("cuda", f32, "gloo", None, True) == ("gloo via host", "mpi via host")
    # Host half precision: MPI has no half type, so it is staged in float32.
    assert route("cpu", torch.float16, "mpi", None, False) == ("mpi via host", "mpi via host")
    assert route("cpu", f32, "gloo", None, False) == ("gloo", "mpi")


def test_cuda_aware_override(monkeypatch):
    monkeypatch.setenv("HADPSGD_CUDA_AWARE", "1")
    assert cuda_support() == (True, "HADPSGD_CUDA_AWARE=1")
    monkeypatch.setenv("HADPSGD_CUDA_AWARE", "0")
    assert cuda_support()[0] is False


def test_host_to_host_staging_never_pins():
    # Page-locked memory only pays for device copies; --device cpu must not take it.
    from hadpsgd.comm.staging import Stager

    st = Stager(pin=True)
    assert not st.buffer(torch.float32, 16, device_copy=False).is_pinned()
    t = torch.arange(10, dtype=torch.bfloat16)
    st.run_staged(t, lambda b: b.add_(1.0))
    assert all(not b.is_pinned() for b in st._buffers.values())
    assert torch.equal(t, torch.arange(10, dtype=torch.bfloat16) + 1)
