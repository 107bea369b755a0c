"""The sweep grid: cells (one training run each), their stable ids and their command lines.

A grid is the product of the values given per option, taken per algorithm: an option that does
not apply to an algorithm (``sync_period`` to ``ssgd``, ``beta1`` to an SGD cell) does not
multiply its cells and stays ``None`` in them. Every cell carries everything that decides its
result, and its id is a readable slug plus a hash of all of it, so the same cell gets the same
id (and the same directory) in every invocation: that is what makes a sweep resumable.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from hadpsgd.exit_codes import EXIT_STOPPED

ADAM_OPTIMIZERS = ("adam", "adamw")
"""Optimizers that have a beta1."""
DEFAULT_OPTIMIZER = {"bmuf": "adam", "ssgd": "sgd", "adpsgd": "sgd"}
"""``--optimizer auto``: the papers' choices (BMUF-Adam; SGD for SSGD and ADPSGD)."""
GRID_OPTIONS = ("sync_period", "adam_moments", "super_learner_size")
"""Algorithm-specific options the grid has axes for (beta1: Adam cells only)."""


def applies_to(option: str) -> tuple[str, ...]:
    """The algorithms that read ``option``, from the registry (each algorithm's ``Options``).

    Imported here, not at the top: the driver stays free of torch until a grid is built.
    """
    from hadpsgd.algorithms import specs

    return tuple(s.name for s in specs() if option in {f.name for f in fields(s.options)})
CONTROLLED_FLAGS = ("--algo", "--epochs", "--batch-size", "--preset", "--optimizer", "--beta1",
                    "--sync-period", "--adam-moments", "--super-learner-size",
                    "--ranks-per-node", "--seed", "--out-dir", "--resume")
"""``hadpsgd.run`` flags the sweep sets itself; they may not appear in the passthrough."""


class GridError(ValueError):
    """A grid that cannot be run; the message names the cell or the option."""


@dataclass(frozen=True)
class Cell:
    """One training run of the sweep; ``None`` marks an option that does not apply."""

    algo: str
    """Algorithm (``--algo``)."""
    global_batch: int
    """Sub-sequences per step over all learners."""
    learners: int
    """MPI ranks."""
    batch_size: int
    """Per-learner batch: ``global_batch / learners``."""
    optimizer: str
    """Local optimizer."""
    epochs: int
    """Epochs to train."""
    preset: str
    """Model preset."""
    beta1: float | None = None
    """Adam beta1 (Adam cells only)."""
    sync_period: int | None = None
    """BMUF tau."""
    adam_moments: str | None = None
    """BMUF moment-buffer strategy."""
    super_learner_size: int | None = None
    """ADPSGD learners per super-learner."""
    ranks_per_node: int | None = None
    """Emulated node size (at most ``learners``)."""
    seed: int | None = None
    """Seed (``None``: hadpsgd.run's default)."""
    extra: tuple[str, ...] = ()
    """Passthrough ``hadpsgd.run`` arguments (common ones, then this algorithm's)."""

    def params(self) -> dict[str, Any]:
        """The cell's parameters as a JSON-ready dict (``extra`` as a list)."""
        d = asdict(self)
        d["extra"] = list(self.extra)
        return d

    @property
    def id(self) -> str:
        """Stable id: readable slug + the first 8 hex digits of a hash of every parameter."""
        digest = hashlib.sha1(json.dumps(self.params(), sort_keys=True).encode()).hexdigest()
        return f"{self.slug}-{digest[:8]}"

    @property
    def slug(self) -> str:
        """The parameters that usually vary, short: ``bmuf-B256-L8-adam-b1_0.5-tau8-corrected``."""
        parts = [self.algo, f"B{self.global_batch}", f"L{self.learners}", self.optimizer]
        if self.beta1 is not None:
            parts.append(f"b1_{self.beta1:g}")
        if self.sync_period is not None:
            parts.append(f"tau{self.sync_period}")
        if self.adam_moments is not None:
            parts.append(self.adam_moments)
        if self.super_learner_size is not None:
            parts.append(f"sl{self.super_learner_size}")
        if self.seed is not None:
            parts.append(f"s{self.seed}")
        return "-".join(parts)

    def run_args(self, out_dir: str, emulate_nodes: bool = True) -> list[str]:
        """Arguments of ``python -m hadpsgd.run`` for this cell.

        Args:
            out_dir: The run's ``--out-dir``.
            emulate_nodes: Pass ``--ranks-per-node`` (local runs). On a cluster the real nodes
                are the super-learners and the launcher places the ranks instead.
        """
        args = ["--algo", self.algo, "--epochs", str(self.epochs), "--batch-size",
                str(self.batch_size), "--preset", self.preset, "--optimizer", self.optimizer]
        for name, value in (("--beta1", self.beta1), ("--sync-period", self.sync_period),
                            ("--adam-moments", self.adam_moments),
                            ("--super-learner-size", self.super_learner_size),
                            ("--seed", self.seed)):
            if value is not None:
                args += [name, f"{value:g}" if isinstance(value, float) else str(value)]
        # ADPSGD's --super-learner-size is its node size: the two flags are one setting, and
        # the command refuses them differing.
        if emulate_nodes and self.ranks_per_node is not None and self.super_learner_size is None:
            args += ["--ranks-per-node", str(self.ranks_per_node)]
        # Logs go to a file: a progress bar would fill it with carriage returns.
        return [*args, "--no-progress", *self.extra, "--out-dir", out_dir]


