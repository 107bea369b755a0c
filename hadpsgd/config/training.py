"""The loop's section of a run's configuration, and the three it owns no more.

``TrainConfig`` held 23 options of four owners; each owner now has its section, as
torchtitan's job config keeps one per component: the loop (``train``), checkpoints and
resumes (``checkpoint``: :mod:`hadpsgd.train.checkpoint`, :mod:`hadpsgd.assembly.resume`),
what a failure does (``failure``: :mod:`hadpsgd.train.control`,
:mod:`hadpsgd.assembly.elastic`) and the arithmetic (``precision``: :mod:`hadpsgd.precision`).
Each option keeps its one flag; a ``config.json`` written before the split holds the last
three sections' options in ``train`` and is read as before (:data:`FORMER_SECTION`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hadpsgd import algorithms
from hadpsgd.cli import ConfigError, check_finite
from hadpsgd.config.sections import check_paths, check_positive
from hadpsgd.precision import PRECISIONS

__all__ = ["ELASTIC_ALGOS", "FORMER_SECTION", "CheckpointConfig", "FailureConfig",
           "PrecisionConfig", "TrainConfig"]

ELASTIC_ALGOS = ("ssgd", "bmuf", "adpsgd")
"""The algorithms that continue among the survivors of a failure (--on-failure continue)."""


def _algo_names() -> list[str]:
    return algorithms.names()


@dataclass
class TrainConfig:
    """Training loop and its outputs."""

    algo: str = field(default="ssgd", metadata={"choices": _algo_names})
    """Distributed algorithm (from the registry)."""
    epochs: int = 4
    """Passes over the training data."""
    batch_size: int = 32
    """Sub-sequences per learner per step (the global batch is this times the ranks)."""
    seed: int = 0
    """Seed of the model initialisation and the data order."""
    max_steps: int = 0
    """Stop after this many steps in total (0: run all epochs)."""
    log_every: int = 10
    """Write a training-metrics line every this many steps."""
    out_dir: str | None = None
    """Directory for config.json, metrics.jsonl and checkpoints (default: runs/<algo>-<time>)."""
    tensorboard: bool = False
    """Also write TensorBoard event files (needs pip install 'hadpsgd[tb]')."""
    progress: bool = True
    """Show a progress bar (rank 0 only)."""
    cuda_graph: bool = False
    """On a GPU, capture the model's forward and backward in CUDA graphs at the first training
    step (torch.cuda.make_graphed_callables) and replay them every step after: one launch
    instead of ~1,300 kernels a step, where the host launching them is the bound (swb at
    batch 128). The loss, the gradients' reduction and the optimizer stay eager; evaluation
    and a batch of another shape run the model as it is. On one H200, swb bf16 at batch
    128: 382k frames/s, 3.1x without it (docs/gpu.md)."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.algo not in _algo_names():
            raise ConfigError(
                f"--algo {self.algo!r} is unknown; registered algorithms: "
                f"{', '.join(_algo_names())}"
            )
        check_positive(self, "epochs", "batch_size", "log_every")
        check_positive(self, "max_steps", "seed", allow_zero=True)  # numpy seeds are >= 0
        check_paths(self, "out_dir")


@dataclass
class CheckpointConfig:
    """Checkpoints: how often, how many are kept, and how a start continues a run."""

    checkpoint_every: int = 0
    """Also checkpoint every this many steps (0: only at the end of each epoch and of the run)."""
    resume: str | None = None
    """Checkpoint directory to resume from, or 'auto' for the newest complete, valid one in
    --out-dir (corrupted or incomplete ones are reported and skipped)."""
    overwrite: bool = False
    """Start afresh in an --out-dir that already holds a run, deleting its config.json,
    metrics.jsonl, train.log, checkpoints/ and tb/ first (without it such a start is refused:
    continue the run with --resume auto, or choose another --out-dir)."""
    allow_resume_change: str | None = field(default=None, metadata={"const": "all"})
    """A resume runs the run's own configuration: a flag given on it that differs from the
    run's is refused, except --epochs, --max-steps, --log-every, --progress, --tensorboard,
    --checkpoint-every, --keep-checkpoints, --keep-best, --num-workers and --max-nonfinite.
    This lets the flags it names (comma-separated, e.g. lr,batch-size; np for another number
    of ranks), or all of them (the flag alone), differ. Another -np, --algo, --optimizer or
    --batch-size carries over the deployable model (and optimizer state if the optimizer
    matches) and the epoch position; the algorithm's own state starts afresh, so the result
    is not exact."""
    keep_checkpoints: int = 3
    """Keep only the newest this many checkpoints in --out-dir (0 keeps all)."""
    keep_best: int = 1
    """Besides the newest --keep-checkpoints, never delete this many checkpoints with the
    lowest held-out loss (those written after an evaluation: each epoch's end and the run's);
    checkpoints/best.json lists every scored checkpoint, best first (0: only the newest)."""

    def __post_init__(self) -> None:
        check_finite(self)
        check_positive(self, "checkpoint_every", "keep_checkpoints", "keep_best",
                       allow_zero=True)
        check_paths(self, "resume")
        if isinstance(self.allow_resume_change, bool):  # a config.json of an older version
            self.allow_resume_change = "all" if self.allow_resume_change else None
        if self.overwrite and self.resume is not None:
            raise ConfigError("--overwrite deletes the run in --out-dir and --resume continues "
                              "it: pass one of them")


