"""How far a whole training step captured in one CUDA graph takes ``swb`` on one GPU.

Issue 44 asks what holds a GPU from 400 k frames/s (SWB-2000's 16 epochs in an hour on one
8-GPU node). The grid's profile (docs/gpu.md) found the host launching ~1,290 kernels a step
the bound, the GPU busy 18 % of it; the ways named there were fewer kernels with no host in
the loop (CUDA graphs) and larger batches per GPU. This probe measures both on the plain
loop the grid is anchored to (``hadpsgd.models``' BLSTM, SGD with momentum, cross-entropy
over every frame from fp32 logits, random data already on the device), per batch:

- ``eager``: the step as the grid's plain loop runs it;
- ``graph``: the same step (forward under autocast, backward, the optimizer) captured once
  into a ``torch.cuda.CUDAGraph`` and replayed: one launch a step (the recipe of torch's
  *whole-network capture*: warm-up on a side stream, gradients kept, not set to ``None``);
- ``model_graph``: only the model's forward and backward captured
  (``torch.cuda.make_graphed_callables``), the loss and the optimizer's step eager, as a
  trainer that keeps its own step (hadpsgd's gradient buckets, finiteness check and
  communication) could take it;
- ``model_graph_staged``: the same, a graph pair per stage (each LSTM layer, or the stack,
  and the head), as ``--cuda-graph`` captures now (:class:`hadpsgd.train.graphs.GraphedForward`,
  issue 59 item 3).

Beside each step's time, its **overlap** (issue 59 item 3 asks the overlap with and without
graphs), from events recorded at the backward's start, in each gradient's reduction hook and
at its end: ``overlap_window``, the share of the backward's device time left when the first
gradient is accumulated, and ``overlap_bytes``, that share per gradient weighted by its bytes
(the reduction work a run could hide). Captured whole, every gradient reaches autograd after
the one backward replay: both ~0; per stage, each stage's gradients have the stages below it.
One GPU and no communication: these bound the overlap a run of several nodes could get, they
do not time one.

Both are timed alike: windows of ``--window`` steps, the first left out, the median of the
rest. A variant that cannot run (capture refused, out of memory) is reported with its error,
not hidden. Each batch prints one JSON line; ``--json`` writes the record with the graph's
ratio to the eager step measured in the same run.

    python -m benchmarks.training.graph_probe --batch 128 256 512 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

from benchmarks._common.timing import device_sync
from benchmarks.training.gpu_grid_worker import add_plain_loop_args, window_rates
from hadpsgd.models import build_model
from hadpsgd.train.graphs import GraphedForward

Step = Callable[[], None]
Forward = Callable[[], torch.Tensor]
Variant = tuple[Step, Forward | None]
"""A step, and the forward whose backward's overlap window is measured (None: not apart)."""


@dataclass
class Steps:
    """What :func:`make_steps` builds over one model and one batch."""

    eager: Variant
    """The eager step and its forward."""
    loss: Callable[[torch.Tensor], torch.Tensor]
    """The step's loss of the logits."""
    params: list[torch.nn.Parameter]
    """The model's parameters (whose hooks time the overlap window)."""
    variants: dict[str, Callable[[], Variant]]
    """A maker of each captured variant, by name."""


def make_steps(batch: int, a: argparse.Namespace) -> Steps:
    """The eager step, and a maker of each captured variant, over one model and one batch."""
    device = torch.device(a.device)
    torch.manual_seed(0)
    model = build_model(a.preset, a.feat_dim, a.classes,
                        per_layer=a.layout == "per-layer").to(device)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    x = torch.randn(batch, a.chunk_len, a.feat_dim, device=device)
    y = torch.randint(0, a.classes, (batch * a.chunk_len,), device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)

    def autocast() -> torch.autocast:
        # No autocast cache: a graph must not keep casts made outside it (torch's advice).
        return torch.autocast(device.type, dtype=dtype or torch.float32,
                              enabled=dtype is not None, cache_enabled=False)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, a.classes), y)

    def finish(logits: torch.Tensor) -> None:
        loss(logits).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    def eager_forward() -> torch.Tensor:
        with autocast():
            return model(x)

    def eager() -> None:
        finish(eager_forward())

    def graphed() -> Step:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: lazy state, cuDNN's plans, the momentum
            for _ in range(3):
                eager()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        return graph.replay, None

    def model_graphed() -> Variant:
        # The model's forward and backward in graphs (torch.cuda.make_graphed_callables), the
        # loss and the optimizer eager: what a trainer that keeps its own step could take.
        # Given the module, torch replaces its forward: taken back off, as hadpsgd does, so
        # that the staged variant below captures the eager model.
        with autocast():
            torch.cuda.make_graphed_callables(model, (x,))
        replay = vars(model).pop("forward")

        def forward() -> torch.Tensor:
            with autocast():
                return replay(x)

        return (lambda: finish(forward())), forward

    def model_graphed_staged() -> Variant:
        # hadpsgd's own capture (--cuda-graph): a graph pair per stage of the model.
        graphed = GraphedForward(model, a.precision, device)
        graphed(x)  # the capture (its warm-up and captures touch no gradient)
        if graphed.failed:
            raise RuntimeError(graphed.failed)

        def forward() -> torch.Tensor:
            return graphed(x)

        return (lambda: finish(forward())), forward

    return Steps((eager, eager_forward), loss, list(model.parameters()),
                 {"graph": graphed, "model_graph": model_graphed,
                  "model_graph_staged": model_graphed_staged})


