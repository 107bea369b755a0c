"""Keep training through a failure: ULFM's revoke, shrink and agreement, for the survivors.

Under ``mpirun --with-ft ulfm`` (Open MPI's User-Level Failure Mitigation) an operation that
involves a process that died raises ``MPI_ERR_PROC_FAILED`` on the survivors within a fraction
of a second (the runtime's failure detector; with ``mpi_ft_detector`` it also finds a frozen
process by its missing heartbeat). What a survivor then does:

1. **Revoke** every communicator it uses (:func:`revoke`): a peer blocked in a collective that
   the dead process is not part of (the other members of a node whose leader was cut off)
   would otherwise wait forever; a revoked communicator fails every pending and later
   operation on it, everywhere, with ``MPI_ERR_REVOKED``.
2. **Shrink** the world to the survivors (:func:`shrink`): a fault-tolerant collective that
   also agrees on who is gone.
3. The caller rebuilds the topology on the new world (``hadpsgd.comm.init(base=...)``) and
   the run from a state every survivor holds (``hadpsgd.assembly.elastic``).

Only this module calls ULFM's routines (the comm layer is the one room that touches MPI).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import numpy as np

from hadpsgd import env
from hadpsgd.comm import deadline
from hadpsgd.comm.frozen import kill_frozen_peers
from hadpsgd.comm.mpi import mpi
from hadpsgd.comm.sentinel import Sentinel, process_state

FT_ENV = "OMPI_MCA_mpi_ft_enable"
"""Set to 1 by ``mpirun --with-ft ulfm`` in every process it starts."""


def enabled() -> bool:
    """Whether this job runs with failure mitigation: ULFM's routines and the runtime's."""
    MPI = mpi()  # noqa: N806
    return launched_with_ft() and hasattr(MPI.Comm, "Shrink") and hasattr(MPI, "ERR_PROC_FAILED")


def launched_with_ft() -> bool:
    """Whether the launcher started this process with failure mitigation (no MPI call).

    Then ``MPI_Finalize`` may never return (the heartbeat detector's thread), whatever the
    run did: the process ends without it.
    """
    return os.environ.get(FT_ENV, "").lower() in ("1", "true", "yes")


def note_exit(code: int) -> None:
    """Note this rank's own exit with ``code`` for ``python -m hadpsgd.launch``.

    Under ``mpirun --with-ft ulfm`` a job whose every rank ended by a signal exits 0; the
    launcher takes a job where no rank noted an exit as failed. Nothing outside its launch.
    """
    where = os.environ.get("_HADPSGD_LAUNCH_EXITS")  # hadpsgd.launch.mpirun.EXITS_ENV
    if where:
        try:
            with open(os.path.join(where, f"pid-{os.getpid()}"), "w") as note:
                note.write(f"{code}\n")
        except OSError:
            pass  # the launcher's directory is gone: it has ended


def raise_if_revoked(comm: Any) -> None:
    """Raise MPI's ``ERR_REVOKED`` if a peer revoked ``comm`` after a failure (a local check).

    A learner whose own operations never involve the dead process (an ADPSGD learner that
    only gossips with live neighbours and takes batches from the pool) learns of the failure
    here, at its next step, instead of at the next meeting. A no-op without ULFM.
    """
    global _FT  # noqa: PLW0603 - decided once per process, asked every step
    if _FT is None:
        _FT = enabled()
    if _FT and comm.Is_revoked():
        MPI = mpi()  # noqa: N806
        raise MPI.Exception(MPI.ERR_REVOKED)


_FT: bool | None = None


def _classes() -> set[int]:
    MPI = mpi()  # noqa: N806
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    return {getattr(MPI, n) for n in names if hasattr(MPI, n)}


def is_peer_failure(err: BaseException | None) -> bool:
    """Whether ``err`` (or an error it was raised from or during) is a failed or revoked peer.

    Collectives run in background threads and are re-raised in the main thread wrapped in
    other errors, so the chain is followed. Open MPI's non-blocking collectives (libnbc:
    ``Ibarrier``, ``Iallreduce``) may end a schedule that met a failed peer with
    ``MPI_ERR_OTHER`` instead (``NBC_Progress: an error 75 was found ... aborting the
    schedule``, then "known error not in list"): that counts too where this process knows of
    a failed process in the world, or learns of one within 3 s (the elastic soak's rank 1
    in an ``Ibarrier`` after a checkpoint, while rank 2 had been killed).
    """
    MPI = mpi()  # noqa: N806
    classes = _classes()
    seen = 0
    while err is not None and seen < 16:
        if getattr(err, "peer_killed", False):
            return True  # a frozen peer found at a deadline, being killed (kill_frozen_peers)
        if isinstance(err, MPI.Exception):
            try:
                if err.Get_error_class() in classes:
                    return True
                # A peer this process killed as frozen: the call it cut is that death, also
                # where the runtime has not told this process yet (a channel's all-to-all).
                if err.Get_error_class() == MPI.ERR_OTHER and classes and (
                        deadline.killed_peers() or _failure_known()):
                    return True
            except Exception:  # noqa: BLE001 - a finalized MPI cannot be asked
                return False
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _failure_known(wait_s: float = 3.0) -> bool:
    """Whether this process knows of a failed process in the world, within ``wait_s``.

    A schedule that a peer's revocation cut may end before the runtime has told this
    process of the death behind it: that news comes within the heartbeat detector's timeout.
    """
    MPI = mpi()  # noqa: N806
    end = time.monotonic() + wait_s
    while not failed_ranks(MPI.COMM_WORLD) and not _host_peer_gone():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _host_peer_gone() -> bool:
    """Whether a learner of the running world on this host has no process any more.

    A blocking all-to-all on a channel's communicator (BMUF's compressed block sync) that a
    killed learner cut ends with ``MPI_ERR_OTHER``, and the world's list of failed processes
    may stay empty for longer than the caller waits (the soak, round 3: 4 of 8 learners took
    a killed one for their own error). A dead sibling is a local fact: its process is gone.
    """
    siblings = _siblings(_current) if _current is not None else {}
    return any(process_state(pid) in (None, "Z", "X") for pid in siblings.values())


def _siblings(topo: Any) -> dict[int, int]:
    """The rank and process id of every other learner of ``topo`` on this host.

    Empty where the topology does not know them.
    """
    hosts, pids, me = list(topo.hosts), list(getattr(topo, "pids", [])), topo.rank
    if len(hosts) != topo.size or len(pids) != topo.size:
        return {}
    return {r: pids[r] for r in range(topo.size) if r != me and hosts[r] == hosts[me]}


def revoke(comms: list[Any]) -> None:
    """Revoke every communicator in ``comms`` (already revoked or freed ones are skipped)."""
    for comm in comms:
        try:
            comm.Revoke()
        except Exception:  # noqa: BLE001, S112 - revoked by a peer already, or freed
            continue


def shrink(world: Any, timeout: float | None = None) -> tuple[Any, list[int]]:
    """The survivors' world and the ranks (in ``world``) that are gone (collective).

    ``MPI_Comm_shrink`` is itself fault tolerant: it completes among the processes alive,
    and every survivor gets the same new communicator, ranks in the old order. A process
    that is neither dead nor taking part (frozen, and not killed) would keep it waiting:
    past ``timeout`` seconds the job is aborted instead.
    """
    MPI = mpi()  # noqa: N806
    done = threading.Event()

    def guard() -> None:  # the wheel's MPI_Ishrink fails (MPI_ERR_INTERN): watch a blocking one
        if not done.wait(timeout):
            print(f"hadpsgd: error: the survivors of a failure could not agree on who is gone "
                  f"within {timeout:g} s (HADPSGD_TIMEOUT): a learner is frozen and no learner "
                  "on its host could kill it; ending the job", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(1)

    if timeout is not None:
        threading.Thread(target=guard, name="hadpsgd-shrink-deadline", daemon=True).start()
    try:
        new = world.Shrink()
    finally:
        done.set()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    old_group, new_group = world.Get_group(), new.Get_group()
    kept = MPI.Group.Translate_ranks(new_group, list(range(new.Get_size())), old_group)
    gone = sorted(set(range(world.Get_size())) - {int(r) for r in kept})
    old_group.Free()
    new_group.Free()
    return new, gone


def keep(world: Any, stays: bool) -> Any:
    """The communicator of the survivors that stay (collective; None for one that leaves)."""
    MPI = mpi()  # noqa: N806
    new = world.Split(color=0 if stays else MPI.UNDEFINED, key=world.Get_rank())
    if new == MPI.COMM_NULL:
        return None
    new.Set_errhandler(MPI.ERRORS_RETURN)
    return new


def agree_min(comm: Any, value: int) -> int:
    """The smallest ``value`` over ``comm`` (the survivors' world, after :func:`shrink`)."""
    MPI = mpi()  # noqa: N806
    out = np.empty(1, dtype=np.int64)
    comm.Allreduce(np.array([value], dtype=np.int64), out, op=MPI.MIN)
    return int(out[0])


def count(comm: Any, flag: bool) -> int:
    """How many survivors of ``comm`` (the survivors' world) pass ``flag`` true."""
    MPI = mpi()  # noqa: N806
    out = np.empty(1, dtype=np.int64)
    comm.Allreduce(np.array([int(flag)], dtype=np.int64), out, op=MPI.SUM)
    return int(out[0])


def allgather_object(comm: Any, obj: Any) -> list[Any]:
    """Every survivor's ``obj`` (collective over ``comm``, the survivors' world)."""
    return comm.allgather(obj)


class PeerError(RuntimeError):
    """A learner's own error (an exception, an I/O error, bad data) ends every learner.

    Under ``--on-failure continue`` only a dead or frozen learner is a failure to go on
    through; a learner that raised tells its peers so (:func:`end_with_error`), and they end
    with its message instead of going on without it.

    Attributes:
        origins: ``(launch rank, host, message)`` of every learner that raised.
        say: Whether this learner prints the line (one survivor that did not raise).
    """

    def __init__(self, origins: list[tuple[int, str, str]], say: bool) -> None:
        who = "; ".join(f"rank {rank} ({host}): {message}" for rank, host, message in origins)
        super().__init__(
            f"learner(s) failed with their own error, not a lost learner: {who}. Every learner "
            "ends: --on-failure continue goes on through a dead or frozen learner only. Fix "
            "the cause (that learner's traceback is above) and resume with --resume auto")
        self.origins = origins
        self.say = say


def own_errors(world: Any, launch_rank: int, host: str, message: str | None) -> None:
    """Share each survivor's own error, if any, over the survivors' ``world`` (collective).

    Called by every survivor right after :func:`shrink`: by the peers of a failure with
    ``message`` None, and by a learner whose own error started it with that error's text
    (:func:`end_with_error`), which stays alive and takes part in the shrink for this. A
    process that merely died has no say: the survivors go on without it.

    Raises:
        PeerError: Where some survivor raised, on every survivor.
    """
    every = world.allgather((launch_rank, host, message))
    origins = [(r, h, m) for r, h, m in every if m is not None]
    if origins:
        first_peer = next((i for i, (_, _, m) in enumerate(every) if m is None), None)
        raise PeerError(origins, say=first_peer == world.Get_rank())


_current: Any = None
"""The topology of this learner's running world under ``--on-failure continue`` (:func:`watch`)."""
_ending = threading.Lock()


def watch(topo: Any) -> None:
    """Survive peers' failures on ``topo`` (``--on-failure continue``; at start and after each).

    Remembers the running world for :func:`end_with_error` and has a frozen learner found at
    a deadline killed from its host (:func:`hadpsgd.comm.frozen.kill_frozen_peers`).
    """
    global _current  # noqa: PLW0603 - one running world per process
    _current = topo
    # Open MPI reports the error of a request it cannot tie to a communicator (a one-sided
    # window's, ADPSGD's data pool) on MPI_COMM_WORLD, whose handler is fatal by default:
    # a second failure during a recovery then aborted the survivors instead of raising.
    MPI = mpi()  # noqa: N806
    MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)
    kill_frozen_peers(topo)
    _watch_host(topo)


