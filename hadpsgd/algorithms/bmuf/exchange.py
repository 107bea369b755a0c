"""How a BMUF fragment's block average crosses the nodes, and the bytes it sends.

Blocking in fp32, a hierarchical allreduce on the training thread's communicators; overlapped
or compressed, the private side channel (:class:`hadpsgd.comm.side.SideChannel`): in a
background thread while the next block computes, and with a compressed wire each segment of a
pack (the model's progress, each sent moment's) scaled on its own. A background mean names its
packs to the side channel, which on a GPU runs it on a stream of its own behind the packing
(never on the compute stream) and orders the waiter's stream after it.
"""

from __future__ import annotations

from typing import Any

import torch

from hadpsgd.algorithms.bmuf.filter import BlockAverage, Flat, Fragment
from hadpsgd.comm import World


def part_key(index: int, dtype: torch.dtype, segment: int | None = None) -> str:
    """The side channel's name of a fragment's pack of one dtype, or of one of its segments.

    Whole on fp32; on a compressed wire ``segment`` 0 is the model's progress, then each
    sent moment's. One spelling for the sender and for whoever reads a part's residual back
    by name: a key the side channel does not know reads as nothing sent.
    """
    key = f"fragment{index}-{dtype}"
    return key if segment is None else f"{key}-{segment}"


class BlockExchange:
    """The cross-node mean of block averages: blocking, in the background, or compressed.

    Args:
        topo: The topology (the means run across its nodes).
        wire: The wire's spec (:func:`hadpsgd.comm.codec.wire_spec`): ``fp32``, ``bf16``,
            ``int8``, ``int4`` or ``topk:<fraction>``; every one but fp32 with error feedback.
        background: Run the means in a background thread (``--bmuf-overlap``).
        segments: Parts of every pack: the model and each sent moment buffer.
    """

    def __init__(self, topo: World, wire: str, background: bool, segments: int) -> None:
        self.topo, self.wire, self.segments = topo, wire, segments
        # A private channel for background or compressed means (collective: every rank).
        self.side = (topo.side_channel(wire, background=background)
                     if background or wire != "fp32" else None)
        self.bytes_sent = 0
        """Payload bytes this rank sent across nodes (fp32 without a side channel: a ring
        allreduce's share of the hierarchical reduction)."""
        self.bytes_received = 0
        """Payload bytes this rank received across nodes: as many as it sent, as the ring and
        the compressed mean's two stages are symmetric per rank (a top-k mean too: each shard
        comes back re-encoded at its fixed size, never as N sparse messages)."""

    def send(self, frag: Fragment, average: BlockAverage, background: bool) -> None:
        """Average ``frag``'s packs across super-learners: now, or in the background."""
        if self.topo.num_nodes == 1:
            return
        if background:
            average.job = self.side.submit(  # type: ignore[union-attr]
                lambda: self._mean(frag.index, average),
                f"background block average of fragment {frag.index}",
                uses=list(average.packs.values()))
        else:
            self._mean(frag.index, average)

    def wait(self, average: BlockAverage | None) -> None:
        """Wait until ``average`` (if any) has arrived."""
        if average is not None and average.job is not None:
            self.side.wait(average.job)  # type: ignore[union-attr]
            average.job = None

    def _mean(self, index: int, average: BlockAverage) -> None:
        """The mean of a fragment's packs (identical inside each node), in place."""
        for dtype, pack in average.packs.items():
            if self.side is not None:
                before = self.side.bytes_sent
                for key, part in self._parts(index, dtype, pack).items():
                    self.side.mean_(key, part)
                self.bytes_sent += self.side.bytes_sent - before
                self.bytes_received += self.side.bytes_sent - before
            else:
                # Identical inside each node (synchronous super-learner), so the cross-node
                # average is bit-identical on every learner; so is all arithmetic after it.
                self.topo.inter_allreduce_(pack, op="avg")
                n = self.topo.num_nodes
                ring = (2 * (n - 1) * pack.numel() * pack.element_size()
                        // (n * self.topo.local_size))
                self.bytes_sent += ring
                self.bytes_received += ring

    def _parts(self, index: int, dtype: torch.dtype,
               pack: torch.Tensor) -> dict[str, torch.Tensor]:
        """A pack as the side channel sends it: whole in fp32; compressed, one part per segment.

        The model's progress and each moment's differ in scale by orders of magnitude; a
        compressed wire scales each part on its own, so no quantisation chunk mixes them.
        """
        if self.wire == "fp32":
            return {part_key(index, dtype): pack}
        return {part_key(index, dtype, i): part
                for i, part in enumerate(pack.split(pack.numel() // self.segments))}

    def move_model_residual_(self, index: int, dtype: torch.dtype,
                             into: torch.Tensor, keep: float = 1.0) -> None:
        """Add fragment ``index``'s model rounding error of its last mean to ``into``.

        The model's part (segment 0 of :meth:`_parts`); nothing on fp32 or a single node.
        Call it once the mean has arrived (:meth:`wait`). ``keep``: the share moved; the
        rest stays error feedback (all of it moved: the residual is zero after).
        """
        if self.side is not None:
            self.side.move_residual_(part_key(index, dtype, 0), into, keep)

    def state_dict(self) -> dict[str, Any]:
        """The wire's rounding errors (per super-learner), or nothing without a side channel."""
        return self.side.state_dict() if self.side is not None else {}

    def load_state_dict(self, state: dict[str, Any], fragments: list[Fragment],
                        params: Flat) -> None:
        """Restore :meth:`state_dict`, for the packs of ``fragments`` of ``params``."""
        if self.side is None or not state:
            return
        keys: dict[str, torch.Tensor] = {}  # each compressed tensor's key and shape
        for f in fragments:
            for dtype, (lo, hi) in f.spans.items():
                like = torch.empty(self.segments * (hi - lo), dtype=dtype,
                                   device=params[dtype].device)
                keys.update(self._parts(f.index, dtype, like))
        self.side.load_state_dict(state, keys)

    def close(self) -> None:
        """Stop the side channel's thread (after every mean was waited for)."""
        if self.side is not None:
            self.side.close()
            self.side = None
