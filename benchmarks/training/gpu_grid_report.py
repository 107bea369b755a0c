"""The GPU grid's cells, ratios, targets and report: pure functions (no torch, no GPU).

:mod:`benchmarks.training.gpu_grid` measures; this module turns the figures into the rows,
the Markdown table and the JSON record, so ``tests/lab/test_gpu_grid.py`` checks all of it
with fake numbers on any machine.

A *cell* is one batch x precision x LSTM layout. Its precision is one of ``fp32`` (IEEE fp32,
TF32 off, as ``hadpsgd.run --precision fp32``), ``tf32`` (``--precision fp32 --tf32``),
``bf16`` and ``fp16`` (autocast, TF32 off, as ``hadpsgd.run`` sets it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BATCHES = (16, 64, 128)
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
LAYOUTS = ("stacked", "per-layer")
DEFAULT_PRECISIONS = ("bf16", "fp32", "tf32")
"""The default grid's precisions: fp16 (with its loss scale) is for GPUs without bf16, and
its six cells would not fit the default budget beside the rest (``--precision fp16`` adds
them)."""
PRECISION_ORDER = ("bf16", "fp32", "tf32", "fp16")
"""Which cells run first at one batch (the budget leaves out the last): bf16 is the target."""

V100_FRAMES_PER_S = 15_800.0
"""The seed paper's single V100 on this model (swb BLSTM, batch 128)."""
SPEEDUP_GOAL = 3.0
"""bf16 at batch 128 on an H100: at least this many V100s."""
RATIO_GOAL = 0.95
"""hadpsgd's steady frames/s over the plain loop's, at least."""
TARGET_BATCH = 128


CELL_S = 18.0
"""Seconds a cell takes: ``hadpsgd.run``'s 14-16 s (its start-up most of it) and the cell's
share of the plain loop (H200, 2026-11-27: 4 cells in 59 s)."""
FIXED_S = 55.0
"""Seconds of the grid that are no cell: the synthetic set, the plain loop's start, the
profile of one cell through ``hadpsgd.run`` and the forward check (H200, 2026-11-27)."""
DEFAULT_BUDGET_S = 480.0
"""``--budget``'s default: one command of a lent machine (10 minutes) with its set-up."""


def estimate(cells: int, fixed: bool = True) -> float:
    """Seconds a grid of ``cells`` cells needs on one H100 / H200 (the plan's dry run).

    Args:
        cells: Cells in the grid.
        fixed: Whether the profile and the forward check run too.
    """
    return cells * CELL_S + (FIXED_S if fixed else 0.0)


@dataclass(frozen=True)
class Cell:
    """One measurement: batch (per rank), precision, LSTM layout."""

    batch: int
    precision: str
    layout: str

    @property
    def amp(self) -> str:
        """``hadpsgd.run --precision``: ``fp32`` for both fp32 and tf32."""
        return "fp32" if self.precision == "tf32" else self.precision

    @property
    def tf32(self) -> bool:
        """Whether TF32 is on (``--tf32``): only in the ``tf32`` cells."""
        return self.precision == "tf32"

    @property
    def key(self) -> str:
        """``128/bf16/stacked``."""
        return f"{self.batch}/{self.precision}/{self.layout}"

    def run_args(self) -> list[str]:
        """The cell's ``hadpsgd.run`` flags."""
        return ["--batch-size", str(self.batch), "--precision", self.amp, "--lstm-layout",
                self.layout, *(["--tf32"] if self.tf32 else [])]


def parse_key(key: str) -> Cell:
    """The cell of ``128/bf16/stacked``.

    Raises:
        ValueError: If ``key`` is not ``batch/precision/layout`` with known values.
    """
    parts = key.split("/")
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in PRECISIONS \
            or parts[2] not in LAYOUTS:
        raise ValueError(f"a cell is batch/precision/layout, e.g. 128/bf16/stacked; got {key!r}")
    return Cell(int(parts[0]), parts[1], parts[2])


def grid(batches: Iterable[int], precisions: Iterable[str], layouts: Iterable[str]
         ) -> list[Cell]:
    """Every cell of the product, in the order they run: largest batch first, bf16 first.

    The budget leaves out the last cells, so the ones the targets are about come first.
    """
    ps = [p for p in PRECISION_ORDER if p in set(precisions)]
    ls = [x for x in LAYOUTS if x in set(layouts)]
    return [Cell(b, p, x) for b in sorted(set(batches), reverse=True) for p in ps for x in ls]


