"""Build the parts of a run from its configuration: data, model, algorithm, loop.

Everything a user can get wrong (flags, files, layout) is checked here, before a model or an
output directory exists; :func:`build_trainer` is the whole assembly ``run.py`` calls.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from hadpsgd import algorithms
from hadpsgd.cli import ConfigError, to_dict
from hadpsgd.comm import Topology
from hadpsgd.config import OptimConfig, RunConfig
from hadpsgd.data import ChunkDataset, FeatureFile, FeatureFileError
from hadpsgd.data.validate import nonfinite_error, path_problem, scan_frames
from hadpsgd.models import build_model
from hadpsgd.models.presets import per_layer_lstm
from hadpsgd.train import provenance, rundir
from hadpsgd.train.loop import LoopOptions, Trainer
from hadpsgd.train.metrics import MetricsWriter
from hadpsgd.train.schedule import LRSchedule


def load_data(cfg: RunConfig, topo: Topology) -> tuple[ChunkDataset, ChunkDataset]:
    """The training and held-out chunks, checked (shapes, sizes, every frame finite).

    Raises:
        FeatureFileError: For a missing, malformed or too small file, naming it and the fix.
    """
    train_path, heldout_path = resolve_data(cfg, topo)
    verify = cfg.data.verify_data
    train_set = ChunkDataset(train_path, cfg.data.chunk_len, verify=verify)
    heldout_set = ChunkDataset(heldout_path, cfg.data.chunk_len,
                               expected_feat_dim=train_set.file.feat_dim, verify=verify)
    if heldout_set.file.num_classes != train_set.file.num_classes:
        raise FeatureFileError(
            f"{heldout_path} has {heldout_set.file.num_classes} classes but {train_path} has "
            f"{train_set.file.num_classes}; both splits must share one label set"
        )
    check_steps(train_set, cfg.train.batch_size, topo.size)
    validate_data([train_set.file, heldout_set.file], topo)
    return train_set, heldout_set


def loop_options(cfg: RunConfig) -> LoopOptions:
    """The loop's view of the configuration: each field from the section that holds it."""
    values = {}
    for f in dataclasses.fields(LoopOptions):
        section = cfg.train if hasattr(cfg.train, f.name) else cfg.data
        values[f.name] = getattr(section, f.name)
    return LoopOptions(**values)


def build_trainer(cfg: RunConfig, topo: Topology) -> Trainer:
    """Data, model, optimizer, algorithm, run directory, metrics and LR recipe, in a Trainer.

    Raises:
        FeatureFileError, ConfigError, ValueError: For bad input, before anything is written.
    """
    check_out_dir(cfg, topo)
    train_set, heldout_set = load_data(cfg, topo)
    # Only rank 0's initial values matter (the algorithm broadcasts them), but seeding all
    # ranks keeps single-process runs reproducible too.
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model.preset, train_set.file.feat_dim, train_set.file.num_classes,
                        per_layer=per_layer_lstm(cfg.model.lstm_layout, topo.device)
                        ).to(topo.device)
    algo_cls = algorithms.get(cfg.train.algo)
    algo = algo_cls(model, build_optimizer(cfg.optim, model), topo, **algo_cls.options_from(cfg))
    out_dir = make_out_dir(cfg, topo)
    metrics = MetricsWriter(out_dir, enabled=topo.rank == 0, tensorboard=cfg.train.tensorboard)
    # The recipe scales with the batch behind one optimizer update, which the algorithm knows.
    schedule = LRSchedule(cfg.optim.lr, cfg.optim.base_batch,
                          algo.update_batch(cfg.train.batch_size),
                          cfg.optim.warmup_epochs, cfg.optim.anneal)
    return Trainer(algo, topo, train_set, heldout_set, schedule, loop_options(cfg), out_dir,
                   metrics, config=to_dict(cfg))


def resolve_data(cfg: RunConfig, topo: Topology) -> tuple[Path, Path]:
    """Training and held-out file paths; generates the synthetic default set on first use.

    Rank 0 generates (into a temp dir renamed into place, so an interrupted generation is
    never mistaken for a finished one); the other ranks wait for it under the deadline.

    Raises:
        FeatureFileError: If a given path does not exist or cannot be read (a directory, no
            permission, an empty file), naming the flag, the path and the fix.
    """
    if cfg.data.train is not None and cfg.data.heldout is not None:
        paths = (Path(cfg.data.train), Path(cfg.data.heldout))
        for flag_name, p in zip(("--train", "--heldout"), paths, strict=True):
            problem = path_problem(p)
            if problem is not None:
                raise FeatureFileError(f"{flag_name} {p}: {problem}")
        return paths
    from hadpsgd.data import default_dataset

    generated = None
    if topo.rank == 0:
        generated = tuple(str(p) for p in default_dataset())
        print(f"[hadpsgd] synthetic data: {generated[0]}, {generated[1]}", flush=True)
    generated = topo.bcast_object(generated, root=0)
    return Path(generated[0]), Path(generated[1])


