"""Steady training speed from a run's ``metrics.jsonl``: the median of its steady windows.

``hadpsgd.run`` writes a ``train`` record every ``--log-every`` steps
(:class:`hadpsgd.train.progress.Progress`) with the frames/s of the steps since the last one
(a *window*). The first window of a run, of a resumed run and of every epoch starts when its
reporter is made and so holds the start-up of that segment: CUDA context and cuDNN's first
calls, the loader's first batches, the allocator's growth. On one H100 that window read
3,334 frames/s where the same run's steps took 9.2k frames/s. So the speed of a run is the
median of the other windows (a window that holds an evaluation or a checkpoint is one
outlier the median ignores), and a run with no other window has no steady speed.

Pure functions on the records (no torch): used by ``scripts/gpu_check.py`` and
:mod:`benchmarks.training.gpu_grid`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Steady:
    """The steady speed of one run.

    Attributes:
        frames_per_s: Median frames/s of the steady windows; ``None`` without one.
        sec_per_step: Median seconds per step of the same windows (from the records' clock
            times and steps); ``None`` without one.
        windows: Steady windows the medians are of.
        warmup: Windows left out as the first of a segment (start, resume, epoch).
    """

    frames_per_s: float | None
    sec_per_step: float | None
    windows: int
    warmup: int

    def describe(self) -> str:
        """``9,212 frames/s (median of 4 steady windows)``, or why there is no figure."""
        if self.frames_per_s is None:
            return f"no steady window ({self.warmup} warm-up window(s) only)"
        return f"{self.frames_per_s:,.0f} frames/s (median of {self.windows} steady windows)"


def steady_records(records: Iterable[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]],
                                                                    int]:
    """The ``train`` records that are not the first window of a segment.

    A segment starts at the top of the file, after a ``resume`` record, after an ``eval``
    record (the end of an epoch), where the epoch changes and where the step goes back (a
    new run appended to the same file).

    Args:
        records: The records of one ``metrics.jsonl``, in file order.

    Returns:
        The steady ``train`` records (each with a ``window_s`` key added: seconds since the
        previous ``train`` record of its segment, for :func:`steady`) and how many were left
        out as warm-up windows.
    """
    out: list[Mapping[str, Any]] = []
    warmup = 0
    prev: Mapping[str, Any] | None = None  # the last train record of the current segment
    for rec in records:
        kind = rec.get("kind")
        if kind in ("resume", "eval"):
            prev = None
            continue
        if kind != "train":
            continue
        new_segment = (prev is None or rec.get("epoch") != prev.get("epoch")
                       or rec.get("step", 0) <= prev.get("step", 0))
        if new_segment:
            warmup += 1
        else:
            assert prev is not None
            window = float(rec.get("time", 0.0)) - float(prev.get("time", 0.0))
            out.append({**rec, "window_s": window,
                        "window_steps": int(rec["step"]) - int(prev["step"])})
        prev = rec
    return out, warmup


def steady(records: Iterable[Mapping[str, Any]]) -> Steady:
    """The steady speed of a run from its records (see :func:`steady_records`)."""
    kept, warmup = steady_records(records)
    fps = [float(r["frames_per_s"]) for r in kept if r.get("frames_per_s") is not None]
    secs = [r["window_s"] / r["window_steps"] for r in kept
            if r["window_steps"] > 0 and r["window_s"] > 0]
    return Steady(frames_per_s=statistics.median(fps) if fps else None,
                  sec_per_step=statistics.median(secs) if secs else None,
                  windows=len(fps), warmup=warmup)


def read_steady(path: Path) -> Steady | None:
    """:func:`steady` of the ``metrics.jsonl`` at ``path``; ``None`` where there is none.

    Lines that are no JSON record are passed over: a run cut at a time limit may leave its
    last record half-written.
    """
    if not path.exists():
        return None
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # blank, or the half-written last record of a run killed mid-write
    return steady(records)


__all__ = ["Steady", "read_steady", "steady", "steady_records"]
