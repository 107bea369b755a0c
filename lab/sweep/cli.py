r"""Hyper-parameter sweeps of real training runs: algorithm x global batch x learners x options.

Every cell of the grid is one ``hadpsgd.run`` job on local MPI ranks (``--ranks-per-node``
emulates nodes), with its own ``--out-dir`` under the sweep directory::

    <sweep-dir>/sweep.json              the grid asked for last, and its cell ids
    <sweep-dir>/results.jsonl, .csv     one row per cell run: parameters, status, losses, ...
    <sweep-dir>/cells/<cell-id>/        the run: run.log, metrics.jsonl, config.json, checkpoints

Rerunning the same command resumes: cells whose row says ``ok`` are skipped, failed or timed
out ones run again (``--no-rerun-failed`` keeps them). ``--print-commands`` prints the cells as
``mpirun`` lines, ``--sbatch`` writes a Slurm script per cell instead of running, and
``--collect`` turns the outputs of those cluster jobs into result rows.

Usage::

    python -m lab.sweep --sweep-dir runs/sweep1 --algos ssgd,adpsgd,bmuf \
        --global-batch 64,256 --learners 4,8 --sync-period 8 --beta1 0.9,0.5 \
        --super-learner-size 1,2 --epochs 4 --preset tiny --ranks-per-node 4 -- --lr 0.1
    python -m lab.plots runs/sweep1
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._common.launch import emit
from hadpsgd.launch import Launcher, find_launcher
from lab.sweep.grid import (
    DEFAULT_OPTIMIZER,
    Cell,
    GridError,
    GridSpec,
    expand,
    shell_line,
    unused_options,
)
from lab.sweep.results import (
    FINISHED,
    STATUS_DIVERGED,
    TABLE_HEADER,
    append_row,
    finished_ids,
    format_row,
    latest_rows,
)
from lab.sweep.runner import cell_dir, collect, local_command, run_cell, write_sbatch
from lab.sweep.score import score_row

# cell_dir is the runner's, named here too: where a cell of this sweep writes its run.
__all__ = ["MOMENT_STRATEGIES", "OPTIMIZERS", "build_parser", "cell_dir", "main", "parse",
           "run_all"]

OPTIMIZERS = ("auto", "sgd", "adam", "adamw")
MOMENT_STRATEGIES = ("corrected", "average", "local", "reset")


def _list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    return parse


def _algo_args(text: str) -> tuple[str, list[str]]:
    algo, sep, args = text.partition("=")
    if not sep or not algo:
        raise argparse.ArgumentTypeError(f"{text!r}: write ALGO='ARGS', e.g. bmuf='--lr 0.002'")
    return algo.strip(), shlex.split(args)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m lab.sweep`` (hadpsgd.run arguments after ``--``)."""
    p = argparse.ArgumentParser(
        prog="python -m lab.sweep",
        description="Grid of hadpsgd.run training runs on local MPI ranks, resumable, with a "
                    "results table. Arguments after -- go to every run. Comma lists: each "
                    "value is a grid axis; options an algorithm does not read do not multiply "
                    "its cells.")
    p.add_argument("--sweep-dir", type=Path, required=True,
                   help="directory of the sweep (results, one subdirectory per cell)")
    g = p.add_argument_group("grid")
    g.add_argument("--algos", type=_list(str), required=True, help="e.g. ssgd,adpsgd,bmuf")
    g.add_argument("--global-batch", type=_list(int), required=True,
                   help="global batches (sub-sequences per step over all learners)")
    g.add_argument("--learners", type=_list(int), required=True, help="MPI ranks per run")
    g.add_argument("--optimizer", type=_list(str), default=["auto"],
                   help="sgd, adam, adamw or auto (adam for bmuf, sgd for ssgd/adpsgd; default)")
    g.add_argument("--beta1", type=_list(float), default=[], help="Adam beta1 (Adam cells)")
    g.add_argument("--sync-period", type=_list(int), default=[], help="BMUF tau (bmuf cells)")
    g.add_argument("--adam-moments", type=_list(str), default=[],
                   help="corrected, average, local, reset (bmuf cells)")
    g.add_argument("--super-learner-size", type=_list(int), default=[],
                   help="learners per super-learner (adpsgd cells; 1 = flat ADPSGD)")
    g.add_argument("--seed", type=_list(int), default=[], help="seeds (default: run's default)")
    g.add_argument("--epochs", type=int, default=4, help="epochs per run (default 4)")
    g.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="emulated node size (capped at the cell's learners)")
    g.add_argument("--algo-args", type=_algo_args, action="append", default=[],
                   metavar="ALGO='ARGS'",
                   help="extra hadpsgd.run arguments for one algorithm, e.g. bmuf='--lr 0.002'")
    g = p.add_argument_group("running")
    g.add_argument("--timeout", type=float, default=7200.0,
                   help="seconds per cell before it is killed and recorded as timeout (7200)")
    g.add_argument("--no-rerun-failed", dest="rerun_failed", action="store_false",
                   help="also skip cells whose last row is failed or timeout")
    g.add_argument("--print-commands", "--dry-run", dest="print_commands", action="store_true",
                   help="print every cell as an mpirun command line; run nothing")
    g.add_argument("--json", type=Path, default=None, help="also write the summary record here")
    g.add_argument("--wer", action="store_true",
                   help="score every finished cell's word error rate on its --heldout set "
                        "(hadpsgd.forward with the --train set's priors, then hadpsgd.decode: "
                        "lab/sweep/score.py); finished cells not yet scored are scored")
    g = p.add_argument_group("cluster (Slurm)")
    g.add_argument("--sbatch", nargs="?", type=Path, const=True, default=None, metavar="DIR",
                   help="write one sbatch script per pending cell (to DIR, default "
                        "<sweep-dir>/sbatch) and print the sbatch lines; run nothing")
    g.add_argument("--sbatch-opt", action="append", default=[], metavar="OPT",
                   help="extra #SBATCH option, e.g. --sbatch-opt=--gpus-per-node=8")
    g.add_argument("--sbatch-launcher", default="srun --mpi=pmix",
                   help="rank launcher inside the job (default 'srun --mpi=pmix')")
    g.add_argument("--sbatch-python", default="python", help="interpreter of the ranks")
    g.add_argument("--gpus-per-node", type=int, default=8,
                   help="tasks (one GPU each) per node when --ranks-per-node is not given; "
                        "0 for a CPU cluster (default 8)")
    g.add_argument("--collect", action="store_true",
                   help="record the cells that sbatch jobs finished (their exit.json); run "
                        "nothing")
    return p


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, GridSpec]:
    """Parse the sweep's options and the passthrough; exits 2 on a bad grid."""
    argv = list(argv)
    rest: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, rest = argv[:split], argv[split + 1:]
    p = build_parser()
    a = p.parse_args(argv)
    algo_extra: dict[str, list[str]] = {}
    for algo, args in a.algo_args:
        algo_extra.setdefault(algo, []).extend(args)
    spec = GridSpec(algos=a.algos, global_batches=a.global_batch, learners=a.learners,
                    epochs=a.epochs, preset=a.preset, optimizers=a.optimizer,
                    beta1s=a.beta1, sync_periods=a.sync_period, adam_moments=a.adam_moments,
                    super_learner_sizes=a.super_learner_size, seeds=a.seed,
                    ranks_per_node=a.ranks_per_node, extra=rest, algo_extra=algo_extra)
    # Absolute, so the printed and sbatch commands work from any directory.
    a.sweep_dir = a.sweep_dir.absolute()
    problem = _check_values(a)
    if problem:
        p.error(problem)
    unknown = set(algo_extra) - set(a.algos)
    if unknown:
        p.error(f"--algo-args names {', '.join(sorted(unknown))}, not in --algos")
    return a, spec


