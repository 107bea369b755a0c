r"""Markdown tables of the two paper studies from their sweep directories.

Study A (BMUF-Adam, Table 1 of its paper): one row per BMUF cell with its held-out loss and
frame error next to the single-learner Adam baseline's. Study B (h-adpsgd paper, Table 1):
the final held-out loss of SSGD, ADPSGD and H-ADPSGD at each global batch, each marked
against the baseline's loss within a tolerance (2 %), and the largest batch that stays within.

Usage::

    python -m lab.studies.tables a runs/study-a
    python -m lab.studies.tables b runs/study-b --tolerance 0.02 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.sweep.results import STATUS_OK, latest_rows

TOLERANCE = 0.02
"""Study B: a cell 'holds' when its held-out loss is at most (1 + this) x the baseline's."""


class StudyError(ValueError):
    """The sweep directory does not hold what the study needs (named in the message)."""


def _ok(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("status") == STATUS_OK]


def baseline(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The finished single-learner row of a study (its reference; the last one if several).

    Raises:
        StudyError: If there is none.
    """
    base = [r for r in _ok(rows) if r.get("learners") == 1]
    if not base:
        raise StudyError("no finished single-learner (--learners 1) baseline cell in this sweep; "
                         "run the study script's baseline step first")
    return base[-1]


def algo_label(row: dict[str, Any]) -> str:
    """``SSGD``, ``BMUF``, ``ADPSGD`` (flat) or ``H-ADPSGD (S x k)`` for a results row."""
    algo = str(row.get("algo"))
    if row.get("learners") == 1:
        return "baseline (1 learner)"
    if algo == "adpsgd":
        k = row.get("super_learner_size") or 1
        if k > 1:
            return f"H-ADPSGD ({row['learners'] // k} x {k})"
        return f"ADPSGD ({row['learners']} x 1)"
    return algo.upper()


def _rel(value: float | None, ref: float) -> float | None:
    return None if value is None else (value - ref) / ref


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def study_a(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Study A: every BMUF cell against the baseline (loss, frame error, relative change)."""
    base = baseline(rows)
    out = []
    for r in sorted((r for r in rows if r.get("algo") == "bmuf"),
                    key=lambda r: (r.get("learners"), str(r.get("adam_moments")),
                                   -float(r.get("beta1") or 0))):
        loss = r.get("final_heldout_loss") if r.get("status") == STATUS_OK else None
        err = r.get("final_frame_error") if r.get("status") == STATUS_OK else None
        out.append({"id": r["id"], "strategy": r.get("adam_moments"),
                    "workers": r.get("learners"), "beta1": r.get("beta1"),
                    "tau": r.get("sync_period"), "status": r.get("status"),
                    "heldout_loss": loss, "frame_error": err,
                    "loss_vs_baseline": _rel(loss, base["final_heldout_loss"]),
                    "error_vs_baseline": _rel(err, base["final_frame_error"]),
                    "wall_s": r.get("wall_s")})
    return {"study": "a", "baseline": {"id": base["id"], "heldout_loss":
                                       base["final_heldout_loss"],
                                       "frame_error": base["final_frame_error"],
                                       "wall_s": base.get("wall_s")},
            "rows": out}


def study_b(rows: Sequence[dict[str, Any]], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Study B: held-out loss per algorithm and global batch, and the largest batch within."""
    base = baseline(rows)
    ref = base["final_heldout_loss"]
    limit = ref * (1 + tolerance)
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        if r.get("learners") == 1:
            continue
        loss = r.get("final_heldout_loss") if r.get("status") == STATUS_OK else None
        table.setdefault(algo_label(r), {})[int(r["global_batch"])] = {
            "id": r["id"], "status": r.get("status"), "heldout_loss": loss,
            "frame_error": r.get("final_frame_error") if loss is not None else None,
            "holds": loss is not None and loss <= limit, "wall_s": r.get("wall_s")}
    batches = sorted({b for cells in table.values() for b in cells})
    largest = {}
    for label, cells in table.items():
        # The largest batch such that it and every smaller one measured stay within.
        best = None
        for b in sorted(cells):
            if not cells[b]["holds"]:
                break
            best = b
        largest[label] = best
    return {"study": "b", "tolerance": tolerance, "limit": limit, "batches": batches,
            "baseline": {"id": base["id"], "global_batch": base["global_batch"],
                         "heldout_loss": ref, "frame_error": base["final_frame_error"],
                         "wall_s": base.get("wall_s")},
            "table": {k: {str(b): v for b, v in cells.items()} for k, cells in table.items()},
            "largest_within": largest}


def markdown_a(res: dict[str, Any]) -> str:
    """Study A as a Markdown table (the layout of Table 1 of the BMUF-Adam paper)."""
    b = res["baseline"]
    lines = ["| moments | workers | beta1 | held-out loss | frame error | loss vs baseline "
             "| error vs baseline | wall (s) |",
             "|---|---|---|---|---|---|---|---|",
             f"| baseline (1 worker, Adam) | 1 | 0.9 | {b['heldout_loss']:.4f} | "
             f"{b['frame_error']:.4f} | | | {_fmt(b['wall_s'], '.0f')} |"]
    for r in res["rows"]:
        lines.append(
            f"| {r['strategy']} | {r['workers']} | {r['beta1']} | "
            f"{_fmt(r['heldout_loss'], '.4f')} | {_fmt(r['frame_error'], '.4f')} | "
            f"{_fmt(r['loss_vs_baseline'], '+.1%')} | {_fmt(r['error_vs_baseline'], '+.1%')} | "
            f"{_fmt(r['wall_s'], '.0f')} |" + ("" if r["status"] == STATUS_OK
                                                else f" ({r['status']})"))
    return "\n".join(lines)


def markdown_b(res: dict[str, Any]) -> str:
    """Study B as a Markdown table: loss and change vs the baseline per batch (✓ within).

    The last column is the largest batch within the tolerance.
    """
    b = res["baseline"]
    batches = res["batches"]
    head = ("| algorithm | " + " | ".join(f"B={x}" for x in batches)
            + f" | largest batch within {res['tolerance']:.0%} |")
    lines = [head, "|---|" + "---|" * (len(batches) + 1),
             f"| baseline (1 learner, B={b['global_batch']}) | "
             + " | ".join("" for _ in batches) + f" | loss {b['heldout_loss']:.4f} "
             f"(limit {res['limit']:.5f}) |"]
    for label in sorted(res["table"], key=lambda s: (not s.startswith("SSGD"), s)):
        cells = res["table"][label]
        row = []
        for x in batches:
            c = cells.get(str(x))
            if c is None:
                row.append("")
            elif c["heldout_loss"] is None:
                row.append(c["status"])
            else:
                rel = c["heldout_loss"] / b["heldout_loss"] - 1
                row.append(f"{c['heldout_loss']:.4f} ({rel:+.3%}) {'✓' if c['holds'] else '✗'}")
        best = res["largest_within"].get(label)
        lines.append(f"| {label} | " + " | ".join(row) + f" | {best if best else 'none'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: print the study's Markdown table (and optionally write its JSON)."""
    p = argparse.ArgumentParser(prog="python -m lab.studies.tables",
                                description="Markdown tables of study A (BMUF-Adam) or "
                                            "study B (batch-size scaling) from a sweep dir.")
    p.add_argument("study", choices=("a", "b"), help="which study")
    p.add_argument("sweep_dir", type=Path, help="the study's --sweep-dir")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="study b: relative held-out loss margin over the baseline (0.02)")
    p.add_argument("--json", type=Path, default=None, help="also write the result as JSON")
    a = p.parse_args(argv)
    if not (a.sweep_dir / "results.jsonl").is_file():
        p.error(f"{a.sweep_dir}/results.jsonl not found: give the directory the study "
                "script ran its sweeps in")
    rows = list(latest_rows(a.sweep_dir).values())
    try:
        res = study_a(rows) if a.study == "a" else study_b(rows, a.tolerance)
    except StudyError as err:
        print(f"lab.studies.tables: {a.sweep_dir}: {err}", file=sys.stderr)
        return 2
    print(markdown_a(res) if a.study == "a" else markdown_b(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
