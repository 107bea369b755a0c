"""``python -m hadpsgd.plot RUN_DIR``: a run's training and held-out curves in one PNG.

Read from the run's ``metrics.jsonl`` (:mod:`hadpsgd.plot.curves`), drawn with matplotlib
(the ``plot`` extra, :mod:`hadpsgd.plot.draw`) into ``RUN_DIR/plot.png`` by default.
"""

from __future__ import annotations

import json
from pathlib import Path

from hadpsgd.plot.curves import Curves, curves_of, read_run
from hadpsgd.plot.draw import PlotUnavailable, draw

PLOT_FILE = "plot.png"
"""The default figure's name in the run directory."""


class NothingToPlot(ValueError):
    """The run has no training or held-out record yet; the message names it."""


def title_of(run_dir: Path) -> str:
    """The figure's title: the run directory, and its algorithm and learners where known."""
    run_dir = Path(run_dir)
    try:
        config = json.loads((run_dir / "config.json").read_text())
        what = f"{config['train']['algo']} on {config['world']['size']} learners"
    except (OSError, ValueError, KeyError, TypeError):
        return str(run_dir)
    return f"{run_dir} ({what})"


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw the run in ``run_dir`` into ``out`` (default ``run_dir/plot.png``); returns it.

    Raises:
        FileNotFoundError: ``run_dir`` is no run directory (naming what is missing).
        ValueError: A damaged ``metrics.jsonl`` line.
        NothingToPlot: No training or held-out record yet.
        PlotUnavailable: matplotlib is not installed (with the install command).
    """
    run_dir = Path(run_dir)
    curves = read_run(run_dir)
    if curves.empty:
        raise NothingToPlot(f"{run_dir / 'metrics.jsonl'} has no training or held-out record "
                            "yet: nothing to plot (a run writes one every --log-every steps "
                            "and at every evaluation)")
    return draw(curves, out or run_dir / PLOT_FILE, title_of(run_dir))


__all__ = ["PLOT_FILE", "Curves", "NothingToPlot", "PlotUnavailable", "curves_of", "plot_run",
           "read_run", "title_of"]
