"""A resume at another world size (``--allow-resume-change np``) under real mpirun, for every
algorithm: the interrupted epoch trains each of its chunks once over both runs, and the steps
after the ``resume`` record only go forward.

The first run stops at ``--max-steps 20`` of a one-epoch run (checkpoints at 10 and 20), the
second resumes its step-20 checkpoint on another number of learners and trains the epoch to
its end. ADPSGD changes plans with the world: its pool across super-learners, the shards on
one super-learner; a pool of the same slots keeps its tickets, anything else goes on from the
chunks trained.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from hadpsgd.data import ChunkDataset
from tests.mpi._resume import train

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

BATCH = 2
FIRST = ("--batch-size", str(BATCH), "--epochs", "1", "--control-every", "5",
         "--checkpoint-every", "10", "--max-steps", "20")

ADPSGD = ("--algo", "adpsgd", "--super-learner-size", "1")
HADPSGD = ("--algo", "adpsgd", "--super-learner-size", "2")


# (algorithm, learners before, after), run on learners as threads
# (tests/unit/test_resume_world_threads.py), through the same trainer and resume.
CASES = [
    pytest.param(("--algo", "ssgd"), 4, 3, id="ssgd-4-3"),
    pytest.param(("--algo", "ssgd"), 2, 4, id="ssgd-2-4"),
    pytest.param(("--algo", "bmuf", "--ranks-per-node", "1"), 4, 2, id="bmuf-4-2"),
    pytest.param(ADPSGD, 4, 3, id="adpsgd-4-3"),  # the pool, the same slots, fewer of them
    pytest.param(ADPSGD, 3, 5, id="adpsgd-3-5"),  # the pool, the same slots, more of them
    pytest.param(HADPSGD, 4, 2, id="hadpsgd-4-2"),  # the pool to the shards of one node
    # A pool of 2-rank slots growing (2 -> 3 super-learners): the same slots, more of them.
    pytest.param(HADPSGD, 4, 6, id="hadpsgd-4-6"),
]
"""Run on threads; the shards of one node to the pool (below) runs under mpirun too, where
the pool's board and the node's shards are MPI's windows."""


def check_resume_at_another_size(train_run: Callable[..., str], algo: tuple[str, ...],
                                 before: int, after: int, tiny_data: tuple[Path, Path],
                                 tmp_path: Path) -> None:
    """Train ``before`` learners to step 20, resume on ``after`` and check the epoch.

    ``train_run(nprocs, *flags)`` trains the run in ``tmp_path`` (chunk traces in
    ``tmp_path / "trace"``) and returns what it printed.
    """
    train_run(before, *algo, *FIRST)
    traces = sorted((tmp_path / "trace").glob("chunks-rank*.jsonl"))
    first_run = {path.name: len(path.read_text().splitlines()) for path in traces}
    # On through the next epoch too, logging every `after` batches: a pooled learner's log
    # lines are then at least a global step apart (it may take several slots in one).
    stdout = train_run(after, "--resume", "auto", "--max-steps", "0", "--epochs", "2",
                       "--log-every", str(after), "--allow-resume-change", "np")

    total = len(ChunkDataset(tiny_data[0], 21))
    done = 20 * BATCH * before  # the first run's steps
    assert f"epoch 0, {done} of its {total} chunks trained" in stdout

    used: Counter = Counter()
    for path in sorted((tmp_path / "trace").glob("chunks-rank*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for rec in records:
            if rec["epoch"] == 0:
                used.update(rec["chunks"])
        # Each learner's steps after the resume go on from the checkpoint's, forward only.
        steps = [rec["global_step"] for rec in records[first_run.get(path.name, 0):]]
        if int(path.stem.removeprefix("chunks-rank")) >= after:
            continue  # a learner of the first run only
        assert steps and steps[0] > 20, (path.name, steps[:5])
        assert all(a <= b for a, b in zip(steps, steps[1:], strict=False)), (path.name, steps)
    twice = [c for c, n in used.items() if n > 1]
    assert not twice, f"{len(twice)} chunks of the interrupted epoch trained twice"
    assert total - len(used) < BATCH * after  # only the last incomplete global batch

    records = [json.loads(line) for line in
               (tmp_path / "metrics.jsonl").read_text().splitlines()]
    at = max(i for i, r in enumerate(records) if r["kind"] == "resume")
    assert records[at]["step"] == 20
    later = records[at + 1:]
    logged = [r["step"] for r in later if r["kind"] == "train"]
    assert logged and logged[0] > 20, logged
    assert all(a < b for a, b in zip(logged, logged[1:], strict=False)), logged
    every = [r["step"] for r in later]
    assert all(a <= b for a, b in zip(every, every[1:], strict=False)), later


def test_a_resume_at_another_size_trains_each_chunk_of_the_epoch_once(tiny_data, tmp_path):
    """The shards of one node (2 learners) to the pool of 4 super-learners."""
    def run(nprocs: int, *flags: str) -> str:
        return train(nprocs, tiny_data, tmp_path, *flags).stdout

    check_resume_at_another_size(run, HADPSGD, 2, 4, tiny_data, tmp_path)
