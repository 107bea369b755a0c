"""Start-up and memory reports of the main command, and the note on too-short epochs."""

from __future__ import annotations

import time

from hadpsgd.assembly.footprint import (
    MIN_EPOCH_STEPS,
    StartupClock,
    epoch_note,
    peak_line,
    peak_rss_mb,
    process_age,
    pss_mb,
    startup_line,
)

# This module was imported by this process: the process is at least this old.
_IMPORTED_AT = time.monotonic()


def test_the_64_rank_epoch_of_the_default_set_is_named_with_its_fix() -> None:
    # The case: 4,028 chunks, 32 per learner, 64 learners: one step an epoch.
    note = epoch_note(4028, 32, 64)
    assert note is not None and "only 1 step " in note and "2,048" in note
    fit = int(note.split("--batch-size ")[2].split()[0])
    assert 4028 // (fit * 64) >= MIN_EPOCH_STEPS and 4028 // ((fit + 1) * 64) < MIN_EPOCH_STEPS
    assert "--synthetic-utts" in note
    assert epoch_note(4028, 32, 2) is None  # 62 steps


def test_clock_phases_add_up_to_the_process_age() -> None:
    clock = StartupClock()
    clock.mark("first")
    time.sleep(0.05)
    clock.mark("second")
    phases = clock.phases()
    assert list(phases) == ["first", "second"] and phases["second"] >= 0.05
    assert abs(sum(phases.values()) - clock.marks[-1][1]) < 1e-9
    # The process's age is bounded by independent clocks, not by a constant: at least the time
    # since this module was imported and the clock's last mark, at most the machine's uptime
    # (a pytest run of over an hour once failed a fixed "< 3600").
    # Read before the age: a pause of this process between the two (a loaded machine)
    # must not put the lower bound above the age read after it.
    since_import = time.monotonic() - _IMPORTED_AT
    age = process_age()
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    assert since_import <= age + 0.05 and clock.marks[-1][1] <= age + 0.05
    assert age <= uptime + 0.05
    assert peak_rss_mb() > 10 and 0 < pss_mb() <= peak_rss_mb()


def test_reports_name_the_slowest_rank_and_the_largest_memory() -> None:
    every = [{"imports": 1.0, "mpi": 0.5}, {"imports": 2.0, "mpi": 1.0}]
    line = startup_line(every, [200.0, 300.0], [100.0, 156.0])
    assert line.startswith("start-up 3.0 s on the slowest rank (1: imports 2.0, mpi 1.0)")
    assert "max 300 MiB (rank 1), mean 250 MiB resident; 0.2 GiB proportional" in line
    assert "max 300 MiB (rank 1)" in peak_line([200.0, 300.0])
    assert "proportional" not in peak_line([200.0, 300.0], [float("nan"), 1.0])
