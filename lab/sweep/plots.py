"""Plots of a sweep's results (``python -m lab.plots <sweep-dir>``), PNG via matplotlib Agg.

From ``<sweep-dir>/results.jsonl`` (the last row of every cell; only finished cells are drawn,
the others are listed):

- ``loss_vs_epoch.png``: held-out loss against epoch, one line per global batch size, one panel
  per algorithm (the layout of Fig. 2 of the h-adpsgd paper);
- ``error_vs_batch.png``: final held-out frame error (1 - frame accuracy) against the global
  batch, one line per algorithm;
- ``scaling.png``: training frames/s and scaling efficiency against learners at a fixed
  per-learner batch, with the ideal (linear) line from each group's smallest learner count.

When other options vary too (beta1, tau, ...), each of their combinations gets its own line,
labelled with the values that differ. Empty plots say so instead of failing. Only the cells of
the grid last run in the directory (``sweep.json``) are drawn, unless ``--all``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._common.launch import emit
from lab.sweep.results import STATUS_OK, latest_rows

VARIANT_KEYS = ("learners", "optimizer", "beta1", "sync_period", "adam_moments",
                "super_learner_size", "ranks_per_node", "seed", "epochs", "preset", "extra")
"""Cell parameters besides the algorithm and the global batch that can tell lines apart (the
per-learner batch follows from the global batch and the learners)."""
LINESTYLES = ("-", "--", ":", "-.")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise SystemExit("lab.plots needs matplotlib: pip install 'hadpsgd[plot]'") \
            from err
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def varying(rows: Sequence[dict[str, Any]], keys: Iterable[str]) -> list[str]:
    """The keys among ``keys`` whose value differs between ``rows``."""
    return [k for k in keys if len({repr(r.get(k)) for r in rows}) > 1]


def extra_options(text: Any) -> dict[str, str]:
    """``{'--lr': '0.1', '--nesterov': ''}`` from a row's passthrough arguments (``extra``)."""
    words = shlex.split(text) if isinstance(text, str) else list(text or [])
    out: dict[str, str] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") \
                else ""
            out[word] = value
    return out


def label(row: dict[str, Any], keys: Sequence[str],
          rows: Sequence[dict[str, Any]] = ()) -> str:
    """``k=v, ...`` of ``keys`` in ``row`` (empty when no key varies).

    The passthrough arguments (``extra``) are shown only by the options whose values differ
    among ``rows``: the data paths and the other shared flags would drown the legend.
    """
    parts = []
    for k in keys:
        if k != "extra":
            parts.append(f"{k}={row.get(k)}")
            continue
        opts = [extra_options(r.get("extra")) for r in rows] or [{}]
        mine = extra_options(row.get("extra"))
        differ = [o for o in dict.fromkeys(o for d in opts + [mine] for o in d)
                  if len({d.get(o) for d in opts + [mine]}) > 1]
        for o in differ:
            name = o.lstrip("-")
            parts.append(f"no {name}" if o not in mine else f"{name}={mine[o]}" if mine[o]
                         else name)
    return ", ".join(parts)


def _groups(rows: Iterable[dict[str, Any]], keys: Sequence[str]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(repr(r.get(k)) for k in keys), []).append(r)
    return out


def _epochs(row: dict[str, Any]) -> list[int]:
    """1-based epoch of each point of a row's held-out loss curve."""
    return [e + 1 for e in row.get("eval_epochs") or range(len(row["heldout_loss_curve"]))]


def _nan(values: Iterable[Any]) -> list[float]:
    """Values with ``None`` (a non-finite figure in the results) as NaN, which is not drawn."""
    return [float("nan") if v is None else float(v) for v in values]


def _legend(ax: Any) -> None:
    """A legend below the axes: with many lines it would hide the curves inside them."""
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2,
              frameon=False)


def _empty(ax: Any, text: str = "no finished cells") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def _algos(rows: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["algo"] for r in rows))