def _check_values(a: argparse.Namespace) -> str | None:
    """What is wrong with the option values, before any cell is built (``None``: nothing)."""
    if a.timeout <= 0:
        return f"--timeout must be > 0, got {a.timeout}"
    for flag, values in (("--global-batch", a.global_batch), ("--learners", a.learners),
                         ("--sync-period", a.sync_period),
                         ("--super-learner-size", a.super_learner_size),
                         ("--epochs", [a.epochs])):
        if any(v < 1 for v in values):
            return f"{flag} values must be >= 1, got {values}"
    if not (a.algos and a.global_batch and a.learners):
        return "--algos, --global-batch and --learners need at least one value each"
    bad = [o for o in a.optimizer if o not in OPTIMIZERS]
    if bad:
        return f"--optimizer {','.join(bad)}: choose from {', '.join(OPTIMIZERS)}"
    bad = [m for m in a.adam_moments if m not in MOMENT_STRATEGIES]
    if bad:
        return f"--adam-moments {','.join(bad)}: choose from {', '.join(MOMENT_STRATEGIES)}"
    if any(not 0 <= b < 1 for b in a.beta1):
        return f"--beta1 values must be in [0, 1), got {a.beta1}"
    unknown = [x for x in a.algos if x not in DEFAULT_OPTIMIZER]
    if unknown:
        from hadpsgd import algorithms  # slow (torch): only for names this module does not know

        unknown = [x for x in unknown if x not in algorithms.names()]
        if unknown:
            return (f"--algos {','.join(unknown)}: unknown; registered: "
                    f"{', '.join(algorithms.names())}")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; 0 when every cell finished (or nothing was to run), 1 if any failed."""
    a, spec = parse(sys.argv[1:] if argv is None else argv)
    try:
        cells = expand(spec)
    except GridError as err:
        print(f"lab.sweep: error: {err}", file=sys.stderr)
        return 2
    for note in unused_options(spec):
        print(f"# note: {note}", file=sys.stderr)
    sweep_dir: Path = a.sweep_dir
    if a.print_commands:
        launcher = find_launcher()
        print(f"# {len(cells)} cells; environment: OMPI_ALLOW_RUN_AS_ROOT=1 "
              "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc=^ucx (as python -m hadpsgd.launch)")
        done = finished_ids(sweep_dir)
        for cell in cells:
            print(f"# {cell.id}" + (" (finished)" if cell.id in done else ""))
            print(shell_line(local_command(cell, sweep_dir, launcher)))
        return 0
    if a.sbatch is not None:
        write_sbatch(a, cells, sweep_dir)
        return 0
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "sweep.json").write_text(json.dumps(
        {"argv": sys.argv if argv is None else list(argv), "spec": spec.as_dict(),
         "cells": [c.id for c in cells]}, indent=1) + "\n")
    if a.collect:
        recorded, pending = collect(cells, sweep_dir)
        print(f"# recorded {recorded} cell(s); {pending} without exit.json yet")
        return 0
    return run_all(a, cells, sweep_dir)


def run_all(a: argparse.Namespace, cells: Sequence[Cell], sweep_dir: Path) -> int:
    """Run every pending cell in order; print the table and the summary record."""
    rows = latest_rows(sweep_dir)
    skip = {i for i, r in rows.items() if r.get("status") in FINISHED or not a.rerun_failed}
    launcher: Launcher | None = None
    counts = {"ran": 0, "skipped": 0, "ok": 0, STATUS_DIVERGED: 0, "failed": 0}
    print(f"# sweep {sweep_dir}: {len(cells)} cells, timeout {a.timeout:g} s per cell")
    print(TABLE_HEADER, flush=True)
    tic = time.perf_counter()
    for cell in cells:
        if cell.id in skip and a.wer and rows[cell.id].get("status") == "ok" \
                and "wer" not in rows[cell.id]:
            row = score_row(rows[cell.id], cell.extra)  # trained before --wer: score it now
            append_row(sweep_dir, row)
            print(format_row(row), flush=True)
            continue
        if cell.id in skip:
            counts["skipped"] += 1
            print(f"# {cell.id}: skipped ({rows[cell.id].get('status')} in results.jsonl)",
                  flush=True)
            continue
        launcher = launcher or find_launcher()
        try:
            row = run_cell(cell, sweep_dir, launcher, a.timeout)
        except KeyboardInterrupt:
            print(f"# interrupted in {cell.id}: not recorded; rerun to resume", flush=True)
            return 130
        if a.wer:
            row = score_row(row, cell.extra)
        append_row(sweep_dir, row)
        counts["ran"] += 1
        counts[row["status"] if row["status"] in FINISHED else "failed"] += 1
        print(format_row(row), flush=True)
    final = latest_rows(sweep_dir)
    summary = {"benchmark": "sweep", "sweep_dir": str(sweep_dir), "cells": len(cells),
               **counts, "finished": sum(final.get(c.id, {}).get("status") in FINISHED
                                         for c in cells),
               "results": str(sweep_dir / "results.jsonl"),
               "seconds": round(time.perf_counter() - tic, 1)}
    emit(summary, a.json)
    return 1 if counts["failed"] else 0
