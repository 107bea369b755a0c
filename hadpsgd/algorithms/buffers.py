"""A model's buffers (BatchNorm's running statistics) in one flat memory, kept in agreement.

The algorithms train and average parameters; a model's buffers change too, in every training
forward (each BatchNorm's ``running_mean``, ``running_var`` and ``num_batches_tracked``), on
each learner from its own batch, so left alone they differ on every rank after one step and
the model evaluated is not the model of any other rank. :class:`ModelBuffers` lays them out
as :class:`~hadpsgd.comm.FlatBuffer` lays out the parameters: one byte memory per device,
every buffer re-pointed to a view of it (BatchNorm's in-place updates land there, and no
copy is made at a sync), the floating-point buffers of each dtype in one typed region and
the rest (integers, bools) in one region after them. An agreement is then one message: a
broadcast of the whole memory (SSGD, as DDP's ``broadcast_buffers``), or a mean of each
floating-point region and a broadcast of the rest from rank 0 (BMUF, ADPSGD).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from hadpsgd.comm import World
from hadpsgd.comm.flat import zeros

_ALIGN = 16
"""Bytes every buffer and region starts on: a typed view of the byte memory needs its
element size, and 16 keeps every dtype (complex128 included) and vector loads aligned."""

Scope = Literal["node", "nodes", "world"]
"""Who a mean is over: the learners of this node (``node``), the nodes, whose learners hold
the same values (``nodes``: one learner per node sends), or every learner (``world``)."""


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class _Slot:
    """One buffer and its place: the module that holds it, under ``key``, at ``offset``."""

    name: str
    """The model's name for it (``named_buffers()``: ``bn.running_mean``)."""
    module: nn.Module
    key: str
    tensor: torch.Tensor
    """The tensor the module holds (re-pointed to :attr:`view`)."""
    offset: int
    view: torch.Tensor | None = None


class _Memory:
    """The buffers of one device in one byte tensor: the floating-point regions, then the rest.

    Args:
        slots: The buffers (on ``device``), in the model's order.
        device: Where the memory lives.
    """

    def __init__(self, slots: list[_Slot], device: torch.device) -> None:
        floats: dict[torch.dtype, list[_Slot]] = {}
        rest: list[_Slot] = []
        for slot in slots:
            dtype = slot.tensor.dtype
            (floats.setdefault(dtype, []) if dtype.is_floating_point else rest).append(slot)
        self.regions: list[tuple[torch.dtype, int, int]] = []
        """Per floating-point dtype: ``(dtype, lo, hi)``, its bytes in the memory."""
        self.slots: list[_Slot] = []
        end = 0
        for dtype, group in floats.items():
            lo = end
            end = self._place(group, end)
            self.regions.append((dtype, lo, end))
        self.rest = (end, self._place(rest, end))
        """The bytes ``[lo, hi)`` of the buffers that are not floating point."""
        self.data = zeros(self.rest[1], torch.uint8, device)
        for slot in self.slots:
            slot.view = self.value(self.data, slot)
            slot.view.copy_(slot.tensor)
            slot.tensor.data = slot.view

    def _place(self, group: list[_Slot], end: int) -> int:
        for slot in group:
            slot.offset = end
            end = _up(end + slot.tensor.numel() * slot.tensor.element_size())
            self.slots.append(slot)
        return end

    @staticmethod
    def value(data: torch.Tensor, slot: _Slot) -> torch.Tensor:
        """``slot``'s buffer in ``data`` (this memory or a copy of it), as the module's."""
        t = slot.tensor
        size = t.numel() * t.element_size()
        return data[slot.offset:slot.offset + size].view(t.dtype).view(t.shape)

    def floats(self, data: torch.Tensor) -> list[torch.Tensor]:
        """The floating-point regions of ``data``, each as its dtype (padding included)."""
        return [data[lo:hi].view(dtype) for dtype, lo, hi in self.regions]