_sentinel: Sentinel | None = None
"""The running world's :class:`~hadpsgd.comm.sentinel.Sentinel` (one per process)."""


def _watch_host(topo: Any) -> None:
    """Have this host's other learners watched: one stopped ``HADPSGD_FROZEN_S`` s is killed.

    A new world (after a recovery) replaces the sentinel of the old one, and forgets the
    learners killed there.
    """
    global _sentinel  # noqa: PLW0603 - one running world per process
    if _sentinel is not None:
        _sentinel.stop()
    deadline.note_killed(None)
    _sentinel = Sentinel(topo.rank, _siblings(topo), env.frozen_s(),
                         deadline.note_killed).start()


def end_with_error(message: str) -> bool:
    """End the job for this learner's own error, telling the peers (collective with them).

    ``MPI_Abort`` does not end a job under ``mpirun --with-ft ulfm``: the peers blocked in a
    collective with this learner wait for it to their deadline, then take it for a frozen one
    (measured: 51 s at ``HADPSGD_TIMEOUT=20``). Instead this learner revokes its
    communicators (every peer's pending and next operation fails at once), joins the
    survivors' shrink and tells them its error (:func:`own_errors`); then every learner ends
    with exit 1, the peers with its message.

    Args:
        message: This learner's error, as the peers print it.

    Returns:
        False without ``--on-failure continue`` (the caller aborts the job as usual); True
        once the peers know, when the caller should exit without ``MPI_Finalize`` (which
        waits for the failed world forever). A second caller (another thread) waits here
        for the first one's exit.
    """
    topo = _current
    if topo is None or topo.size == 1:
        return False
    if not _ending.acquire(blocking=False):
        while True:  # the first caller ends the process
            time.sleep(60)
    revoke(topo.communicators())
    try:
        world, _ = shrink(topo.comm, timeout=topo.timeout)
        own_errors(world, topo.launch_ranks[topo.rank], topo.hosts[topo.rank], message)
    except PeerError:
        pass  # the peers know: this learner's own message is among the origins
    except Exception as err:  # noqa: BLE001 - the peers find this one gone: it still ends
        print(f"hadpsgd: rank {topo.rank}: could not tell the peers ({err}); ending",
              file=sys.stderr, flush=True)
    return True


