"""ADPSGD's evaluation model: the replicas' average, taken only when asked, or each replica.

The paper has no global averaging; an evaluation, a checkpoint and the run's end need one
model all the same. :class:`ReplicaAverage` (a part of
:class:`~hadpsgd.algorithms.adpsgd.ADPSGD`) takes the replicas' mean across the nodes when
one changed since the last, in fp32 or, on a compressed gossip wire, as a coarse difference
to the last average; with ``eval_model replicas`` each learner scores with its own replica
until the run's end.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hadpsgd.algorithms.adpsgd.options import ADPSGDOptions, average_wire
from hadpsgd.algorithms.gradsync import internode_share
from hadpsgd.comm import World


class ReplicaAverage:
    """The replicas' average for evaluation, checkpoints and the deployed model.

    A part of :class:`~hadpsgd.algorithms.adpsgd.ADPSGD`, which holds the replica (``flat``,
    under ``lock``) and the rest of the state read here (the annotations below).
    """

    topo: World
    options: ADPSGDOptions
    model: nn.Module
    params: Any
    buffers: Any
    flat: torch.Tensor
    lock: threading.Lock
    steps: int
    syncs_buffers: bool
    _closed: bool
    _check_thread: Callable[[], None]
    """Raises the gossip thread's error, if it failed (before a collective it cannot join)."""

    def _init_average(self) -> None:
        """The average's state, none taken yet (called by the algorithm's constructor)."""
        topo = self.topo
        self.consensus_distance = float("nan")
        self._average: torch.Tensor | None = None
        """The replicas' average at the last :meth:`sync` (what is evaluated and deployed); with
        ``eval_model replicas`` before :meth:`finish`, this replica as it was then."""
        self._average_buffers: list[torch.Tensor] | None = None
        """The mean of every learner's buffers at the last :meth:`sync` (``sync_buffers``)."""
        self._synced_at: tuple[int, int] | None = None
        """This learner's (steps, closed) at the last :meth:`sync`."""
        self._changed = torch.zeros(1, dtype=torch.float64)
        self.sync_bytes = 0
        """Bytes this rank sent across nodes averaging the replicas (evaluation, checkpoints):
        a ring receives as much."""
        self._eval_model: nn.Module | None = None
        # On a compressed gossip wire (a slow link) the evaluation average crosses the nodes
        # as a coarse difference to the last one (collective: every rank makes the channel).
        self._coarse = (topo.side_channel(average_wire(self.options.wire), background=False)
                        if self.options.wire != "fp32" and topo.num_nodes > 1 else None)
        self._reference: torch.Tensor | None = None
        """The last average, the same on every rank: what the next coarse one is sent
        against (None: the next is sent whole, in fp32)."""
        self._fresh = True
        """Built and not loaded: every replica is still rank 0's broadcast model."""
        self._finished = False
        """:meth:`finish` was called: the replicas are averaged whatever ``eval_model``."""

    def sync(self) -> None:
        """Average the replicas into the evaluation model (before evaluation, checkpoints).

        A global collective, but the replicas are left as they are: the paper has no global
        averaging, and writing the average back would add it. A delta still in flight is
        applied at the learner's next step, as usual.

        The average crosses nodes in fp32 (one model, as an SSGD step's gradients), so it is
        taken again only where a replica changed since the last: an epoch's end evaluates,
        then checkpoints, and the run's end finishes, evaluates and checkpoints, all of the
        same replicas. Whether any changed is agreed first (8 bytes): one learner may have
        stepped where another did not, and all must take the same collectives.

        On a compressed gossip wire (a slow link: issue 57) it crosses coarsely: each node's
        mean (inside the node, in fp32) less the last average, which every rank holds, in
        int8 (bf16 on ``--wire bf16``): 4x fewer bytes than fp32, and the rounding is of an
        epoch's change, not of the weights. Each is sent against the last, so the rounding
        does not add up. The first is free where every replica is still the broadcast
        start (agreed), else it is sent whole in fp32, as after a resume.

        With ``eval_model replicas`` (the default on ``--wire topk`` and ``sign``) nothing is
        averaged before :meth:`finish`: the evaluation model is this replica as it is.
        """
        self._check_thread()
        if not self._averages():
            self._take_own_replica()
            return
        # The replica changes at a step (its update, the gossip's delta) and when closing.
        now = (self.steps, int(self._closed))
        if self._average is not None:
            self._changed.fill_(0.0 if now == self._synced_at else 1.0)
            if float(self.topo.allreduce_(self._changed, op="sum")) == 0.0:
                return  # nobody's replica changed: the average and distance stand
        else:
            self._average = torch.empty_like(self.flat)
        with self.lock:
            self._average.copy_(self.flat)
        sent = self._average_replicas()
        dist = (self.flat - self._average).double().pow(2).sum().reshape(1)
        self.consensus_distance = float(self.topo.allreduce_(dist, op="avg").sqrt())
        nbytes = 0
        if self.syncs_buffers:
            self._average_buffers = self.buffers.copy()
            self.buffers.mean("world", self._average_buffers)
            nbytes += sum(b.nbytes for b in self._average_buffers)
        self.sync_bytes += internode_share(nbytes, self.topo) + sent
        self._synced_at = now

    def _averages(self) -> bool:
        """Whether :meth:`sync` averages the replicas now (``eval_model``, or the run's end)."""
        return self.options.evaluates_average() or self._finished

    def _take_own_replica(self) -> None:
        """Hold this replica, as it is, for :meth:`evaluation_parameters` (``replicas``).

        No average and nothing across nodes: each learner scores its share of the held-out
        set with its own replica; the consensus distance is not measured.
        """
        if self._average is None:
            self._average = torch.empty_like(self.flat)
        with self.lock:
            self._average.copy_(self.flat)
        self._average_buffers = None  # this replica's own buffers
        self._synced_at = None  # the next average is taken, whatever changed

    def finish(self) -> None:
        """End of training: the replicas' average, whatever ``eval_model`` (the deployed model).

        With ``eval_model replicas`` this is the run's one average: in fp32 on every wire
        (no earlier average to send it against), a fixed cost of one model, as the start's
        broadcast.
        """
        self._finished = True
        self.sync()

    def evaluation_note(self) -> str:
        """Says when the held-out line scores the replicas as they are, not their average."""
        if (self._averages() or self.topo.num_nodes == 1
                or (self._fresh and self.steps == 0)):  # every replica the broadcast start
            return ""
        return " (each learner's own replica on its share; their average at the run's end)"

    def _average_replicas(self) -> int:
        """Make :attr:`_average` (this replica on entry) the replicas' mean; bytes sent."""
        assert self._average is not None
        if self._coarse is None:
            self.topo.allreduce_(self._average, op="avg")
            return internode_share(self._average.nbytes, self.topo)
        if self._reference is None:
            # Free only if every learner is still at the broadcast start (agreed: 8 bytes).
            self._changed.fill_(0.0 if self._fresh and self.steps == 0 else 1.0)
            moved = float(self.topo.allreduce_(self._changed, op="sum")) != 0.0
            if moved:
                self.topo.allreduce_(self._average, op="avg")
            self._reference = self._average.clone()
            return internode_share(self._average.nbytes, self.topo) if moved else 0
        diff = self._average.sub_(self._reference)
        self.topo.intra_allreduce_(diff, op="avg")  # the node's mean, over its own link
        before = self._coarse.bytes_sent
        self._coarse.mean_("average", diff, feedback=False)
        self._reference.add_(diff)
        self._average.copy_(self._reference)
        return self._coarse.bytes_sent - before

    @contextlib.contextmanager
    def evaluation_parameters(self) -> Iterator[nn.Module]:
        """A copy of the model holding the replicas' average from the last :meth:`sync`.

        Its buffers are every learner's mean from that :meth:`sync` (``sync_buffers``), or
        this replica's own.

        A separate model, not the replica swapped in place: the gossip thread may snapshot
        the replica at any time, and must see the learner's own parameters.
        """
        if self._average is None:
            self.sync()
        if self._eval_model is None:
            self._eval_model = copy.deepcopy(self.model)
            # A copy's LSTM weights lose the flat buffer's cuDNN layout: let cuDNN lay them
            # out afresh (a no-op on CPU), or it copies them at every evaluation forward.
            for module in self._eval_model.modules():
                if isinstance(module, nn.RNNBase):
                    module.flatten_parameters()
        assert self._average is not None
        # The average is laid out as the flat buffer is (FlatBuffer.params: on CUDA an LSTM's
        # weights in cuDNN's order), which need not be the model's: match them by name.
        names = {id(p): name for name, p in self.model.named_parameters()}
        copies = dict(self._eval_model.named_parameters())
        offset = 0
        for p in self.params.params:
            n = p.numel()
            copies[names[id(p)]].data.copy_(self._average[offset:offset + n].view_as(p))
            offset += n
        # The buffers' mean (sync_buffers), else this replica's own: never the copy's, which
        # were this replica's when it was made.
        self.buffers.write_into(self._eval_model, self._average_buffers)
        yield self._eval_model


__all__ = ["ReplicaAverage"]
