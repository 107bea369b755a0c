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


def test_the_replay_is_taken_off_the_model_so_other_callers_run_it_eagerly(monkeypatch):
    # torch.cuda.make_graphed_callables, given a module, sets an instance ``forward`` that
    # replays the graphs in training mode. Stand-in: a replay that marks its output. After
    # the capture the graphed object replays, while ``model(x)`` (a batch of another shape,
    # a user's own call) is the model's own forward again.
    model = torch.nn.Linear(3, 2)

    def fake_capture(module, samples):
        assert module is model and samples[0].shape == (4, 3)
        module.forward = lambda x: torch.full((x.shape[0], 2), 7.0)
        return module

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_capture)
    graphed = GraphedForward(model, "fp32", torch.device("cuda"))
    x = torch.ones(4, 3)
    assert graphed.fits(x) and not graphed.captured
    assert torch.equal(graphed(x), torch.full((4, 2), 7.0))  # captured, then replayed
    assert graphed.captured and graphed.fits(x) and not graphed.fits(torch.ones(5, 3))
    assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight, model.bias))
    assert torch.equal(graphed(x), torch.full((4, 2), 7.0))
    model.eval()
    assert not graphed.fits(x)


def test_a_failed_capture_warns_once_and_trains_on_eagerly(monkeypatch):
    model = torch.nn.Linear(3, 2)

    def refuse(module, samples):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", refuse)
    graphed = GraphedForward(model, "fp32", torch.device("cuda"))
    x = torch.ones(4, 3)
    with pytest.warns(RuntimeWarning, match="could not be captured.*without CUDA graphs"):
        out = graphed(x)
    assert torch.equal(out, model(x)) and graphed.failed and not graphed.fits(x)