def overlap(forward: Forward, loss: Callable[[torch.Tensor], torch.Tensor],
            params: list[torch.nn.Parameter], device: torch.device) -> dict[str, float]:
    """How much of one backward a gradient reduction could run beside.

    CUDA events recorded on the backward's stream at its start, in each parameter's
    post-accumulate hook (where a reduction hook fires) and at its end; host clocks on CPU,
    where the backward runs in the caller's time. Returns ``overlap_window``, the share of
    the backward's time left when the first gradient is accumulated, and ``overlap_bytes``,
    the same share for each parameter weighted by its gradient's bytes (the reduction work
    that could be hidden: 0 when every gradient lands at the end, as from one whole-model
    replay). See the module's docstring.
    """
    cuda = device.type == "cuda"

    def mark() -> Any:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    landed: list[tuple[int, Any]] = []

    def hook(p: torch.Tensor) -> None:
        landed.append((p.numel() * p.element_size(), mark()))

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    try:
        value = loss(forward())
        start = mark()
        value.backward()
        end = mark()
    finally:
        for handle in handles:
            handle.remove()
    for p in params:
        p.grad = None
    if cuda:
        torch.cuda.synchronize(device)
        total = start.elapsed_time(end)
        left = [(size, at.elapsed_time(end)) for size, at in landed]
    else:
        total = end - start
        left = [(size, end - at) for size, at in landed]
    if total <= 0 or not left:
        return {"overlap_window": 0.0, "overlap_bytes": 0.0}
    share = [(size, min(1.0, max(0.0, t / total))) for size, t in left]
    return {"overlap_window": share[0][1],
            "overlap_bytes": sum(n * f for n, f in share) / sum(n for n, _ in share)}


def row(res: dict[str, Any]) -> str:
    """A batch's result as one table row: ms a step and the overlap of each variant."""
    cells = []
    for name in ("eager", "graph", "model_graph", "model_graph_staged"):
        r = res.get(name, {})
        if "ms_per_step" not in r:
            cells.append(f"{name}: {r.get('error', '-')[:40]}")
            continue
        cells.append(f"{name} {r['ms_per_step']:.2f} ms" + (
            f", window {r['overlap_window']:.2f}, bytes {r['overlap_bytes']:.2f}"
            if "overlap_window" in r else ""))
    return f"| batch {res['batch']} | " + " | ".join(cells) + " |"


def rates(step: Step, frames: int, a: argparse.Namespace) -> dict[str, Any]:
    """Median frames/s and ms a step over the timed windows (the first one left out)."""
    steady = window_rates(step, a.window, a.windows + 1, frames,
                          device_sync(torch.device(a.device)))[1:]
    sec = statistics.median(frames / r for r in steady)
    return {"frames_per_s": frames / sec, "ms_per_step": 1e3 * sec}


def probe(batch: int, a: argparse.Namespace) -> dict[str, Any]:
    """One batch: eager, then each captured variant, on the same model; errors per variant."""
    frames = batch * a.chunk_len
    out: dict[str, Any] = {"batch": batch, "frames": frames}
    device = torch.device(a.device)
    try:
        steps = make_steps(batch, a)
        (eager, eager_forward), loss, params = steps.eager, steps.loss, steps.params
        out["eager"] = rates(eager, frames, a)
        out["eager"].update(overlap(eager_forward, loss, params, device))
    except Exception as err:  # noqa: BLE001 - reported, the next batch still runs
        out["eager"] = {"error": f"{type(err).__name__}: {err}"[:400]}
        return out
    for name, make in steps.variants.items():
        if a.device != "cuda":
            out[name] = {"error": "CUDA graphs need --device cuda"}
            continue
        try:
            step, forward = make()
            out[name] = rates(step, frames, a)
            out[f"{name}_over_eager"] = out[name]["frames_per_s"] / out["eager"]["frames_per_s"]
            if forward is not None:
                out[name].update(overlap(forward, loss, params, device))
        except Exception as err:  # noqa: BLE001
            out[name] = {"error": f"{type(err).__name__}: {err}"[:400]}
        finally:
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    """Probe every batch; print a JSON line each, and the record with ``--json``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--layout", choices=["stacked", "per-layer"], default="stacked")
    add_plain_loop_args(p)
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, help="write the record here")
    a = p.parse_args(argv)
    results = []
    for batch in a.batch:
        res = probe(batch, a)
        results.append(res)
        print(json.dumps(res), flush=True)
        print(row(res), flush=True)
    if a.json:
        meta = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                "torch": torch.__version__, "precision": a.precision, "layout": a.layout,
                "preset": a.preset, "classes": a.classes, "chunk_len": a.chunk_len}
        a.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
