"""The direct path of a host sum: one guarded MPI allreduce, without the dispatch around it.

:meth:`hadpsgd.comm.hierarchical.Reducer.direct_sum_` sends the common case (a contiguous
host tensor of an MPI type within one bucket, on a scope that is one MPI allreduce) here:
what a tensor's address, length and dtype allow is decided once and kept, with its NumPy
view and the deadline's message, so a small message pays about what MPI itself costs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hadpsgd.comm.mpi import MPI_NATIVE

_NUMPY = {t: np.dtype(torch.empty(0, dtype=t).numpy().dtype) for t in MPI_NATIVE}
"""The NumPy dtype of each dtype MPI reduces natively."""
_CACHE_ENTRIES = 256
"""Tensors (address, length, dtype) a direct plan remembers before it starts afresh."""


def mpi_consts() -> tuple[Any, Any]:
    """``(MPI.IN_PLACE, MPI.SUM)``, imported on first use (mpi4py's import starts MPI)."""
    from mpi4py import MPI

    return MPI.IN_PLACE, MPI.SUM


class _Memory:
    """Host memory at an address, as NumPy's array interface (see :class:`Direct`)."""

    def __init__(self, address: int, numel: int, typestr: str) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (numel,),
                                    "typestr": typestr, "version": 3}


class Direct(dict):
    """A scope whose host sum is one MPI allreduce (see :meth:`Reducer.direct_sum_`).

    The dictionary maps ``(address, nbytes, dtype)`` of the tensors seen to what they get:
    False where the tensor cannot go direct (a dtype MPI lacks, more than a bucket); True
    where the scope holds this rank alone (nothing to do); otherwise the call's every
    argument, ``(comm.Allreduce, MPI.IN_PLACE, NumPy view, MPI.SUM, message, group)``.
    ``t.numpy()`` and the message's formatting each cost about a microsecond, as much as
    MPI's own overhead on a small message. The view is made from the address alone (it
    owns and keeps alive nothing), so it is right for whatever live tensor is at that
    address with that length and dtype.

    Args:
        comm: The communicator, or None when the scope holds this rank alone.
        what: The deadline's message, or None to name the tensor (``allreduce of N dtype``,
            prefixed ``inter-node`` across nodes), as the general path does.
        group: World ranks taking part, for the diagnosis (None: everyone).
        inter: Whether the scope is across nodes (for the message).
    """

    __slots__ = ("comm", "group", "in_place", "inter", "op", "what")

    def __init__(self, comm: Any, what: str | None, group: list[int] | None,
                 inter: bool) -> None:
        super().__init__()
        self.comm = comm
        self.what = what
        self.group = group
        self.inter = inter
        self.in_place: Any = None
        self.op: Any = None

    def entry(self, key: tuple[int, int, torch.dtype], bucket_bytes: int) -> tuple[Any, ...] | bool:
        """Decide, remember and return what the tensor of ``key`` gets."""
        address, nbytes, dtype = key
        np_dtype = _NUMPY.get(dtype)
        entry: tuple[Any, ...] | bool
        if np_dtype is None or nbytes > bucket_bytes:
            entry = False
        elif self.comm is None:
            entry = True
        else:
            numel = nbytes // np_dtype.itemsize
            view = np.asarray(_Memory(address, numel, np_dtype.str))
            what = self.what or (f"{'inter-node ' if self.inter else ''}allreduce of "
                                 f"{numel} {dtype}")
            entry = (self.comm.Allreduce, self.in_place, view, self.op, what, self.group)
        if len(self) >= _CACHE_ENTRIES:
            self.clear()
        self[key] = entry
        return entry


__all__ = ["Direct", "mpi_consts"]
