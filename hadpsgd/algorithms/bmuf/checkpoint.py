"""BMUF's checkpoint: the filter, counters, moments and each super-learner's own state.

A part of :class:`~hadpsgd.algorithms.bmuf.BMUF`, which holds the state read and written
here (the annotations below). What one learner's checkpoint holds for the whole job is in
:meth:`BlockCheckpoint.state_dict`; what differs between super-learners mid-block (the local
model, the optimizer, the wire's rounding errors) in :meth:`BlockCheckpoint.node_state`.
A state written in another flat order is moved parameter by parameter
(:mod:`hadpsgd.algorithms.bmuf.relayout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from hadpsgd.algorithms.bmuf.exchange import BlockExchange
from hadpsgd.algorithms.bmuf.filter import BlockFilter, Fragment
from hadpsgd.algorithms.bmuf.moments import BlockMoments
from hadpsgd.algorithms.bmuf.options import BMUFOptions
from hadpsgd.algorithms.bmuf.relayout import relayout_node, relayout_state
from hadpsgd.comm import World
from hadpsgd.comm.codec import FORMATS


class BlockCheckpoint:
    """BMUF's :meth:`state_dict`, :meth:`node_state` and their loads (a part of BMUF)."""

    topo: World
    options: BMUFOptions
    optimizer: torch.optim.Optimizer
    params: Any
    buffers: Any
    syncs_buffers: bool
    eta: float
    tau: int
    warmup_lr: str
    residual: str
    share: float | None
    keep: float
    started: bool
    filter: BlockFilter
    moments: BlockMoments
    fragments: list[Fragment]
    exchange: BlockExchange
    _agreed: list[torch.Tensor] | None
    _saved_layout: list[list[Any]] | None
    block_steps: int
    num_syncs: int
    rho: float
    wait_in_flight: Callable[[], None]
    """Waits for an overlapped mean in flight (BMUF's)."""
    flat_layout: Callable[[], list[list[Any]]]
    """The flat buffers' order (the algorithm's)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume mid-block: the filter, counters, moments and optimizer.

        Adam's ``k`` is the optimizer's own ``state["step"]`` (in ``optimizer``); the local
        parameters are the model's (the trainer saves ``model.state_dict()``). An overlapped
        mean in flight is waited for: the mean is the same on every learner and saved here,
        what it is re-based on is per super-learner (:meth:`node_state`).
        """
        self.wait_in_flight()
        state = super().state_dict()
        state["bmuf"] = {
            "started": self.started, "block_steps": self.block_steps,
            "num_syncs": self.num_syncs, "rho": self.rho,
            **self.filter.state_dict(self.fragments), "moments": self.moments.state_dict(),
            "wire_bytes": self.exchange.bytes_sent,
            "wire_bytes_received": self.exchange.bytes_received,
            "options": {**dataclasses.asdict(self.options), "block_momentum": self.eta,
                        "sync_period": self.tau, "warmup_lr": self.warmup_lr,
                        "residual": self.residual, "topk_fraction": self.share,
                        "residual_keep": self.keep},
            "flat_layout": self.flat_layout(),  # the flat tensors' order (relayout.py)
        }
        if self._agreed is not None:  # the global model's buffers, the same on every learner
            state["bmuf"]["buffers"] = self.buffers.state(self._agreed)
        return state

    def node_state(self) -> dict[str, Any] | None:
        """Mid-block, each super-learner's own local model and optimizer state.

        At a block boundary (or on one node) every learner holds the same, and rank 0's
        state in the checkpoint is everyone's: nothing extra is saved. With an overlapped
        mean pending or a compressed wire, the local state at the block's end and the
        wire's rounding errors are per super-learner too.
        """
        shared = super().node_state()  # fp16's loss scale, decided per super-learner
        if not self.started or self.topo.num_nodes == 1:
            return shared
        self.wait_in_flight()  # the wire's rounding errors change while a mean is in flight
        snaps = self.filter.node_snaps(self.fragments)
        mid_block = any(f.block_steps for f in self.fragments)
        if not (mid_block or snaps or self.exchange.side is not None):
            return shared
        # The buffers too: mid-block each super-learner's differ (the checkpoint's model
        # state holds rank 0's).
        own = {"buffers": self.buffers.state()} if self.syncs_buffers else {}
        return {"params": {str(d): b.clone() for d, b in self.params.buffers.items()},
                "optimizer": self.optimizer.state_dict(), "snaps": snaps,
                "wire": self.exchange.state_dict(), **own, **(shared or {})}

    def load_node_state(self, state: dict[str, Any]) -> None:
        """This super-learner's local model, optimizer state and overlapped/wire state."""
        super().load_node_state(state)
        if "params" not in state:  # only the loss scale (at a block boundary)
            return
        if self._saved_layout is not None:  # written in another flat order: by name
            state = relayout_node(state, self._saved_layout, self.flat_layout())
        for dtype, buf in self.params.buffers.items():
            buf.copy_(state["params"][str(dtype)].to(buf.device, buf.dtype))
        if self.syncs_buffers:
            self.buffers.load_state(state.get("buffers", {}))
        self.optimizer.load_state_dict(state["optimizer"])
        self.filter.load_node_snaps(state.get("snaps", {}), self.fragments)
        self.exchange.load_state_dict(state.get("wire", {}), self.fragments, self.params.buffers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (load the model's local parameters separately)."""
        super().load_state_dict(state)
        b = state["bmuf"]
        was = b.get("options", {})
        # A state of another flat-buffer order (CUDA's cuDNN layout against CPU's, another
        # parameter order) is moved parameter by parameter; one without a record is of this
        # process's order (written before the order was recorded, on the same device).
        saved, now = b.get("flat_layout"), self.flat_layout()
        self._saved_layout = saved if saved is not None and saved != now else None
        if self._saved_layout is not None:
            b = relayout_state(b, self._saved_layout, now)
        # What is in flight was packed for one fragment layout and one wire: refuse another.
        # The wire with its fraction, which only counts for a sparse wire (its default where
        # none was given: a state written with 0.015625 for topk is topk's default).
        # And the share of the rounding the model form takes back: another share resumes,
        # but not the run it was.
        for name in ("fragments", "wire", "topk_fraction", "residual_keep"):
            then, now = was.get(name, getattr(BMUFOptions(), name)), getattr(self.options, name)
            if name == "topk_fraction":  # the share in use (states before: None, 112/4096)
                default = FORMATS[self.options.wire].fraction
                if default is None:
                    continue
                then = default if then is None else then
                now = self.share
            if name == "residual_keep":  # in use with the model form (states before: all)
                if self.residual != "model" or was.get("residual", "model") != "model":
                    continue
                then = 1.0 if then is None else then
                now = self.keep
            if then != now:
                flag = self.options.flag(name)
                raise ValueError(f"the checkpoint's BMUF state was written with {flag} {then} "
                                 f"(now {now}); resume with {flag} {then}")
        self.started = bool(b["started"])
        if self.syncs_buffers:  # a state without them: the loaded model's are the global ones
            self._agreed = self.buffers.copy() if self.started else None
            if self._agreed is not None:
                self.buffers.load_state(b.get("buffers", {}), self._agreed)
        self.filter.load_state_dict(b, self.fragments)
        self.exchange.bytes_sent = int(b.get("wire_bytes", 0))
        self.exchange.bytes_received = int(b.get("wire_bytes_received", b.get("wire_bytes", 0)))
        self.moments.load_state_dict(b["moments"])
