"""A world whose communication fails as planned: faults injected at the face, not in the code.

:class:`FaultyWorld` wraps any :class:`~hadpsgd.comm.World` (MPI's ``Topology``, the
in-process ``ThreadWorld``) and hands every member through unchanged, except at the calls an
:class:`Injection` names, where it makes them fail the way a real failure shows to the
learner (as torchft tests its managers behind a fault-injecting process group):

- ``raise``: the call raises :class:`InjectedCommFault` before the learner joins it (its own
  error; its peers then wait for it, as for a learner that died there);
- ``timeout``: the call raises :class:`~hadpsgd.comm.CommTimeoutError` naming the operation,
  as a deadline that ran out would;
- ``nan``: this learner's contribution is NaN (its tensor filled before the call: a
  learner whose values went bad), so a sum carries it to every learner;
- ``delay``: the learner sleeps ``seconds`` before joining (a straggler at that call).

An injection names a method of the world (``allreduce_``, ``intra_allreduce_``,
``inter_allreduce_``, ``broadcast_``, ``intra_broadcast_``, ``half_mean_``,
``mean_deferred_``, ``barrier``) or ``exchange``, a call of the gossip's pair channel
(:meth:`pair_channel`'s; it runs in the gossip thread). It fires at its ``call``-th call on
this learner, or at every call where ``when`` says so; ``action`` replaces the built-in kinds
with any callable (the run's ``HADPSGD_FAULT`` in the gossip thread goes through it:
:func:`hadpsgd.assembly.build.build_trainer`), so the algorithms carry no test hook.

What only processes show stays real: a killed or frozen learner, a hang, the deadlines
(``HADPSGD_FAULT``'s ``kill``, ``hang``, ``stop``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hadpsgd.comm.deadline import CommTimeoutError

KINDS = ("raise", "timeout", "nan", "delay")
"""What an :class:`Injection` does where it fires (unless it has an ``action``)."""

OPS = ("allreduce_", "intra_allreduce_", "inter_allreduce_", "broadcast_", "intra_broadcast_",
       "half_mean_", "mean_deferred_", "barrier", "exchange")
"""The calls an injection may name: the world's collectives, and the pair channel's swap."""


KEPT = 100
"""How many of an injection's firings it records."""


class InjectedCommFault(RuntimeError):
    """The error a ``raise`` injection throws (this learner's own, not a deadline's)."""


@dataclass
class Injection:
    """One planned fault at one kind of call of this learner.

    Args:
        op: The call (one of :data:`OPS`).
        call: Fire at this call of ``op`` on this learner, counted from 1 (without ``when``).
        kind: One of :data:`KINDS`.
        seconds: How long a ``delay`` sleeps.
        when: Fire at every call of ``op`` where this returns True (instead of ``call``).
        action: Called where it fires instead of the kind's own behaviour (it may raise).
    """

    op: str
    call: int = 1
    kind: str = "raise"
    seconds: float = 0.0
    when: Callable[[], bool] | None = None
    action: Callable[[], None] | None = None
    fired: list[int] = field(default_factory=list)
    """The calls (counted from 1) at which it fired: the first :data:`KEPT` of them (one
    that fires at every call, as the run's gossip faults do, must not grow for ever)."""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"injection op {self.op!r} is unknown; choose one of "
                             f"{', '.join(OPS)}")
        if self.kind not in KINDS:
            raise ValueError(f"injection kind {self.kind!r} is unknown; choose one of "
                             f"{', '.join(KINDS)}")
        if self.call < 1:
            raise ValueError(f"injection call must be >= 1 (counted from 1), got {self.call}")

    def due(self, count: int) -> bool:
        """Whether it fires at the ``count``-th call of its op."""
        return self.when() if self.when is not None else count == self.call


