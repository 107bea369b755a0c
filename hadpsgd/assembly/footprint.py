"""What starting and running a rank costs: start-up time by phase and resident memory.

At 64 ranks on one host, start-up time and memory per rank decide whether a run fits at all,
so the main command measures them on every rank and rank 0 prints the slowest rank's
start-up and the largest resident set: ``[hadpsgd] start-up: ...`` after set-up and
``[hadpsgd] peak resident memory ...`` at the end.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field

MIN_EPOCH_STEPS = 10
"""Below this many steps an epoch is too short to mean much: a note says what to change."""


def process_age() -> float:
    """Seconds since this process started (from ``/proc``; 0 where that is unavailable).

    Counted from the ``exec``, so the interpreter's own start and every import are in it.
    """
    try:
        with open("/proc/self/stat") as f:
            # The command name (field 2) may hold spaces: count fields after its ")".
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pss_mb() -> float:
    """This process's proportional set size now, in MiB (NaN where ``/proc`` lacks it).

    The resident set counts every shared library page in every process that maps it (torch's
    ~100 MiB of them, in each of 64 ranks); the proportional set divides shared pages among
    their processes, so the ranks' sum is the memory the job really takes.
    """
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return float("nan")


@dataclass
class StartupClock:
    """Marks of the start-up phases of one rank, from the process's start.

    Attributes:
        marks: ``(phase, seconds since the process started)`` in order.
    """

    marks: list[tuple[str, float]] = field(default_factory=list)
    _t0: float = field(default_factory=time.perf_counter, repr=False)
    _age0: float = field(default_factory=process_age, repr=False)

    def mark(self, phase: str) -> None:
        """``phase`` ended now."""
        self.marks.append((phase, self._age0 + time.perf_counter() - self._t0))

    def phases(self) -> dict[str, float]:
        """Each phase's own seconds (the first counted from the process's start)."""
        out, before = {}, 0.0
        for phase, at in self.marks:
            out[phase] = at - before
            before = at
        return out


def _memory(rss: list[float], pss: list[float]) -> str:
    top = max(range(len(rss)), key=rss.__getitem__)
    text = (f"max {rss[top]:.0f} MiB (rank {top}), mean {sum(rss) / len(rss):.0f} MiB "
            f"resident")
    if pss and all(p == p for p in pss):  # NaN where /proc has no smaps_rollup
        text += (f"; {sum(pss) / 1024:.1f} GiB proportional over {len(pss)} ranks (shared "
                 "libraries counted once)")
    return text


def startup_line(every: list[dict[str, float]], rss: list[float],
                 pss: list[float] | None = None) -> str:
    """The start-up report from every rank's phases and memory (rank order)."""
    total = [sum(p.values()) for p in every]
    slowest = max(range(len(total)), key=total.__getitem__)
    parts = ", ".join(f"{name} {sec:.1f}" for name, sec in every[slowest].items())
    return (f"start-up {total[slowest]:.1f} s on the slowest rank ({slowest}: {parts}); "
            f"memory after start-up: {_memory(rss, pss or [])}")


def peak_line(rss: list[float], pss: list[float] | None = None) -> str:
    """The end-of-run report: every rank's peak resident memory and its memory now."""
    return f"memory per rank at the end: peak {_memory(rss, pss or [])}"


def epoch_note(chunks: int, batch_size: int, world_size: int) -> str | None:
    """A note when an epoch is shorter than :data:`MIN_EPOCH_STEPS` steps, with the fixes."""
    steps = chunks // (batch_size * world_size)
    if steps >= MIN_EPOCH_STEPS:
        return None
    fit = max(1, chunks // (MIN_EPOCH_STEPS * world_size))
    return (f"an epoch is only {steps} step{'s' if steps != 1 else ''} ({chunks:,} training "
            f"chunks / a global batch of {batch_size * world_size:,} = --batch-size "
            f"{batch_size} x {world_size} learners), so held-out figures come after almost no "
            f"training; for {MIN_EPOCH_STEPS} steps or more use --batch-size {fit} or less, "
            "or more training data (--train, or a larger synthetic set: --synthetic-utts)")


__all__ = ["MIN_EPOCH_STEPS", "StartupClock", "epoch_note", "peak_line", "peak_rss_mb",
           "process_age", "pss_mb", "startup_line"]
