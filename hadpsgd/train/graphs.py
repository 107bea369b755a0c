"""The model's training passes replayed from CUDA graphs (``--cuda-graph``).

A training step of ``swb`` at batch 128 launches ~1,300 kernels of ~6 µs each; the host
launching them is the bound and the GPU idles most of the step (docs/gpu.md). Captured once
with :func:`torch.cuda.make_graphed_callables`, the forward and the backward are one launch
each: on one H200 the plain loop's step at batch 128 (bf16) went from 22.9 to 6.7 ms.

Only the model's passes are captured. The loss, the gradients' reduction (hooks that fire as
each gradient is accumulated, after the graphed backward hands its gradients to autograd),
the finiteness check and the optimizer stay eager, so every algorithm, precision and fault
path is the one the eager loop takes. The capture needs what a graph needs:

- fixed shapes: the first training batch's shape is captured (training batches are all alike:
  the sampler drops the incomplete last one); a batch of another shape runs eagerly;
- fixed addresses: hadpsgd's flat buffers keep every parameter's storage for the whole run,
  and the algorithms change parameters in place (block syncs, gossip, evaluation swaps);
- no casts kept across calls: the forward runs under autocast without its weight cache;
- training mode with gradients: evaluation (``eval()``, ``no_grad``) runs the model as it is.

``make_graphed_callables`` warms up and captures with ``torch.autograd.grad`` on its own
sample, so nothing reaches the parameters' gradients (nor the reduction hooks) until the
first replayed step.

**Stage by stage** (issue 59 item 3). Captured whole, the backward is one replay that hands
every gradient to autograd at its end: each bucket's reduction then starts after the whole
backward, and the overlap of backward with communication the eager loop has is lost. A model
that names its stages (``graph_stages()``: modules whose chained calls, each on the last
one's output, are its forward; :meth:`hadpsgd.models.blstm.BLSTM.graph_stages` gives each
LSTM layer and the output head) is captured as one graph pair per stage, in one call so they
share a memory pool. The replayed backward is then one replay per stage, last stage first,
and autograd accumulates a stage's gradients (its reduction hooks fire, and a full bucket
starts its reduction) before the next replay runs: the eager loop's overlap at the stages'
grain. A model without stages is captured whole. With the BLSTM's stacked LSTM (one cuDNN
call, ``--lstm-layout auto``) the stages are the stack and the head; ``--lstm-layout
per-layer`` gives a stage per layer.

The capture is in CUDA's thread-local mode (issue 59 item 2). In the global mode torch
captures in by default, a CUDA call of *another* thread that is unsafe during a capture
invalidates it: the loader's pin-memory thread pinning the next batch (a page-locked
allocation) made the capture fail at the first fetch that overlapped it (an H200 run passed
only because the prefetch had ended first). No other thread launches work on the capture's
stream, so only this thread's calls need the check. ``make_graphed_callables`` takes no
mode, so :func:`thread_local_capture` gives the ``torch.cuda.graph`` it opens that default
while it runs (as torch's own CUDA graph trees capture).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hadpsgd.precision import autocast

CAPTURE_MODE = "thread_local"
"""The ``cudaStreamCaptureMode`` of the model's capture (see the module's docstring)."""


@contextlib.contextmanager
def thread_local_capture() -> Iterator[None]:
    """``torch.cuda.graph`` captures in :data:`CAPTURE_MODE` unless told otherwise, meanwhile.

    ``make_graphed_callables`` opens ``torch.cuda.graph(...)`` without a mode; the name is
    looked up at the call, so a subclass with another default takes its place while the
    capture runs (on the capturing thread; no other thread captures) and the original is put
    back afterwards, whatever happened.
    """
    original = torch.cuda.graph

    class _Graph(original):  # type: ignore[misc,valid-type] - torch's context manager
        def __init__(self, *args: Any, capture_error_mode: str = CAPTURE_MODE,
                     **kwargs: Any) -> None:
            super().__init__(*args, capture_error_mode=capture_error_mode, **kwargs)

    torch.cuda.graph = _Graph  # type: ignore[misc]
    try:
        yield
    finally:
        torch.cuda.graph = original  # type: ignore[misc]


class GraphedForward:
    """The model's forward and backward from CUDA graphs, captured at the first training batch.

    Args:
        model: The model being trained (its parameters in place for the whole run).
        precision: The run's ``--precision`` (the autocast the capture runs under).
        device: The learner's device; must be CUDA.

    Raises:
        ValueError: ``device`` is not a CUDA device (the run refuses ``--cuda-graph`` there
            before it starts: ``hadpsgd.assembly.build``).
        TypeError: The model's ``graph_stages()`` gives something other than modules.
    """

    def __init__(self, model: nn.Module, precision: str, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model = model
        self.precision = precision
        self.device = device
        self._graphed: Callable[..., torch.Tensor] | None = None
        self._shape: tuple[int, ...] | None = None
        self.failed: str | None = None
        """Why the capture failed (the run goes on eagerly), or ``None``."""
        self.stages = 0
        """Graph pairs captured: the model's stages (:func:`stages_of`), 1 when captured
        whole, 0 before the capture."""
        self._stages = stages_of(model)
        """The modules captured a graph pair each, or None for the whole model (read here: a
        model's bad ``graph_stages()`` is said before any step)."""

    @property
    def captured(self) -> bool:
        """Whether the passes are captured (after the first training batch)."""
        return self._graphed is not None

    def fits(self, feats: torch.Tensor) -> bool:
        """Whether ``feats`` may replay the graphs (or be the one they are captured from)."""
        if self.failed is not None or not self.model.training or not torch.is_grad_enabled():
            return False
        return self._shape is None or tuple(feats.shape) == self._shape

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        """The logits of ``feats`` (a training batch on the device, :meth:`fits`)."""
        if self._graphed is None:
            self._capture(feats)
            if self._graphed is None:  # the capture failed: this step, and the rest, eager
                with autocast(self.precision, self.device):
                    return self.model(feats)
        with autocast(self.precision, self.device, cache=False):
            return self._graphed(feats)

    def _capture(self, feats: torch.Tensor) -> None:
        """Capture the passes on a copy of the first batch; warn and stay eager if they cannot."""
        sample = feats.detach().clone()
        stages = self._stages
        try:
            with autocast(self.precision, self.device, cache=False), thread_local_capture():
                if stages is None:
                    graphed = torch.cuda.make_graphed_callables(self.model, (sample,))
                else:
                    samples = stage_samples(stages, sample)
                    graphed = torch.cuda.make_graphed_callables(
                        tuple(stages), tuple((x,) for x in samples))
        except Exception as err:  # noqa: BLE001 - the run goes on without graphs, said once
            self.failed = f"{type(err).__name__}: {err}"
            warnings.warn(f"--cuda-graph: the model's passes could not be captured "
                          f"({self.failed[:300]}); training goes on without CUDA graphs",
                          RuntimeWarning, stacklevel=3)
            return
        if stages is not None:
            # As below for the whole model, per stage: a stage may be one of the model's own
            # submodules, whose eager forward the model's other callers still need.
            self._graphed = chained([vars(stage).pop("forward", None) or replay
                                     for stage, replay in zip(stages, graphed, strict=True)])
            self._shape = tuple(feats.shape)
            self.stages = len(stages)
            return
        # Given a module, torch replaces its forward (an attribute of the instance) by one
        # that replays the graphs whenever the module is in training mode. Taken back off the
        # module, the replay is this object's alone, and ``model(x)`` stays the eager model
        # for every other caller (a batch of another shape, a user's own forward).
        replay = vars(self.model).pop("forward", None) if graphed is self.model else graphed
        self._graphed = replay if replay is not None else graphed
        self._shape = tuple(feats.shape)
        self.stages = 1


def stages_of(model: nn.Module) -> list[nn.Module] | None:
    """The modules ``model`` is captured as, one graph pair each, or ``None`` for whole.

    A model names its stages with a ``graph_stages()`` method (see the module's docstring);
    fewer than two stages, or none, capture the model whole.

    Raises:
        TypeError: ``graph_stages()`` gave something other than modules (each is captured
            with its parameters, which only a module carries).
    """
    get = getattr(model, "graph_stages", None)
    if get is None:
        return None
    stages = list(get())
    for i, stage in enumerate(stages):
        if not isinstance(stage, nn.Module):
            raise TypeError(f"{type(model).__name__}.graph_stages() gave a "
                            f"{type(stage).__name__} at {i}: give nn.Module objects, whose "
                            "chained calls are the model's forward")
    return stages if len(stages) > 1 else None


def stage_samples(stages: list[nn.Module], feats: torch.Tensor) -> list[torch.Tensor]:
    """Each stage's sample input: ``feats``, then each stage's output on the one before.

    Computed without autograd, under the autocast the caller opened (the dtypes a replay
    meets). Every sample after the first requires a gradient, as the live input does (the
    output of the stage before, a function of its parameters); the first is the batch's
    features, which do not.
    """
    samples = [feats]
    with torch.no_grad():
        x = feats
        for stage in stages[:-1]:
            x = stage(x)
            samples.append(x.detach().clone().requires_grad_(True))
    return samples


def chained(stages: list[Callable[..., torch.Tensor]]) -> Callable[[torch.Tensor], torch.Tensor]:
    """One callable running ``stages`` in order, each on the last one's output."""

    def run(feats: torch.Tensor) -> torch.Tensor:
        x = feats
        for stage in stages:
            x = stage(x)
        return x

    return run


__all__ = ["CAPTURE_MODE", "GraphedForward", "chained", "stage_samples", "stages_of",
           "thread_local_capture"]
