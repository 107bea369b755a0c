"""Several runs in one PNG: what a slow-link user compares.

Three panels, one colour per run: the held-out loss (and, faint, the training loss) by step,
with each run's resumes and survived failures marked; the held-out loss against the bytes
rank 0 sent to other nodes by then (BMUF's block syncs, ADPSGD's gossip and SSGD's gradients
alike, ``internode_bytes``); and those bytes against wall-clock time.
"""

from __future__ import annotations

from pathlib import Path

from hadpsgd.plot.curves import Curves
from hadpsgd.plot.draw import EVENT_STYLE, pyplot, save


def draw_runs(runs: list[tuple[str, Curves]], out: Path, title: str) -> Path:
    """Write the comparison of ``runs`` (label, curves) to ``out``; returns ``out``.

    Raises:
        PlotUnavailable: Without matplotlib.
        ValueError: If ``out`` is a directory or names no image format.
        FigureNotWritten: If the file cannot be written, naming it.
    """
    plt = pyplot()
    fig, (by_step, by_bytes, by_time) = plt.subplots(3, 1, figsize=(7.5, 10.0))
    try:
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        counted = False
        for i, (label, curves) in enumerate(runs):
            colour = colours[i % len(colours)]
            steps, values = curves.train_loss
            if steps:
                by_step.plot(steps, values, color=colour, linewidth=0.8, alpha=0.35)
            steps, values = curves.heldout_loss
            if steps:
                by_step.plot(steps, values, color=colour, marker="o", markersize=3,
                             label=label)
            for event in curves.events:
                style = EVENT_STYLE.get(event.kind, ("black", "--"))[1]
                by_step.axvline(event.step, color=colour, linestyle=style, linewidth=0.8)
            sent, losses = curves.loss_against_bytes()
            if sent:
                counted = True
                by_bytes.plot([b / 2**20 for b in sent], losses, color=colour, marker="o",
                              markersize=3, label=label)
            steps, values = curves.internode_bytes
            _, seconds = curves.seconds
            if steps and len(seconds) == len(steps):
                by_time.plot(seconds, [b / 2**20 for b in values], color=colour, label=label)
        by_step.set_xlabel("step (faint: training loss; dashed: resume, dotted: failure)")
        by_step.set_ylabel("held-out loss")
        by_step.set_title(title, fontsize=10)
        by_bytes.set_xlabel("MiB sent to other nodes by rank 0 (internode_bytes)")
        by_bytes.set_ylabel("held-out loss")
        if counted and any(b > 0 for _, c in runs for b in c.internode_bytes[1]):
            by_bytes.set_xscale("symlog", linthresh=0.01)  # 8x to 1,000x apart
            by_time.set_yscale("symlog", linthresh=0.01)
        by_time.set_xlabel("seconds since the run's first record")
        by_time.set_ylabel("MiB sent to other nodes")
        for ax in (by_step, by_bytes, by_time):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        if not counted:
            by_bytes.text(0.5, 0.5, "no run counted its bytes between nodes", ha="center",
                          va="center", transform=by_bytes.transAxes, color="gray")
        fig.tight_layout()
        return save(fig, Path(out))
    finally:
        plt.close(fig)


__all__ = ["draw_runs"]