def plot_loss_curves(plt: Any, rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Held-out loss vs epoch; a panel per algorithm, a colour per global batch.

    Single-learner cells are the studies' baselines: when other cells exist they are drawn in
    black in every panel (as in Fig. 2 of the h-adpsgd paper) instead of a panel of their own.
    """
    baselines = [r for r in rows if r.get("learners") == 1 and r.get("heldout_loss_curve")]
    if baselines and len(baselines) < len(rows):
        rows = [r for r in rows if r.get("learners") != 1]
    else:
        baselines = []
    algos = _algos(rows) or ["(none)"]
    fig, axes = plt.subplots(1, len(algos), figsize=(4.5 * len(algos), 3.8), squeeze=False,
                             sharey=True)
    batches = sorted({r["global_batch"] for r in rows})
    cmap = plt.get_cmap("viridis")
    for ax, algo in zip(axes[0], algos, strict=True):
        mine = [r for r in rows if r["algo"] == algo and r.get("heldout_loss_curve")]
        keys = varying(mine, VARIANT_KEYS)
        variants = list(_groups(mine, keys))
        for r in sorted(mine, key=lambda r: r["global_batch"]):
            color = cmap(batches.index(r["global_batch"]) / max(len(batches) - 1, 1))
            style = LINESTYLES[variants.index(tuple(repr(r.get(k)) for k in keys)) %
                               len(LINESTYLES)]
            text = f"B={r['global_batch']}" + (f" ({label(r, keys, mine)})" if keys else "")
            ax.plot(_epochs(r), _nan(r["heldout_loss_curve"]), style, marker="o", ms=3, color=color,
                    label=text)
        for n, r in enumerate(baselines):
            ax.plot(_epochs(r), _nan(r["heldout_loss_curve"]), LINESTYLES[n % len(LINESTYLES)],
                    color="black", marker="s", ms=3,
                    label=f"baseline: 1 learner, B={r['global_batch']} ({r['algo']}"
                          + (f", {r['optimizer']}" if r.get("optimizer") else "") + ")")
        ax.set_title(algo)
        ax.set_xlabel("epoch")
        ax.xaxis.get_major_locator().set_params(integer=True)
        if mine:
            _legend(ax)
        else:
            _empty(ax)
    axes[0][0].set_ylabel("held-out loss")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_error_vs_batch(plt: Any, rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Final held-out frame error vs global batch; a line per algorithm (and variant)."""
    fig, ax = plt.subplots(figsize=(5.5, 4))
    drawn = False
    for algo in _algos(rows):
        mine = [r for r in rows if r["algo"] == algo and r.get("final_frame_error") is not None]
        keys = varying(mine, VARIANT_KEYS)
        for n, group in enumerate(_groups(mine, keys).values()):
            group.sort(key=lambda r: (r["global_batch"], r["learners"]))
            text = algo + (f" ({label(group[0], keys, mine)})" if keys else "")
            ax.plot([r["global_batch"] for r in group], _nan(r["final_frame_error"] for r in group),
                    LINESTYLES[n % len(LINESTYLES)], marker="o", label=text)
            drawn = True
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch (sub-sequences)")
    ax.set_ylabel("final held-out frame error (1 - accuracy)")
    _finish(plt, fig, [ax], drawn, path)


def _finish(plt: Any, fig: Any, axes: list[Any], drawn: bool, path: Path) -> None:
    """Legend (or an "empty" note) on every axis, then save and close the figure."""
    for ax in axes:
        if drawn:
            _legend(ax)
        else:
            _empty(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def scaling_groups(rows: Sequence[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Weak-scaling groups: same algorithm, per-learner batch and other options, by learners.

    Returns:
        ``(label, rows sorted by learners)`` per group with a measured frames/s.
    """
    out = []
    for algo in _algos(rows):
        mine = [r for r in rows if r["algo"] == algo and r.get("mean_frames_per_s")]
        # Weak scaling: the per-learner batch stays, the learners (and node sizes) vary.
        keys = [k for k in varying(mine, ("batch_size", *VARIANT_KEYS))
                if k not in ("learners", "ranks_per_node")]
        for group in _groups(mine, keys).values():
            group.sort(key=lambda r: r["learners"])
            out.append((algo + (f" ({label(group[0], keys, mine)})" if keys else ""), group))
    return out


def plot_scaling(plt: Any, rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Frames/s and scaling efficiency vs learners, with the ideal line per group."""
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(10, 4))
    groups = scaling_groups(rows)
    for n, (text, group) in enumerate(groups):
        color = f"C{n % 10}"
        p = [r["learners"] for r in group]
        fps = [r["mean_frames_per_s"] for r in group]
        ideal = [fps[0] * x / p[0] for x in p]
        ax_t.plot(p, fps, "-o", color=color, label=text)
        ax_t.plot(p, ideal, ":", color=color, alpha=0.7)
        ax_e.plot(p, [f / i for f, i in zip(fps, ideal, strict=True)], "-o", color=color,
                  label=text)
    ax_e.axhline(1.0, color="black", ls=":", label="ideal")
    for ax, ylabel in ((ax_t, "training frames/s (dotted: ideal)"),
                       (ax_e, "scaling efficiency")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("learners")
        ax.set_ylabel(ylabel)
    _finish(plt, fig, [ax_t, ax_e], bool(groups), path)


def current_cells(sweep_dir: Path) -> set[str] | None:
    """The cell ids of the grid last run in ``sweep_dir`` (its ``sweep.json``), if known."""
    path = Path(sweep_dir) / "sweep.json"
    try:
        return set(json.loads(path.read_text())["cells"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def make_plots(sweep_dir: Path, out_dir: Path | None = None,
               every_row: bool = False) -> dict[str, Any]:
    """Write the three PNGs of ``sweep_dir``; a record of what was drawn and left out.

    Args:
        sweep_dir: The sweep directory.
        out_dir: Where the PNGs go (default ``<sweep_dir>/plots``).
        every_row: Draw every cell of ``results.jsonl``, not only those of the grid last run
            in the directory (a grid run with other options leaves its rows there too).
    """
    plt = _pyplot()
    rows = list(latest_rows(sweep_dir).values())
    keep = None if every_row else current_cells(sweep_dir)
    if keep is not None:
        rows = [r for r in rows if r["id"] in keep]
    done = [r for r in rows if r.get("status") == STATUS_OK]
    out_dir = out_dir or Path(sweep_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"loss_vs_epoch": out_dir / "loss_vs_epoch.png",
             "error_vs_batch": out_dir / "error_vs_batch.png",
             "scaling": out_dir / "scaling.png"}
    plot_loss_curves(plt, done, paths["loss_vs_epoch"])
    plot_error_vs_batch(plt, done, paths["error_vs_batch"])
    plot_scaling(plt, done, paths["scaling"])
    return {"benchmark": "plots", "sweep_dir": str(sweep_dir), "cells": len(rows),
            "drawn": len(done), "left_out": {r["id"]: r.get("status") for r in rows
                                             if r.get("status") != STATUS_OK},
            "plots": {k: str(v) for k, v in paths.items()}}


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is one run's directory (``metrics.jsonl``) rather than a sweep's."""
    return (path / "metrics.jsonl").is_file() and not (path / "results.jsonl").is_file()


def _plot_run(run_dir: Path, out: Path | None) -> int:
    """Draw one run's directory with ``hadpsgd.plot`` (into ``out/plot.png`` if given)."""
    from hadpsgd.plot.__main__ import main as plot_main

    print(f"lab.plots: note: {run_dir} is a run directory (metrics.jsonl, no results.jsonl), "
          "not a sweep's: drawn by python -m hadpsgd.plot", file=sys.stderr)
    return plot_main([str(run_dir)] + (["--out", str(out / "plot.png")] if out else []))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: write the plots and print where."""
    p = argparse.ArgumentParser(prog="python -m lab.plots",
                                description="PNG plots of a lab.sweep directory.")
    p.add_argument("sweep_dir", type=Path, help="the sweep's --sweep-dir")
    p.add_argument("--out", type=Path, default=None, help="directory (default <sweep>/plots)")
    p.add_argument("--all", dest="every_row", action="store_true",
                   help="draw every cell in results.jsonl, not only the grid last run there")
    a = p.parse_args(argv)
    if not a.sweep_dir.is_dir():
        p.error(f"{a.sweep_dir} is not a directory (give a lab.sweep --sweep-dir)")
    if is_run_dir(a.sweep_dir):
        return _plot_run(a.sweep_dir, a.out)
    if not (a.sweep_dir / "results.jsonl").is_file():
        print(f"lab.plots: note: {a.sweep_dir}/results.jsonl not found; the plots "
              "will be empty", file=sys.stderr)
    record = make_plots(a.sweep_dir, a.out, a.every_row)
    for cell, status in record["left_out"].items():
        print(f"# left out {cell}: {status}")
    for path in record["plots"].values():
        print(f"# wrote {path}")
    emit(record, None)
    return 0
