"""``--cuda-graph`` stage by stage (issue 59 item 3), checked on CPU.

The capture itself needs a GPU (tests/gpu/test_gpu_graphs.py replays real graphs). Here:
the BLSTM's stages chained are its forward, bit for bit, in both LSTM layouts; the samples a
capture is given; and, with a stand-in for ``torch.cuda.make_graphed_callables`` that keeps
its structure (one autograd node per callable, whose backward hands back that callable's
gradients at once, as a replayed backward graph does) but no graph, the property the stages
are for: a stage's gradients are accumulated (their reduction hooks fire) before the
backward of the stages below it runs. Captured whole, no gradient is ready before the
whole backward is.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hadpsgd.models.blstm import BLSTM
from hadpsgd.train.graphs import GraphedForward, stage_samples, stages_of


def _model(per_layer: bool) -> BLSTM:
    return BLSTM(40, 12, hidden=16, layers=2, proj=8, per_layer=per_layer)


def _chain(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("per_layer", [False, True])
def test_the_stages_chained_are_the_forward_bit_for_bit(per_layer):
    torch.manual_seed(0)
    model = _model(per_layer)
    stages = stages_of(model)
    assert stages is not None
    assert len(stages) == (3 if per_layer else 2)  # each layer (or the stack), the head
    x = torch.randn(3, 7, 40)
    assert torch.equal(_chain(stages, x), model(x))
    # the stages hold the model's own parameters, in its order, and are not its submodules
    staged = [p for s in stages for p in s.parameters()]
    assert [id(p) for p in staged] == [id(p) for p in model.parameters()]
    assert not any(s is m for s in stages for m in model.modules())


def test_a_model_without_stages_or_with_one_is_captured_whole():
    assert stages_of(nn.Linear(2, 2)) is None

    class One(nn.Linear):
        def graph_stages(self) -> list[nn.Module]:
            return [self]

    assert stages_of(One(2, 2)) is None

    class Bad(nn.Linear):
        def graph_stages(self) -> list[Any]:
            return [self, lambda x: x]

    with pytest.raises(TypeError, match=r"Bad.graph_stages\(\) gave a function at 1: give "
                                        "nn.Module objects"):
        stages_of(Bad(2, 2))
    with pytest.raises(TypeError, match="gave a function"):  # before any step, not at the first
        GraphedForward(Bad(2, 2), "fp32", torch.device("cuda"))


def test_the_samples_are_each_stages_input_and_want_a_gradient_after_the_first():
    torch.manual_seed(0)
    model = _model(True)
    stages = stages_of(model)
    x = torch.randn(2, 5, 40)
    samples = stage_samples(stages, x)
    assert len(samples) == len(stages) and samples[0] is x
    assert [s.requires_grad for s in samples] == [False] + [True] * (len(stages) - 1)
    assert all(s.grad_fn is None for s in samples)  # leaves: nothing recorded
    for stage, sample, following in zip(stages, samples, samples[1:], strict=False):
        assert torch.equal(stage(sample).detach(), following.detach())


def _graphless_capture(calls: list[tuple[Any, Any]], backwards: list[int]):
    """``make_graphed_callables``'s structure without a graph (see the module docstring).

    ``calls`` gets each call's arguments, ``backwards`` one entry per replayed backward.
    """

    def capture(callables: Any, sample_args: Any) -> Any:
        calls.append((callables, sample_args))
        single = not isinstance(callables, tuple)
        mods = (callables,) if single else callables

        def replay_of(module: nn.Module):
            params = tuple(module.parameters())
            eager = module.forward

            class Replay(torch.autograd.Function):
                @staticmethod
                def forward(ctx: Any, x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
                    ctx.save_for_backward(x)
                    with torch.no_grad():
                        return eager(x)

                @staticmethod
                def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
                    (x,) = ctx.saved_tensors
                    backwards.append(1)
                    with torch.enable_grad():
                        xi = x.detach().requires_grad_(ctx.needs_input_grad[0])
                        wanted = ([xi] if xi.requires_grad else []) + list(params)
                        got = list(torch.autograd.grad(eager(xi), wanted, grad))
                    gx = got.pop(0) if xi.requires_grad else None
                    return (gx, *got)

            return lambda x: Replay.apply(x, *params)

        for m in mods:
            m.forward = replay_of(m)  # as torch does to a module it is given
        return mods[0] if single else mods

    return capture


@pytest.mark.parametrize("staged", [True, False])
def test_a_stage_s_gradients_are_ready_before_the_backward_below_it(staged, monkeypatch):
    calls: list[tuple[Any, Any]] = []
    backwards: list[int] = []
    monkeypatch.setattr(torch.cuda, "make_graphed_callables",
                        _graphless_capture(calls, backwards))
    torch.manual_seed(0)
    model = _model(True)
    if not staged:  # the same model, captured whole (as a model without stages is)
        monkeypatch.setattr(type(model), "graph_stages", None, raising=False)
    graphed = GraphedForward(model, "fp32", torch.device("cuda"))
    first = list(model.lstm[0].parameters())
    head = model.out.weight
    seen: list[tuple[int, bool]] = []  # at the head's hook: backwards run, layer 0's grads
    head.register_post_accumulate_grad_hook(
        lambda p: seen.append((len(backwards), all(q.grad is None for q in first))))
    x = torch.randn(4, 6, 40)
    want = model(x)
    model.zero_grad(set_to_none=True)
    got = graphed(x)
    assert graphed.captured and graphed.stages == (3 if staged else 1)
    (callables, samples), = calls
    if staged:
        assert isinstance(callables, tuple) and len(callables) == 3  # 2 layers, the head
        assert [s[0].requires_grad for s in samples] == [False, True, True]
    else:
        assert callables is model
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    got.square().mean().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    # Staged: the head's gradient landed after its own backward alone, before the layers'
    # ran (their reduction could start now). Whole: only after the one backward of all.
    assert seen == ([(1, True)] if staged else [(1, seen[0][1])])
    assert len(backwards) == graphed.stages
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    for g, w in zip(eager, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # the model's own forward stays eager for every other caller
    assert "forward" not in vars(model) and all("forward" not in vars(m)
                                                for m in model.modules())
