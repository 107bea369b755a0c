"""Run configuration: dataclasses whose field docstrings become the ``hadpsgd.run`` CLI help.

Every value is checked at construction, and errors name the option and what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from hadpsgd.cli import flag


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the option and the fix."""


def _algo_names() -> list[str]:
    from hadpsgd import algorithms

    return algorithms.names()


def _preset_names() -> list[str]:
    from hadpsgd.models import PRESETS

    return sorted(PRESETS)


def _positive(obj: object, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{flag(name)} must be {bound}, got {value}")


@dataclass
class DataConfig:
    """Data: HDF5 feature files (DESIGN section 5) or the cached synthetic default."""

    train: str | None = None
    """Training HDF5 file. Omit both --train and --heldout to use the synthetic SWB-shaped set
    (generated once and cached in $HADPSGD_CACHE or ~/.cache/hadpsgd)."""
    heldout: str | None = None
    """Held-out HDF5 file, evaluated after every epoch."""
    chunk_len: int = 21
    """Frames per training sub-sequence (the LSTM unroll length; the paper uses 21)."""
    num_workers: int = 0
    """DataLoader worker processes per learner (0 reads in the training process)."""

    def __post_init__(self) -> None:
        if (self.train is None) != (self.heldout is None):
            raise ConfigError(
                "give both --train and --heldout, or neither (to use the synthetic default set)"
            )
        _positive(self, "chunk_len")
        _positive(self, "num_workers", allow_zero=True)


@dataclass
class ModelConfig:
    """Model: the SWB BLSTM at one of its size presets."""

    preset: str = field(default="small", metadata={"choices": _preset_names})
    """BLSTM size: swb (6x512 + 256 projection, ~43 M parameters), small or tiny."""

    def __post_init__(self) -> None:
        if self.preset not in _preset_names():
            raise ConfigError(
                f"--preset {self.preset!r} is unknown; choose one of {', '.join(_preset_names())}"
            )


@dataclass
class OptimConfig:
    """Optimizer and the learning-rate recipe (h-adpsgd paper, section 3)."""

    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    """Local optimizer of every learner."""
    lr: float = 0.5
    """Learning rate at --base-batch sub-sequences; scaled linearly with the global batch."""
    base_batch: int = 128
    """Global batch (sub-sequences) at which --lr applies: lr = lr * global_batch / base_batch."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """Weight decay (L2 for sgd/adam, decoupled for adamw)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.999
    """Adam beta2."""
    warmup_epochs: int = 1
    """Epochs of linear warm-up to the scaled rate (the paper uses 10 of 16); 0 disables."""
    anneal: float = 1 / math.sqrt(2)
    """Factor applied to the rate each epoch after warm-up (the paper's 1/sqrt(2))."""
    max_grad_norm: float = 0.0
    """Clip the averaged gradient to this global L2 norm before the step; 0 disables."""

    def __post_init__(self) -> None:
        _positive(self, "lr", "base_batch")
        _positive(self, "momentum", "weight_decay", "warmup_epochs", "max_grad_norm",
                  allow_zero=True)
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 < self.anneal <= 1.0:
            raise ConfigError(f"--anneal must be in (0, 1], got {self.anneal}")


@dataclass
class TrainConfig:
    """Training loop, outputs and checkpoints."""

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
    checkpoint_every: int = 0
    """Also checkpoint every this many steps (0: only at the end of each epoch and of the run)."""
    resume: str | None = None
    """Checkpoint directory to resume from, or 'auto' for the newest complete, valid one in
    --out-dir (corrupted or incomplete ones are reported and skipped)."""
    allow_resume_change: bool = False
    """Let --resume take a checkpoint written with another number of ranks or another --algo:
    its deployable model (and optimizer state if the optimizer matches) and its epoch position
    are carried over; the algorithm's own state starts afresh, so the result is not exact."""
    keep_checkpoints: int = 3
    """Keep only the newest this many checkpoints in --out-dir (0 keeps all)."""
    control_every: int = 10
    """Every this many steps the ranks agree (one tiny allreduce) on stop requests from
    signals and on non-finite steps; a SIGTERM/SIGINT/SIGUSR1 takes effect at the next one."""
    max_nonfinite: int = 5
    """Steps with a non-finite loss or gradient are skipped by every learner sharing them; more
    than this many such events (rank x step) stop the run with an error naming them (0: stop
    at the first)."""
    tensorboard: bool = False
    """Also write TensorBoard event files (needs pip install 'hadpsgd[tb]')."""
    progress: bool = True
    """Show a progress bar (rank 0 only)."""

    def __post_init__(self) -> None:
        if self.algo not in _algo_names():
            raise ConfigError(
                f"--algo {self.algo!r} is unknown; registered algorithms: "
                f"{', '.join(_algo_names())}"
            )
        _positive(self, "epochs", "batch_size", "log_every")
        _positive(self, "control_every")
        _positive(self, "max_steps", "checkpoint_every", "keep_checkpoints", "max_nonfinite",
                  allow_zero=True)
        if self.resume == "auto" and self.out_dir is None:
            raise ConfigError("--resume auto needs --out-dir (the run directory to resume)")


@dataclass
class AlgoConfig:
    """Options of the distributed algorithms.

    Each algorithm reads the ones it declares in its ``config_keys``.
    """

    sync_period: int = 8
    """BMUF: local steps per block (tau) between two block syncs across super-learners."""
    block_momentum: float | None = None
    """BMUF: block momentum eta in [0, 1) (default 1 - 1/N for N super-learners, so 0 for
    one node)."""
    block_lr: float = 1.0
    """BMUF: block learning rate zeta (> 0; the paper uses 1)."""
    nesterov: bool = True
    """BMUF: Nesterov block momentum (the next block starts at theta_n + eta * Delta_n);
    --no-nesterov for classical block momentum (it starts at theta_n)."""
    adam_moments: Literal["corrected", "average", "local", "reset"] = "corrected"
    """BMUF: optimizer moment buffers at a block sync: corrected (the paper's Eq. 18, with
    fractional Adam step), average (Eq. 13), local (kept) or reset (zeroed). SGD's momentum
    buffer is treated the same way with beta = --momentum."""
    bmuf_warmup_steps: int = 0
    """BMUF: synchronous SGD over all learners for this many steps, then BMUF starts from the
    warmed model with Delta = 0."""
    super_learner_size: int | None = None
    """ADPSGD: learners per super-learner (consecutive ranks; 1 = flat ADPSGD); default: the
    nodes (or --ranks-per-node)."""
    max_staleness: int = 0
    """ADPSGD: a learner more than this many local steps past its last completed exchange
    waits for the next one (0: never wait)."""

    def __post_init__(self) -> None:
        _positive(self, "sync_period")
        _positive(self, "bmuf_warmup_steps", "max_staleness", allow_zero=True)
        if self.super_learner_size is not None:
            _positive(self, "super_learner_size")
        _positive(self, "block_lr")
        if self.block_momentum is not None and not 0.0 <= self.block_momentum < 1.0:
            raise ConfigError(f"{flag('block_momentum')} must be in [0, 1) (omit it for "
                              f"1 - 1/N), got {self.block_momentum}")
        if self.adam_moments not in ("corrected", "average", "local", "reset"):
            raise ConfigError(f"{flag('adam_moments')} must be corrected, average, local or "
                              f"reset, got {self.adam_moments!r}")


@dataclass
class CommConfig:
    """Communication layout."""

    ranks_per_node: int | None = None
    """Emulate nodes of this many consecutive ranks (default: real nodes; env
    HADPSGD_RANKS_PER_NODE)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Compute device: auto picks CUDA when available; a rank's GPU is its rank among the
    processes of its physical host (modulo the GPUs it sees), whatever the node emulation."""
    intra_backend: Literal["auto", "mpi", "gloo", "nccl"] = "auto"
    """Intra-node backend: auto = NCCL (torch.distributed) for device tensors when every rank
    of the node has its own GPU, else MPI shared memory (host tensors always take MPI, or
    gloo if chosen); nccl insists on NCCL and fails with the reason where it cannot run."""
    hier_algo: Literal["auto", "shard", "leader"] = "auto"
    """Hierarchical allreduce form: shard (reduce-scatter / inter-node / allgather; equal
    nodes) or leader (reduce / leaders' allreduce / broadcast); auto picks shard when it can."""
    bucket_mb: float = 64.0
    """Large buffers are reduced in buckets of this many MiB."""

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None:
            _positive(self, "ranks_per_node")
        _positive(self, "bucket_mb")


@dataclass
class RunConfig:
    """Everything ``python -m hadpsgd.run`` needs."""

    data: DataConfig = field(default_factory=DataConfig)
    """Data options."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model options."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule options."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop options."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm options."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Communication options."""
