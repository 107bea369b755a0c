"""``python -m hadpsgd.forward --device cuda`` against ``--device cpu`` (skipped without CUDA).

The same checkpoint over the same features on both devices: in fp32 (IEEE fp32 on the GPU:
the forward leaves TF32 off unless ``--tf32``) the log-posteriors agree to fp32 rounding;
in bf16 (the GPU's LSTM in bf16 on cuDNN, the CPU's under oneDNN's autocast) each agrees
with the fp32 figures to bf16 rounding. Whole utterances (packed batches) and windows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tests._mpi import ROOT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def run_dir(tiny_data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with one checkpoint of the ``small`` BLSTM (random weights)."""
    from hadpsgd.models import build_model
    from hadpsgd.train.checkpoint import checkpoint_path, save_checkpoint

    out = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = build_model("small", 260, 12)
    config = {"data": {"train": str(tiny_data[0]), "chunk_len": 21},
              "model": {"preset": "small", "lstm_layout": "auto"},
              "train": {"precision": "fp32"}}
    state = {"model": model.state_dict(), "config": config,
             "progress": {"epoch": 0, "step_in_epoch": 0, "global_step": 5}}
    save_checkpoint(state, checkpoint_path(out / "checkpoints", 5), meta={"step": 5})
    return out


def forward(run_dir: Path, features: Path, out: Path, *flags: str) -> tuple[np.ndarray, str]:
    """One ``python -m hadpsgd.forward`` process: its log-posteriors and its status lines."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"):
        env.pop(name, None)  # one process, not a rank of the test runner's job
    cmd = [sys.executable, "-m", "hadpsgd.forward", "--model", str(run_dir), "--features",
           str(features), "--output", str(out), "--priors", "none", "--no-progress", *flags]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    with h5py.File(out, "r") as h5:
        return h5["loglikes"][()], res.stderr


@pytest.mark.parametrize("context", [[], ["--context", "chunks", "--chunk-overlap", "5"]],
                         ids=["whole", "chunks"])
def test_cuda_equals_cpu_in_fp32_and_bf16(run_dir: Path, tiny_data: tuple[Path, Path],
                                          tmp_path: Path, context: list[str]) -> None:
    feats = tiny_data[1]
    runs = {}
    for device in ("cpu", "cuda"):
        for precision in ("fp32", "bf16"):
            runs[device, precision] = forward(
                run_dir, feats, tmp_path / f"{device}-{precision}.h5", "--device", device,
                "--precision", precision, *context)
    cpu, (gpu, said) = runs["cpu", "fp32"][0], runs["cuda", "fp32"]
    assert "fp32 (no TF32)" in said and "cuda" in said
    assert cpu.shape == gpu.shape and np.isfinite(gpu).all()
    # IEEE fp32 both sides: the sums round differently, nothing more.
    np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=2e-4)
    for device in ("cpu", "cuda"):
        half = runs[device, "bf16"][0]
        assert half.dtype == np.float32 and np.isfinite(half).all()
        # A random model's logits are small (bf16's step there ~5e-4); measured on CPU:
        # max 9e-4, mean 2e-4.
        assert np.abs(half - cpu).max() < 0.02, device
        assert np.abs(half - cpu).mean() < 0.005, device
    assert not np.array_equal(runs["cuda", "bf16"][0], gpu)  # bf16 ran, not fp32


def test_tf32_is_the_users_choice(run_dir: Path, tiny_data: tuple[Path, Path],
                                  tmp_path: Path) -> None:
    scores, said = forward(run_dir, tiny_data[1], tmp_path / "tf32.h5", "--device", "cuda",
                           "--precision", "fp32", "--tf32")
    assert "fp32 (TF32 allowed: --tf32)" in said
    assert np.isfinite(scores).all()
