"""A frozen learner under ``--on-failure continue`` (issue 55, items 1 and 5).

Item 1: found in seconds by default, by the host's sentinel (``HADPSGD_FROZEN_S``, 5 s), with
no opt-in and the deadline as long as slow collectives need: before, a SIGSTOPped learner
cost the whole deadline (306.7 s at the default). Item 5: frozen during BMUF's compressed
block sync, it is found at the deadline there too, asked on the main control communicator
whether it is alive, killed from its host, and the others go on: before, the compressed
mean's own watchdog gave up without that probe and the job ended with exit 3. Each through
``python -m hadpsgd.launch`` (``tests/mpi/test_elastic.py``'s launch), bounded in time.
"""

from __future__ import annotations

import pytest

from tests.mpi.test_elastic import _final_world, _launch, _records

pytestmark = pytest.mark.mpi


def test_a_frozen_learner_is_found_in_seconds_by_default(tiny_data, tmp_path):
    """Rank 2 of 4 SIGSTOPs itself at step 10 under a 600 s deadline, longer than the
    launch's own 240 s limit, no detector asked for: only the sentinel can end it."""
    out = tmp_path / "run"
    res = _launch(4, tiny_data, out, "--epochs", "1", "--control-every", "5",
                  fault="kind=stop,rank=2,step=10", timeout="600")
    assert res.returncode == 0, res.output[-4000:]
    assert "mpi_ft_detector" not in res.stdout.splitlines()[0]  # the launcher's command
    assert "rank 2 on this host stopped (SIGSTOP) for 5 s: killed" in res.stderr, res.output
    assert "did not answer" not in res.output  # not at a deadline
    assert "3 learners go on" in res.stdout
    failure, = _records(out, "failure")
    assert failure["lost"] == [2] and _final_world(out) == 3


def test_a_learner_frozen_in_a_compressed_block_sync_is_killed_and_the_others_go_on(
        tiny_data, tmp_path):
    """BMUF's block sync in 1-bit signs (a compressed mean on the side channel), rank 2 of 4
    stopped at a sync step, the sentinel off: the deadline (4 s) of the channel's all-to-all
    finds it, the main control communicator's probe finds it silent, it is killed and the
    3 others go on to exit 0."""
    out = tmp_path / "run"
    res = _launch(4, tiny_data, out, "--epochs", "1", "--algo", "bmuf", "--ranks-per-node", "1",
                  "--wire", "sign", "--sync-period", "4", "--control-every", "4",
                  fault="kind=stop,rank=2,step=8", timeout="4",
                  env_extra={"HADPSGD_FROZEN_S": "0"})
    assert res.returncode == 0, res.output[-4000:]
    assert "compressed mean (sign)" in res.output, res.output[-4000:]
    assert "did not answer: dead or frozen); killed by a learner on its host" in res.output
    assert "3 learners go on" in res.stdout
    failure, = _records(out, "failure")
    assert failure["lost"] == [2] and _final_world(out) == 3
