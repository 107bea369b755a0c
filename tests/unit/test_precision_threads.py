"""Mixed precision through the main command's trainer on learners as threads
(``tests/trainer_threads.py``): bf16 replicas identical where the algorithm promises it, for
every algorithm, and an fp16 overflow on one learner skipped by exactly the learners that
share its gradient. The layouts are ``tests/mpi/test_precision.py``'s; what needs processes
(the command's own run and endings, oneDNN capped by the environment, kill and resume, the
bf16 wire) stays there."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi._resume import run_args
from tests.trainer_threads import by_node, check_bf16_replicas, train_on_threads

# The layouts: (algorithm flags, learners). Super-learners are 2 learners where there are nodes.
LAYOUTS = {
    "ssgd": (["--algo", "ssgd"], 3),
    "bmuf": (["--algo", "bmuf", "--ranks-per-node", "2"], 4),
    "adpsgd": (["--algo", "adpsgd", "--super-learner-size", "1"], 2),
    "hadpsgd": (["--algo", "adpsgd", "--super-learner-size", "2"], 4),
}


def flags(tiny_data: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    return run_args(tiny_data, out, "--batch-size", "4", *extra)[2:]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_replicas_identical_where_promised(layout: str, tiny_data: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    algo, size = LAYOUTS[layout]
    every = train_on_threads(flags(tiny_data, tmp_path, *algo, "--epochs", "2",
                                   "--precision", "bf16"), size)
    check_bf16_replicas(layout, every)


@pytest.mark.parametrize("layout", ["ssgd", "bmuf", "hadpsgd"])
def test_fp16_overflow_on_one_learner_is_skipped_by_its_group(
        layout: str, tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    """Learner 1's fp16 gradient overflows at step 5: every learner that shares its gradient
    skips that step and halves its scale (2**16 -> 2**15); other super-learners do not."""
    algo, size = LAYOUTS[layout]
    every = train_on_threads(flags(tiny_data, tmp_path, *algo, "--max-steps", "12",
                                   "--precision", "fp16", "--max-nonfinite", "0"),
                             size, fault="kind=overflow,rank=1,step=5")
    group = {s["node"] for s in every if s["rank"] == 1} if layout != "ssgd" else None
    for s in every:
        hit = group is None or s["node"] in group
        assert s["loss_scale"] == (2.0**15 if hit else 2.0**16), every
        assert s["overflow_steps"] == s["skipped_steps"] == (1 if hit else 0), every
        assert s["nonfinite"] == 0, every  # the scale's search is no non-finite data
    assert all(len(d) == 1 for d in by_node(every, "local").values()), every
    if layout == "ssgd":
        assert len({s["local"] for s in every}) == 1, every
