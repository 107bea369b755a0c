"""Fault injection for tests: make one rank die, raise, hang or misbehave at a chosen point.

Set ``HADPSGD_FAULT`` to one or more ``;``-separated faults of ``key=value`` pairs::

    HADPSGD_FAULT="kind=hang,rank=1,step=5"
    HADPSGD_FAULT="kind=kill,rank=0,step=8,at=ckpt-manifest"

Keys:
    kind: ``kill`` (SIGKILL itself), ``raise`` (an exception in the main thread), ``hang``
        (sleep forever; its watchdog still answers), ``stop`` (SIGSTOP itself: frozen, every
        thread), ``raise-gossip`` (an exception in ADPSGD's gossip thread), ``nan``
        (this rank's loss becomes NaN: its gradients are all NaN), ``overflow`` (this rank's
        loss is scaled by a further 2**40 before backward: under ``--precision fp16`` its
        gradient overflows, the loss-scale test), ``signal`` (send SIGTERM to itself, as a
        scheduler would).
    rank: Launch rank that fails (default 0): the world rank at start, kept by a process
        whose survivors renumber after a failure.
    step: Global step at which it fails (the step about to be taken, counted from 1; for the
        checkpoint points, the step of the checkpoint being written; the first one at or
        after it). Default 1.
    at: Where: ``step`` (default: in the training loop, before the step), ``gossip`` (in the
        gossip thread; the default for ``raise-gossip``), ``ckpt-data`` (a checkpoint's data
        file is written), ``ckpt-manifest`` (its manifest is written), ``ckpt-rename`` (it
        has been renamed into place, before the ``latest`` pointer moves), ``ckpt-wait`` (a
        rank other than 0, the writer, while rank 0 writes the checkpoint), ``ckpt-part`` (a
        node leader, after writing its node's part of a sharded checkpoint); in start-up
        (``step`` does not apply): ``startup-mpi`` (before ``MPI_Init``: a rank that never
        reaches MPI), ``startup-data`` (in the data checks, before the files are read),
        ``startup-model`` (before the model's broadcast from rank 0).
    count: How many of this rank's steps a ``nan`` or ``overflow`` fault lasts: its first
        ``count`` steps from ``step`` on (default 1). Under SSGD and BMUF those are steps
        ``step`` .. ``step + count - 1``; under ADPSGD's pool a rank's steps are not
        consecutive (another super-learner may take step ``step``), so the fault takes the
        rank's next steps instead of missing it.

Each fault fires at most once per process (``nan`` and ``overflow`` for ``count`` steps).
Before it fires it prints ``[hadpsgd] fault injection: ... t=<unix time>`` to stderr, so
tests can time how long the job takes to end.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field

from hadpsgd import cli, env
from hadpsgd.env import EnvError

ENV = env.FAULT
KINDS = ("kill", "raise", "hang", "stop", "raise-gossip", "nan", "overflow", "signal")
POINTS = ("step", "gossip", "ckpt-data", "ckpt-manifest", "ckpt-rename", "ckpt-wait",
          "ckpt-part", "startup-mpi", "startup-data", "startup-model")


class InjectedFault(RuntimeError):
    """The exception a ``raise`` or ``raise-gossip`` fault throws."""


@dataclass
class Fault:
    """One planned failure (see the module docstring)."""

    kind: str
    rank: int = 0
    step: int = 1
    at: str = "step"
    count: int = 1
    fired: int = field(default=0, compare=False)


def parse(text: str) -> list[Fault]:
    """Parse a ``HADPSGD_FAULT`` value.

    Raises:
        hadpsgd.env.EnvError: On an unknown key, kind or point, or a number that is not an
            integer, naming it and the valid choices (a ``ValueError``).
    """
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields: dict[str, str] = {}
        for item in part.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise EnvError(f"{ENV}: {item!r} is not key=value (e.g. kind=kill,rank=1,step=5)")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"kind", "rank", "step", "at", "count"}
        if unknown:
            raise EnvError(f"{ENV}: unknown key(s) {sorted(unknown)}; use kind, rank, step, at, "
                           "count")
        kind = fields.get("kind", "")
        if kind not in KINDS:
            raise EnvError(f"{ENV}: kind={kind!r} is unknown; choose one of {', '.join(KINDS)}")
        at = fields.get("at", "gossip" if kind == "raise-gossip" else "step")
        if at not in POINTS:
            raise EnvError(f"{ENV}: at={at!r} is unknown; choose one of {', '.join(POINTS)}")
        faults.append(Fault(kind, _integer(fields, "rank", 0), _integer(fields, "step", 1), at,
                            _integer(fields, "count", 1)))
    return faults


def _integer(fields: dict[str, str], key: str, default: int) -> int:
    """``fields[key]`` as an integer (``default`` when absent).

    Raises:
        hadpsgd.env.EnvError: Naming the variable and the key, where a bare ``int()`` would
            only say "invalid literal".
    """
    if key not in fields:
        return default
    try:
        return int(fields[key])
    except ValueError:
        raise EnvError(f"{ENV}: {key}={fields[key]!r} is not an integer; set e.g. "
                       f"{key}={default}") from None


_PLAN: list[Fault] | None = None


def plan() -> list[Fault]:
    """The faults of ``HADPSGD_FAULT`` (parsed once per process)."""
    global _PLAN
    if _PLAN is None:
        _PLAN = parse(env.fault_spec())
    return _PLAN


def active() -> bool:
    """Whether any fault is planned (lets hot paths skip the hook entirely)."""
    return bool(plan())


def launch_rank(rank: int) -> int:
    """The rank the launcher gave this process, else ``rank``.

    A fault names a process, which keeps its launch rank when the survivors of a failure
    renumber themselves (``--on-failure continue``).
    """
    return cli.launch_rank(default=rank)


def hit(at: str, rank: int, step: int) -> str | None:
    """Fire the fault planned for (``at``, ``rank``, ``step``), if any.

    ``kill``, ``raise``, ``hang`` and ``signal`` act here; ``nan`` and ``overflow`` are
    returned to the caller (which poisons its loss), as is nothing when no fault matches.

    Raises:
        InjectedFault: For ``raise`` and ``raise-gossip``.
    """
    rank = launch_rank(rank)
    for fault in plan():
        if fault.at != at or fault.rank != rank:
            continue
        if fault.kind in ("nan", "overflow"):
            if step >= fault.step and fault.fired < fault.count:
                fault.fired += 1
                _announce(fault, step)
                return fault.kind
            continue
        if step < fault.step or fault.fired:
            continue  # ">=": the gossip thread may see the step count jump past ``step``
        fault.fired += 1
        _announce(fault, step)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind in ("raise", "raise-gossip"):
            raise InjectedFault(f"injected fault: {fault.kind} on rank {rank} at {at} {step}")
        elif fault.kind == "hang":
            while True:  # a stuck rank: only the peers' deadlines end the job
                time.sleep(60)
        elif fault.kind == "stop":  # frozen, every thread (SIGSTOP): it answers nobody
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        return fault.kind
    return None


def startup(at: str, rank: int = 0) -> None:
    """Fire a start-up fault planned at ``at`` (a ``startup-*`` point) for this process.

    ``rank`` is this learner's rank where known; before MPI starts, the launcher's.
    """
    if active():
        hit(at, rank, 1)


def _announce(fault: Fault, step: int) -> None:
    print(f"[hadpsgd] fault injection: kind={fault.kind} rank={fault.rank} at={fault.at} "
          f"step={step} pid={os.getpid()} t={time.time():.3f}", file=sys.stderr, flush=True)