@dataclass
class FailureConfig:
    """Failures: a dead learner, non-finite steps, divergence, and how often ranks agree."""

    on_failure: Literal["stop", "continue"] = "stop"
    """What the job does when a learner dies: stop (every rank ends, bounded in time, and the
    run resumes from its last checkpoint), or continue among the survivors (needs mpirun
    --with-ft ulfm, which python -m hadpsgd.launch adds): they drop the dead learner(s) and go
    on, SSGD and BMUF from the state they all hold at the last control point, ADPSGD from each
    survivor's own replica."""
    min_learners: float = 1.0
    """With --on-failure continue, stop as today when fewer learners than this survive: a
    count (>= 1), or a fraction of the starting learners (< 1, e.g. 0.5)."""
    control_every: int = 10
    """Every this many steps the ranks agree (one tiny allreduce) on stop requests from
    signals and on non-finite steps; a SIGTERM/SIGINT/SIGUSR1 takes effect at the next one."""
    max_nonfinite: int = 5
    """Steps with a non-finite loss or gradient are skipped by every learner sharing them; more
    than this many such events (rank x step) stop the run with an error naming them (0: stop
    at the first)."""
    max_loss_ratio: float = 5.0
    """Stop the run as diverged when the held-out loss, or the training loss at 3 control
    points in a row, exceeds this many times the starting loss ln C, the loss of a uniform
    guess over the C classes (0: never)."""

    def __post_init__(self) -> None:
        check_finite(self)
        check_positive(self, "control_every")
        check_positive(self, "max_nonfinite", allow_zero=True)
        if self.max_loss_ratio and self.max_loss_ratio <= 1.0:
            raise ConfigError(f"--max-loss-ratio must be > 1 (or 0 to disable the divergence "
                              f"check), got {self.max_loss_ratio}")
        if self.on_failure not in ("stop", "continue"):
            raise ConfigError(f"--on-failure must be stop or continue, got {self.on_failure!r}")
        if self.min_learners <= 0:
            raise ConfigError(f"--min-learners must be > 0 (a count, or a fraction below 1), "
                              f"got {self.min_learners}")


@dataclass
class PrecisionConfig:
    """Arithmetic: the forward pass's precision and the GPU's TF32."""

    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Arithmetic of the forward pass, the loss and evaluation: fp32, or mixed precision
    under torch.autocast with fp32 master weights, optimizer and algorithm state. GPU users
    want bf16 (A100, H100: fp32's range, no loss scale); fp16 (V100, which has no bf16) adds
    a dynamic loss scale that every learner sharing a step agrees on. On CPU, bf16 runs the
    LSTM in bf16 where the CPU supports it; fp16 is for tests (oneDNN has no fp16 LSTM, so
    the LSTM stays fp32 there). What runs in which precision: docs/gpu.md."""
    tf32: bool = False
    """On a GPU, let fp32 matmuls and cuDNN's LSTM use TF32 tensor cores (faster, 10-bit
    mantissa). Off by default, so --precision fp32 is IEEE fp32, the reference mixed
    precision is measured against."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got "
                              f"{self.precision!r}")


FORMER_SECTION: dict[str, str] = {
    name: "train" for cls in (CheckpointConfig, FailureConfig, PrecisionConfig)
    for name in cls.__dataclass_fields__}
"""Options that a ``config.json`` written before the split holds in another section."""
