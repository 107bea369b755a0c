"""``--cuda-graph`` on a GPU: the replayed passes compute what the eager ones do.

Skipped without CUDA. The model's forward and backward are captured with
``torch.cuda.make_graphed_callables`` (``hadpsgd/train/graphs.py``); the loss, the
reduction and the optimizer stay eager, so a captured run must follow the eager run's
trajectory: the same gradients on the same batch, and through ``python -m hadpsgd.run`` the
same losses, step for step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from hadpsgd.models import build_model
from hadpsgd.models.blstm import BLSTM
from hadpsgd.precision import autocast
from hadpsgd.train.graphs import GraphedForward
from tests._mpi import assert_ok, run_mpi
from tests.mpi._resume import run_args

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_replayed_passes_give_the_eager_gradients(precision, per_layer):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = BLSTM(40, 12, hidden=32, layers=2, proj=16, per_layer=per_layer).to(dev)
    graphed = GraphedForward(model, precision, dev)

    def grads(run_graph: bool, x: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        if run_graph:
            logits = graphed(x)
        else:
            with autocast(precision, dev):
                logits = model(x)
        logits.float().square().mean().backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    for seed in range(3):  # the capture's batch, then new batches through the same graphs
        x = torch.randn(8, 21, 40, device=dev, generator=torch.Generator(dev).manual_seed(seed))
        assert graphed.fits(x)
        got, want = grads(True, x), grads(False, x)
        assert graphed.captured and graphed.failed is None
        assert graphed.stages == (3 if per_layer else 2)  # issue 59 item 3: stage by stage
        tol = 1e-5 if precision == "fp32" else 2e-2
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    model.eval()
    assert not graphed.fits(x)  # evaluation runs the model as it is
    model.train()
    assert not graphed.fits(x[:4])  # another shape too


def _losses(out: Path) -> list[float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if x["kind"] == "train"] + [
        x["heldout_loss"] for x in lines if x["kind"] == "eval"]


def test_a_captured_run_follows_the_eager_one(tiny_data, tmp_path):
    common = ["--device", "cuda", "--batch-size", "4", "--epochs", "1", "--log-every", "2",
              "--algo", "bmuf", "--ranks-per-node", "1", "--sync-period", "3",
              "--optimizer", "adam", "--lr", "0.003"]
    eager, graph = tmp_path / "eager", tmp_path / "graph"
    assert_ok(run_mpi(2, run_args(tiny_data, eager, *common)))
    res = run_mpi(2, run_args(tiny_data, graph, *common, "--cuda-graph"))
    assert_ok(res)
    assert "could not be captured" not in res.stdout + res.stderr
    a, b = _losses(eager), _losses(graph)
    assert len(a) == len(b) > 4
    assert a == pytest.approx(b, rel=1e-3)


def test_a_thread_pinning_batches_does_not_break_the_capture():
    """The loader's pin-memory thread pins while the model is captured (issue 59 item 2).

    In CUDA's global capture mode another thread's page-locked allocation invalidates the
    capture; hadpsgd captures thread-locally. Every pinned tensor is kept until the end, so
    each pin is a new ``cudaHostAlloc`` (torch's host cache rounds sizes up to a power of two
    and hands a freed block back: pins of sizes that come and go mostly allocate nothing, a
    review found), and the count of pins made while the capture ran must be above zero.
    """
    import threading

    stop, pinned = threading.Event(), []

    def pin() -> None:
        while not stop.is_set() and len(pinned) < 8192:  # at most 512 MiB, 64 KiB each
            pinned.append(torch.empty(1 << 14).pin_memory())

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = build_model("tiny", 40, 12).to(dev)
    graphed = GraphedForward(model, "fp32", dev)
    thread = threading.Thread(target=pin, daemon=True)
    thread.start()
    try:
        while not pinned:  # the thread is pinning before the capture starts
            time.sleep(0.001)
        x = torch.randn(8, 21, 40, device=dev)
        before = len(pinned)
        graphed(x).float().square().mean().backward()
        during = len(pinned) - before
    finally:
        stop.set()
        thread.join()
    assert graphed.captured and graphed.failed is None, graphed.failed
    assert during > 0, (before, during)  # new pins were made while the capture ran


def test_a_layer_s_gradients_land_before_the_layers_below_replay_their_backward():
    """Issue 59 item 3: captured stage by stage, the replayed backward hands each stage's
    gradients to autograd before the stage below replays, so the reduction hooks of the
    upper layers fire (and their buckets may start) while backward still runs below."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = BLSTM(40, 12, hidden=32, layers=2, proj=16, per_layer=True).to(dev)
    graphed = GraphedForward(model, "fp32", dev)
    first = list(model.lstm[0].parameters())
    seen: list[bool] = []
    for p in (model.out.weight, model.lstm[1].weight_ih_l0):
        p.register_post_accumulate_grad_hook(
            lambda _: seen.append(all(q.grad is None for q in first)))
    for seed in range(2):  # the capture's step, then a replay
        model.zero_grad(set_to_none=True)
        seen.clear()
        x = torch.randn(8, 21, 40, device=dev, generator=torch.Generator(dev).manual_seed(seed))
        graphed(x).float().square().mean().backward()
        assert graphed.stages == 3 and seen == [True, True], seen
        assert all(q.grad is not None for q in first)
