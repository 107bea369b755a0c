"""Flat contiguous buffers for parameters and gradients: a sync is a few large messages."""

from __future__ import annotations

import copy
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
    of their own, from the storage's first byte, each where cuDNN's layout puts it (it takes
    the storage from offset 0 and compares every weight's address with that place);
    otherwise it copies all of them into a new buffer at every forward and warns "not part
    of a single contiguous chunk". cuDNN 9 puts every matrix of the module first and the
    biases after them, not the module's ``_flat_weights`` order, so the layout is asked of
    cuDNN itself (:func:`_cudnn_order`) for CUDA modules; elsewhere each group is in the
    module's own order. Hand these groups to :class:`FlatBuffer` (``own_storage``).
    """
    groups = []
    for m in model.modules():
        if not isinstance(m, nn.RNNBase):
            continue
        weights = [p for p in m._flat_weights if isinstance(p, nn.Parameter)]  # noqa: SLF001
        if len(weights) != len(m._flat_weights):  # noqa: SLF001
            continue
        order = _cudnn_order(m) if weights and weights[0].is_cuda else range(len(weights))
        if order is not None:
            groups.append([weights[i] for i in order])
    return groups


def _cudnn_order(module: nn.RNNBase) -> list[int] | None:
    """The order in which cuDNN lays out ``module``'s weights (indices into ``_flat_weights``).

    Learned from a copy of the module that cuDNN flattens (its own buffer, its own places).
    None when cuDNN did not flatten it (disabled, or a configuration it does not run) or
    left gaps: such a module keeps the plain layout.
    """
    probe = copy.deepcopy(module)
    probe.flatten_parameters()
    weights = probe._flat_weights  # noqa: SLF001
    storage = weights[0].untyped_storage()
    if any(w.untyped_storage().data_ptr() != storage.data_ptr() for w in weights):
        return None
    size = weights[0].element_size()
    offsets = [(w.data_ptr() - storage.data_ptr()) // size for w in weights]
    order = sorted(range(len(weights)), key=offsets.__getitem__)
    end = 0
    for i in order:  # dense: each weight begins where the one before it ends
        if offsets[i] != end:
            return None
        end += weights[i].numel()
    return order if end * size == storage.nbytes() else None


def _grouped(params: list[nn.Parameter], groups: list[list[nn.Parameter]]
             ) -> list[nn.Parameter]:
    """``params`` with each group's members together, in the group's order.

    A group goes where its first member was; one that is not wholly in ``params`` (or
    shares a member with an earlier group) changes nothing.
    """
    ids = {id(p) for p in params}
    owner: dict[int, int] = {}
    for g, group in enumerate(groups):
        if group and all(id(p) in ids for p in group) and not any(id(p) in owner
                                                                  for p in group):
            owner.update((id(p), g) for p in group)
    out: list[nn.Parameter] = []
    placed: set[int] = set()
    for p in params:
        g = owner.get(id(p))
        if g is None:
            out.append(p)
        elif g not in placed:
            placed.add(g)
            out.extend(groups[g])
    return out


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
            their own starting at the group's first element (see :func:`cudnn_weight_groups`).
            Each group's members are laid out together, in the group's order, where its first
            member would be (so :attr:`params`, the layout's order, can differ from
            ``params`` inside a group), and of one dtype get their views through such an
            alias of their slice of the buffer: the same memory, so every write to the
            buffer is seen.
    """

    def __init__(self, params: Iterable[nn.Parameter], kind: str = "grad",
                 own_storage: Iterable[list[nn.Parameter]] = ()) -> None:
        if kind not in ("data", "grad"):
            raise ValueError(f"FlatBuffer kind must be 'data' or 'grad', got {kind!r}")
        self.kind = kind
        own_storage = list(own_storage) if kind == "data" else []
        self.params = _grouped([p for p in params if p.requires_grad], own_storage)
        """The parameters in the buffer's order."""
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
            self.aliased = self._give_own_storage(own_storage, slots)

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
