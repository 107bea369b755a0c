"""SSGD under real mpirun: big-batch equivalence, identical replicas, exact resume."""

from pathlib import Path

import pytest
import torch

from tests._commands import run_command, run_worker_warm
from tests._mpi import assert_ok

pytestmark = pytest.mark.mpi


def _train(nprocs: int, data: tuple[Path, Path], out: Path, *extra: str) -> Path:
    res = run_command(nprocs, ["-m", "hadpsgd.run", "--train", str(data[0]), "--heldout",
                           str(data[1]), "--preset", "tiny", "--out-dir", str(out),
                           "--no-progress", "--optimizer", "sgd", "--momentum", "0.9",
                           "--warmup-epochs", "0", *extra])
    assert_ok(res)
    return out


def _final_state(out: Path) -> dict:
    from hadpsgd.train import latest_checkpoint, load_checkpoint

    return load_checkpoint(latest_checkpoint(out / "checkpoints"))


def test_replicas_bit_identical_every_step():
    res = run_worker_warm(3, "ssgd_replicas")
    assert_ok(res)
    assert res.stdout.count("OK rank") == 3


@pytest.mark.parametrize(("nprocs", "per_node"), [(6, 2)])
def test_n_ranks_equal_one_process_with_n_times_batch(nprocs, per_node, tiny_data, tmp_path):
    # An emulated 3x2 layout: MPI's hierarchical allreduce. The flat and 2x2 layouts run on
    # learners as threads (tests/unit/test_ssgd_threads.py), through the same trainer.
    b = 4
    layout = ["--ranks-per-node", str(per_node)] if per_node else []
    multi = _final_state(_train(nprocs, tiny_data, tmp_path / "multi", "--batch-size", str(b),
                                "--max-steps", "5", *layout))
    single = _final_state(_train(1, tiny_data, tmp_path / "single", "--batch-size",
                                 str(nprocs * b), "--max-steps", "5"))
    assert multi["progress"]["global_step"] == single["progress"]["global_step"] == 5
    for name, p in single["model"].items():
        q = multi["model"][name]
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (name, (p - q).abs().max())
    # and the 5 steps did move the model (the comparison is not vacuous): run.py seeds torch
    # with --seed (0) before building the model, so the initial model is reproducible here.
    from hadpsgd.data import FeatureFile
    from hadpsgd.models import build_model

    f = FeatureFile(tiny_data[0])
    torch.manual_seed(0)
    init = build_model("tiny", f.feat_dim, f.num_classes).state_dict()
    assert any(not torch.allclose(init[k], single["model"][k]) for k in init)


def test_killed_run_resumes_bit_exact(tiny_data, tmp_path):
    # 28 steps per epoch at global batch 8: checkpoints every 10 steps, the kill at step 24
    # leaves step 20 as the newest; the resumed run crosses the epoch boundary (evaluation,
    # LR change, reshuffle) and ends mid-epoch 1.
    from tests.mpi._resume import assert_same_run, kill_then_resume
    from tests.mpi._resume import train as traced

    args = ("--batch-size", "4", "--epochs", "2", "--max-steps", "40", "--checkpoint-every",
            "10", "--optimizer", "sgd", "--momentum", "0.9")
    traced(2, tiny_data, tmp_path / "full", *args)
    kill_then_resume(2, tiny_data, tmp_path / "part", *args, fault="kind=kill,rank=1,step=24")
    state = assert_same_run(tmp_path / "full", tmp_path / "part")
    assert state["progress"]["global_step"] == 40
    assert state["algo"]["optimizer"]["state"][0]["momentum_buffer"].abs().sum() > 0
