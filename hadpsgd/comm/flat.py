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


def cudnn_weight_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """The weights of each recurrent module (``nn.LSTM`` / ``GRU`` / ``RNN``) of ``model``.

    cuDNN runs a recurrent module on its weights in place only if they lie in one storage
    of their own, in the module's ``_flat_weights`` order from the storage's first byte (it
    takes the storage from offset 0 and compares every weight's address with the place
    cuDNN's layout gives it); otherwise it copies all of them into a new buffer at every
    forward and warns "not part of a single contiguous chunk". Hand these groups to
    :class:`FlatBuffer` so each gets such a storage inside the flat buffer.
    """
    return [[p for p in m._flat_weights if isinstance(p, nn.Parameter)]  # noqa: SLF001
            for m in model.modules() if isinstance(m, nn.RNNBase)]


def _alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor on the memory of the 1-D ``view`` whose *storage* starts at its first element.

    DLPack hands over a pointer, not a storage: the tensor it builds owns a storage (kept
    alive with the source) that begins at ``view``'s address and is exactly as long. Writes
    through either are seen by both.
    """
    return torch.from_dlpack(view)


class FlatBuffer:
    """One contiguous buffer per dtype that backs a list of tensors through views.

    Args:
        params: The parameters whose values (``kind="data"``) or gradients (``kind="grad"``)
            the buffers hold. Their order fixes the layout, identical on every rank.
        kind: ``data`` re-points each parameter's storage into the buffer; ``grad`` makes each
            ``param.grad`` a view of the buffer.
        own_storage: Groups of parameters (``kind="data"``) that must each see a storage of
            their own starting at the group's first element (see :func:`cudnn_weight_groups`):
            a group that is consecutive in ``params``, in the same order and of one dtype
            gets its views through such an alias of its slice of the buffer (same memory, so
            every write to the buffer is seen); any other group is left as it is.
    """

    def __init__(self, params: Iterable[nn.Parameter], kind: str = "grad",
                 own_storage: Iterable[list[nn.Parameter]] = ()) -> None:
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
        self.aliased = 0
        """Parameter groups given a storage of their own (see ``own_storage``)."""
        if kind == "data":
            self.aliased = self._give_own_storage(list(own_storage), slots)

    def _give_own_storage(self, groups: list[list[nn.Parameter]],
                          slots: list[tuple[torch.dtype, int]]) -> int:
        index = {id(p): i for i, p in enumerate(self.params)}
        done = 0
        for group in groups:
            idx = [index.get(id(p), -1) for p in group]
            if not group or -1 in idx or idx != list(range(idx[0], idx[0] + len(idx))):
                continue  # not all trainable, or not consecutive in the buffer's order
            dtype = slots[idx[0]][0]
            if any(slots[i][0] != dtype for i in idx):
                continue
            lo = slots[idx[0]][1]
            hi = slots[idx[-1]][1] + self.params[idx[-1]].numel()
            alias = _alias(self.buffers[dtype][lo:hi])
            for i in idx:
                p, off = self.params[i], slots[i][1] - lo
                view = alias[off:off + p.numel()].view_as(p)
                p.data = view
                self.views[i] = view
            done += 1
        return done

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
