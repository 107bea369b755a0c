"""Run configuration: dataclasses whose field docstrings become the ``hadpsgd.run`` CLI help.

Every value is checked at construction, and errors name the option and what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_type_hints

from hadpsgd import algorithms
from hadpsgd.algorithms.gradsync import DEFAULT_GRAD_BUCKET_MB, GRAD_WIRES
from hadpsgd.cli import (
    ConfigError,
    RankParser,
    add_arguments,
    check_finite,
    field_docs,
    flag,
    from_namespace,
    option_name,
    to_dict,
)
from hadpsgd.config_file import merge, read_config_file
from hadpsgd.precision import PRECISIONS

__all__ = ["AlgoConfig", "CommConfig", "ConfigError", "DataConfig", "ModelConfig",
           "OptimConfig", "RunConfig", "TrainConfig", "check_read", "parse_config", "run_parser"]


def _algo_names() -> list[str]:
    return algorithms.names()


def _preset_names() -> list[str]:
    from hadpsgd.models import PRESETS

    return sorted(PRESETS)


def _lstm_layouts() -> list[str]:
    from hadpsgd.models.presets import LSTM_LAYOUTS

    return list(LSTM_LAYOUTS)


def _positive(obj: object, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{flag(name)} must be {bound}, got {value}")


def _paths(obj: object, *names: str) -> None:
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
        _paths(self, "train", "heldout")
        _positive(self, "chunk_len", "synthetic_utts")
        if self.num_workers is not None:
            _positive(self, "num_workers", allow_zero=True)


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


ELASTIC_ALGOS = ("ssgd", "bmuf", "adpsgd")
"""The algorithms that continue among the survivors of a failure (--on-failure continue)."""

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
    tensorboard: bool = False
    """Also write TensorBoard event files (needs pip install 'hadpsgd[tb]')."""
    progress: bool = True
    """Show a progress bar (rank 0 only)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Arithmetic of the forward pass, the loss and evaluation: fp32, or mixed precision
    under torch.autocast with fp32 master weights, optimizer and algorithm state. GPU users
    want bf16 (A100, H100: fp32's range, no loss scale); fp16 (V100, which has no bf16) adds
    a dynamic loss scale that every learner sharing a step agrees on. On CPU, bf16 runs the
    LSTM in bf16 where the CPU supports it; fp16 is for tests (oneDNN has no fp16 LSTM, so
    the LSTM stays fp32 there). What runs in which precision: docs/gpu.md."""
    on_failure: Literal["stop", "continue"] = "stop"
    """What the job does when a learner dies: stop (every rank ends, bounded in time, and the
    run resumes from its last checkpoint), or continue among the survivors (needs mpirun
    --with-ft ulfm, which python -m hadpsgd.launch adds): they drop the dead learner(s) and go
    on, SSGD and BMUF from the state they all hold at the last control point, ADPSGD from each
    survivor's own replica."""
    min_learners: float = 1.0
    """With --on-failure continue, stop as today when fewer learners than this survive: a
    count (>= 1), or a fraction of the starting learners (< 1, e.g. 0.5)."""
    tf32: bool = False
    """On a GPU, let fp32 matmuls and cuDNN's LSTM use TF32 tensor cores (faster, 10-bit
    mantissa). Off by default, so --precision fp32 is IEEE fp32, the reference mixed
    precision is measured against."""
    cuda_graph: bool = False
    """On a GPU, capture the model's forward and backward in CUDA graphs at the first training
    step (torch.cuda.make_graphed_callables) and replay them every step after: one launch
    instead of ~1,300 kernels a step, where the host launching them is the bound (swb at
    batch 128). The loss, the gradients' reduction and the optimizer stay eager; evaluation
    and a batch of another shape run the model as it is. On one H200, swb bf16 at batch
    128: 382k frames/s, 3.1x without it (docs/gpu.md)."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got "
                              f"{self.precision!r}")
        if self.algo not in _algo_names():
            raise ConfigError(
                f"--algo {self.algo!r} is unknown; registered algorithms: "
                f"{', '.join(_algo_names())}"
            )
        _positive(self, "epochs", "batch_size", "log_every")
        _positive(self, "control_every")
        _positive(self, "max_steps", "checkpoint_every", "keep_checkpoints", "keep_best",
                  "max_nonfinite", "seed", allow_zero=True)  # numpy seeds are >= 0
        _paths(self, "out_dir", "resume")
        if self.max_loss_ratio and self.max_loss_ratio <= 1.0:
            raise ConfigError(f"--max-loss-ratio must be > 1 (or 0 to disable the divergence "
                              f"check), got {self.max_loss_ratio}")
        if self.resume == "auto" and self.out_dir is None:
            raise ConfigError("--resume auto needs --out-dir (the run directory to resume)")
        if isinstance(self.allow_resume_change, bool):  # a config.json of an older version
            self.allow_resume_change = "all" if self.allow_resume_change else None
        if self.on_failure not in ("stop", "continue"):
            raise ConfigError(f"--on-failure must be stop or continue, got {self.on_failure!r}")
        if self.min_learners <= 0:
            raise ConfigError(f"--min-learners must be > 0 (a count, or a fraction below 1), "
                              f"got {self.min_learners}")
        if self.on_failure == "continue" and self.algo not in ELASTIC_ALGOS:
            raise ConfigError(f"--on-failure continue is built for --algo "
                              f"{' and '.join(ELASTIC_ALGOS)}; --algo {self.algo} stops at a "
                              "failure (bounded in time) and resumes from its checkpoint: drop "
                              "--on-failure continue")
        if self.overwrite and self.resume is not None:
            raise ConfigError("--overwrite deletes the run in --out-dir and --resume continues "
                              "it: pass one of them")


def _algo_config() -> type:
    """The ``algo`` section: every registered algorithm's options, generated from the registry.

    Each algorithm defines and validates its options in its own module (``Options``); this
    class only gathers them, so adding an algorithm or an option touches that module alone.
    Its fields are named as the run's flags and ``config.json`` name them
    (:func:`hadpsgd.cli.option_name`: ``bmuf_warmup_steps`` for BMUF's ``warmup_steps``).
    ``--help`` shows one group per algorithm. An option shared by several algorithms must be
    declared alike in each. The chosen algorithm validates its own, once
    (:meth:`RunConfig.algo_options`).
    """
    fields: dict[str, tuple[str, Any, dataclasses.Field]] = {}
    docs: dict[str, str] = {}
    groups: dict[str, str] = {}
    owners: dict[str, list[str]] = {}
    for spec in algorithms.specs():
        hints = get_type_hints(spec.options)
        for f in dataclasses.fields(spec.options):
            name = option_name(f)
            owners.setdefault(name, []).append(spec.name)
            if name in fields:
                continue
            default = (field(default=f.default, metadata=f.metadata)
                       if f.default is not dataclasses.MISSING
                       else field(default_factory=f.default_factory, metadata=f.metadata))
            fields[name] = (name, hints[f.name], default)
            docs[name] = field_docs(spec.options).get(f.name, "")
            groups[name] = f"--algo {spec.name}: {spec.description}"

    return dataclasses.make_dataclass(
        "AlgoConfig", list(fields.values()),
        namespace={"__field_docs__": docs,
                   "__field_groups__": groups, "__owners__": owners,
                   "__doc__": "Options of the distributed algorithms (from the registry).",
                   "__module__": __name__})


AlgoConfig = _algo_config()


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
    """Large buffers (models, BMUF's moments) are reduced in buckets of this many MiB."""
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
            _positive(self, "ranks_per_node")
        _positive(self, "bucket_mb")
        _positive(self, "grad_bucket_mb")
        for name in ("bucket_mb", "grad_bucket_mb"):
            if getattr(self, name) > MAX_BUCKET_MB:
                raise ConfigError(f"{flag(name)} must be at most {MAX_BUCKET_MB:.0f} (1 TiB), "
                                  f"got {getattr(self, name)}")


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
    algo: AlgoConfig = field(default_factory=AlgoConfig)  # type: ignore[valid-type]
    """Algorithm options."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Communication options."""

    def __post_init__(self) -> None:
        check_finite(self)
        _check_resume_changes(self.train.allow_resume_change)
        # Built and validated here, once: the assembly hands this very object to the
        # algorithm, and run.main asks it for the layout (ADPSGD's super-learners).
        self._algo_options = algorithms.spec(self.train.algo).options.from_section(self.algo)

    def given(self) -> dict[str, Any]:
        """The options the user gave (command line and ``--config`` file), by option name.

        Empty for a configuration built in code. A resume takes every other option from the
        run it continues (:mod:`hadpsgd.assembly.resume_config`).
        """
        return dict(getattr(self, "_given", {}))

    def typed(self) -> set[str]:
        """The options given on the command line (not by a ``--config`` file), by name.

        Empty for a configuration built in code. An option of the run's algorithm that its
        other choices leave unread is refused only where typed (a run's ``config.json`` holds
        every option): :meth:`AlgoOptions.check_read`.
        """
        return set(getattr(self, "_typed", set()))

    def recipe_note(self) -> str | None:
        """The line that says what ``--algo``'s recipe filled in, or None.

        None where nothing was filled: a resume (its options are the run's it continues), a
        configuration built in code (no recipe ran), or every option given. The API says
        its recipe in the same words (:mod:`hadpsgd.api.recipe`).
        """
        if self.train.resume or not hasattr(self, "_given"):
            return None
        options = algorithms.spec(self.train.algo).options
        if self.optim.recipe == "none":
            filled = options.recipe({**self.given(), "optimizer": self.optim.optimizer})
            return (f"{self.train.algo}: --recipe none, so every option left out keeps its "
                    "own default" + (f" (the recipe would have set "
                                      f"{', '.join(flag(k) for k in filled)})" if filled
                                      else ""))
        return options.recipe_line(self.train.algo, self.optim.optimizer,
                                   options.recipe(self.given()),
                                   lambda name, value: f"{flag(name)} {value}")

    def algo_options(self) -> algorithms.AlgoOptions:
        """The options of ``--algo``'s algorithm, picked from :attr:`algo` and validated.

        Raises nothing: a bad value was a :class:`ConfigError` when this was constructed.
        """
        return self._algo_options


def _check_resume_changes(text: str | bool | None) -> None:
    """Refuse an ``--allow-resume-change`` list naming no flag of the run, or none at all."""
    if not isinstance(text, str):
        return
    names = set(_option_types(RunConfig)) | {"np", "all"}
    parts = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [p for p in parts if p.lstrip("-").replace("-", "_") not in names]
    if not parts or unknown:
        raise ConfigError(f"--allow-resume-change takes flags of python -m hadpsgd.run "
                          f"(comma-separated, e.g. lr,batch-size; np for another number of "
                          f"ranks), or nothing for all of them; got {text!r}")


def _foreign_options(given: Iterable[str], algo: str) -> list[str]:
    """Options among ``given`` that belong only to other algorithms than ``algo``."""
    owners: dict[str, list[str]] = AlgoConfig.__owners__  # type: ignore[attr-defined]
    names = set(given)
    return [f"{flag(name)} (an option of --algo {' / '.join(who)})"
            for name, who in owners.items() if name in names and algo not in who]


def check_read(algo: str, given: Iterable[str], resumed: str | None = None) -> None:
    """Refuse an option in ``given`` that the algorithm ``algo`` does not read.

    Silently ignoring it would run something else than the user asked for.

    Args:
        algo: The run's ``--algo``.
        given: The options the user gave, by name.
        resumed: The checkpoint a resume continues, whose run's algorithm ``algo`` is (the
            one to check against, not the default ``--algo``).

    Raises:
        ConfigError: Naming each such flag, whose algorithm it is, and the fix.
    """
    foreign = _foreign_options(given, algo)
    if not foreign:
        return
    if resumed is None:
        raise ConfigError(f"--algo {algo} does not read {', '.join(foreign)}; drop it or "
                          "choose that algorithm")
    raise ConfigError(f"the run resumed from {resumed} is --algo {algo}, which does not read "
                      f"{', '.join(foreign)}; drop it to continue that run, or start a new "
                      "run of that algorithm in another --out-dir")


def run_parser() -> RankParser:
    """The parser of ``python -m hadpsgd.run``.

    Every option of :class:`RunConfig`, then ``--config`` and ``--print-config``. Its
    ``--help`` is the reference the docs' option tables are held to
    (``tests/unit/test_docs_flags.py``).
    """
    parser = RankParser(
        prog="python -m hadpsgd.run", allow_abbrev=False,
        description="Train the SWB BLSTM with SSGD, ADPSGD / H-ADPSGD or BMUF over MPI. "
                    "Launch with mpirun (one process per learner). Algorithms: "
                    + "; ".join(f"{s.name}: {s.description}" for s in algorithms.specs()),
        epilog=" ".join(s.options.recipe_help for s in algorithms.specs()
                        if s.options.recipe_help) or None,
    )
    add_arguments(parser, RunConfig)
    group = parser.add_argument_group("configuration file")
    group.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                       help="read options from a JSON file with the sections of a run's "
                            "config.json; options on the command line win")
    group.add_argument("--print-config", action="store_true", default=argparse.SUPPRESS,
                       help="print the resolved configuration as JSON and exit")
    return parser


def parse_config(argv: Sequence[str] | None = None) -> RunConfig:
    """Parse the command line into a validated :class:`RunConfig` (exits 2 on bad input)."""
    parser = run_parser()
    ns = parser.parse_args(argv)
    for name, value in vars(ns).items():
        if isinstance(value, list):  # argparse drops the value "--" of --lr=-- and leaves []
            parser.error(f"argument {flag(name)}: expected one value, got '--'")
    show = bool(vars(ns).pop("print_config", False))
    path = vars(ns).pop("config", None)
    owners: dict[str, list[str]] = AlgoConfig.__owners__  # type: ignore[attr-defined]
    # A --config file (a run's config.json) holds every option: only the typed ones are
    # refused where the chosen wire does not read them, as its other algorithms' are dropped.
    typed = set(vars(ns))
    if path is not None:
        try:
            from_file = read_config_file(path, _option_types(RunConfig),
                                         _option_sections(RunConfig))
        except ConfigError as err:
            parser.error(str(err))
        algo = getattr(ns, "algo", from_file.get("algo", TrainConfig.algo))
        for name, value in merge(vars(ns), from_file, algo, owners).items():
            setattr(ns, name, value)
    named = getattr(ns, "recipe", "auto")
    if named in ("sgd", "adam"):  # a recipe by name is its optimizer's
        if getattr(ns, "optimizer", named) != named:
            parser.error(f"--recipe {named} is the recipe of --optimizer {named}, but "
                         f"--optimizer {ns.optimizer} was given: drop one of them")
        ns.optimizer = named
    given = dict(vars(ns))  # before the recipe: what the user said, not what it implies
    # The chosen algorithm's recipe fills options the user left out (BMUF: BMUF-Adam).
    algo = getattr(ns, "algo", TrainConfig.algo)
    if algo in algorithms.names() and named != "none":
        try:
            recipe = algorithms.get(algo).Options.recipe(vars(ns))
        except ConfigError as err:
            parser.error(str(err))
        for name, value in recipe.items():
            setattr(ns, name, value)
    try:
        cfg = from_namespace(RunConfig, ns)
    except ConfigError as err:
        parser.error(str(err))
    # A resume runs its run's algorithm: checked against that (resume_config), not the
    # default --algo, unless --algo is given.
    if not cfg.train.resume or "algo" in given:
        try:
            check_read(cfg.train.algo, given)
            cfg.algo_options().check_read(typed)
        except ConfigError as err:
            parser.error(str(err))
    cfg._given = given  # type: ignore[attr-defined]
    cfg._typed = typed  # type: ignore[attr-defined]
    if show:
        print(json.dumps(to_dict(cfg), indent=2))
        raise SystemExit(0)
    return cfg


@functools.cache  # read-only; typing.get_type_hints is most of a parse's time
def _option_types(cls: type) -> dict[str, Any]:
    """Every option's field name and type, through the nested sections."""
    hints = get_type_hints(cls)
    types_: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            types_.update(_option_types(hints[f.name]))
        else:
            types_[f.name] = hints[f.name]
    return types_


@functools.cache
def _option_sections(cls: type) -> dict[str, str]:
    """Every option's field name and the section of ``config.json`` that holds it."""
    hints = get_type_hints(cls)
    return {name: sec.name for sec in dataclasses.fields(cls)
            for name in _option_types(hints[sec.name])}
