"""``python -m hadpsgd.run --algo bmuf`` under mpirun: checkpoint, resume bit for bit."""

from pathlib import Path

import pytest
import torch

from tests.conftest import assert_ok, run_mpi

pytestmark = pytest.mark.mpi


def _train(data: tuple[Path, Path], out: Path, *extra: str) -> dict:
    from hadpsgd.train import latest_checkpoint, load_checkpoint

    # Two emulated nodes of one learner: N = 2 super-learners, eta = 1 - 1/2.
    res = run_mpi(2, ["-m", "hadpsgd.run", "--train", str(data[0]), "--heldout", str(data[1]),
                      "--preset", "tiny", "--out-dir", str(out), "--no-progress", "--algo",
                      "bmuf", "--optimizer", "adam", "--beta1", "0.5", "--lr", "0.002",
                      "--warmup-epochs", "0", "--batch-size", "8", "--epochs", "3",
                      "--sync-period", "3", "--bmuf-warmup-steps", "2", *extra],
                  env={"HADPSGD_RANKS_PER_NODE": "1"})
    assert_ok(res)
    assert "bmuf on 2 learners (2 nodes)" in res.stdout
    return load_checkpoint(latest_checkpoint(out / "checkpoints"))


def _assert_equal(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_resume_is_bit_exact(tiny_data, tmp_path):
    # ~15 steps per epoch: the checkpoint at step 10 ends a short block (tau = 3: 2 warm-up
    # steps, blocks end at 5 and 8, then 2 steps); the run continues across an epoch boundary
    # (evaluation -> forced sync, LR change, reshuffle) to step 20, again mid-block.
    # A checkpoint forces a block sync, so the uninterrupted run checkpoints at step 10 too.
    k = 10
    full = _train(tiny_data, tmp_path / "full", "--max-steps", str(2 * k),
                  "--checkpoint-every", str(k))
    _train(tiny_data, tmp_path / "part", "--max-steps", str(k))
    resumed = _train(tiny_data, tmp_path / "part", "--max-steps", str(2 * k), "--resume", "auto")
    assert resumed["progress"] == full["progress"]
    _assert_equal(full["model"], resumed["model"], "model")
    _assert_equal(full["eval_model"], resumed["eval_model"], "eval_model")
    _assert_equal(full["algo"], resumed["algo"], "algo")
    bmuf = full["algo"]["bmuf"]
    assert bmuf["started"] and bmuf["num_syncs"] >= 5 and bmuf["rho"] > 3
    step = full["algo"]["optimizer"]["state"][0]["step"]
    assert float(step) != round(float(step))  # corrected: Adam's k is fractional
    # the global model (evaluated) differs from the Nesterov start point (local)
    assert any(not torch.equal(full["model"][n], full["eval_model"][n]) for n in full["model"])
