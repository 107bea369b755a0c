"""Mixed precision under real mpirun: bf16 through the main command (H-ADPSGD, whose
gossip, nodes and super-learners touch every precision path; SSGD with oneDNN capped at
AVX2, as on a CPU without native bf16), fp16's scale search through the command, exact
resume with a scale in the checkpoint, and bf16 gradients on the wire. bf16's identical
replicas for every algorithm and fp16's overflow skipped by its group run on learners as
threads (``tests/unit/test_precision_threads.py``), through the same trainer."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import pytest

from tests._commands import run_command, run_worker_warm
from tests._mpi import MPIResult, assert_ok
from tests.mpi._resume import assert_equal, final_state, kill_then_resume, run_args, train

pytestmark = pytest.mark.mpi

# The layouts: (algorithm flags, ranks). Super-learners are 2 ranks where there are nodes.
LAYOUTS = {
    "ssgd": (["--algo", "ssgd"], 3),
    "bmuf": (["--algo", "bmuf", "--ranks-per-node", "2"], 4),
    "adpsgd": (["--algo", "adpsgd", "--super-learner-size", "1"], 2),
    "hadpsgd": (["--algo", "adpsgd", "--super-learner-size", "2"], 4),
}


def states(res: MPIResult) -> list[dict]:
    """Every rank's end state, as ``tests/workers/precision_run.py`` prints it."""
    assert_ok(res)
    line = next(x for x in res.stdout.splitlines() if x.startswith("STATE "))
    return json.loads(line.removeprefix("STATE "))


def flags(tiny_data, out, *extra: str) -> list[str]:
    return run_args(tiny_data, out, "--batch-size", "4", *extra)[2:]


def metrics(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def bf16_run(layout: str, tiny_data: tuple[Path, Path], out: Path,
             env: dict[str, str] | None = None) -> MPIResult:
    """12 bf16 steps of ``layout`` through the main command, checked to end well."""
    algo, nprocs = LAYOUTS[layout]
    res = run_command(nprocs, run_args(tiny_data, out, *algo, "--batch-size", "4",
                                   "--max-steps", "12", "--precision", "bf16"), env=env)
    assert_ok(res)
    assert json.loads((out / "config.json").read_text())["precision"]["precision"] == "bf16"
    evals = [m for m in metrics(out) if m["kind"] == "eval"]
    assert evals and all(math.isfinite(m["heldout_loss"]) for m in evals)
    return res


def test_bf16_through_the_main_command(tiny_data, tmp_path):
    bf16_run("hadpsgd", tiny_data, tmp_path)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="ONEDNN_MAX_CPU_ISA=AVX2 names an x86 ISA")
def test_bf16_on_a_cpu_without_native_bf16(tiny_data: tuple[Path, Path],
                                           tmp_path: Path) -> None:
    """oneDNN capped at AVX2, as on a CPU without AVX-512 (ONEDNN_MAX_CPU_ISA, read by every
    rank): torch's CPU autocast LSTM ended such a run at its first evaluation with oneDNN's
    "could not create a primitive descriptor" (issue 42). The LSTM runs in bf16 there on
    torch's own kernels, with no fallback to fp32 to warn of."""
    res = bf16_run("ssgd", tiny_data, tmp_path, env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert "primitive descriptor" not in res.output and "runs in fp32" not in res.output


def test_fp16_run_finding_its_scale_is_not_stopped(tiny_data, tmp_path):
    """Overflows on 3 steps with --max-nonfinite 0 through the main command: the run ends
    normally, and the log counts the overflows apart (3), with the scale halved 3 times."""
    res = run_command(2, run_args(tiny_data, tmp_path, "--batch-size", "4", "--max-steps", "12",
                              "--log-every", "4", "--precision", "fp16", "--max-nonfinite",
                              "0"),
                  env={"HADPSGD_FAULT": "kind=overflow,rank=1,step=3,count=3"})
    assert_ok(res)
    last = [m for m in metrics(tmp_path) if m["kind"] == "train"][-1]
    assert last["overflow_steps"] == 3 and last["loss_scale"] == 2.0**13, last
    assert last["skipped_steps"] == 3


@pytest.mark.parametrize("algo", [["--algo", "ssgd"],
                                  ["--algo", "bmuf", "--ranks-per-node", "1"]])
def test_fp16_resume_is_exact_with_the_scale(algo, tiny_data, tmp_path):
    """Killed after a checkpoint and resumed, an fp16 run ends bit-identical to one that was
    never stopped, loss scales included (BMUF: each super-learner's own)."""
    common = [*algo, "--batch-size", "4", "--max-steps", "16", "--checkpoint-every", "6",
              "--precision", "fp16"]
    overflow = "kind=overflow,rank=1,step=3"
    ref = tmp_path / "ref"
    train(2, tiny_data, ref, *common, env={"HADPSGD_FAULT": overflow})
    out = tmp_path / "resumed"
    # The resumed run starts after step 6: the overflow at step 3 is in its checkpoint.
    kill_then_resume(2, tiny_data, out, *common, fault=f"{overflow};kind=kill,rank=1,step=9")
    a, b = final_state(ref), final_state(out)
    if "bmuf" in algo:  # rank 1 is super-learner 1: its scale alone was halved
        scales = [n["loss_scale"]["scale"] for n in a["node_states"]]
        assert scales == [2.0**16, 2.0**15], scales
    else:
        assert a["algo"]["loss_scale"]["scale"] == 2.0**15
    for key in ("model", "algo", "node_states", "eval_model"):
        assert_equal(a.get(key), b.get(key), key)


def test_half_mean_against_a_float64_reference():
    """Across 2 nodes of 2 under MPI (its inter-node communicator, its node's backend); the
    world of one node and the node scope run on learners as threads
    (tests/unit/test_precision_threads.py, the same check: tests/half_mean_check.py)."""
    res = run_worker_warm(4, "half_mean", "world", env={"HADPSGD_RANKS_PER_NODE": "2"})
    assert_ok(res)
    assert res.stdout.count("OK rank") == 4
