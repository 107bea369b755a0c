"""Mixed precision through the main command's trainer on learners as threads
(``tests/trainer_threads.py``): bf16 replicas identical where the algorithm promises it, for
every algorithm, and an fp16 overflow on one learner skipped by exactly the learners that
share its gradient. The layouts are ``tests/mpi/test_precision.py``'s; what needs processes
(the command's own run and endings, oneDNN capped by the environment, kill and resume, the
bf16 wire of the H-ADPSGD layout) stays there."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hadpsgd.comm.threads import ThreadJob
from hadpsgd.models import build_model
from tests.half_mean_check import check_half_mean
from tests.mpi._resume import final_state, run_args
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


@pytest.mark.parametrize("layout", ["ssgd", "bmuf"])
def test_bf16_replicas_identical_with_the_bf16_wire(layout: str, tiny_data: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    """As above, with bf16 gradients on the wire (the thread world's ``half_mean_`` runs the
    MPI world's code: :mod:`hadpsgd.comm.thread_links`)."""
    algo, size = LAYOUTS[layout]
    every = train_on_threads(flags(tiny_data, tmp_path, *algo, "--epochs", "2",
                                   "--precision", "bf16", "--grad-wire", "bf16"), size)
    check_bf16_replicas(layout, every)
    assert all(s["grad_wire_bytes"] > 0 for s in every), every


def test_grad_wire_bf16_is_within_tolerance_of_fp32_at_half_the_bytes(
        tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    """SSGD with bf16 gradient buckets on the wire after 20 steps: the update (weights minus
    the initial weights) is within 1 % (relative L2) of fp32 SSGD's (measured: 0.12 %), and
    the bytes sent are half (up to shard padding)."""
    every = {wire: train_on_threads(flags(tiny_data, tmp_path / wire, "--max-steps", "20",
                                          "--grad-wire", wire), 3)
             for wire in ("fp32", "bf16")}
    a = final_state(tmp_path / "fp32")["model"]
    b = final_state(tmp_path / "bf16")["model"]
    # The updates, not the weights: against the initial weights (rank 0's, from the seed)
    # a wrong mean (a sum, a lost bucket) would hide in a small relative weight change.
    torch.manual_seed(0)
    init = build_model("tiny", 260, 12).state_dict()
    diff = math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a))
    moved = math.sqrt(sum(float((a[k].double() - init[k].double()).pow(2).sum()) for k in a))
    assert 0 < diff / moved < 0.01, diff / moved
    full = every["fp32"][0]["grad_wire_bytes"]
    half = every["bf16"][0]["grad_wire_bytes"]
    assert full > 0 and 0.5 <= half / full < 0.51, (half, full)


@pytest.mark.parametrize(("scope", "size", "per_node"), [("world", 3, 3), ("node", 4, 2),
                                                         ("world", 4, 2)])
def test_half_mean_against_a_float64_reference(scope: str, size: int, per_node: int) -> None:
    """``half_mean_`` within one rounding of the float64 mean of the bf16-rounded inputs (of
    the node means, across nodes), the same bits in the scope, half an fp32 ring's bytes:
    ``tests/half_mean_check.py``, which ``tests/mpi/test_precision.py`` runs under MPI."""
    failed = ThreadJob(size, per_node, timeout=60).run(lambda w: check_half_mean(w, scope))
    assert failed == [None] * size, failed


def test_ssgd_grad_wire_bf16_across_nodes_through_the_main_command(
        tiny_data: tuple[Path, Path], tmp_path: Path) -> None:
    """SSGD over 2 nodes x 2 with ``--grad-wire bf16``: every replica ends with the same
    bits, and ``grad_wire_bytes`` is what each learner sent between nodes: per step (one
    bucket of the tiny model's P parameters) a ring's share of its slice,
    2 (N - 1) / N x 2 bytes x P / 2, padded to the shards."""
    steps = 6
    every = train_on_threads(flags(tiny_data, tmp_path, "--algo", "ssgd", "--ranks-per-node",
                                   "2", "--max-steps", str(steps), "--grad-wire", "bf16"), 4)
    assert len({s["node"] for s in every}) == 2, every
    assert len({s["local"] for s in every}) == 1, every
    params = sum(p.numel() for p in build_model("tiny", 260, 12).parameters())
    piece = -(-params // 2)  # a local rank's slice of the node's sum
    shard = -(-piece // 2)  # cut in one shard per node
    assert all(s["skipped_steps"] == 0 for s in every), every
    assert {s["grad_wire_bytes"] for s in every} == {steps * 2 * (2 - 1) * shard * 2}, every