class ModelBuffers:
    """Every buffer of ``model`` in one memory per device, and their agreements over ``topo``.

    Made before any collective; it finds no buffers in a model without them (hadpsgd's
    BLSTM), and then every method is free (no message).

    Args:
        model: The local replica.
        topo: The topology the agreements run on.
    """

    def __init__(self, model: nn.Module, topo: World) -> None:
        self.topo = topo
        by_device: dict[torch.device, list[_Slot]] = {}
        for name, tensor in model.named_buffers():
            prefix, _, key = name.rpartition(".")
            slot = _Slot(name, model.get_submodule(prefix), key, tensor, 0)
            by_device.setdefault(tensor.device, []).append(slot)
        self.memories = [_Memory(slots, device) for device, slots in by_device.items()]
        self.slots = [slot for memory in self.memories for slot in memory.slots]

    def __bool__(self) -> bool:
        return bool(self.slots)

    @property
    def names(self) -> list[str]:
        """The buffers' names (as ``model.named_buffers()`` gives them), in the memory's order."""
        return [slot.name for slot in self.slots]

    def check(self) -> None:
        """Re-point a buffer the user's code replaced (``module.running_mean = t``) into place.

        BatchNorm and ``load_state_dict`` write buffers in place; an assignment makes a new
        tensor, which would fall out of the agreement without a word. It takes the new
        tensor's values.

        Raises:
            ValueError: If a buffer was removed or replaced by one of another shape, dtype or
                device: its place in the memory no longer fits.
        """
        for slot in self.slots:
            now = slot.module._buffers.get(slot.key)  # noqa: SLF001 - where the module holds it
            assert slot.view is not None
            if now is slot.tensor and now.data_ptr() == slot.view.data_ptr():
                continue
            if now is None or (now.shape, now.dtype, now.device) != (
                    slot.view.shape, slot.view.dtype, slot.view.device):
                raise ValueError(
                    f"buffer {slot.name} was removed or replaced by one of another shape, dtype "
                    "or device after the algorithm was made; keep its shape (the learners' "
                    "buffers are kept in agreement), or pass sync_buffers=False")
            slot.view.copy_(now)
            now.data = slot.view
            slot.tensor = now

    # ------------------------------------------------------------------ agreements
    def broadcast(self, root: int = 0) -> None:
        """Every learner takes ``root``'s buffers: one message per device (DDP's way)."""
        if self.topo.size == 1:
            return
        self.check()
        for memory in self.memories:
            self.topo.broadcast_(memory.data, root=root)

    def mean(self, scope: Scope, copy: list[torch.Tensor] | None = None) -> None:
        """Average the floating-point buffers over ``scope``; the rest from rank 0 but in ``node``.

        The integer buffers (``num_batches_tracked``) count forwards, which no mean makes
        sense of: across nodes they are rank 0's. Inside a node they are left alone: every
        learner of a super-learner takes the same steps, and a second message per step
        would buy nothing.

        Args:
            scope: Who the mean is over (:data:`Scope`).
            copy: Average this copy (:meth:`copy`) instead of the model's own buffers.
        """
        size = {"node": self.topo.local_size, "nodes": self.topo.num_nodes,
                "world": self.topo.size}[scope]
        if size == 1 and (scope == "node" or self.topo.size == 1):
            return
        if copy is None:
            self.check()
        reduce = {"node": self.topo.intra_allreduce_, "nodes": self.topo.inter_allreduce_,
                  "world": self.topo.allreduce_}[scope]
        for memory, data in zip(self.memories, copy or self._live(), strict=True):
            if size > 1:
                for region in memory.floats(data):
                    reduce(region, op="avg")
            lo, hi = memory.rest
            if scope != "node" and hi > lo:
                self.topo.broadcast_(data[lo:hi], root=0)

    # ------------------------------------------------------------------ copies and state
    def _live(self) -> list[torch.Tensor]:
        return [memory.data for memory in self.memories]

    def copy(self) -> list[torch.Tensor]:
        """A copy of the buffers' memories (what :meth:`swapped` and :meth:`write_into` take)."""
        self.check()
        return [data.clone() for data in self._live()]

    @contextlib.contextmanager
    def swapped(self, copy: list[torch.Tensor]) -> Iterator[None]:
        """The model's buffers hold ``copy`` inside the block; their own values come back."""
        saved = self.copy()
        try:
            for data, values in zip(self._live(), copy, strict=True):
                data.copy_(values)
            yield
        finally:
            for data, values in zip(self._live(), saved, strict=True):
                data.copy_(values)

    def write_into(self, model: nn.Module, copy: list[torch.Tensor] | None = None) -> None:
        """Copy the buffers (or ``copy``) into ``model``'s of the same names (a model's copy)."""
        theirs = dict(model.named_buffers())
        for name, value in self.state(copy).items():
            theirs[name].copy_(value)

    def state(self, copy: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The buffers (or ``copy``) by name, each a tensor of its own (for a checkpoint)."""
        if copy is None:
            self.check()
        datas = copy if copy is not None else self._live()
        return {slot.name: memory.value(data, slot).clone()
                for memory, data in zip(self.memories, datas, strict=True)
                for slot in memory.slots}

    def load_state(self, state: dict[str, torch.Tensor],
                   copy: list[torch.Tensor] | None = None) -> None:
        """Restore :meth:`state` into the buffers (or ``copy``); names it lacks are kept."""
        if copy is None:
            self.check()
        datas = copy if copy is not None else self._live()
        for memory, data in zip(self.memories, datas, strict=True):
            for slot in memory.slots:
                if slot.name in state:
                    value = memory.value(data, slot)
                    value.copy_(state[slot.name].to(value.device, value.dtype))
