"""Throughput window, progress bar and the training log line of one epoch."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hadpsgd import env
from hadpsgd.algorithms import Algorithm
from hadpsgd.train.console import reaches_terminal
from hadpsgd.train.metrics import MetricsWriter

LINE_EVERY_S = 10.0
"""The shortest interval between two plain log lines."""


def on_terminal() -> bool:
    """Whether the run's console is a terminal (a progress bar) or a file (plain lines).

    ``HADPSGD_STDOUT_TTY`` decides where the launcher set it (Open MPI gives every rank a pty,
    so a rank's own stdout says "terminal" even under ``> log``); else both stdout and stderr
    must reach a terminal: the process's own, or under a plain ``mpirun`` the launcher's
    (:func:`hadpsgd.train.console.reaches_terminal`).
    """
    told = env.stdout_tty()
    return reaches_terminal() if told is None else told


def byte_text(n: float) -> str:
    """``n`` bytes for a log line, in the unit that keeps them readable.

    ``812 B``, ``4.4 kB``, ``671 kB``, ``164.0 MiB``, ``2.31 GiB``: a sign run's kilobytes
    are not "0.0 MiB".
    """
    if n < 1000:
        return f"{n:.0f} B"
    if n < 2**20:
        return f"{n / 1000:.3g} kB"
    if n < 2**30:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class ByteCount:
    """Bytes across nodes: payloads sent and received, and control (both ways together)."""

    sent: int
    received: int
    control: int = 0
    """What decides who exchanges what with whom: ADPSGD's pairing board and data pool."""

    @staticmethod
    def total(counts: list[ByteCount]) -> ByteCount:
        """Every rank's together."""
        return ByteCount(sum(c.sent for c in counts), sum(c.received for c in counts),
                         sum(c.control for c in counts))

    def record(self, prefix: str) -> dict[str, int]:
        """The figures for a metrics record, keys prefixed."""
        return {f"{prefix}internode_bytes": self.sent,
                f"{prefix}internode_bytes_received": self.received,
                f"{prefix}control_bytes": self.control}


def internode_line(algo: Algorithm, steps: int, frames: int, mine: ByteCount | None = None,
                   everyone: ByteCount | None = None) -> str:
    """The run's inter-node traffic as this rank counts it, per trained frame and against SSGD.

    Args:
        algo: The algorithm (:meth:`~hadpsgd.algorithms.Algorithm.internode_bytes`).
        steps: Steps taken (the reference: SSGD in fp32 for as many steps).
        frames: Frames this rank trained in them (positions of its batches).
        mine: This rank's count (default: the algorithm's payloads, no control).
        everyone: Every rank's together, said after this rank's where given.
    """
    mine = mine or ByteCount(*algo.internode_bytes())
    sent, received = mine.sent, mine.received
    ssgd = algo.ssgd_fp32_bytes(steps)
    control = f" (and {byte_text(mine.control)} of control)" if mine.control else ""
    head = (f"inter-node bytes of this rank after {steps} steps: {byte_text(sent)} sent, "
            f"{byte_text(received)} received{control}")
    if ssgd == 0:  # one node: SSGD would send nothing between nodes either
        return head + " (one node: nothing crosses nodes)"
    per = max(frames, 1)
    ratio = f"{ssgd / sent:.1f}x fewer" if sent else "none"
    line = (f"{head}; per trained frame {sent / per:.3g} sent, {received / per:.3g} received; "
            f"SSGD in fp32 would have sent {ssgd / per:.3g} a frame: {ratio}")
    if everyone is not None:
        line += (f"; all ranks: {byte_text(everyone.sent)} sent, "
                 f"{byte_text(everyone.received)} received, {byte_text(everyone.control)} of "
                 f"control (pairing, data pool)")
    if algo.startup_bytes:
        line += (f"; apart from these, at start rank 0's model to the other nodes: "
                 f"{byte_text(algo.startup_bytes)}")
    return line


class Progress:
    """Counts steps since the last log line and writes it (frames/s, loss, algorithm figures).

    Args:
        algo: The algorithm (its :meth:`metrics` go into the log line).
        metrics: The metrics writer.
        frames_per_step: Frames of one global step (for frames/s).
        total: Steps in the epoch; ``initial`` of them already done.
        initial: Steps of the epoch already taken (after a resume).
        desc: Progress-bar label.
        bar: Whether to show a tqdm bar (rank 0, on a terminal, with --progress).
        lines: Whether to print plain log lines where there is no bar (rank 0): a batch log
            gets one line per log step, at most one per ``LINE_EVERY_S`` seconds, instead of
            a bar's carriage-return updates.
    """

    def __init__(self, algo: Algorithm, metrics: MetricsWriter, frames_per_step: int,
                 total: int, initial: int, desc: str, bar: bool, lines: bool = False) -> None:
        self.algo = algo
        self.total = total
        self.lines = lines and not bar
        self._last_line = float("-inf")
        self._done = initial
        self.metrics = metrics
        self.frames_per_step = frames_per_step
        self._bar: Any = None
        if bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step",
                             dynamic_ncols=True, mininterval=1.0)
        self._tic, self._window = time.perf_counter(), 0

    def step(self) -> None:
        """One more step taken."""
        self._window += 1
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)

    def log(self, step: int, epoch: int, lr: float, mean_loss: float) -> None:
        """Write the training line for the steps since the last one, and restart the window."""
        elapsed = time.perf_counter() - self._tic
        fps = self._window * self.frames_per_step / max(elapsed, 1e-9)
        extra = self.algo.metrics()
        if self.algo.skipped_steps:
            extra["skipped_steps"] = float(self.algo.skipped_steps)
        self.metrics.write("train", step, epoch=epoch, lr=lr, loss=mean_loss,
                           frames_per_s=round(fps, 1), **extra)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{mean_loss:.3f}", fps=f"{fps:.0f}")
        now = time.perf_counter()
        if self.lines and now - self._last_line >= LINE_EVERY_S:
            self._last_line = now
            # Bytes on the wire (BMUF's block syncs, ADPSGD's gossip): what --wire saves.
            wire = (f", {byte_text(extra['wire_bytes'])} sent across nodes"
                    if extra.get("wire_bytes") else "")
            # Gradient bytes (what --grad-wire bf16 halves) and fp16's scale and overflows.
            if extra.get("grad_wire_bytes"):
                wire += f", {byte_text(extra['grad_wire_bytes'])} of gradients sent"
            if "loss_scale" in extra:
                wire += (f", loss scale {extra['loss_scale']:g} "
                         f"({extra['overflow_steps']:.0f} overflow steps skipped)")
            print(f"[hadpsgd] epoch {epoch} step {step} ({self._done}/{self.total} of the "
                  f"epoch): loss {mean_loss:.4f}, lr {lr:.3g}, {fps:.0f} frames/s{wire}",
                  flush=True)
        self._tic, self._window = now, 0

    def close(self) -> None:
        """Close the bar."""
        if self._bar is not None:
            self._bar.close()
