"""The sweep's results table: one row per cell in ``results.jsonl`` (and ``results.csv``).

``results.jsonl`` is append-only: a cell run again (after a failure) appends a new row, and
the last row of an id is the one that counts. A row holds the cell's parameters, its exit
status, and what its ``metrics.jsonl`` says: the held-out loss and frame accuracy after every
epoch (the curve) and at the end, and the mean training frames/s.

A run's outcome is read from its exit code (:mod:`hadpsgd.exit_codes`), never from its log.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hadpsgd.exit_codes import EXIT_DIVERGED, EXIT_OK, describe

RESULTS_JSONL = "results.jsonl"
RESULTS_CSV = "results.csv"
STATUS_OK = "ok"
"""Exit code 0 and at least one evaluation: the cell is finished and is skipped on a rerun."""
STATUS_DIVERGED = "diverged"
"""The run stopped itself because it diverged (exit code :data:`~hadpsgd.exit_codes.EXIT_DIVERGED`:
more than ``--max-nonfinite`` non-finite steps, or a finite loss past ``--max-loss-ratio``
times its start): a result (the paper tables' 'not converged'), not a failure, so a rerun
skips it too."""
FINISHED = (STATUS_OK, STATUS_DIVERGED)
"""Statuses a rerun of the sweep skips."""

CSV_COLUMNS = (
    "id", "status", "exit_code", "algo", "global_batch", "learners", "batch_size",
    "optimizer", "beta1", "sync_period", "adam_moments", "super_learner_size",
    "ranks_per_node", "seed", "epochs", "preset", "final_heldout_loss", "final_heldout_acc",
    "final_frame_error", "heldout_loss_curve", "heldout_acc_curve", "eval_epochs",
    "mean_frames_per_s", "steps", "wall_s", "timed_out", "log", "out_dir", "extra", "command",
    "error",
)
"""Columns of ``results.csv``, in order (lists are written as JSON)."""


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON objects of a JSONL file; a torn last line (a run killed mid-write) is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def summarize_metrics(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Curves and final figures from the records of one run's ``metrics.jsonl``.

    Evaluations are taken in the order written, one per epoch (the last record of an epoch
    wins: a run stopped by ``--max-steps`` inside an epoch evaluates that partial epoch once);
    the one before training (step 0) is no epoch's and is left out.
    ``mean_frames_per_s`` is the mean over the training records of their windowed frames/s.
    """
    evals: dict[int, dict[str, Any]] = {}
    for rec in records:
        if rec.get("kind") == "eval" and rec.get("step") != 0:
            evals[int(rec.get("epoch", len(evals)))] = rec
    ordered = [evals[e] for e in sorted(evals)]
    losses = [_finite(r.get("heldout_loss")) for r in ordered]
    accs = [_finite(r.get("heldout_acc")) for r in ordered]
    fps = [v for v in (_finite(r.get("frames_per_s")) for r in records
                       if r.get("kind") == "train") if v is not None]
    steps = [int(r["step"]) for r in records if isinstance(r.get("step"), int)]
    final_acc = accs[-1] if accs else None
    return {
        "eval_epochs": sorted(evals),
        "heldout_loss_curve": losses,
        "heldout_acc_curve": accs,
        "final_heldout_loss": losses[-1] if losses else None,
        "final_heldout_acc": final_acc,
        "final_frame_error": None if final_acc is None else 1.0 - final_acc,
        "mean_frames_per_s": sum(fps) / len(fps) if fps else None,
        "steps": max(steps) if steps else None,
    }


def build_row(cell_id: str, params: dict[str, Any], out_dir: Path, exit_code: int | None,
              wall_s: float | None, timed_out: bool = False, command: str = "",
              log: Path | None = None) -> dict[str, Any]:
    """The results row of a cell that has run (finished, failed or timed out).

    Args:
        cell_id: The cell's id.
        params: The cell's parameters (:meth:`Cell.params`).
        out_dir: The run's ``--out-dir`` (its ``metrics.jsonl`` is read when present).
        exit_code: The launcher's exit code (``None`` if unknown): the status follows it
            (:mod:`hadpsgd.exit_codes`), whatever the log says.
        wall_s: Seconds from launch to exit.
        timed_out: The sweep killed the run at its time limit.
        command: The command line, for the record.
        log: The run's combined stdout/stderr.
    """
    metrics = summarize_metrics(read_jsonl(out_dir / "metrics.jsonl"))
    error = None
    if timed_out:
        status = "timeout"
        error = "killed at the sweep's --timeout"
    elif exit_code == EXIT_DIVERGED:
        status = STATUS_DIVERGED
        error = "diverged: non-finite steps past --max-nonfinite or loss past --max-loss-ratio"
        error += f"; see {log}" if log else ""
    elif exit_code != EXIT_OK:
        status = "failed"
        error = "exit code unknown" if exit_code is None else \
            f"exit code {exit_code} ({describe(exit_code)})"
        error += f"; see {log}" if log else ""
    elif metrics["final_heldout_loss"] is None:
        status = "failed"
        error = "exit code 0 but no held-out evaluation in metrics.jsonl"
    else:
        status = STATUS_OK
    extra = params.get("extra", [])
    return {"id": cell_id, "status": status, "exit_code": exit_code, "timed_out": timed_out,
            "error": error, **{k: v for k, v in params.items() if k != "extra"},
            "extra": " ".join(extra) if isinstance(extra, list) else extra, **metrics,
            "wall_s": wall_s, "log": str(log) if log else None, "out_dir": str(out_dir),
            "command": command}


def latest_rows(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """The last row of every cell id in the sweep's ``results.jsonl``, in first-seen order."""
    rows: dict[str, dict[str, Any]] = {}
    for row in read_jsonl(Path(sweep_dir) / RESULTS_JSONL):
        if "id" in row:
            rows[row["id"]] = row
    return rows


def finished_ids(sweep_dir: Path) -> set[str]:
    """Ids whose last row is finished (``ok`` or ``diverged``): a rerun skips them."""
    return {i for i, row in latest_rows(sweep_dir).items() if row.get("status") in FINISHED}


def append_row(sweep_dir: Path, row: dict[str, Any]) -> None:
    """Append ``row`` to ``results.jsonl`` (flushed at once) and rewrite ``results.csv``."""
    path = Path(sweep_dir) / RESULTS_JSONL
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
    write_csv(Path(sweep_dir) / RESULTS_CSV, latest_rows(sweep_dir).values())


def write_csv(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Write ``rows`` as CSV with :data:`CSV_COLUMNS` (lists as JSON, missing as empty)."""
    with path.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            writer.writerow(["" if row.get(c) is None else
                             json.dumps(row[c]) if isinstance(row.get(c), list) else row[c]
                             for c in CSV_COLUMNS])


def format_row(row: dict[str, Any]) -> str:
    """One line of the sweep's progress table."""
    def num(key: str, fmt: str) -> str:
        v = row.get(key)
        return "-" if v is None else format(v, fmt)

    return (f"{row['id']:<56} {row['status']:<8} {num('exit_code', 'd'):>4} "
            f"{num('final_heldout_loss', '.4f'):>9} {num('final_heldout_acc', '.4f'):>8} "
            f"{num('mean_frames_per_s', '.0f'):>9} {num('wall_s', '.1f'):>8} "
            f"{num('wer', '.2f'):>6}")


TABLE_HEADER = (f"#{'cell':<55} {'status':<8} {'exit':>4} {'loss':>9} {'acc':>8} "
                f"{'frames/s':>9} {'wall_s':>8} {'WER':>6}")
"""Header of the progress table."""
