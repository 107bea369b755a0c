"""The background gossip of ADPSGD: matched ring pairs, snapshot exchange, clean termination.

Super-learners sit on a ring. In even rounds the pairs are (0,1), (2,3), ...; in odd rounds
(1,2), (3,4), ... and, with an even count, (N-1, 0). Each round's pairing is a matching, so
the mixing matrix of every round is symmetric and doubly stochastic, and an odd ring simply
lets one super-learner sit out a round. Every thread walks the rounds in order and a round
needs both partners, which rules out deadlock: the thread at the lowest round always has its
partner waiting for it.
"""

from __future__ import annotations

import math
import random
import threading
import time
from typing import Any

import torch

from hadpsgd import faults
from hadpsgd.comm.pair import PairChannel, Pending


def partner(node: int, num_nodes: int, round_: int) -> int | None:
    """The super-learner that ``node`` averages with in ``round_``, or None if it sits out."""
    if num_nodes < 2:
        return None
    first_even = round_ % 2 == 0
    p = node + 1 if (node % 2 == 0) == first_even else node - 1
    if num_nodes % 2 == 0:
        return p % num_nodes  # the ring closes: (N-1, 0) in odd rounds
    return p if 0 <= p < num_nodes else None


class GossipThread(threading.Thread):
    """Exchanges snapshots of one super-learner's flat parameters with its ring partners.

    The main thread owns the parameters; this thread takes a snapshot under ``lock``,
    exchanges it, and publishes ``delta = (w_peer - w_own) / 2`` for the main thread to add at
    its next step (so local steps taken meanwhile are never lost). The partner computes the
    exact negation, so gossip conserves the sum of all replicas. A round starts only after
    the main thread has stepped and applied the previous delta: at most one exchange per step.

    The snapshot, the exchange and the delta live in host memory (pinned with CUDA): the
    thread never launches device work of its own beyond one copy off the device, and the
    main thread moves the delta onto the device when it adds it.

    Args:
        flat: The super-learner's flat parameter buffer (this leader's; host or device).
        lock: Guards ``flat`` against the optimizer step.
        channel: The comm layer's pair channel among the super-learner leaders (rank = node
            index), used only by this thread.
        jitter: Upper bound of a random sleep before each exchange (tests the asynchrony).
    """

    def __init__(self, flat: torch.Tensor, lock: threading.Lock, channel: PairChannel,
                 jitter: float = 0.0) -> None:
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
        n = flat.numel()
        # One extra slot: 1.0 when the snapshot is finite. A non-finite model is never sent;
        # both partners then skip the round, which keeps the pair's deltas opposite.
        pin = flat.is_cuda
        self._send = torch.empty(n + 1, dtype=flat.dtype, pin_memory=pin)
        self._recv = torch.empty(n + 1, dtype=flat.dtype, pin_memory=pin)
        self._cond = threading.Condition()
        self._steps = 0
        self._delta: torch.Tensor | None = None
        self._taken = False
        self._closing = False
        self.error: BaseException | None = None
        self.exchanges = 0
        self.skipped_nonfinite = 0
        self.rounds = 0
        self.last_exchange_step = 0

    # ------------------------------------------------------------------ main-thread side
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
            self._cond.notify_all()

    def close(self) -> torch.Tensor | None:
        """Ask the thread to run the termination protocol; the caller then joins it.

        Returns:
            A published delta the main thread had not taken yet: the caller applies it
            (from now on the thread applies its deltas itself).
        """
        with self._cond:
            self._closing = True
            # A copy: the termination rounds that follow reuse the receive buffer it lives in.
            pending = None if self._taken or self._delta is None else self._delta.clone()
            self._delta = None
            self._taken = False
            self._cond.notify_all()
        return pending

    # ------------------------------------------------------------------ thread side
    def run(self) -> None:  # noqa: D102
        try:
            self._loop()
        except BaseException as err:  # noqa: BLE001 - reported to the main thread
            self.error = err

    def _loop(self) -> None:
        seen = 0
        while True:
            with self._cond:
                # Pace: one round per main-thread step, after the last delta was applied.
                while not self._closing and (self._steps <= seen or self._delta is not None):
                    self._cond.wait(0.05)
                if self._closing:
                    break
                seen = self._steps
            self._round(apply_now=False)
        self._terminate()

    def _round(self, apply_now: bool, terminating: Any = None) -> None:
        p = partner(self.node, self.num_nodes, self.rounds)
        r = self.rounds
        self.rounds += 1
        if p is None:
            return
        if faults.active():  # tests: an exception in this thread, not the main one
            faults.hit("gossip", self.world_ranks[self.node], self._steps)
        if self.jitter:
            time.sleep(self.rng.uniform(0, self.jitter))
        n = self.flat.numel()
        with self.lock:
            self._send[:n].copy_(self.flat)
        # One sum: NaN and Inf propagate through it (a scan of every element costs far more).
        self._send[n] = 1.0 if math.isfinite(float(self._send[:n].sum())) else 0.0
        what = (f"gossip exchange (round {r}) between super-learner {self.node} and "
                f"{p} (rank {self.world_ranks[p]})")
        # While terminating, keep the termination agreement moving as we wait (_terminate).
        self.channel.exchange(self._send, self._recv, p, tag=r % 32_000, what=what,
                              progress=terminating)
        if self._send[n] == 0.0 or self._recv[n] == 0.0:
            self.skipped_nonfinite += 1
            return
        # In place, in the receive buffer: no round starts before the main thread has applied
        # this delta (see _loop), so the buffer is not reused while it is being read.
        delta = self._recv[:n].sub_(self._send[:n]).mul_(0.5)
        self.exchanges += 1
        if not apply_now:
            with self._cond:
                # Once closing, the main thread no longer steps: apply the delta here.
                apply_now = self._closing
                if not apply_now:
                    self._delta = delta
                    self.last_exchange_step = self._steps
        if apply_now:
            delta = delta.to(self.flat.device)
            with self.lock:
                self.flat.add_(delta)

    def _terminate(self) -> None:
        """Serve rounds until every super-learner is closing, then up to an agreed last round.

        Closing leaders enter a non-blocking barrier and keep exchanging (a learner far
        behind still needs its partners). When the barrier completes, each contributes the
        number of rounds it has started to a MAX reduction, and every thread finishes exactly
        that many rounds, so no exchange is left without its partner.
        """
        barrier = self.channel.start_barrier()
        agreed: list[Pending] = []

        def drive() -> None:
            if not agreed and barrier.done():
                agreed.append(self.channel.start_max(self.rounds))

        deadline = time.monotonic() + self.watchdog.timeout
        while True:
            drive()
            final = agreed[0].value if agreed and agreed[0].done() else None
            if final is not None and self.rounds >= final:
                return
            if agreed and final is None:
                # Agreement in flight: start no new round until the last one is known.
                if time.monotonic() > deadline:
                    self.watchdog.fail("gossip termination agreement", None)
                time.sleep(1e-3)
                continue
            self._round(apply_now=True, terminating=drive)
            deadline = time.monotonic() + self.watchdog.timeout
            if final is None:
                time.sleep(2e-3)  # closing peers need not spin at full speed
