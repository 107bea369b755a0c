"""The sections of a run's configuration that its data, model, optimizer and layout read.

Every value is checked at construction, and errors name the option and what to change.
The loop's, checkpoints', failures' and precision's sections are in
:mod:`hadpsgd.config.training`; the algorithms' own options in their modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from hadpsgd.algorithms.gradsync import DEFAULT_GRAD_BUCKET_MB, GRAD_WIRES
from hadpsgd.cli import ConfigError, check_finite, flag
from hadpsgd.env import EnvError, bucket_mb

__all__ = ["DEFAULT_LR", "MAX_BUCKET_MB", "CommConfig", "DataConfig", "ModelConfig",
           "OptimConfig", "check_paths", "check_positive"]


def _preset_names() -> list[str]:
    from hadpsgd.models import PRESETS

    return sorted(PRESETS)


def _lstm_layouts() -> list[str]:
    from hadpsgd.models.presets import LSTM_LAYOUTS

    return list(LSTM_LAYOUTS)


def check_positive(obj: object, *names: str, allow_zero: bool = False) -> None:
    """Refuse a field of ``obj`` below zero (or at zero, unless ``allow_zero``), by its flag."""
    for name in names:
        value = getattr(obj, name)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{flag(name)} must be {bound}, got {value}")


def check_paths(obj: object, *names: str) -> None:
    """Refuse an empty path or one with a NUL byte (``''`` is the working directory)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and (not value.strip() or "\0" in value):
            raise ConfigError(f"{flag(name)} must name a file or directory, got {value!r}; "
                              f"give a path or leave it out")


MAX_BUCKET_MB = 2.0**20
"""The largest bucket (1 TiB): a bucket's size in bytes must be a Python int."""

@dataclass
class DataConfig:
    """Data: HDF5 feature files (docs/design.md, the feature format) or the synthetic default."""

    train: str | None = None
    """Training HDF5 file. Omit both --train and --heldout to use the synthetic SWB-shaped set
    (generated once and cached in $HADPSGD_CACHE or ~/.cache/hadpsgd)."""
    heldout: str | None = None
    """Held-out HDF5 file, evaluated after every epoch."""
    chunk_len: int = 21
    """Frames per training sub-sequence (the LSTM unroll length; the paper uses 21)."""
    num_workers: int | None = None
    """DataLoader worker processes per learner (0 reads in the training process). Default:
    2 on CUDA, where reading and pinning a batch in the training process left the GPU idle
    (7.6 ms of a 36 ms step of swb at batch 128 on an H200), 0 on CPU, where the ranks
    already use the cores."""
    verify_data: bool = False
    """Check every frame and label at start even when a file's validation stamp (written by
    hadpsgd's writer and importers) vouches for them; files without a stamp always are."""
    synthetic_utts: int = 400
    """Training utterances of the synthetic default set (without --train): 400 make ~4,000
    chunks of 21 frames, one epoch of 62 steps at 2 learners x 32, but of 1 step at 64
    learners; raise it (or lower --batch-size) for many learners. Each size is generated
    once and cached."""

    def __post_init__(self) -> None:
        check_finite(self)
        if (self.train is None) != (self.heldout is None):
            raise ConfigError(
                "give both --train and --heldout, or neither (to use the synthetic default set)"
            )
        check_paths(self, "train", "heldout")
        check_positive(self, "chunk_len", "synthetic_utts")
        if self.num_workers is not None:
            check_positive(self, "num_workers", allow_zero=True)


