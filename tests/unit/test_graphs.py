"""``--cuda-graph`` on CPU: refused with its fix before any run directory is made.

What a graph replays is checked on a GPU (tests/gpu/test_gpu_graphs.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hadpsgd.config import parse_config
from hadpsgd.train.graphs import GraphedForward
from tests._mpi import ROOT


def test_the_graphed_model_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, not cpu"):
        GraphedForward(torch.nn.Linear(2, 2), "bf16", torch.device("cpu"))


def test_flag_parses_and_is_off_by_default():
    assert parse_config(["--cuda-graph"]).train.cuda_graph is True
    assert parse_config([]).train.cuda_graph is False


def test_the_run_exits_2_before_its_directory(tmp_path):
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "hadpsgd.run", "--preset", "tiny",
                          "--max-steps", "1", "--device", "cpu", "--cuda-graph",
                          "--out-dir", str(out)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stdout + res.stderr
    assert ("--cuda-graph needs a CUDA device, and this learner runs on cpu: drop "
            "--cuda-graph, or run on a GPU (--device cuda)") in res.stderr
    assert not out.exists()
