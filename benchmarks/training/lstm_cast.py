"""The bf16 LSTM's weight cast: one cast of the flat buffer's span against one cast a weight.

Issue 44, item 8(b). Under ``--precision bf16`` the LSTM runs on a bf16 copy of its fp32
weights made at every forward (:mod:`hadpsgd.models.lstm_weights`). Where the weights lie in
hadpsgd's flat parameter buffer, laid out as cuDNN lays out bf16 weights, the copy is one
cast of that span of the buffer (and the backward one cast of its gradient); the baseline,
measured in the same run on the same model, is the per-weight route the project had before
(each weight cast alone, then joined; the backward splits and casts each piece).

For each route: the median seconds of a training step (forward under bf16 autocast, frame
cross-entropy, backward, SGD update) on fixed data, the kernels (CUDA) or cast operators
(CPU) one step runs, from ``torch.profiler``, and the ratio of the two step times. The
model is a ``hadpsgd.models`` preset with its parameters in hadpsgd's flat buffers, as
``hadpsgd.run`` trains it. Prints a table and one JSON line; ``--json`` writes the record.

    python -m benchmarks.training.lstm_cast --device cuda --preset swb --batch 128
    python -m benchmarks.training.lstm_cast --device cpu --preset tiny --batch 4 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._common.launch import emit
from benchmarks._common.timing import device_sync, frame_loss, step_times
from hadpsgd.comm.flat import FlatBuffer, cudnn_weight_groups
from hadpsgd.models import build_model, lstm_weights
from hadpsgd.models.lstm import lstm_layout

FEATURES, CLASSES_DEFAULT, FRAMES = 260, 32000, 21
"""Input features, output classes and frames a chunk of ``swb`` (docs/design.md)."""


def _model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(args.preset, FEATURES, args.classes,
                        per_layer=args.layout == "per-layer").to(device)
    params = list(model.parameters())
    FlatBuffer(params, kind="data", own_storage=cudnn_weight_groups(model))
    FlatBuffer(params, kind="grad")
    return model


def _profile_counts(step: Any, device: torch.device) -> dict[str, int]:
    """Kernels (CUDA) and cast operators one ``step`` runs."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        device_sync(device)()
    events = prof.events()
    kernels = sum(1 for e in events
                  if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    casts = sum(1 for e in events if e.name == "aten::_to_copy")
    return {"kernels": kernels, "casts": casts}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both routes on one model, alternating rounds; the record."""
    device = torch.device(args.device)
    model = _model(args, device)
    lstms = [m for m in model.modules() if isinstance(m, nn.LSTM)]
    spans = []
    for m in lstms:
        layout = lstm_layout(m, torch.bfloat16)
        spans.append(layout is not None and lstm_weights.storage_span(
            m._flat_weights, layout) is not None)  # noqa: SLF001
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, FRAMES, FEATURES, device=device)
    y = torch.randint(0, args.classes, (args.batch, FRAMES), device=device)

    def step() -> None:
        loss = frame_loss(model, x, y, args.classes, "bf16")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    real_span = lstm_weights.storage_span
    routes = {"span": real_span, "per_weight": lambda *_: None}
    times: dict[str, list[float]] = {r: [] for r in routes}
    counts: dict[str, dict[str, int]] = {}
    sync = device_sync(device)
    try:
        for name, fn in routes.items():  # warm each route, then count its work
            lstm_weights.storage_span = fn
            step_times(step, 1, warmup=args.warmup, sync=sync)
            counts[name] = _profile_counts(step, device)
        for _ in range(args.rounds):  # alternate, so drift of the machine hits both alike
            for name, fn in routes.items():
                lstm_weights.storage_span = fn
                times[name] += step_times(step, args.steps, warmup=1, sync=sync)
    finally:
        lstm_weights.storage_span = real_span
    med = {r: statistics.median(t) for r, t in times.items()}
    frames = args.batch * FRAMES
    rows = {r: {"median_s": med[r], "frames_per_s": frames / med[r], **counts[r]}
            for r in routes}
    return {
        "bench": "lstm_cast", "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "preset": args.preset, "layout": args.layout,
        "batch": args.batch, "classes": args.classes, "lstm_modules": len(lstms),
        "span_route_taken": spans, "routes": rows,
        "speedup_span_vs_per_weight": med["per_weight"] / med["span"],
        "steps": args.steps, "rounds": args.rounds,
    }


def table(rec: dict[str, Any]) -> str:
    """The record as a Markdown table."""
    lines = [f"lstm_cast on {rec['device_name']} ({rec['preset']}, {rec['layout']}, batch "
             f"{rec['batch']}, bf16; span route taken by {sum(rec['span_route_taken'])} of "
             f"{rec['lstm_modules']} LSTM modules)", "",
             "| route | ms/step (median) | frames/s | kernels/step | casts/step |",
             "|---|---|---|---|---|"]
    for name, r in rec["routes"].items():
        lines.append(f"| {name} | {1e3 * r['median_s']:.2f} | {r['frames_per_s']:,.0f} | "
                     f"{r['kernels']} | {r['casts']} |")
    lines.append(f"\nspan / per-weight speed: {rec['speedup_span_vs_per_weight']:.3f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse, measure, print the table and the JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="swb")
    p.add_argument("--layout", choices=["stacked", "per-layer"], default="stacked")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--classes", type=int, default=CLASSES_DEFAULT)
    p.add_argument("--steps", type=int, default=20, help="timed steps a route a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="write the record here")
    args = p.parse_args(argv)
    rec = measure(args)
    print(table(rec))
    emit(rec, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