def farewell(topo: Any) -> None:
    """Wait until every learner is done, before this one ends without ``MPI_Finalize``.

    Under ``--on-failure continue`` a learner ends without ``MPI_Finalize`` (it never
    returns with the heartbeat detector's thread), and the runtime takes such an exit for a
    failure: one that left while a peer still waited for its last message would start a
    recovery there. Past this barrier every learner has finished its operations; a peer
    failure inside it (one that passed it and ended) is that very exit, and ignored.
    """
    try:
        topo.barrier()
    except Exception as err:
        if not is_peer_failure(err):
            raise


class LostOutsideTraining(RuntimeError):
    """Learners failed where no agreed state exists to go on from (start-up, a recovery)."""

    def __init__(self, topo: Any) -> None:
        lost = ", ".join(f"rank {topo.launch_ranks[r]} ({topo.hosts[r]})"
                         for r in failed_ranks(topo.comm)) or "a learner"
        super().__init__(
            f"{lost} failed (dead, or frozen and found by MPI's failure detector) outside "
            "training, while setting up or recovering: there is no agreed state to go on "
            "from, so the job ends as without --on-failure continue")


def failed_ranks(comm: Any) -> list[int]:
    """The ranks of ``comm`` that this process knows to have failed (a local query)."""
    MPI = mpi()  # noqa: N806
    try:
        failed, group = comm.Get_failed(), comm.Get_group()
        ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), group)
        failed.Free()
        group.Free()
    except Exception:  # noqa: BLE001 - no ULFM query in this MPI: the failure is unnamed
        return []
    return sorted(int(r) for r in ranks if r != MPI.UNDEFINED)


def hold_if_ending() -> None:
    """Wait for the exit where another thread of this process ends it (:func:`end_with_error`).

    The main thread sees its own revocation as a peer's failure; it must not shrink the
    world a second time beside the thread that is telling the peers.
    """
    while _ending.locked():
        time.sleep(60)
