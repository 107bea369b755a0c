"""``python -m hadpsgd.run``: parse the configuration, build the parts, run the loop.

Launch one process per learner, e.g. ``mpirun -np 4 python -m hadpsgd.run --algo ssgd`` or
``python -m hadpsgd.launch -n 4 -- --algo ssgd``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Sequence

import torch

from hadpsgd import algorithms, comm
from hadpsgd.cli import add_arguments, from_namespace, to_dict
from hadpsgd.config import ConfigError, RunConfig
from hadpsgd.data import ChunkDataset, FeatureFileError
from hadpsgd.models import build_model, count_parameters
from hadpsgd.train import (
    LoopOptions,
    LRSchedule,
    MetricsWriter,
    Trainer,
    latest_checkpoint,
    load_checkpoint,
)
from hadpsgd.train.setup import build_optimizer, make_out_dir, resolve_data

# Errors a user causes (bad flag, file, layout): reported as one line, without a traceback.
USER_ERRORS = (ConfigError, FeatureFileError, FileNotFoundError, comm.TopologyError,
               ImportError, ValueError)


def parse_config(argv: Sequence[str] | None = None) -> RunConfig:
    """Parse the command line into a validated :class:`RunConfig` (exits 2 on bad input)."""
    parser = argparse.ArgumentParser(
        prog="python -m hadpsgd.run",
        description="Train the SWB BLSTM with SSGD, ADPSGD / H-ADPSGD or BMUF over MPI. "
                    "Launch with mpirun (one process per learner).",
    )
    add_arguments(parser, RunConfig)
    ns = parser.parse_args(argv)
    try:
        return from_namespace(RunConfig, ns)
    except ConfigError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


def train(cfg: RunConfig, topo: comm.Topology) -> Trainer:
    """Build every part from ``cfg`` and train; returns the finished trainer."""
    start = time.perf_counter()
    train_path, heldout_path = resolve_data(cfg, topo)
    train_set = ChunkDataset(train_path, cfg.data.chunk_len)
    heldout_set = ChunkDataset(heldout_path, cfg.data.chunk_len,
                               expected_feat_dim=train_set.file.feat_dim)
    if heldout_set.file.num_classes != train_set.file.num_classes:
        raise FeatureFileError(
            f"{heldout_path} has {heldout_set.file.num_classes} classes but {train_path} has "
            f"{train_set.file.num_classes}; both splits must share one label set"
        )
    # Only rank 0's initial values matter (the algorithm broadcasts them), but seeding all
    # ranks keeps single-process runs reproducible too.
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model.preset, train_set.file.feat_dim,
                        train_set.file.num_classes).to(topo.device)
    algo_cls = algorithms.get(cfg.train.algo)
    algo = algo_cls(model, build_optimizer(cfg.optim, model), topo, **algo_cls.options_from(cfg))
    out_dir = make_out_dir(cfg, topo)
    metrics = MetricsWriter(out_dir, enabled=topo.rank == 0, tensorboard=cfg.train.tensorboard)
    schedule = LRSchedule(cfg.optim.lr, cfg.optim.base_batch, cfg.train.batch_size * topo.size,
                          cfg.optim.warmup_epochs, cfg.optim.anneal)
    opts = LoopOptions(epochs=cfg.train.epochs, batch_size=cfg.train.batch_size,
                       seed=cfg.train.seed, max_steps=cfg.train.max_steps,
                       log_every=cfg.train.log_every, checkpoint_every=cfg.train.checkpoint_every,
                       progress=cfg.train.progress, num_workers=cfg.data.num_workers)
    trainer = Trainer(algo, topo, train_set, heldout_set, schedule, opts, out_dir, metrics,
                      config=to_dict(cfg))
    if cfg.train.resume:
        _resume(trainer, cfg, topo, out_dir)
    if topo.rank == 0:
        print(f"[hadpsgd] comm: {topo.describe()}", flush=True)
        print(f"[hadpsgd] {cfg.train.algo} on {topo.size} learners ({topo.num_nodes} nodes), "
              f"{cfg.model.preset} BLSTM with {count_parameters(model):,} parameters, "
              f"{len(train_set):,} training chunks, global batch "
              f"{cfg.train.batch_size * topo.size}, peak lr {schedule.peak:g}", flush=True)
    with algo:
        history = trainer.run()
    metrics.close()
    if topo.rank == 0:
        first, last = history[0], history[-1]
        print(f"[hadpsgd] done in {time.perf_counter() - start:.1f} s: held-out loss "
              f"{first.loss:.4f} (first evaluation) -> {last.loss:.4f} (last), frame accuracy "
              f"{last.accuracy:.4f}\n[hadpsgd] metrics: {metrics.path}\n"
              f"[hadpsgd] checkpoint: {trainer.last_checkpoint}\n"
              f"[hadpsgd] config: {out_dir / 'config.json'}", flush=True)
    return trainer


def _resume(trainer: Trainer, cfg: RunConfig, topo: comm.Topology, out_dir: os.PathLike) -> None:
    path = latest_checkpoint(trainer.ckpt_dir) if cfg.train.resume == "auto" else cfg.train.resume
    if path is None:
        if topo.rank == 0:
            print(f"[hadpsgd] --resume auto: no checkpoint in {trainer.ckpt_dir}, starting fresh")
        return
    state = load_checkpoint(path)
    if state.get("world_size") != topo.size:
        raise ValueError(
            f"checkpoint {path} was written by {state.get('world_size')} learners; resume it "
            f"with the same number of ranks (-np {state.get('world_size')}), not {topo.size}"
        )
    trainer.load_state_dict(state)
    if topo.rank == 0:
        print(f"[hadpsgd] resumed from {path} at step {trainer.pos.global_step}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    cfg = parse_config(argv)
    try:
        # A super-learner is a node; --super-learner-size regroups ranks like emulated nodes.
        rpn = cfg.algo.super_learner_size or cfg.comm.ranks_per_node
        topo = comm.init(rpn, cfg.comm.device, cfg.comm.intra_backend,
                         cfg.comm.hier_algo, cfg.comm.bucket_mb)
    except comm.TopologyError as err:
        print(f"hadpsgd: error: {err}", file=sys.stderr)
        return 2
    try:
        train(cfg, topo)
    except BaseException as err:  # noqa: BLE001 - every failure must end every rank
        user = isinstance(err, USER_ERRORS)
        prefix = f"hadpsgd: rank {topo.rank}: error: " if topo.size > 1 else "hadpsgd: error: "
        if not user or os.environ.get("HADPSGD_DEBUG"):
            traceback.print_exc()
        print(f"{prefix}{err}", file=sys.stderr, flush=True)
        if topo.size > 1:
            # The peers may be blocked in a collective this rank will never join.
            topo.abort(2 if user else 1)
        return 2 if user else 1
    topo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
