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
  communication) could take it.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

from benchmarks._common.timing import device_sync
from benchmarks.training.gpu_grid_worker import add_plain_loop_args, window_rates
from hadpsgd.models import build_model

Step = Callable[[], None]


def make_steps(batch: int, a: argparse.Namespace) -> tuple[Step, dict[str, Callable[[], Step]]]:
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

    def finish(logits: torch.Tensor) -> None:
        F.cross_entropy(logits.float().reshape(-1, a.classes), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    def eager() -> None:
        with autocast():
            logits = model(x)
        finish(logits)

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
        return graph.replay

    def model_graphed() -> Step:
        # The model's forward and backward in graphs (torch.cuda.make_graphed_callables), the
        # loss and the optimizer eager: what a trainer that keeps its own step could take.
        with autocast():
            graphed_model = torch.cuda.make_graphed_callables(model, (x,))

        def step() -> None:
            with autocast():
                logits = graphed_model(x)
            finish(logits)

        return step

    return eager, {"graph": graphed, "model_graph": model_graphed}


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
    try:
        eager, variants = make_steps(batch, a)
        out["eager"] = rates(eager, frames, a)
    except Exception as err:  # noqa: BLE001 - reported, the next batch still runs
        out["eager"] = {"error": f"{type(err).__name__}: {err}"[:400]}
        return out
    for name, make in variants.items():
        if a.device != "cuda":
            out[name] = {"error": "CUDA graphs need --device cuda"}
            continue
        try:
            out[name] = rates(make(), frames, a)
            out[f"{name}_over_eager"] = out[name]["frames_per_s"] / out["eager"]["frames_per_s"]
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
    if a.json:
        meta = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                "torch": torch.__version__, "precision": a.precision, "layout": a.layout,
                "preset": a.preset, "classes": a.classes, "chunk_len": a.chunk_len}
        a.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
