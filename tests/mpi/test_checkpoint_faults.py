"""Faults while a checkpoint is written, on the user's path (``python -m hadpsgd.run``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests._mpi import assert_ok, run_mpi
from tests.mpi._resume import final_state, run_args

pytestmark = pytest.mark.mpi


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(where)], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A 450 KiB file system: room for one checkpoint of the tiny model (~300 KB), not two."""
    where = tmp_path / "disk"
    if not _mount_tmpfs(where, "450k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def test_a_full_disk_ends_the_job_by_name_and_resume_is_exact(tiny_data, small_disk,
                                                              tmp_path):
    common = ("--max-steps", "4", "--checkpoint-every", "2", "--keep-checkpoints", "0",
              "--optimizer", "sgd", "--momentum", "0.9")
    full = small_disk / "run"
    res = run_mpi(2, run_args(tiny_data, full, *common), timeout=120)
    assert res.returncode == 1, res.output[-3000:]
    assert "no space left in" in res.stderr and str(full / "checkpoints") in res.stderr
    assert "MiB free" not in res.stderr or "are free" in res.stderr
    assert "--resume auto" in res.stderr and "Traceback" not in res.stderr
    # The step-2 checkpoint stands and `latest` points at it; nothing partial is visible.
    ckpts = full / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00000002"]
    assert (ckpts / "latest").read_text().strip() == "step-00000002"
    # Room is made (the user's fix), and --resume auto continues to the end bit for bit.
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True,
                   capture_output=True, timeout=30)
    assert_ok(run_mpi(2, run_args(tiny_data, full, *common, "--resume", "auto")))
    assert_ok(run_mpi(2, run_args(tiny_data, tmp_path / "ref", *common)))
    got, want = final_state(full), final_state(tmp_path / "ref")
    assert got["progress"]["global_step"] == want["progress"]["global_step"] == 4
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
