"""Draw a run's curves into one PNG: loss on top, held-out frame accuracy below, by step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hadpsgd.plot.curves import Curves

EVENT_STYLE = {"resume": ("tab:gray", "--"), "failure": ("tab:red", ":")}
"""Colour and line style of the vertical line that marks each kind of event."""


class PlotUnavailable(ImportError):
    """matplotlib is missing; the message says how to install it."""


class FigureNotWritten(ValueError):
    """The figure's file could not be written (a directory that cannot be made or written)."""


def pyplot() -> Any:
    """The pyplot module of matplotlib on the Agg backend (files only: no display needed).

    Raises:
        PlotUnavailable: If matplotlib is not installed, with the install command.
    """
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("plotting needs matplotlib: pip install 'hadpsgd[plot]'") \
            from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mark_events(ax: Any, curves: Curves, labelled: set[str]) -> None:
    """A vertical line at every resume and failure (each kind in the legend once)."""
    for event in curves.events:
        colour, style = EVENT_STYLE.get(event.kind, ("black", "--"))
        label = None
        if event.kind not in labelled:
            labelled.add(event.kind)
            label = event.kind
        ax.axvline(event.step, color=colour, linestyle=style, linewidth=1.0, label=label)


def _mark_exchanges(ax: Any, curves: Curves) -> None:
    """Ticks along the bottom of ``ax`` where block syncs or gossip rounds happened.

    At the training records by which they did (one legend entry).
    """
    steps = curves.exchange_steps()
    if steps:
        ax.plot(steps, [0.02] * len(steps), linestyle="none", marker="|", markersize=8,
                color="tab:purple", transform=ax.get_xaxis_transform(),
                label=f"{curves.exchange_kind} (by the step)")


def draw(curves: Curves, out: Path, title: str) -> Path:
    """Write the figure of ``curves`` to ``out`` (PNG); returns ``out``.

    Raises:
        PlotUnavailable: Without matplotlib.
        ValueError: If ``out`` is a directory or its suffix names no format matplotlib writes.
        FigureNotWritten: If the file cannot be written, naming it.
    """
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7.0, 6.0))
    try:
        check_out(fig, Path(out))
        steps, values = curves.train_loss
        if steps:
            top.plot(steps, values, color="tab:blue", linewidth=1.0, alpha=0.8,
                     label="training loss")
        steps, values = curves.heldout_loss
        if steps:
            top.plot(steps, values, color="tab:orange", marker="o", markersize=4,
                     label="held-out loss")
        top.set_ylabel("cross-entropy (nats)")
        top.set_title(title, fontsize=10)
        _mark_events(top, curves, set())
        _mark_exchanges(top, curves)
        top.legend(fontsize=8)
        top.grid(alpha=0.3)
        steps, values = curves.heldout_acc
        if steps:
            bottom.plot(steps, values, color="tab:green", marker="o", markersize=4,
                        label="held-out frame accuracy")
        steps, values = curves.speech_acc
        if steps:
            bottom.plot(steps, values, color="tab:olive", marker="s", markersize=3,
                        label="on speech frames")
        _mark_events(bottom, curves, {"resume", "failure"})  # the legend above has them
        bottom.set_xlabel("step")
        bottom.set_ylabel("frame accuracy")
        if curves.heldout_acc[0]:
            bottom.legend(fontsize=8)
        else:
            bottom.text(0.5, 0.5, "no held-out evaluation yet", ha="center", va="center",
                        transform=bottom.transAxes, color="gray")
        bottom.grid(alpha=0.3)
        fig.tight_layout()
        return save(fig, Path(out))
    finally:
        plt.close(fig)


def check_out(fig: Any, out: Path) -> str:
    """The image format ``out`` names; refuses a directory or a suffix of no format.

    Raises:
        ValueError: Naming ``out`` and the fix.
    """
    if out.is_dir():
        raise ValueError(f"{out} is a directory; name the image file to write "
                         f"({out / 'plot.png'})")
    fmt = out.suffix[1:].lower()
    if fmt not in fig.canvas.get_supported_filetypes():
        # matplotlib would add ".png" to a name without a suffix and write another file than
        # the one named (and printed).
        raise ValueError(f"{out}: its suffix names no image format matplotlib writes; name a "
                         ".png file (or .pdf, .svg)")
    return fmt


def save(fig: Any, out: Path) -> Path:
    """Write ``fig`` to ``out`` whole (see :func:`check_out`); returns ``out``.

    Raises:
        ValueError: For a directory or a suffix of no format.
        FigureNotWritten: If the file cannot be written, naming it.
    """
    fmt = check_out(fig, out)
    # Under a temporary name, renamed when complete: a viewer (or a plot made while the run
    # goes on) never finds half a file under the figure's name.
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=110, format=fmt)
        os.replace(tmp, out)
    except OSError as err:
        raise FigureNotWritten(f"cannot write {out} ({err.strerror or err}); choose another "
                               "--out") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out