@dataclass
class GridSpec:
    """What the command line asks for: lists of values per option."""

    algos: list[str]
    global_batches: list[int]
    learners: list[int]
    epochs: int
    preset: str
    optimizers: list[str] = field(default_factory=lambda: ["auto"])
    beta1s: list[float] = field(default_factory=list)
    sync_periods: list[int] = field(default_factory=list)
    adam_moments: list[str] = field(default_factory=list)
    super_learner_sizes: list[int] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    ranks_per_node: int | None = None
    extra: list[str] = field(default_factory=list)
    algo_extra: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (written to the sweep's ``sweep.json``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_passthrough(args: Sequence[str]) -> None:
    """Refuse passthrough arguments that would override what the sweep sets per cell.

    Raises:
        GridError: Naming the flag and the sweep option to use instead.
    """
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in CONTROLLED_FLAGS:
            raise GridError(f"{name} is set by the sweep for every cell; give it as a sweep "
                            f"option (python -m lab.sweep --help), not after --")


def _values(values: list[Any]) -> list[Any]:
    """The values of an option, or ``[None]`` (one cell, option not passed) when none given."""
    return list(dict.fromkeys(values)) or [None]


def unused_options(spec: GridSpec) -> list[str]:
    """Notes for options given on the command line that apply to no cell of the grid."""
    given = {"sync_period": spec.sync_periods, "adam_moments": spec.adam_moments,
             "super_learner_size": spec.super_learner_sizes}
    notes = []
    for option in GRID_OPTIONS:
        algos = applies_to(option)
        if given[option] and not set(algos) & set(spec.algos):
            notes.append(f"--{option.replace('_', '-')} applies to {', '.join(algos)} only, "
                         "which is not in --algos: ignored")
    optimizers = {resolve_optimizer(o, a) for o in spec.optimizers for a in spec.algos}
    if spec.beta1s and not optimizers & set(ADAM_OPTIMIZERS):
        notes.append("--beta1 applies to adam/adamw cells only, and no cell uses them: ignored")
    return notes


def resolve_optimizer(name: str, algo: str) -> str:
    """``auto`` becomes the papers' choice for ``algo``; other names stay."""
    return DEFAULT_OPTIMIZER.get(algo, "sgd") if name == "auto" else name


def expand(spec: GridSpec) -> list[Cell]:
    """Every cell of the grid, in a stable order (algorithm, batch, learners, the rest).

    Raises:
        GridError: If a cell's global batch is not a multiple of its learners, its learners
            do not fill the emulated nodes or super-learners equally, or the passthrough
            overrides a sweep option; the message names the cell.
    """
    check_passthrough(spec.extra)
    for extra in spec.algo_extra.values():
        check_passthrough(extra)
    cells: list[Cell] = []
    for algo in dict.fromkeys(spec.algos):
        extra = (*spec.extra, *spec.algo_extra.get(algo, []))
        taus = _values(spec.sync_periods) if algo in applies_to("sync_period") else [None]
        moments = _values(spec.adam_moments) if algo in applies_to("adam_moments") else [None]
        sls = (_values(spec.super_learner_sizes) if algo in applies_to("super_learner_size")
               else [None])
        for gb, n, opt_name, seed in itertools.product(
                _values(spec.global_batches), _values(spec.learners), _values(spec.optimizers),
                _values(spec.seeds)):
            opt = resolve_optimizer(opt_name, algo)
            beta1s = _values(spec.beta1s) if opt in ADAM_OPTIMIZERS else [None]
            name = f"{algo} global batch {gb} x {n} learners"
            if gb % n:
                raise GridError(f"cell {name}: global batch {gb} is not divisible by {n} "
                                f"learners (the per-learner batch must be whole)")
            rpn = None if spec.ranks_per_node is None else min(spec.ranks_per_node, n)
            if rpn is not None and n % rpn:
                raise GridError(f"cell {name}: {n} learners do not fill emulated nodes of "
                                f"--ranks-per-node {rpn} equally")
            for b1, tau, mom, sl in itertools.product(beta1s, taus, moments, sls):
                if sl is not None and n % sl:
                    raise GridError(f"cell {name}: {n} learners do not split into "
                                    f"super-learners of {sl}")
                cells.append(Cell(algo=algo, global_batch=gb, learners=n, batch_size=gb // n,
                                  optimizer=opt, epochs=spec.epochs, preset=spec.preset,
                                  beta1=b1, sync_period=tau, adam_moments=mom,
                                  super_learner_size=sl, ranks_per_node=rpn, seed=seed,
                                  extra=tuple(extra)))
    ids = [c.id for c in cells]
    if len(set(ids)) != len(ids):  # only possible with repeated values; kept out by _values
        raise GridError("two cells share an id")
    return cells


def shell_line(cmd: Sequence[str]) -> str:
    """A command as one copy-pasteable shell line."""
    return shlex.join(cmd)


def sbatch_script(cell: Cell, cell_dir: str, timeout_s: float, launcher: str = "srun --mpi=pmix",
                  python: str = "python", gpus_per_node: int = 8,
                  options: Sequence[str] = ()) -> str:
    """A Slurm batch script running ``cell`` on a cluster, that survives preemption.

    The ranks of one node form a super-learner, so ``--ntasks-per-node`` is the cell's emulated
    node size when the sweep set one, else ``gpus_per_node`` (at most the learners), with one
    GPU per task (``gpus_per_node`` 0: a CPU cluster, no GPUs asked). Slurm sends SIGUSR1 to
    every rank (not only the batch shell: no ``B:``) 120 s before the time limit or at
    preemption; the ranks checkpoint and exit :data:`~hadpsgd.exit_codes.EXIT_STOPPED` (75),
    and the script requeues the job, which continues with ``--resume auto``. Only a finished
    run leaves ``exit.json`` (exit code, wall seconds) next to its outputs for ``--collect``.

    Args:
        cell: The cell.
        cell_dir: The run's output directory (on a shared file system).
        timeout_s: Slurm time limit.
        launcher: Command that starts the ranks inside the allocation.
        python: Interpreter of the ranks.
        gpus_per_node: Tasks per node when the cell has no emulated node size.
        options: Extra ``#SBATCH`` options, e.g. ``--partition=gpu``, ``--gpus-per-node=8``.
    """
    per_node = cell.ranks_per_node or (min(cell.learners, gpus_per_node) if gpus_per_node
                                       else cell.learners)
    minutes = max(1, int(timeout_s + 59) // 60)
    run = [*shlex.split(launcher), python, "-m", "hadpsgd.run",
           *cell.run_args(cell_dir, emulate_nodes=False), "--resume", "auto"]
    gpus = [f"#SBATCH --gpus-per-node={per_node}"] if gpus_per_node else []
    lines = ["#!/bin/bash", f"#SBATCH --job-name=hadpsgd-{cell.id}",
             f"#SBATCH --ntasks={cell.learners}", f"#SBATCH --ntasks-per-node={per_node}",
             *gpus,
             f"#SBATCH --time={minutes // 60:d}:{minutes % 60:02d}:00",
             f"#SBATCH --output={cell_dir}/run.log",
             "#SBATCH --open-mode=append",
             "#SBATCH --signal=USR1@120",
             "#SBATCH --requeue",
             *(f"#SBATCH {opt}" for opt in options),
             f"# cell {cell.id}: {json.dumps(cell.params(), sort_keys=True)}",
             f"mkdir -p {shlex.quote(cell_dir)}",
             "start=$(date +%s)",
             shell_line(run),
             "rc=$?",
             f"if [ \"$rc\" -eq {EXIT_STOPPED} ]; then  "
             "# stopped on the signal after a checkpoint: go on later",
             "  scontrol requeue \"$SLURM_JOB_ID\"",
             "  exit 0",
             "fi",
             "end=$(date +%s)",
             f"printf '{{\"exit_code\": %d, \"wall_s\": %d}}\\n' \"$rc\" \"$((end - start))\" "
             f"> {shlex.quote(cell_dir + '/exit.json')}",
             "exit $rc", ""]
    return "\n".join(lines)
