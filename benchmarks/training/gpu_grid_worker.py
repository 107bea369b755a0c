"""The GPU grid's anchor: a plain PyTorch loop of the same model, per cell; and its profile.

Run by :mod:`benchmarks.training.gpu_grid` as one process for every cell (start-up once).
For each cell (``128/bf16/stacked``): the ``hadpsgd.models`` BLSTM of the preset with that
LSTM layout, ``torch.optim.SGD`` with momentum, cross-entropy over every frame from fp32
logits, the forward under the cell's autocast (``torch.amp.GradScaler`` for fp16), TF32 on
only in the ``tf32`` cells (as ``hadpsgd.run`` sets it), random data already on the device
(:func:`benchmarks._common.timing.training_step`). Timed as ``hadpsgd.run`` logs itself:
windows of ``--window`` steps, the first one left out as warm-up, the median of the rest.

Prints one JSON line per cell (``{"cell", "frames_per_s", "sec_per_step", "windows",
"warmup_frames_per_s"}`` or ``{"cell", "error"}``), and with ``--profile-cell`` a chrome trace
of two steady steps of that cell (``{"cell", "profile": path}``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._common.timing import device_sync, seconds_per_step, training_step
from benchmarks.training.gpu_grid_report import Cell, parse_key
from hadpsgd.models import build_model


def set_tf32(device: torch.device, allow: bool) -> None:
    """TF32 of fp32 matmuls and cuDNN as the cell has it (torch's flags, set both ways)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.backends.cudnn.allow_tf32 = allow


def window_rates(step: Callable[[], None], window: int, windows: int, frames: int,
                 sync: Callable[[], None]) -> list[float]:
    """Frames/s of ``windows`` back-to-back windows of ``window`` steps (the first: warm-up)."""
    return [frames / seconds_per_step(step, window, sync=sync) for _ in range(windows)]


def profile_steps(step: Callable[[], None], sync: Callable[[], None], device: torch.device,
                  out: Path) -> None:
    """Two steps under ``torch.profiler`` (after one more as its warm-up); a chrome trace."""
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
        for _ in range(3):
            step()
            sync()  # each step's kernels inside its ProfilerStep mark
            prof.step()


def measure(cell: Cell, a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One cell's plain loop: build, warm up, time; profile it when asked."""
    set_tf32(device, cell.tf32)
    torch.manual_seed(0)
    model = build_model(a.preset, a.feat_dim, a.classes,
                        per_layer=cell.layout == "per-layer").to(device)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    x = torch.randn(cell.batch, a.chunk_len, a.feat_dim, device=device)
    y = torch.randint(0, a.classes, (cell.batch, a.chunk_len), device=device)
    step = training_step(model, opt, x, y, a.classes, None, cell.amp)
    sync = device_sync(device)
    frames = cell.batch * a.chunk_len
    rates = window_rates(step, a.window, a.windows + 1, frames, sync)
    steady = rates[1:]
    out: dict[str, Any] = {
        "cell": cell.key, "frames_per_s": statistics.median(steady),
        "sec_per_step": statistics.median(frames / r for r in steady),
        "windows": len(steady), "warmup_frames_per_s": rates[0]}
    if a.profile_cell == cell.key and a.profile_out:
        profile_steps(step, sync, device, Path(a.profile_out))
        out["profile"] = a.profile_out
    return out


def add_plain_loop_args(p: argparse.ArgumentParser) -> None:
    """The plain loop's model, data and timing flags (shared with the CUDA-graph probe)."""
    p.add_argument("--preset", default="swb")
    p.add_argument("--classes", type=int, default=32000)
    p.add_argument("--feat-dim", type=int, default=260)
    p.add_argument("--chunk-len", type=int, default=21)
    p.add_argument("--window", type=int, default=8, help="steps per timed window")
    p.add_argument("--windows", type=int, default=4, help="timed windows after the warm-up")
    p.add_argument("--lr", type=float, default=0.01)


def main(argv: list[str] | None = None) -> int:
    """Measure every cell of ``--cells``; one JSON line each."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", required=True, help="comma-separated batch/precision/layout")
    add_plain_loop_args(p)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--profile-cell", default="", help="profile two steps of this cell")
    p.add_argument("--profile-out", default="", help="the chrome trace's path")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    for key in a.cells.split(","):
        try:
            result = measure(parse_key(key), a, device)
        except Exception as err:  # noqa: BLE001 - one cell's failure (OOM) is its row's
            result = {"cell": key, "error": f"{type(err).__name__}: {err}"[:500]}
        print(json.dumps(result), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next cell starts from the same free memory
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
