"""``hadpsgd.init``: the learners' topology from MPI, and a job that ends when one rank fails.

Under ``mpirun`` a rank that dies of an exception leaves its peers waiting in their next
collective; hadpsgd's deadlines would end them (naming the dead rank), but only after
``HADPSGD_TIMEOUT``. So, like ``python -m mpi4py`` and ``python -m hadpsgd.run``, a script that
calls :func:`init` aborts the whole job on an exception that escapes it (in any thread): the
error is printed by the rank that had it, and every rank ends at once.

At its end every rank meets the others under the same deadline
(:func:`hadpsgd.comm.meet_at_end`), so that a rank deadlocked in the script's own code is
named instead of holding the others in ``MPI_Finalize`` forever; and a rank that leaves
early with ``sys.exit(N)`` ends the job with ``N`` (at once where ``N`` is not 0; with 0
its peers that wait for it in a collective end the job with 0 as soon as they learn it).

A user's mistake (:data:`USER_ERRORS`: a bad option of :class:`~hadpsgd.Distributed`, an
impossible layout) is said as the CLI says one: every rank finds it, rank 0 says it in one
line, every rank exits 2 (:data:`~hadpsgd.exit_codes.EXIT_USER_ERROR`), no abort.

Before a failure ends the job, the notes registered with :func:`hadpsgd.comm.before_abort` are
told what ended it (a ``Distributed`` with ``run_dir=`` writes a ``failure`` record on rank 0).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from types import TracebackType

from hadpsgd import comm
from hadpsgd.api.options import api_words
from hadpsgd.cli import ConfigError, install_warning_format, launch_rank, leave_it_to_rank_zero
from hadpsgd.comm import CommTimeoutError, PeerEndedError, Topology, TopologyError, World
from hadpsgd.exit_codes import EXIT_FAILED, EXIT_TIMED_OUT, EXIT_USER_ERROR

USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, TopologyError)
"""What a script's user got wrong (``OptionError`` is a ``ConfigError``): said once, exit 2."""

QUIET_DEFAULTS = {"OMPI_MCA_osc": "^ucx"}
"""Open MPI settings every rank may take: the UCX one-sided component, unused by hadpsgd,
prints six ``Error: OSC UCX component …`` lines per window on a machine without a fast
network (``hadpsgd.launch.launch_env`` sets the same for the ranks it starts)."""

_installed = False
_meeting = False
"""Whether the end meeting's exit handler is registered (once, after the first topology)."""
_exit_code: int | None = None
"""The code of the main thread's ``sys.exit``, once called (None: the script's own end)."""
_topology: World | None = None
"""The topology the hooks report for; None before :func:`init` (then no rank has MPI)."""


def init(ranks_per_node: int | None = None, device: str = "auto", *,
         intra_backend: str = "auto", abort_on_error: bool = True) -> Topology:
    """Start MPI and find the learners: the :class:`~hadpsgd.comm.Topology` of this rank.

    Every rank of the job calls it once, first (it is :func:`hadpsgd.comm.init`, the CLI's).
    Before MPI starts it sets :data:`QUIET_DEFAULTS` where the environment has no value of
    its own, so that a script under a plain ``mpirun`` is as quiet as under
    ``python -m hadpsgd.launch``.

    Args:
        ranks_per_node: Learners per super-learner (consecutive ranks: emulated nodes; also
            env ``HADPSGD_RANKS_PER_NODE``); None: the real nodes (ranks sharing a host).
        device: ``auto`` (this rank's GPU where there is one), ``cpu`` or ``cuda``; the
            topology's ``device`` is where the model goes.
        intra_backend: ``auto``, ``mpi``, ``gloo`` or ``nccl`` inside a node.
        abort_on_error: Abort the whole job on an exception that escapes the script, and
            say a user error once with exit 2 (see the module docstring).

    Returns:
        The topology: ``rank``, ``size``, ``local_rank``, ``local_size``, ``node``,
        ``num_nodes``, ``device``, its collectives, and a deadline (``HADPSGD_TIMEOUT``) on
        every blocking wait.

    Raises:
        hadpsgd.comm.TopologyError: For an impossible layout or device, or a bad
            ``HADPSGD_*`` variable.
    """
    # Open MPI reads its MCA settings from the environment once, inside MPI_Init: set after
    # it (or after a script's own `from mpi4py import MPI`, which initialises) they do nothing.
    for name, value in QUIET_DEFAULTS.items():
        os.environ.setdefault(name, value)
    # hadpsgd's warnings as one line (not file:line: RuntimeWarning), naming the script's
    # knobs where they name the run's flags.
    install_warning_format(api_words)
    topo = comm.init(ranks_per_node, device, intra_backend)
    # What a peer that times out waiting for this rank is told, until a step says more.
    topo.now_doing("in the script's own code, outside hadpsgd's calls")
    if abort_on_error:
        install_error_hooks(topo)
    return topo