def check_steps(train_set: ChunkDataset, batch_size: int, world_size: int) -> None:
    """Refuse training data too small for one step.

    Held-out data always has a chunk: a short utterance is one padded chunk.

    Raises:
        FeatureFileError: Naming the file, its chunk count, the global batch and the fixes.
    """
    global_batch = batch_size * world_size
    if len(train_set) < global_batch:
        # The sampler drops the incomplete last global batch: an epoch would have no step.
        raise FeatureFileError(
            f"{train_set.file.path}: {len(train_set)} chunks of {train_set.chunk_len} frames, "
            f"fewer than one global batch of {global_batch} ({batch_size} per learner x "
            f"{world_size} learners), so an epoch would have zero steps; use a smaller "
            f"--batch-size or --chunk-len, fewer learners, or more training data")


def _scan_share(ff: FeatureFile, rank: int, size: int) -> int | str | None:
    """This rank's contiguous share of ``ff``: first bad frame, read-error message or None."""
    start, stop = ff.num_frames * rank // size, ff.num_frames * (rank + 1) // size
    try:
        return scan_frames(ff, start, stop)
    except FeatureFileError as err:
        # Reported, not raised: the other ranks must learn of it in the agreement below
        # instead of waiting for a rank that has left.
        return str(err)
    finally:
        # Scanning opened a handle in this process; closed so that forked loader workers do
        # not inherit it (they would reopen their own anyway).
        ff.close()


def validate_data(files: Sequence[FeatureFile], topo: Topology) -> None:
    """Check every stored frame of ``files`` for NaN/Inf values and read errors, in parallel.

    Each rank scans a contiguous ``1/size`` share of every file; one allgather then tells
    every rank what all shares found, so all ranks raise the same error (or none does) and
    no rank is left waiting in a later collective. Shares are in rank order, so the lowest
    rank that found something holds the earliest problem of the file. (The Topology reduces
    only with ``avg``/``sum``, and the read-error message must travel too: hence an object
    allgather of a few bytes rather than a MIN allreduce.)

    Args:
        files: The feature files the run reads (all ranks pass the same ones, in order).
        topo: The learners.

    Raises:
        FeatureFileError: On every rank, for the first file with a problem: a non-finite
            value (naming the frame and utterance) or an unreadable part of the file.
    """
    # A file whose writer's stamp vouches for it is not rescanned (unless --verify-data).
    files = [ff for ff in files if not ff.stamped]
    if not files:
        return
    local = [_scan_share(ff, topo.rank, topo.size) for ff in files]
    for ff, found in zip(files, zip(*topo.allgather_object(local), strict=True), strict=True):
        for problem in found:
            if isinstance(problem, str):
                raise FeatureFileError(problem)
            if problem is not None:
                raise nonfinite_error(ff, problem)


def check_out_dir(cfg: RunConfig, topo: Topology) -> None:
    """Refuse a fresh start where a run is, or a directory that cannot be written, first.

    Rank 0 looks; every rank gets its verdict, so all stop together (exit 2).

    Raises:
        ConfigError: Naming the directory, what it holds, and ``--resume auto`` /
            another ``--out-dir`` / ``--overwrite``.
    """
    problem = None
    if topo.rank == 0 and cfg.train.out_dir is not None:
        out = Path(cfg.train.out_dir)
        problem = rundir.start_problem(out, cfg.train.resume, cfg.train.overwrite)
        problem = problem or rundir.writable_problem(out)
    problem = topo.bcast_object(problem, root=0)
    if problem is not None:
        raise ConfigError(problem)


def make_out_dir(cfg: RunConfig, topo: Topology) -> Path:
    """Create the run directory and save the resolved config with this start's provenance.

    Rank 0 picks the default name and writes.
    """
    out = None
    if topo.rank == 0:
        out = Path(cfg.train.out_dir or f"runs/{cfg.train.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
        out.mkdir(parents=True, exist_ok=True)
        if cfg.train.overwrite:
            removed = rundir.clear_run(out)
            if removed:
                print(f"[hadpsgd] --overwrite: deleted {', '.join(removed)} of the run in "
                      f"{out}", flush=True)
        resolved = to_dict(cfg)
        resolved["train"]["out_dir"] = str(out)
        resolved["world"] = {"size": topo.size, "num_nodes": topo.num_nodes,
                             "node_sizes": topo.node_sizes, "device": str(topo.device)}
        provenance.write_config(out / "config.json", resolved,
                                provenance.entry(topo, cfg.train.resume))
        out = str(out)
    return Path(topo.bcast_object(out, root=0))


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The local optimizer named by ``cfg.optimizer`` (its rate is set by the schedule)."""
    params = model.parameters()
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                 weight_decay=cfg.weight_decay)
    raise ValueError(f"--optimizer {cfg.optimizer!r} is unknown; choose sgd, adam or adamw")
