"""``python -m hadpsgd.plot RUN_DIR [RUN_DIR ...]``: a run's curves, or several runs compared.

Read from each run's ``metrics.jsonl`` (:mod:`hadpsgd.plot.curves`), drawn with matplotlib
(the ``plot`` extra): one run into ``RUN_DIR/plot.png`` by default (:mod:`hadpsgd.plot.draw`);
several into ``compare.png`` (:mod:`hadpsgd.plot.compare`: held-out loss by step, against the
bytes sent between nodes, and those bytes against time).
"""

from __future__ import annotations

import json
from pathlib import Path

from hadpsgd.plot.compare import draw_runs
from hadpsgd.plot.curves import Curves, curves_of, read_run
from hadpsgd.plot.draw import PlotUnavailable, draw

PLOT_FILE = "plot.png"
"""The default figure's name in the run directory."""
COMPARE_FILE = "compare.png"
"""The default name of several runs' figure (in the current directory)."""


class NothingToPlot(ValueError):
    """The run has no training or held-out record yet; the message names it."""


def what_ran(run_dir: Path) -> str | None:
    """``<algo> on <N> learners`` from the run's ``config.json``, or None where unknown."""
    try:
        config = json.loads((Path(run_dir) / "config.json").read_text())
        return f"{config['train']['algo']} on {config['world']['size']} learners"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def title_of(run_dir: Path) -> str:
    """The figure's title: the run directory, and its algorithm and learners where known."""
    what = what_ran(run_dir)
    return str(run_dir) if what is None else f"{run_dir} ({what})"


def plot_runs(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Draw several runs into one figure (default ``./compare.png``); returns its path.

    Each run is labelled by its directory's name and what ran (``bmuf on 4 learners``).

    Raises:
        FileNotFoundError, ValueError, NothingToPlot, PlotUnavailable: As :func:`plot_run`,
            naming the run.
    """
    runs = []
    for run_dir in map(Path, run_dirs):
        curves = read_run(run_dir)
        if curves.empty:
            raise NothingToPlot(f"{run_dir / 'metrics.jsonl'} has no training or held-out "
                                "record yet: leave it out, or wait for its first record")
        what = what_ran(run_dir)
        runs.append((run_dir.name if what is None else f"{run_dir.name} ({what})", curves))
    return draw_runs(runs, Path(out or COMPARE_FILE), f"{len(runs)} runs")


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


__all__ = ["COMPARE_FILE", "PLOT_FILE", "Curves", "NothingToPlot", "PlotUnavailable", "curves_of",
           "plot_run", "plot_runs", "read_run", "title_of", "what_ran"]
