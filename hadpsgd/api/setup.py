"""``hadpsgd.init``: the learners' topology from MPI, and a job that ends when one rank fails.

Under ``mpirun`` a rank that dies of an exception leaves its peers waiting in their next
collective; hadpsgd's deadlines would end them (naming the dead rank), but only after
``HADPSGD_TIMEOUT``. So, like ``python -m mpi4py`` and ``python -m hadpsgd.run``, a script that
calls :func:`init` aborts the whole job on an exception that escapes it (in any thread): the
error is printed by the rank that had it, and every rank ends at once.
"""

from __future__ import annotations

import sys
import threading
import traceback
from types import TracebackType

from hadpsgd import comm
from hadpsgd.comm import CommTimeoutError, Topology
from hadpsgd.exit_codes import EXIT_FAILED, EXIT_TIMED_OUT

_installed = False


def init(ranks_per_node: int | None = None, device: str = "auto", *,
         intra_backend: str = "auto", abort_on_error: bool = True) -> Topology:
    """Start MPI and find the learners: the :class:`~hadpsgd.comm.Topology` of this rank.

    Every rank of the job calls it once, first (it is :func:`hadpsgd.comm.init`, the CLI's).

    Args:
        ranks_per_node: Learners per super-learner (consecutive ranks: emulated nodes; also
            env ``HADPSGD_RANKS_PER_NODE``); None: the real nodes (ranks sharing a host).
        device: ``auto`` (this rank's GPU where there is one), ``cpu`` or ``cuda``; the
            topology's ``device`` is where the model goes.
        intra_backend: ``auto``, ``mpi``, ``gloo`` or ``nccl`` inside a node.
        abort_on_error: Abort the whole job on an exception that escapes the script (see
            the module docstring).

    Returns:
        The topology: ``rank``, ``size``, ``local_rank``, ``local_size``, ``node``,
        ``num_nodes``, ``device``, its collectives, and a deadline (``HADPSGD_TIMEOUT``) on
        every blocking wait.

    Raises:
        hadpsgd.comm.TopologyError: For an impossible layout or device, or a bad
            ``HADPSGD_*`` variable.
    """
    topo = comm.init(ranks_per_node, device, intra_backend)
    if abort_on_error:
        _abort_on_error(topo)
    return topo


def _abort_on_error(topo: Topology) -> None:
    """Print an escaped exception as the CLI does, then abort every rank (once per process)."""
    global _installed  # noqa: PLW0603 - the hooks are process-wide, installed once
    if _installed or topo.size == 1:
        return
    _installed = True

    def report(kind: type[BaseException], err: BaseException,
               tb: TracebackType | None) -> None:
        code = EXIT_FAILED
        if isinstance(err, CommTimeoutError):
            # The message names the missing peer and what it was doing: a traceback of this
            # rank's wait would only hide it. Its rank leads it, as the watchdog prints it, and
            # its code is the watchdog's (a peer's deadline: one cause, one code).
            print(f"hadpsgd: error: {err}", file=sys.stderr, flush=True)
            code = EXIT_TIMED_OUT
        elif isinstance(err, KeyboardInterrupt):
            print(f"hadpsgd: rank {topo.rank}: interrupted", file=sys.stderr, flush=True)
        else:
            traceback.print_exception(kind, err, tb)
            print(f"hadpsgd: rank {topo.rank}: error: {err or kind.__name__}; aborting the "
                  "job", file=sys.stderr, flush=True)
        topo.abort(code)

    def in_thread(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is None or issubclass(args.exc_type, SystemExit):
            return  # a thread's exit is no failure (threading's own hook ignores it too)
        report(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = report
    threading.excepthook = in_thread


__all__ = ["init"]