@dataclass
class ModelConfig:
    """Model: the SWB BLSTM at one of its size presets."""

    preset: str = field(default="small", metadata={"choices": _preset_names})
    """BLSTM size: swb (6x512 + 256 projection, ~43 M parameters), small or tiny."""
    lstm_layout: str = field(default="auto", metadata={"choices": _lstm_layouts})
    """How the LSTM stack is built: auto = stacked (one multi-layer module) on every device.
    per-layer (one module per layer) lets each layer's gradients be reduced during backward on
    CUDA, where cuDNN's fused multi-layer LSTM releases them all at its end, but its step took
    36.4 ms against 28.4 on an H100 (swb), more than the under-1 ms allreduce of one node it
    could hide; use it where the reduction is slow. Both are numerically the same model, with
    the same initial values and parameter order; checkpoints of either layout load into the
    other."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.preset not in _preset_names():
            raise ConfigError(
                f"--preset {self.preset!r} is unknown; choose one of {', '.join(_preset_names())}"
            )
        if self.lstm_layout not in _lstm_layouts():
            raise ConfigError(f"--lstm-layout {self.lstm_layout!r} is unknown; choose one of "
                              f"{', '.join(_lstm_layouts())}")


DEFAULT_LR: dict[str, float] = {"sgd": 0.5, "adam": 0.004, "adamw": 0.004}
"""--lr at --base-batch 128 when none is given, per optimizer."""


@dataclass
class OptimConfig:
    """Optimizer and the learning-rate recipe (h-adpsgd paper, section 3)."""

    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    """Local optimizer of every learner."""
    recipe: Literal["auto", "none", "sgd", "adam"] = "auto"
    """What fills the options you leave out: auto, --algo's measured recipe for --optimizer
    (BMUF with SGD: the global rate, momentum kept, clipped; with Adam: the BMUF-Adam
    paper's); sgd or adam, that recipe by name (it sets --optimizer); none, every option at
    its own default, for a run that sets everything itself (the line at start says which)."""
    lr: float | None = None
    """Learning rate at --base-batch sub-sequences; scaled linearly with the global batch.
    Default: 0.5 for sgd, 0.004 for adam/adamw (1e-3 at a batch of 32)."""
    base_batch: int = 128
    """Global batch (sub-sequences) at which --lr applies: lr = lr * global_batch / base_batch."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """Weight decay (L2 for sgd/adam, decoupled for adamw)."""
    beta1: float = 0.9
    """Adam beta1 (--algo bmuf: 0.5, the BMUF-Adam paper's)."""
    beta2: float = 0.999
    """Adam beta2."""
    warmup_epochs: int = 1
    """Epochs of linear warm-up to the scaled rate (the paper uses 10 of 16); 0 disables."""
    gradual_warmup: bool = True
    """Where the first warm-up epoch's scaled rate is above --lr (a global batch above
    --base-batch), climb to it step by step from --lr through that epoch (Goyal et al.'s
    gradual warm-up; 16 x 32 chunks at 2.0 from the first step diverged on speechocean762)."""
    anneal: float = 1 / math.sqrt(2)
    """Factor applied to the rate each epoch after warm-up (the paper's 1/sqrt(2))."""
    max_grad_norm: float = 0.0
    """Clip the averaged gradient to this global L2 norm before the step; 0 disables."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.optimizer not in DEFAULT_LR:
            raise ConfigError(f"--optimizer must be one of {', '.join(DEFAULT_LR)}, got "
                              f"{self.optimizer!r}")
        if self.lr is None:  # resolved here, so config.json records the rate used
            self.lr = DEFAULT_LR[self.optimizer]
        check_positive(self, "lr", "base_batch")
        check_positive(self, "momentum", "weight_decay", "warmup_epochs", "max_grad_norm",
                  allow_zero=True)
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 < self.anneal <= 1.0:
            raise ConfigError(f"--anneal must be in (0, 1], got {self.anneal}")

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
    bucket_mb: float | None = None
    """Large buffers (models, BMUF's moments) are reduced in buckets of this many MiB
    (default: env HADPSGD_BUCKET_MB, else 64; config.json records the size used)."""
    overlap: Literal["auto", "on", "off"] = "auto"
    """Reduce the gradients bucket by bucket while backward still runs (as DDP does), in a
    background thread: on, off (after backward: same buckets, same order, same result), or
    auto = on when training on CUDA, off on CPU, where the reduction would take the cores
    backward needs (measured: docs/benchmarks.md, train_throughput)."""
    grad_bucket_mb: float = DEFAULT_GRAD_BUCKET_MB
    """Gradient bucket size in MiB (DDP's default): smaller buckets start reducing earlier
    in backward, larger ones make fewer calls."""
    grad_wire: Literal["fp32", "bf16"] = "fp32"
    """What the gradient buckets are on the wire when SSGD (and BMUF's warm-up) average them
    over the world, or a super-learner (BMUF, H-ADPSGD) inside its node: fp32, or bf16 (half
    the bytes; rounded to bfloat16 for the wire, summed in fp32 where MPI carries them, by
    NCCL in bf16 where it carries them, then cast back: DDP's bf16 compression hook). The
    bytes sent go into the training log (grad_wire_bytes)."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.grad_wire not in GRAD_WIRES:
            raise ConfigError(f"--grad-wire must be one of {', '.join(GRAD_WIRES)}, got "
                              f"{self.grad_wire!r}")
        if self.ranks_per_node is not None:
            check_positive(self, "ranks_per_node")
        if self.bucket_mb is None:  # resolved here, so config.json records the size used
            try:
                self.bucket_mb = bucket_mb()
            except EnvError as err:
                raise ConfigError(f"{err} (or give --bucket-mb)") from None
        check_positive(self, "bucket_mb")
        check_positive(self, "grad_bucket_mb")
        for name in ("bucket_mb", "grad_bucket_mb"):
            if getattr(self, name) > MAX_BUCKET_MB:
                raise ConfigError(f"{flag(name)} must be at most {MAX_BUCKET_MB:.0f} (1 TiB), "
                                  f"got {getattr(self, name)}")

