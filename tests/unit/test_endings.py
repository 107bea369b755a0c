"""The endings' table (``hadpsgd.assembly.endings.ENDINGS``): how an error raised while
training ends ``python -m hadpsgd.run``. Each kind's exit code and way of ending, decided
without MPI (a world of one learner: nobody to abort); the multi-rank endings themselves
are ``tests/mpi/test_faults.py``'s, ``test_elastic.py``'s and ``test_exit_contract.py``'s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hadpsgd.assembly.elastic import LeftTheJob, NotEnoughLearners
from hadpsgd.assembly.endings import ENDINGS, OTHER, STATE, end_training, ending_for
from hadpsgd.comm import CommTimeoutError, ulfm
from hadpsgd.data import FeatureFileError
from hadpsgd.exit_codes import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMED_OUT,
    EXIT_USER_ERROR,
)
from hadpsgd.train.checkpoint import CheckpointWriteError
from hadpsgd.train.control import NonFiniteError

ONE = SimpleNamespace(rank=0, size=1)
"""A world of one learner: the error is said, nobody is aborted."""


@pytest.fixture(autouse=True)
def fresh_state():
    """Each test's own ending state (the process-wide one is restored after)."""
    before = (STATE.elastic, STATE.survived)
    STATE.elastic = STATE.survived = False
    yield
    STATE.elastic, STATE.survived = before


@pytest.mark.parametrize(("err", "code"), [
    (NonFiniteError("6 non-finite steps"), EXIT_DIVERGED),
    (CommTimeoutError("rank 1 never arrived"), EXIT_TIMED_OUT),
    (CheckpointWriteError("disk full"), EXIT_FAILED),
    (FeatureFileError("frame 7 changed after it was validated"), EXIT_USER_ERROR),
    (RuntimeError("a bug"), EXIT_FAILED),
    (KeyboardInterrupt(), EXIT_FAILED),
])
def test_an_error_this_learner_raised_is_said_and_ends_the_job(err, code, capsys):
    try:  # raised, as the loop raises it: with a traceback
        raise err
    except BaseException as raised:  # noqa: BLE001
        assert end_training(raised, ONE) == code
    err_text = capsys.readouterr().err
    assert f"hadpsgd: error: {str(err) or type(err).__name__}" in err_text, err_text
    assert ("Traceback" in err_text) == (ending_for(err) is OTHER)
    assert not STATE.survived


@pytest.mark.parametrize(("err", "code", "said"), [
    (NotEnoughLearners("2 of 4 left, --min-learners 3", say=True), EXIT_FAILED, True),
    (NotEnoughLearners("2 of 4 left", say=False), EXIT_FAILED, False),
    (ulfm.PeerError([(1, "h", "bad data")], say=True), EXIT_FAILED, True),
    (LeftTheJob("nobody goes on", stops=True, say=True), EXIT_FAILED, True),
])
def test_after_a_peers_failure_each_survivor_ends_on_its_own(err, code, said, capsys):
    assert end_training(err, ONE) == code
    assert ("hadpsgd: error:" in capsys.readouterr().err) == said
    assert STATE.survived  # without MPI_Finalize, which would wait for the dead


def test_a_super_learner_that_lost_a_member_leaves_and_the_others_go_on(capsys):
    err = LeftTheJob("super-learner 1 lost rank 3: it leaves, 3 super-learners go on")
    assert end_training(err, ONE) == EXIT_OK
    assert "[hadpsgd] super-learner 1 lost rank 3" in capsys.readouterr().out
    assert STATE.survived


def test_every_row_is_reachable_and_the_first_match_decides():
    kinds = [k for row in ENDINGS for k in row.kinds]
    assert len(kinds) == len(set(kinds))
    # A row's kind is never a subclass of an earlier row's (it would never be reached).
    for i, kind in enumerate(kinds):
        assert not any(issubclass(kind, earlier) for earlier in kinds[:i]), kind
    assert {row.how for row in ENDINGS} == {"abort", "own", "left"}
