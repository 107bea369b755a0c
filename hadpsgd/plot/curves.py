"""A run's curves from its ``metrics.jsonl``: training loss, held-out loss and accuracy.

No plotting here (matplotlib is an extra): :mod:`hadpsgd.plot.draw` draws what this reads.
A resume from the checkpoint of step *s* (a ``resume`` record) or a failure survived from the
control point of step *s* (a ``failure`` record) voids the records of the steps after *s*
written before it: those steps were trained again, and the curves keep the second telling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hadpsgd.train.metrics import read_metrics

METRICS_FILE = "metrics.jsonl"
"""The records of a run, in its run directory (:class:`hadpsgd.train.metrics.MetricsWriter`)."""
EVENT_KINDS = ("resume", "failure")
"""Records that mark a place in the run rather than a measurement."""


@dataclass
class Event:
    """A resume or a survived failure, where it continued from."""

    kind: str
    """``resume`` or ``failure``."""
    step: int
    """The step the run continued from."""
    note: str = ""
    """What the record says besides (the learners left after a failure, or why the run
    stopped there: ``the job ended`` for an API run's failure, ``below --min-learners``)."""


@dataclass
class Curves:
    """What a run's plot draws, each series as (steps, values)."""

    train_loss: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    """The training loss of every training record (every ``--log-every`` steps)."""
    heldout_loss: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    """The held-out loss of every evaluation (step 0: before training)."""
    heldout_acc: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    """The held-out frame accuracy of every evaluation."""
    speech_acc: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    """The frame accuracy on speech frames, where the held-out file names silence classes."""
    internode_bytes: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    """Bytes rank 0 sent to other nodes so far, at every training record that says them."""
    seconds: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    """Seconds since the first record, at every training record (from its ``time``)."""
    events: list[Event] = field(default_factory=list)
    """Resumes and survived failures, in order."""
    exchanges: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    """BMUF's block syncs or ADPSGD's gossip rounds so far, at every training record."""
    exchange_kind: str = ""
    """``block syncs`` or ``gossip rounds`` (empty: the run records neither, as SSGD)."""

    def exchange_steps(self) -> list[int]:
        """The training records' steps by which more exchanges had happened than before.

        A record every ``--log-every`` steps: a mark says "by this step", not the exact
        step. A count that falls (ADPSGD's, from 0 again after a resume) starts over.
        """
        steps, counts = self.exchanges
        out, last = [], 0.0
        for step, count in zip(steps, counts, strict=True):
            if count > last or (count < last and count > 0):
                out.append(step)
            last = count
        return out

    def bytes_at(self, step: int) -> float | None:
        """The bytes sent across nodes by ``step``: the last count at or before it.

        0 at step 0 (before training nothing was sent); None where no count precedes it.
        """
        steps, values = self.internode_bytes
        known = [v for s, v in zip(steps, values, strict=True) if s <= step]
        if known:
            return known[-1]
        return 0.0 if step == 0 else None

    def loss_against_bytes(self) -> tuple[list[float], list[float]]:
        """The held-out losses against the bytes sent across nodes by their step."""
        pairs = [(self.bytes_at(s), v) for s, v in zip(*self.heldout_loss, strict=True)]
        kept = [(b, v) for b, v in pairs if b is not None]
        return [b for b, _ in kept], [v for _, v in kept]

    @property
    def empty(self) -> bool:
        """Whether there is nothing to draw (no training or held-out record)."""
        return not self.train_loss[0] and not self.heldout_loss[0]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _current(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Event]]:
    """The measurement records still valid after every resume and failure, and those events."""
    kept: list[dict[str, Any]] = []
    events: list[Event] = []
    for rec in records:
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        if rec.get("kind") in EVENT_KINDS:
            kept = [r for r in kept if r["step"] <= step]  # trained again after this point
            note = (f"{rec['learners']} learners" if isinstance(rec.get("learners"), int)
                    else "")
            if isinstance(rec.get("stopped"), str):  # a failure that ended the run there
                note = ", ".join(x for x in (note, rec["stopped"]) if x)
            events.append(Event(str(rec["kind"]), step, note))
        else:
            kept.append(rec)
    return kept, events


def curves_of(records: list[dict[str, Any]]) -> Curves:
    """The curves of ``records`` (a ``metrics.jsonl`` read by :func:`read_metrics`)."""
    kept, events = _current(records)
    out = Curves(events=events)
    start = next((r["time"] for r in kept if _number(r.get("time")) is not None), None)
    for rec in kept:
        step = rec["step"]
        pairs = []
        if rec.get("kind") == "train":
            since = (rec["time"] - start if start is not None
                     and _number(rec.get("time")) is not None else None)
            pairs = [(out.train_loss, rec.get("loss")),
                     (out.internode_bytes, rec.get("internode_bytes")),
                     (out.seconds, since)]
            for key, kind in (("block_syncs", "block syncs"), ("gossip_rounds", "gossip rounds")):
                if _number(rec.get(key)) is not None:
                    out.exchange_kind = kind
                    pairs.append((out.exchanges, rec[key]))
        elif rec.get("kind") == "eval":
            pairs = [(out.heldout_loss, rec.get("heldout_loss")),
                     (out.heldout_acc, rec.get("heldout_acc")),
                     (out.speech_acc, rec.get("heldout_speech_acc"))]
        for series, value in pairs:
            number = _number(value)
            if number is not None:
                series[0].append(step)
                series[1].append(number)
    return out


def read_run(run_dir: Path) -> Curves:
    """The curves of the run in ``run_dir``.

    Raises:
        FileNotFoundError: If ``run_dir`` is not a directory or has no ``metrics.jsonl``,
            naming what was expected.
        ValueError: If ``metrics.jsonl`` has a damaged line or is not text (naming it).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory: give a run directory (the "
                                "--out-dir of python -m hadpsgd.run)")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        hint = (" It holds results.jsonl: for a lab.sweep directory use python -m lab.plots."
                if (run_dir / "results.jsonl").is_file() else "")
        raise FileNotFoundError(f"{run_dir} has no {METRICS_FILE}: it is not the --out-dir of "
                                f"a python -m hadpsgd.run, or the run has not started.{hint}")
    try:
        records = read_metrics(path)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}): the "
                         "file is damaged; restore it from the run, or plot another run") \
            from None
    for record in records:
        if not isinstance(record, dict):
            # A record is a JSON object; anything else is damage, not a step to skip.
            raise ValueError(f"{path} holds a line that is not a JSON object "
                             f"({str(record)[:60]!r}): the file is damaged; remove that line")
    return curves_of(records)
