import numpy as np
import torch

from hadpsgd.comm.hierarchical import as_native
from hadpsgd.comm.staging import Stager, mpi_is_cuda_aware


def test_staged_buckets_cover_everything_in_order():
    stager = Stager(pin=False)
    t = torch.arange(1003, dtype=torch.float32)
    seen: list[int] = []

    def op(buf: np.ndarray) -> None:  # stands in for an in-place MPI call on host memory
        seen.append(buf.size)
        buf *= 2

    stager.run_staged(t, bucket_elems=100, op=op)
    assert seen == [100] * 10 + [3]
    assert torch.equal(t, torch.arange(1003, dtype=torch.float32) * 2)
    # the host buffers are reused: two slots, not one per bucket
    assert len(stager._buffers) == 2


def test_as_native_upcasts_half():
    h = torch.ones(4, dtype=torch.float16)
    work, copied = as_native(h)
    assert copied and work.dtype == torch.float32
    f = torch.ones(4)
    assert as_native(f) == (f, False)


def test_cuda_aware_override(monkeypatch):
    monkeypatch.setenv("HADPSGD_CUDA_AWARE", "1")
    assert mpi_is_cuda_aware()
    monkeypatch.setenv("HADPSGD_CUDA_AWARE", "0")
    assert not mpi_is_cuda_aware()