class FaultyWorld:
    """``inner`` with the :class:`Injection` s of this learner applied (see the module).

    Args:
        inner: The world every call goes to.
        injections: This learner's planned faults.
    """

    def __init__(self, inner: Any, injections: list[Injection]) -> None:
        self._inner = inner
        self.injections = injections
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()  # the gossip thread counts its exchanges too

    def __getattr__(self, name: str) -> Any:
        # Everything not wrapped below is the inner world's (its layout, channels, objects).
        return getattr(self._inner, name)

    # ------------------------------------------------------------------ the faults
    def _before(self, op: str) -> bool:
        """Count a call of ``op`` and act on what is due; whether a ``nan`` is (the caller's)."""
        with self._lock:
            self._counts[op] = count = self._counts.get(op, 0) + 1
        poison = False
        for inj in self.injections:
            if inj.op != op or not inj.due(count):
                continue
            if len(inj.fired) < KEPT:
                inj.fired.append(count)
            if inj.action is not None:
                inj.action()
            elif inj.kind == "raise":
                raise InjectedCommFault(f"injected fault: {op} (call {count}) on rank "
                                        f"{self._inner.rank}")
            elif inj.kind == "timeout":
                raise CommTimeoutError(f"rank {self._inner.rank}: {op} (call {count}) did not "
                                       f"complete within {self._inner.timeout:g} s (injected)")
            elif inj.kind == "delay":
                time.sleep(inj.seconds)
            else:
                poison = True
        return poison

    def _collective(self, op: str, tensor: torch.Tensor | None,
                    run: Callable[[], Any]) -> Any:
        if self._before(op) and tensor is not None:
            tensor.fill_(float("nan"))  # this learner's contribution
        return run()

    # ------------------------------------------------------------------ the wrapped calls
    def allreduce_(self, tensor: torch.Tensor, op: str = "avg", path: str = "auto"
                   ) -> torch.Tensor:
        """The inner world's, with the injections of ``allreduce_``."""
        return self._collective("allreduce_", tensor,
                                lambda: self._inner.allreduce_(tensor, op, path))

    def intra_allreduce_(self, tensor: torch.Tensor, op: str = "avg") -> torch.Tensor:
        """The inner world's, with the injections of ``intra_allreduce_``."""
        return self._collective("intra_allreduce_", tensor,
                                lambda: self._inner.intra_allreduce_(tensor, op))

    def inter_allreduce_(self, tensor: torch.Tensor, op: str = "avg") -> torch.Tensor:
        """The inner world's, with the injections of ``inter_allreduce_``."""
        return self._collective("inter_allreduce_", tensor,
                                lambda: self._inner.inter_allreduce_(tensor, op))

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """The inner world's, with the injections of ``broadcast_``."""
        return self._collective("broadcast_", tensor,
                                lambda: self._inner.broadcast_(tensor, root))

    def intra_broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """The inner world's, with the injections of ``intra_broadcast_``."""
        return self._collective("intra_broadcast_", tensor,
                                lambda: self._inner.intra_broadcast_(tensor, root))

    def half_mean_(self, tensor: torch.Tensor, scope: str) -> int:
        """The inner world's, with the injections of ``half_mean_``."""
        return self._collective("half_mean_", tensor,
                                lambda: self._inner.half_mean_(tensor, scope))

    def mean_deferred_(self, tensor: torch.Tensor, scope: str) -> bool:
        """The inner world's, with the injections of ``mean_deferred_``."""
        return self._collective("mean_deferred_", tensor,
                                lambda: self._inner.mean_deferred_(tensor, scope))

    def barrier(self) -> None:
        """The inner world's, with the injections of ``barrier``."""
        self._collective("barrier", None, self._inner.barrier)

    def pair_channel(self) -> Any:
        """The inner world's pair channel, its ``exchange`` with the injections of it."""
        return _FaultyPairChannel(self._inner.pair_channel(), self)


class _FaultyPairChannel:
    """A pair channel whose :meth:`exchange` goes through its world's injections."""

    def __init__(self, inner: Any, world: FaultyWorld) -> None:
        self._inner = inner
        self._world = world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int = 0,
                 **kwargs: Any) -> Any:
        """The inner channel's swap, with the injections of ``exchange``.

        A ``nan`` fills what this learner sends.
        """
        return self._world._collective(
            "exchange", send, lambda: self._inner.exchange(send, recv, peer, tag, **kwargs))


__all__ = ["KINDS", "OPS", "FaultyWorld", "InjectedCommFault", "Injection"]
