"""ADPSGD's background gossip: ready neighbours pair up, exchange, terminate cleanly.

Super-learners sit on a graph (:func:`neighbours`: the paper's ring or the exponential one).
A leader whose main thread has stepped becomes *ready* on a shared board (one slot per
super-learner, each in its own leader's window, one-sided atomics: nobody waits for a call of
anybody else's, and a leader waits by reading local memory); it then pairs with whichever
neighbour is ready first: it takes itself off the board (compare-and-swap ``READY ->
LOCKED``), claims a ready neighbour (``READY -> MATCHED + me``), or, if none is ready, goes
back on the board, where a neighbour may claim it. A claimed leader sees its slot say
``MATCHED + peer``. Every pairing is mutual and each partner applies
the exact negation of the other's delta, so gossip conserves the sum of the replicas and the
mixing is symmetric and doubly stochastic; and a slow super-learner only slows the exchanges
that involve it: its neighbours pair with their other neighbours meanwhile (the paper's ring
lets either neighbour serve).
"""

from __future__ import annotations

import collections
import contextlib
import math
import random
import threading
import time

import torch

from hadpsgd.algorithms.choco import DEFAULT_GOSSIP_STEP, ChocoEdges
from hadpsgd.comm.codec import decode, encode, payload_bytes
from hadpsgd.comm.copies import CopyStream
from hadpsgd.comm.pair import PairChannel
from hadpsgd.comm.streams import bind_thread

BUSY, READY, LOCKED, CLOSED, MATCHED = 0, 1, 2, 3, 16
"""Board states of a super-learner; ``MATCHED + p``: claimed by (and paired with) ``p``."""


GRAPHS: tuple[str, ...] = ("ring", "exponential")
"""Gossip graphs: the paper's ring, or the exponential graph (peers at distance 1, 2, 4, ...)."""


def neighbours(node: int, num_nodes: int, graph: str = "ring") -> list[int]:
    """The gossip neighbours of ``node`` (one for a ring of two, none alone).

    ``ring``: ``node +- 1``, the h-adpsgd paper's ring. ``exponential``: ``node +- 2**k`` for
    every ``2**k < num_nodes``, a symmetric graph (so every pairing stays mutual) whose
    mixing slows with ``log N`` rather than with ``N**2`` as the ring's does; with four or
    fewer super-learners it is the complete graph.
    """
    if graph not in GRAPHS:
        raise ValueError(f"gossip graph must be one of {', '.join(GRAPHS)}, got {graph!r}")
    hops = [1]
    while graph == "exponential" and 2 * hops[-1] < num_nodes:
        hops.append(2 * hops[-1])
    return sorted({(node + s * h) % num_nodes for h in hops for s in (-1, 1)} - {node})