def row(cell: Cell, hadpsgd: Mapping[str, Any] | None, plain: Mapping[str, Any] | None,
        status: str = "ok") -> dict[str, Any]:
    """One JSON row: the cell, both measurements, and the ratios (:func:`add_ratios`).

    Args:
        cell: The cell.
        hadpsgd: ``{"frames_per_s", "sec_per_step", "windows", ...}`` of ``hadpsgd.run``, or
            ``None`` where it did not run.
        plain: The same of the plain loop, or ``None``.
        status: ``ok``, ``over budget`` or what failed.
    """
    out = {"key": cell.key, "batch": cell.batch, "precision": cell.precision,
           "autocast": cell.amp if cell.amp != "fp32" else None, "tf32": cell.tf32,
           "layout": cell.layout, "hadpsgd": dict(hadpsgd) if hadpsgd else None,
           "plain": dict(plain) if plain else None, "status": status}
    add_ratios([out])
    return out


def _fps(side: Mapping[str, Any] | None) -> float | None:
    value = (side or {}).get("frames_per_s")
    return float(value) if value else None


def add_ratios(rows: Sequence[dict[str, Any]]) -> None:
    """Fill ``ratio`` (hadpsgd / plain frames/s, same cell, same run) and ``vs_v100``."""
    for r in rows:
        h, p = _fps(r.get("hadpsgd")), _fps(r.get("plain"))
        r["ratio"] = h / p if h and p else None
        r["vs_v100"] = h / V100_FRAMES_PER_S if h else None