def install_error_hooks(topo: World | None = None) -> None:
    """Have an exception that escapes the script end the job as the module docstring says.

    Installed once per process (the hooks are process-wide); a later call only tells them
    the topology. Without one (before MPI) a user error is said by the launch's rank 0 and
    every rank exits 2, since every rank checked the same arguments; anything else is
    Python's usual traceback.
    """
    global _installed, _topology, _meeting  # noqa: PLW0603 - the hooks are process-wide
    if topo is not None:
        _topology = topo
        if not _meeting:
            # Exit handlers run last-registered first: registered once MPI and the watchdog
            # are up (comm.init registers the watchdog's stop), the end meeting runs before
            # the watchdog stops answering and before mpi4py's MPI_Finalize.
            _meeting = True
            atexit.register(_at_exit)
    if _installed:
        return
    _installed = True
    sys.excepthook = _report
    threading.excepthook = _in_thread
    # Python tells an exit handler neither that sys.exit was called nor its code: note it.
    sys.exit = _noted_exit


def _noted_exit(status: object = None) -> None:
    """``sys.exit`` that notes the code of the main thread's exit for :func:`_at_exit`."""
    global _exit_code  # noqa: PLW0603 - the process's own exit
    if threading.current_thread() is threading.main_thread():
        # Python's own rule: None is 0, an int is itself, anything else is printed and 1.
        _exit_code = 0 if status is None else status if isinstance(status, int) else 1
    raise SystemExit(status)


def _at_exit() -> None:
    """The script has ended: meet every rank under the deadline, or end the job with its code."""
    topo = _topology
    if topo is None or topo.size == 1:
        return
    comm.meet_at_end(topo, _exit_code or 0)


def said_once(topo: World, message: str) -> bool:
    """Rank 0 says ``message`` once if every rank failed with a user error before training.

    Every rank checks the same flags, files and options, so usually every rank refuses
    alike: then rank 0 says it once (and any other message once, with the ranks that gave
    it) and every rank may exit 2 cleanly, without an abort banner.

    Returns:
        False if some rank did not report an error within a few seconds (it went on, or
        failed elsewhere): then abort the job as for any failure (its peers may wait for it).
    """
    every = topo.every_rank_failed(message)
    if every is None:
        return False
    if topo.rank == 0:
        by_message: dict[str, list[int]] = {}
        for rank, said in enumerate(every):
            by_message.setdefault(said, []).append(rank)
        for said, ranks in by_message.items():
            where = "" if len(by_message) == 1 else f"rank(s) {', '.join(map(str, ranks))}: "
            print(f"hadpsgd: error: {where}{said}", file=sys.stderr, flush=True)
    return True


def _report(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
    """``sys.excepthook``: say a user error once, or print a failure and abort every rank."""
    if isinstance(err, USER_ERRORS):
        _user_error(err, _topology)
    _failed(kind, err, tb)


def _failed(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
    """Print a failure as the CLI does and abort every rank (Python's own report for one)."""
    topo = _topology
    if topo is None or topo.size == 1:
        sys.__excepthook__(kind, err, tb)
        return
    code = EXIT_FAILED
    if isinstance(err, PeerEndedError):
        # A peer ended its script while this rank waited for it: its code is the job's.
        code = err.code
        said = f"hadpsgd: {'error' if code else 'rank ended'}: {err}"
    elif isinstance(err, CommTimeoutError):
        # The message names the missing peer and what it was doing: a traceback of this
        # rank's wait would only hide it. Its rank leads it, as the watchdog prints it, and
        # its code is the watchdog's (a peer's deadline: one cause, one code).
        said = f"hadpsgd: error: {err}"
        code = EXIT_TIMED_OUT
    elif isinstance(err, KeyboardInterrupt):
        said = f"hadpsgd: rank {topo.rank}: interrupted"
    else:
        traceback.print_exception(kind, err, tb)
        said = f"hadpsgd: rank {topo.rank}: error: {err or kind.__name__}; aborting the job"
    comm.last_words(said, code)  # said, and told to the notes of comm.before_abort
    topo.abort(code)


def _user_error(err: BaseException, topo: World | None) -> None:
    """Say ``err`` once and end this rank with exit 2 (abort the job if not every rank did)."""
    message = str(err) or type(err).__name__
    if topo is None or topo.size == 1:
        # No MPI yet (or one rank): every rank of the launch checked the same arguments, so
        # the launch's rank 0 speaks for all, as hadpsgd.run's parser does.
        if launch_rank() == 0:
            print(f"hadpsgd: error: {message}", file=sys.stderr, flush=True)
        leave_it_to_rank_zero()
    elif not said_once(topo, message):
        print(f"hadpsgd: rank {topo.rank}: error: {message}", file=sys.stderr, flush=True)
        topo.abort(EXIT_USER_ERROR)  # a peer went on and may wait for this rank
    else:
        # Open MPI ends the job at the first non-zero exit: none before rank 0 has said it.
        topo.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # From an excepthook the interpreter would exit 1 after it returns; every rank is done
    # with MPI (none waits for another), and an exit code says what happened.
    os._exit(EXIT_USER_ERROR)


def _in_thread(args: threading.ExceptHookArgs) -> None:
    """``threading.excepthook``: a failure in any thread aborts every rank, as in the main one.

    A user error too: the other ranks' threads meet no agreement to say it once.
    """
    if args.exc_value is None or issubclass(args.exc_type, SystemExit):
        return  # a thread's exit is no failure (threading's own hook ignores it too)
    if _topology is None or _topology.size == 1:
        threading.__excepthook__(args)
        return
    _failed(args.exc_type, args.exc_value, args.exc_traceback)


__all__ = ["QUIET_DEFAULTS", "USER_ERRORS", "init", "install_error_hooks", "said_once"]