class GossipThread(threading.Thread):
    """Exchanges snapshots of one super-learner's flat parameters with its ring partners.

    The main thread owns the parameters; this thread takes a snapshot under ``lock``,
    exchanges it, and publishes ``delta = (w_peer - w_own) / 2`` for the main thread to add at
    its next step (so local steps taken meanwhile are never lost). The partner computes the
    exact negation, so gossip conserves the sum of all replicas. A round starts only after
    the main thread has stepped and applied the previous delta: at most one exchange per step.

    The snapshot, the exchange and the delta's arithmetic live in host memory (page-locked
    with CUDA, allocated once), also between leaders that share a host: this thread
    launches no NCCL (comm/hostlink.py, *One thread launches NCCL*). On a GPU the two
    copies run on a copy stream of their own (:class:`~hadpsgd.comm.copies.CopyStream`):
    the snapshot is queued under the lock behind the main thread's latest write of the
    parameters (the weights after its last step, read while the next step computes; its
    next write waits for the copy, on the device, not on the host), and only this thread
    sleeps until it has arrived; the delta is uploaded to the device by this thread, and the
    main thread's stream waits for the upload before it adds it. The main thread wraps its
    writes of ``flat`` in ``copies.writing()``.

    A compressed ``wire`` (``bf16``, ``int8``) sends ``encode(w + e)`` and keeps the rounding
    error ``e = (w + e) - decode(own payload)`` for the next exchange (error feedback); the
    delta is ``(decode(peer payload) - decode(own payload)) / 2``. Both partners decode the
    same two payloads, so each one's delta is still the exact negation of the other's and
    the sum of the replicas is conserved. (The error is not checkpointed: after a resume it
    starts at zero, at most one rounding step away.) With ``choco`` it sends instead the code
    of what the edge's public estimates lack, CHOCO-SGD's compressed differences
    (:mod:`hadpsgd.algorithms.choco`): what a sparse top-k code needs.

    Args:
        flat: The super-learner's flat parameter buffer (this leader's; host or device).
        lock: Guards ``flat`` against the optimizer step.
        channel: The comm layer's pair channel among the super-learner leaders (rank = node
            index), used only by this thread.
        jitter: Upper bound of a random sleep before each exchange (tests the asynchrony).
        wire: ``fp32`` (the parameters' own dtype), ``bf16`` or ``int8`` (see
            :mod:`hadpsgd.comm.codec`).
        copies: The copy stream the main thread's writes of ``flat`` are ordered with (its
            own if None: then nobody else writes ``flat``).
        delta_buf: A device buffer like ``flat`` that the published delta is uploaded into
            (made here if None; unused on the CPU, where the delta stays on the host).
        choco: Compressed gossip of differences against per-edge estimates (a compressed
            ``wire`` only; ``topk`` and ``sign`` need it).
        step: CHOCO's consensus step gamma, in (0, 1].
        graph: Who pairs with whom: ``ring`` or ``exponential`` (:func:`neighbours`).
    """

    def __init__(self, flat: torch.Tensor, lock: threading.Lock, channel: PairChannel,
                 jitter: float = 0.0, wire: str = "fp32", copies: CopyStream | None = None,
                 delta_buf: torch.Tensor | None = None, choco: bool = False,
                 step: float = DEFAULT_GOSSIP_STEP, graph: str = "ring") -> None:
        super().__init__(name="hadpsgd-gossip", daemon=True)
        self.flat = flat
        self.lock = lock
        self.channel = channel
        self.watchdog = channel.watchdog
        self.world_ranks = channel.world_ranks
        self.node = channel.rank
        self.num_nodes = channel.size
        self.jitter = jitter
        self.rng = random.Random(1000 + self.node)
        self.peers = neighbours(self.node, self.num_nodes, graph)
        self.board = channel.board(self.num_nodes)
        """One slot per super-learner: BUSY, READY, LOCKED, CLOSED or MATCHED + partner."""
        n = flat.numel()
        self.wire = wire
        self.copies = copies if copies is not None else CopyStream(flat.device)
        # One extra slot: 1.0 when the snapshot is finite. A non-finite model is never sent;
        # both partners then skip the round, which keeps the pair's deltas opposite.
        if wire == "fp32":
            self._send = self.copies.host(n + 1, flat.dtype)
            self._recv = self.copies.host(n + 1, flat.dtype)
        else:  # the payload's bytes and one flag byte (CHOCO: and "I hold our edge")
            size = payload_bytes(n, wire) + (2 if choco else 1)
            self._send = torch.empty(size, dtype=torch.uint8)
            self._recv = torch.empty(size, dtype=torch.uint8)
            self._snap = self.copies.host(n, flat.dtype)
            self._error = torch.zeros(n, dtype=flat.dtype)
            self._delta_host = self.copies.host(n, flat.dtype)
        self.choco = (ChocoEdges(n, flat.dtype, wire, step) if choco and wire != "fp32"
                      else None)
        """CHOCO's per-edge estimates (``--wire topk`` or ``sign`` under ADPSGD), or None."""
        if self.choco is not None:  # made where every replica holds rank 0's broadcast model
            self.choco.seed(self.peers, flat.detach().to("cpu", copy=True))
        self._delta_dev = None
        if flat.is_cuda:
            self._delta_dev = delta_buf if delta_buf is not None else torch.empty_like(flat)
        self.bytes_sent = 0
        """Bytes this leader sent to its partners (payloads and flags)."""
        self.bytes_received = 0
        """Bytes this leader received from its partners (a swap: as many as it sent)."""
        self._cond = threading.Condition()
        self._steps = 0
        self._delta: torch.Tensor | None = None
        self._taken = False
        self._closing = False
        self.error: BaseException | None = None
        self.exchanges = 0
        self.skipped_nonfinite = 0
        self.partners: collections.Counter[int] = collections.Counter()
        """Exchanges started with each partner (which edges of the graph the gossip used)."""
        self.last_exchange_step = 0
        self.pending_since: int | None = None
        """The main thread's step count when the snapshot of the exchange now in flight was
        taken, until the main thread has applied its delta (None: no gossip pending). A
        committed exchange completes without the partner's main thread, so this is what a
        learner may safely wait for (``max_staleness``)."""

    # ------------------------------------------------------------------ main-thread side
    @property
    def steps(self) -> int:
        """Main-thread steps notified to this thread so far.

        This process's count, not the run's: it starts at 0 after a resume, and so do
        :attr:`pending_since` and :attr:`last_exchange_step`, which it is compared with.
        """
        return self._steps

    def staleness_in_flight(self) -> int:
        """Main-thread steps taken since the snapshot of the gossip not yet applied (0: none)."""
        since = self.pending_since  # read once: the thread may clear or set it meanwhile
        return 0 if since is None else self._steps - since

    def notify_step(self) -> None:
        """The main thread finished a step (lets the next round start)."""
        with self._cond:
            self._steps += 1
            self._cond.notify_all()

    def take_delta(self) -> torch.Tensor | None:
        """The published delta, if any; the caller must apply it and call :meth:`applied`."""
        with self._cond:
            if self._delta is None or self._taken:
                return None
            self._taken = True
            return self._delta

    def applied(self) -> None:
        """The delta returned by :meth:`take_delta` is now part of the parameters."""
        with self._cond:
            self._delta = None
            self._taken = False
            # Cleared before the next round may start (it waits on this condition), so a
            # new snapshot's step is never overwritten.
            self.pending_since = None
            self._cond.notify_all()

    def close(self) -> torch.Tensor | None:
        """Ask the thread to run the termination protocol; the caller then joins it.

        Returns:
            A published delta the main thread had not taken yet: the caller applies it
            (from now on the thread applies its deltas itself).
        """
        with self._cond:
            self._closing = True
            # A copy: the exchanges of the termination reuse the receive buffer it lives in.
            pending = None
            if not self._taken and self._delta is not None:
                self.copies.arrived()  # a device delta: this stream waits for its upload
                pending = self._delta.clone()
            self._delta = None
            self._taken = False
            self.pending_since = None  # the main thread steps no more: nothing to bound
            self._cond.notify_all()
        return pending

    @property
    def rounds(self) -> int:
        """Exchanges started, with any partner."""
        return sum(self.partners.values())

    # ------------------------------------------------------------------ thread side
    def run(self) -> None:  # noqa: D102
        try:
            bind_thread(self.flat.device)  # else the copy stream's contexts switch to GPU 0
            # A stream of this thread's own: its kernels (the closing delta's add) neither
            # wait for training's queued kernels nor hold them.
            stream = torch.cuda.Stream(self.flat.device) if self.flat.is_cuda else None
            try:
                with (torch.cuda.stream(stream) if stream is not None
                      else contextlib.nullcontext()):
                    self._loop()
            finally:
                if stream is not None:  # whoever joins this thread reads what it last wrote
                    stream.synchronize()
        except BaseException as err:  # noqa: BLE001 - reported to the main thread
            self.error = err

    def _loop(self) -> None:
        seen = 0
        while True:
            with self._cond:
                # Pace: at most one exchange per main-thread step, after the last delta was
                # applied.
                while not self._closing and (self._steps <= seen or self._delta is not None):
                    self._cond.wait(0.05)
                if self._closing:
                    break
                seen = self._steps
            peer = self._pair()
            if peer is not None:
                self._exchange(peer, apply_now=False)
        self._terminate()

    def _pair(self) -> int | None:
        """Get on the board and wait to be paired with a ready ring neighbour.

        The board's slots live each in its leader's memory (:class:`~hadpsgd.comm.counter.
        OwnedSlots`): reading and changing this leader's own slot crosses no link, claiming
        a neighbour does. So a leader tries to claim its neighbours once, when it gets on
        the board, and then waits on its own slot, where the next neighbour to get on the
        board claims it. It tries again only where a claim met a neighbour in the middle of
        its own claims (``LOCKED``): that neighbour may have found this leader locked too,
        and neither would claim the other again. Any other state a claim meets (busy,
        claimed by someone else, closed) means that neighbour has yet to get on the board,
        and its own first claims will find this leader ready. Waiting thus costs no bytes
        between nodes, however long it lasts; a pairing costs one claim a neighbour (24
        bytes each, :attr:`control_bytes`).

        Returns:
            The partner, or None when closing came first (this leader is off the board).
        """
        board, me = self.board, self.node
        board.compare_and_swap(me, BUSY, READY)
        pause, claim = 50e-6, True
        while True:
            state = board.get(me)
            if state >= MATCHED:  # a neighbour claimed this leader
                board.compare_and_swap(me, state, BUSY)
                return state - MATCHED
            if self._closing:
                if board.compare_and_swap(me, READY, BUSY) == READY:
                    return None
                continue  # claimed just now: the next read says by whom
            if claim and board.compare_and_swap(me, READY, LOCKED) == READY:
                # Off the board while claiming, so nobody claims this leader meanwhile.
                claim = False
                for j in self.rng.sample(self.peers, len(self.peers)):
                    found = board.compare_and_swap(j, READY, MATCHED + me)
                    if found == READY:
                        board.compare_and_swap(me, LOCKED, BUSY)
                        return j
                    claim |= found == LOCKED
                board.compare_and_swap(me, LOCKED, READY)
                if claim:  # two claiming at once: a random pause breaks the tie
                    time.sleep(self.rng.uniform(0, 4 * pause))
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)  # idle leaders need not spin at full speed

    @property
    def control_bytes(self) -> int:
        """Bytes of the pairing's board operations that crossed nodes (claims of neighbours)."""
        return int(self.board.crossing_bytes)

    def _exchange(self, p: int, apply_now: bool) -> None:
        """Swap snapshots with partner ``p`` and publish (or apply) the delta."""
        self.partners[p] += 1
        if self.jitter:
            time.sleep(self.rng.uniform(0, self.jitter))
        delta = (self._swap(p) if self.wire == "fp32" else
                 self._swap_choco(p) if self.choco is not None else self._swap_compressed(p))
        if delta is None:
            self.skipped_nonfinite += 1
            self.pending_since = None  # both partners skip the round: nothing to apply
            return
        self.exchanges += 1
        if not apply_now:
            with self._cond:
                # Once closing, the main thread no longer steps: apply the delta here.
                apply_now = self._closing
                if not apply_now:
                    self._delta = self._publish(delta)
                    self.last_exchange_step = self._steps
        if apply_now:
            # Closing: the main thread no longer steps, nor reads the device delta buffer.
            delta = delta.to(self.flat.device)
            with self.lock, self.copies.writing():
                self.flat.add_(delta)
            self.pending_since = None

    def _publish(self, delta: torch.Tensor) -> torch.Tensor:
        """The delta the main thread adds: on a GPU, queued for upload on the copy stream.

        The device buffer is free: the previous delta was added before this round's
        snapshot, which waited for that write (and the upload follows the snapshot).
        """
        if self._delta_dev is None:
            return delta
        return self.copies.upload(delta, self._delta_dev)

    def _send_recv(self, p: int) -> None:
        what = (f"gossip exchange between super-learner {self.node} and {p} (rank "
                f"{self.world_ranks[p]})")
        # A pair's exchanges are matched in order (MPI does not overtake): one tag suffices.
        self.channel.exchange(self._send, self._recv, p, tag=0, what=what)
        self.bytes_sent += self._send.nbytes
        self.bytes_received += self._recv.nbytes

    def _swap(self, p: int) -> torch.Tensor | None:
        """Swap snapshots as they are; the delta, or None if either side is non-finite."""
        n = self.flat.numel()
        with self.lock:  # queued behind the main thread's latest write of the parameters
            self.copies.fetch(self.flat, self._send[:n])
            self.pending_since = self._steps
        self.copies.wait()  # only this thread sleeps until the snapshot is here
        # One sum: NaN and Inf propagate through it (a scan of every element costs far more).
        self._send[n] = 1.0 if math.isfinite(float(self._send[:n].sum())) else 0.0
        self._send_recv(p)
        if self._send[n] == 0.0 or self._recv[n] == 0.0:
            return None
        # In place, in the receive buffer: no exchange starts before the main thread has
        # applied this delta (see _loop), so the buffer is not reused while it is being read.
        return self._recv[:n].sub_(self._send[:n]).mul_(0.5)

    def _swap_compressed(self, p: int) -> torch.Tensor | None:
        """Swap encoded snapshots with error feedback (see the class docstring)."""
        n, m, dtype = self.flat.numel(), self._send.numel() - 1, self.flat.dtype
        x = self._snap
        with self.lock:
            self.copies.fetch(self.flat, x)
            self.pending_since = self._steps
        self.copies.wait()
        x.add_(self._error)
        self._send[:m] = encode(x, self.wire)
        self._send[m] = 1 if math.isfinite(float(x.sum())) else 0
        self._send_recv(p)
        if self._send[m] == 0 or self._recv[m] == 0:
            return None  # nothing was used: the error stays what it was
        own = decode(self._send[:m], n, self.wire, dtype)
        torch.sub(x, own, out=self._error)
        # Like _swap's, the buffer is not reused before the main thread has applied it.
        delta = torch.sub(decode(self._recv[:m], n, self.wire, dtype), own,
                          out=self._delta_host)
        return delta.mul_(0.5)

    def _swap_choco(self, p: int) -> torch.Tensor | None:
        """Swap codes of what the edge's estimates lack (:mod:`hadpsgd.algorithms.choco`)."""
        edges, m = self.choco, self._send.numel() - 2
        assert edges is not None
        x = self._snap
        with self.lock:
            self.copies.fetch(self.flat, x)
            self.pending_since = self._steps
        self.copies.wait()
        finite = math.isfinite(float(x.sum()))
        held = edges.holds(p)
        if held and finite:
            self._send[:m] = edges.message(p, x)
        self._send[m] = 1 if finite else 0
        self._send[m + 1] = 1 if held else 0
        self._send_recv(p)
        if self._send[m] == 0 or self._recv[m] == 0:
            return None  # nothing was used: the edge stays as it was on both ends
        if self._send[m + 1] == 1 and self._recv[m + 1] == 1:
            return edges.mix(p, self._send[:m], self._recv[:m], self._delta_host)
        # Either end lacks the edge (a run's first exchange on it): start it from the models.
        own, other = x.clone(), torch.empty_like(x)
        what = f"gossip edge start between super-learner {self.node} and {p}"
        self.channel.exchange(own, other, p, tag=0, what=what)
        self.bytes_sent += own.nbytes
        self.bytes_received += other.nbytes
        return edges.start(p, own, other, self._delta_host)

    def _terminate(self) -> None:
        """Leave the board for good, then wait for every leader to have left it too.

        A neighbour that claimed this leader just before is still served (its exchange is
        committed); once the slot says ``CLOSED`` nobody can claim it, so after the final
        barrier no exchange is left without its partner.
        """
        board, me = self.board, self.node
        while True:
            state = board.get(me)
            if state >= MATCHED:
                board.compare_and_swap(me, state, BUSY)
                self._exchange(state - MATCHED, apply_now=True)
            elif board.compare_and_swap(me, state, CLOSED) == state:
                break
        barrier = self.channel.start_barrier()
        self.watchdog.wait_until(barrier.done, "gossip termination", None)
        board.free()
