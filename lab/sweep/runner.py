"""Running the cells of a sweep: locally under mpirun, as Slurm scripts, or collected after.

Each cell is one ``hadpsgd.run`` job with its own ``--out-dir`` (:func:`cell_dir`); its results
row (:mod:`lab.sweep.results`) is built from what the run left there.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common.launch import bench_env
from hadpsgd.launch import Launcher, mpirun_command
from hadpsgd.launch.mpirun import LAUNCH_TRIES, launcher_failed_to_start
from lab.sweep.grid import Cell, sbatch_script, shell_line
from lab.sweep.results import (
    append_row,
    build_row,
    finished_ids,
    format_row,
    latest_rows,
)

KILL_GRACE_S = 30.0
"""After SIGTERM at the time limit, seconds before SIGKILL (hadpsgd.run checkpoints on TERM)."""


def cell_dir(sweep_dir: Path, cell: Cell) -> Path:
    """The cell's ``--out-dir``."""
    return Path(sweep_dir) / "cells" / cell.id


def local_command(cell: Cell, sweep_dir: Path, launcher: Launcher) -> list[str]:
    """The ``mpirun ... python -m hadpsgd.run ...`` command of a cell on this machine."""
    return mpirun_command(cell.learners, cell.run_args(str(cell_dir(sweep_dir, cell))),
                          launcher=launcher, module="hadpsgd.run")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End the run's process group (mpirun and its ranks): TERM, then KILL after a grace."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _launch(cmd: list[str], env: dict[str, str], log: Path,
            timeout: float) -> tuple[int | None, bool]:
    """Run a cell's command once, its output to ``log``; ``(exit code, timed out)``."""
    timed_out = False
    with log.open("wb") as fh:
        # Its own session, so a time limit or Ctrl-C ends mpirun and every rank it started.
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
            code = proc.poll()
        except KeyboardInterrupt:
            _stop(proc)
            raise
    return code, timed_out


def _tail(log: Path, size: int = 8192) -> str:
    """The last ``size`` bytes of a log as text (where mpirun's own errors are)."""
    with log.open("rb") as fh:
        fh.seek(max(0, log.stat().st_size - size))
        return fh.read().decode(errors="replace")


def run_cell(cell: Cell, sweep_dir: Path, launcher: Launcher, timeout: float) -> dict[str, Any]:
    """Run one cell to completion, failure or its time limit; return its results row."""
    out = cell_dir(sweep_dir, cell)
    if out.exists():
        # Left by a failed or interrupted attempt: metrics.jsonl is appended to, so a fresh
        # run needs a fresh directory. The last attempt is kept beside it for inspection.
        prev = out.with_name(out.name + ".prev")
        shutil.rmtree(prev, ignore_errors=True)
        out.rename(prev)
    out.mkdir(parents=True)
    cmd = local_command(cell, sweep_dir, launcher)
    (out / "cell.json").write_text(json.dumps({"id": cell.id, "params": cell.params(),
                                               "command": cmd}, indent=1) + "\n")
    env = bench_env(cell.learners)
    log = out / "run.log"
    tic = time.perf_counter()
    for _ in range(LAUNCH_TRIES):
        code, timed_out = _launch(cmd, env, log, timeout)
        # Open MPI's launcher now and then fails before any rank exists: nothing of the cell
        # ran, so it is started again rather than recorded as a failed configuration.
        if code == 0 or timed_out or not launcher_failed_to_start(_tail(log)):
            break
    wall = time.perf_counter() - tic
    return build_row(cell.id, cell.params(), out, code, round(wall, 2), timed_out,
                     shell_line(cmd), log)


def collect(cells: Sequence[Cell], sweep_dir: Path) -> tuple[int, int]:
    """Record cells that finished as sbatch jobs (their ``exit.json``); ``(recorded, pending)``."""
    done = finished_ids(sweep_dir)
    recorded = pending = 0
    for cell in cells:
        out = cell_dir(sweep_dir, cell)
        if cell.id in done:
            continue
        status = out / "exit.json"
        if not status.is_file():
            pending += 1
            continue
        info = json.loads(status.read_text())
        known = latest_rows(sweep_dir).get(cell.id)
        if known and known.get("exit_json_mtime") == status.stat().st_mtime:
            continue  # this attempt is already recorded (as failed)
        row = build_row(cell.id, cell.params(), out, info.get("exit_code"), info.get("wall_s"),
                        log=out / "run.log")
        row["exit_json_mtime"] = status.stat().st_mtime
        append_row(sweep_dir, row)
        print(format_row(row))
        recorded += 1
    return recorded, pending


def write_sbatch(a: argparse.Namespace, cells: Sequence[Cell], sweep_dir: Path) -> int:
    """Write a script per cell not yet finished and print how to submit them; the count."""
    directory = sweep_dir / "sbatch" if a.sbatch is True else Path(a.sbatch)
    directory.mkdir(parents=True, exist_ok=True)
    done = finished_ids(sweep_dir)
    count = 0
    for cell in cells:
        if cell.id in done:
            print(f"# {cell.id}: finished, no script")
            continue
        out = cell_dir(sweep_dir, cell).resolve()
        out.mkdir(parents=True, exist_ok=True)  # Slurm opens --output before the script runs
        script = directory / f"{cell.id}.sbatch"
        script.write_text(sbatch_script(cell, str(out), a.timeout, a.sbatch_launcher,
                                        a.sbatch_python, a.gpus_per_node, a.sbatch_opt))
        print(f"sbatch {shlex.quote(str(script))}")
        count += 1
    print(f"# {count} script(s) in {directory}; when the jobs are done: the same command with "
          "--collect instead of --sbatch, then python -m lab.plots "
          f"{shlex.quote(str(sweep_dir))}")
    return count


