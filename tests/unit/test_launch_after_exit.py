"""``python -m hadpsgd.launch`` ends an ``mpirun`` that outlives every rank (``--with-ft``).

Open MPI's runtime can hang after a job's end (openpmix/prrte#1839): every rank has ended,
and ``mpirun`` is still there. Here ``mpirun`` is a stand-in process that writes the ranks'
exit notes the way :func:`hadpsgd.comm.ulfm.note_exit` does and then ends, or hangs (its
SIGTERM ignored, or not); the launcher's own supervision of it is what is tested.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pytest

from hadpsgd.comm import ulfm
from hadpsgd.launch.forward import noted_exits, run_forwarding

_MPIRUN = """
import os, signal, sys, time
exits, codes, then, linger = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4]
if then == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
for i, code in enumerate(c for c in codes if c):
    with open(os.path.join(exits, f"pid-{1000 + i}"), "w") as note:
        note.write(code + "\\n")
time.sleep(float(linger))  # a hang after the job's end, or a slow ending
sys.exit(7)
"""


def _launch(tmp_path: Path, codes: str, then: str, nprocs: int = 3, grace: float = 1.0,
            linger: float = 600) -> tuple[int, float]:
    script = tmp_path / "mpirun.py"
    script.write_text(_MPIRUN)
    # A folder of its own a launch, as the launcher makes one (a temporary directory).
    exits = Path(tempfile.mkdtemp(prefix="exits-", dir=tmp_path))
    start = time.monotonic()
    code = run_forwarding([sys.executable, str(script), str(exits), codes, then, str(linger)], {},
                          exits=exits, nprocs=nprocs, after_last_exit_s=grace)
    return code, time.monotonic() - start


@pytest.mark.parametrize("then", ["hang", "deaf"])
def test_an_mpirun_still_there_after_every_ranks_exit_is_ended_with_their_code(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], then: str) -> None:
    """Every rank noted its exit (1, as after a learner's own error) and mpirun hangs, even
    deaf to SIGTERM: the launcher ends it a grace after the last note, with the ranks'
    code, and says why."""
    code, took = _launch(tmp_path, "1,1,1", then)
    assert code == 1
    assert took < 30  # the stand-in would sleep 600 s
    err = capfd.readouterr().err
    assert "every one of the 3 ranks ended (exit 1), but mpirun was still there 1 s later" in err


def test_the_ranks_first_failing_code_is_returned_over_a_clean_one(tmp_path: Path) -> None:
    assert _launch(tmp_path, "0,4,0", "hang")[0] == 4
    assert _launch(tmp_path, "0,0,0", "hang")[0] == 0


def test_an_mpirun_that_ends_keeps_its_own_code_and_one_missing_note_keeps_waiting(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """mpirun's own exit is never overridden; and where a rank has not noted its exit (it
    died by a signal, or is still running) the launcher does not end mpirun, however long
    it takes: mpirun itself knows about that rank."""
    assert _launch(tmp_path, "1,1,1", "hang", linger=0)[0] == 7
    code, took = _launch(tmp_path, "1,1", "hang", grace=0.2, linger=2)  # 2 notes of 3
    assert code == 7 and took >= 2
    assert "ended by the launcher" not in capfd.readouterr().err


def test_the_notes_are_the_ones_hadpsgd_run_writes(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher reads the notes the ranks' own :func:`~hadpsgd.comm.ulfm.note_exit`
    writes (one a process, its exit code)."""
    monkeypatch.setenv("_HADPSGD_LAUNCH_EXITS", str(tmp_path))
    ulfm.note_exit(3)
    assert noted_exits(tmp_path) == [3]
