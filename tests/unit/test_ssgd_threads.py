"""SSGD on N learners equals one learner with N times the batch, through the main command's
trainer on learners as threads (``tests/trainer_threads.py``): 5 steps of SGD with momentum,
flat (2 and 4 learners) and over 2 nodes of 2 (the node's mean, then the nodes'). The 3 x 2
layout runs under mpirun as well (``tests/mpi/test_ssgd.py``: MPI's hierarchical mean)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hadpsgd.data import FeatureFile
from hadpsgd.models import build_model
from hadpsgd.train import latest_checkpoint, load_checkpoint
from tests.mpi._resume import run_args
from tests.trainer_threads import train_on_threads

SGD = ("--optimizer", "sgd", "--momentum", "0.9", "--warmup-epochs", "0", "--max-steps", "5")


def final_model(data: tuple[Path, Path], out: Path, size: int, *extra: str) -> dict:
    """Train on ``size`` learners as threads; the model of the run's last checkpoint."""
    train_on_threads(run_args(data, out, *SGD, *extra)[2:], size)
    state = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    assert state["progress"]["global_step"] == 5
    return state["model"]


@pytest.mark.parametrize(("size", "per_node"), [(2, None), (4, None), (4, 2)])
def test_n_learners_equal_one_with_n_times_the_batch(size: int, per_node: int | None,
                                                     tiny_data: tuple[Path, Path],
                                                     tmp_path: Path) -> None:
    b = 4
    layout = ["--ranks-per-node", str(per_node)] if per_node else []
    multi = final_model(tiny_data, tmp_path / "multi", size, "--batch-size", str(b), *layout)
    single = final_model(tiny_data, tmp_path / "single", 1, "--batch-size", str(size * b))
    for name, p in single.items():
        q = multi[name]
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (name, (p - q).abs().max())
    # The 5 steps moved the model (the comparison is not vacuous): the run seeds torch with
    # --seed (0) before building the model, so the initial model is reproducible here.
    f = FeatureFile(tiny_data[0])
    torch.manual_seed(0)
    init = build_model("tiny", f.feat_dim, f.num_classes).state_dict()
    assert any(not torch.allclose(init[k], single[k]) for k in init)