def targets(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals against the measured rows at batch :data:`TARGET_BATCH`.

    bf16 frames/s of hadpsgd at least :data:`SPEEDUP_GOAL` x the paper's V100 (one line per
    layout), and hadpsgd at least :data:`RATIO_GOAL` x the plain loop (one line per cell).
    ``met`` is ``None`` where the cell has no figure.
    """
    out = []
    speed_goal = SPEEDUP_GOAL * V100_FRAMES_PER_S
    at = [r for r in rows if r["batch"] == TARGET_BATCH]
    for r in at:
        if r["precision"] == "bf16":
            fps = _fps(r.get("hadpsgd"))
            out.append({"target": f"bf16 frames/s >= {SPEEDUP_GOAL:g} x V100 "
                                  f"({speed_goal:,.0f})", "cell": r["key"], "measured": fps,
                        "goal": speed_goal, "met": None if fps is None else fps >= speed_goal})
    for r in at:
        ratio = r.get("ratio")
        out.append({"target": f"hadpsgd / plain >= {RATIO_GOAL:g}", "cell": r["key"],
                    "measured": ratio, "goal": RATIO_GOAL,
                    "met": None if ratio is None else ratio >= RATIO_GOAL})
    return out


def _n(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)


def _ms(side: Mapping[str, Any] | None) -> str:
    sec = (side or {}).get("sec_per_step")
    return "-" if not sec else f"{sec * 1e3:.1f}"


def table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The Markdown table of the cells."""
    lines = ["| batch | precision | TF32 | LSTM | hadpsgd frames/s | plain frames/s | "
             "hadpsgd/plain | hadpsgd ms/step | plain ms/step | x V100 | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        prec = r["precision"] if r["precision"] != "tf32" else "fp32"
        lines.append(f"| {r['batch']} | {prec} | {'on' if r['tf32'] else 'off'} | "
                     f"{r['layout']} | {_n(_fps(r.get('hadpsgd')))} | "
                     f"{_n(_fps(r.get('plain')))} | {_n(r.get('ratio'), '.2f')} | "
                     f"{_ms(r.get('hadpsgd'))} | {_ms(r.get('plain'))} | "
                     f"{_n(r.get('vs_v100'), '.2f')} | {r['status']} |")
    return lines


def target_table(goals: Sequence[Mapping[str, Any]]) -> list[str]:
    """The Markdown table of :func:`targets`."""
    lines = ["| target | cell | measured | goal | met |", "|---|---|---|---|---|"]
    for g in goals:
        fmt = ",.0f" if g["goal"] > 10 else ".2f"
        met = {True: "yes", False: "**no**", None: "not measured"}[g["met"]]
        lines.append(f"| {g['target']} | {g['cell']} | {_n(g['measured'], fmt)} | "
                     f"{format(g['goal'], fmt)} | {met} |")
    return lines


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """The headline ratio (hadpsgd / plain) by cell key."""
    return {r["key"]: r.get("ratio") for r in rows}


def record(rows: Sequence[dict[str, Any]], meta: Mapping[str, Any],
           extras: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON record (the benchmarks' convention: rows, summary, every ratio same-run)."""
    return {"benchmark": "gpu_grid", **meta, "rows": list(rows), "summary": summarize(rows),
            "targets": targets(rows), **(extras or {})}


# ---------------------------------------------------------------------------- profile
def _union_us(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarise_trace(trace: Mapping[str, Any], top: int = 12) -> dict[str, Any]:
    """Top GPU kernels and GPU busy time of a ``torch.profiler`` chrome trace.

    Args:
        trace: The trace's JSON (``traceEvents``: complete events ``ph == "X"`` with ``cat``
            ``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` on the GPU, and the CPU's
            ``ProfilerStep#N`` annotations around each profiled step).
        top: Kernels to list.

    Returns:
        ``steps``, ``span_ms`` (first step's start to the last GPU or step end),
        ``gpu_busy_ms`` and ``gpu_busy_frac`` (union of kernels and copies over the span:
        below 1 the GPU waited for the host), ``kernel_ms``, ``memcpy_ms`` and ``top``:
        ``[{"name", "calls", "ms", "share"}]`` by total kernel time.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") != "gpu_user_annotation"]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    marks = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in steps] or spans
    begin = min((a for a, _ in marks), default=0.0)
    end = max([b for _, b in marks] + [b for _, b in spans], default=0.0)
    # Busy time inside the span only (work queued before the first profiled step).
    spans = [(max(a, begin), b) for a, b in spans if b > begin]
    by_name: dict[str, list[float]] = {}
    for e in gpu:
        if e.get("cat") == "kernel":
            by_name.setdefault(str(e.get("name")), []).append(float(e["dur"]))
    kernel_us = sum(sum(v) for v in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    busy = _union_us(spans)
    span = max(end - begin, 0.0)
    return {"steps": len(steps), "span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3,
            "gpu_busy_frac": busy / span if span else None, "kernel_ms": kernel_us / 1e3,
            "memcpy_ms": sum(float(e["dur"]) for e in gpu if e.get("cat") == "gpu_memcpy") / 1e3,
            "top": [{"name": name, "calls": len(d), "ms": sum(d) / 1e3,
                     "share": sum(d) / kernel_us if kernel_us else None}
                    for name, d in ranked]}


def profile_lines(title: str, summary: Mapping[str, Any] | None, trace: str) -> list[str]:
    """The report's section for one profile (``None``: it did not run)."""
    if not summary:
        return [f"### {title}", "", "not profiled", ""]
    per_step = summary["span_ms"] / max(summary["steps"], 1)
    lines = [f"### {title}", "", f"Chrome trace: `{trace}` (open in chrome://tracing or "
             f"https://ui.perfetto.dev). {summary['steps']} steps, {per_step:.1f} ms a step; "
             f"GPU busy {_n(summary['gpu_busy_frac'], '.0%')} of the span (kernels "
             f"{summary['kernel_ms']:.1f} ms, copies {summary['memcpy_ms']:.1f} ms).", "",
             "| kernel | calls | ms | share |", "|---|---|---|---|"]
    for k in summary["top"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        lines.append(f"| `{name.replace('|', '/')}` | {k['calls']} | {k['ms']:.2f} | "
                     f"{_n(k['share'], '.0%')} |")
    return [*lines, ""]


# ---------------------------------------------------------------------------- report
def forward_lines(fwd: Mapping[str, Any] | None) -> list[str]:
    """The report's section on ``hadpsgd.forward`` CUDA against CPU."""
    lines = ["## hadpsgd.forward: --device cuda against --device cpu", ""]
    if not fwd:
        return [*lines, "not run", ""]
    if fwd.get("skipped"):
        return [*lines, f"not run: {fwd['skipped']}", ""]
    lines += [f"A `{fwd.get('preset')}` checkpoint of a few steps, its held-out set, "
              f"`--precision {fwd.get('precision')}` on both.", "",
              "| device | exit | wall s (with start-up) | forward s | frames/s |",
              "|---|---|---|---|---|"]
    for dev in ("cuda", "cpu"):
        d = fwd.get(dev)
        if not d:
            continue
        rate = d["frames"] / d["forward_s"] if d.get("frames") and d.get("forward_s") else None
        lines.append(f"| {dev} | {d['exit']} | {d['wall_s']:.1f} | {_n(d.get('forward_s'), '.2f')}"
                     f" | {_n(rate)} |")
    if fwd.get("error"):
        lines += ["", f"**failed**: {fwd['error']}"]
    elif "max_abs_diff" in fwd:
        lines += ["", f"Largest |cuda - cpu| of the log-posteriors: {fwd['max_abs_diff']:.3g} "
                      f"(mean {fwd['mean_abs_diff']:.3g}) over {fwd['frames']:,} frames x "
                      f"{fwd['classes']} classes; the best class agrees on "
                      f"{fwd['argmax_agree']:.2%} of the frames; same utterance offsets: "
                      f"{'yes' if fwd['same_offsets'] else '**no**'}."]
    return [*lines, ""]


def markdown(rec: Mapping[str, Any]) -> str:
    """The whole Markdown report of a :func:`record`."""
    dev, o = rec["device"], rec["options"]
    lines = [f"# hadpsgd GPU grid: `{o['preset']}` on one GPU", "",
             f"- date: {rec['time']}", f"- device: {dev['name']}",
             f"- torch {dev['torch']}, CUDA {dev['cuda']}, cuDNN {dev['cudnn']}; torch's TF32 "
             f"defaults in this process: matmul {dev['tf32_matmul_default']}, cuDNN "
             f"{dev['tf32_cudnn_default']} (each cell sets both)",
             f"- model: `{o['preset']}` BLSTM, {o['classes']:,} classes, chunks of 21 frames, "
             "SGD with momentum 0.9; batch is per step (one rank)",
             f"- hadpsgd: `python -m hadpsgd.run --algo ssgd --device {o['device']}"
             + (f" {o['run_flags']}" if o.get("run_flags") else "") + "` under "
             f"`mpirun -np 1`, {o['steps']} steps on a synthetic set, a `metrics.jsonl` window "
             f"every {o['log_every']} steps: frames/s is the median of the steady windows (the "
             "first, its warm-up, left out)",
             "- plain: the same model, batch, autocast and TF32 in a plain loop "
             "(`torch.optim.SGD`, cross-entropy from fp32 logits, GradScaler for fp16) on random "
             "data already on the device, timed in windows of the same length, the first left "
             "out; hadpsgd/plain is the ratio of the two (same run)",
             f"- total: {rec['total_s']:.0f} s of a {o['budget']:.0f} s budget", "",
             "## Cells", "", *table(rec["rows"]), "", "## Targets", "",
             f"The seed paper's single V100: {V100_FRAMES_PER_S:,.0f} frames/s at batch "
             f"{TARGET_BATCH}.", "", *target_table(rec["targets"]), ""]
    prof = rec.get("profile") or {}
    if prof:
        lines += [f"## Profile of {prof.get('cell')}: two steady steps", ""]
        for side, what in (("hadpsgd", "python -m hadpsgd.run"), ("plain", "plain loop")):
            part = prof.get(side) or {}
            lines += profile_lines(f"{side} ({what})", part.get("summary"),
                                   part.get("trace", "-"))
    lines += forward_lines(rec.get("forward"))
    for name, text in (rec.get("logs") or {}).items():
        lines += [f"## Output of {name} (failed)", "", "```", text, "```", ""]
    return "\n".join(lines)


__all__ = ["BATCHES", "CELL_S", "DEFAULT_BUDGET_S", "DEFAULT_PRECISIONS", "FIXED_S",
           "LAYOUTS", "PRECISIONS", "RATIO_GOAL", "SPEEDUP_GOAL", "V100_FRAMES_PER_S", "Cell",
           "add_ratios", "estimate", "forward_lines", "grid", "markdown", "parse_key",
           "profile_lines", "record", "row", "summarise_trace", "table", "target_table",
           "targets"]
