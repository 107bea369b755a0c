"""Flat contiguous buffers for parameters and gradients: a sync is a few large messages."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn


def zeros(numel: int, dtype: torch.dtype = torch.float32,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed 1-D tensor whose host memory MPI moves fastest.

    On CPU the memory comes from NumPy's allocator: measured with Open MPI's shared-memory
    transport, an ``Allreduce`` of 1-8 MiB on it was 10-25 % faster than on memory from
    torch's CPU allocator (see ``python -m benchmarks.comm``). Other devices and dtypes NumPy
    lacks use ``torch.zeros``.
    """
    if torch.device(device).type == "cpu":
        try:
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:  # e.g. bfloat16: no NumPy equivalent
            return torch.zeros(numel, dtype=dtype)
        return torch.from_numpy(np.zeros(numel, dtype=np_dtype))
    return torch.zeros(numel, dtype=dtype, device=device)


class FlatBuffer:
    """One contiguous buffer per dtype that backs a list of tensors through views.

    Args:
        params: The parameters whose values (``kind="data"``) or gradients (``kind="grad"``)
            the buffers hold. Their order fixes the layout, identical on every rank.
        kind: ``data`` re-points each parameter's storage into the buffer; ``grad`` makes each
            ``param.grad`` a view of the buffer.
    """

    def __init__(self, params: Iterable[nn.Parameter], kind: str = "grad") -> None:
        if kind not in ("data", "grad"):
            raise ValueError(f"FlatBuffer kind must be 'data' or 'grad', got {kind!r}")
        self.kind = kind
        self.params = [p for p in params if p.requires_grad]
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.views: list[torch.Tensor] = []
        sizes: dict[torch.dtype, int] = {}
        slots: list[tuple[torch.dtype, int]] = []
        for p in self.params:
            slots.append((p.dtype, sizes.get(p.dtype, 0)))
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        for dtype, n in sizes.items():
            device = next(p.device for p in self.params if p.dtype == dtype)
            self.buffers[dtype] = zeros(n, dtype, device)
        for p, (dtype, offset) in zip(self.params, slots, strict=True):
            view = self.buffers[dtype][offset:offset + p.numel()].view_as(p)
            if kind == "data":
                view.copy_(p.detach())
                p.data = view
            else:
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
            self.views.append(view)

    def gather_grads(self) -> None:
        """Make sure every gradient lives in the buffer.

        ``optimizer.zero_grad(set_to_none=True)`` or code that assigns ``p.grad`` detaches
        the gradient from its view; copy it back (or zero the slot) and re-point it.
        """
        for i in range(len(self.params)):
            self.gather_grad(i)

    def gather_grad(self, index: int) -> None:
        """:meth:`gather_grads` for parameter ``index`` alone (from a gradient hook)."""
        p, view = self.params[index], self.views[index]
        g = p.grad
        if g is None:
            view.zero_()
            p.grad = view
        elif g.data_ptr() != view.data_ptr():
            view.copy_(g)
            p.grad = view

    def zero_(self) -> None:
        """Zero every buffer (all gradients or all values at once)."""
        for buf in self.buffers.values():
            buf.zero_()

    def numel(self) -> int:
        """Total number of elements over all dtypes."""
        return sum(b.numel() for b in self.buffers.values())
