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
from hadpsgd.train.checkpoint import CheckpointError
from hadpsgd.train.loop import NonFiniteError
from hadpsgd.train.setup import (
    build_optimizer,
    check_steps,
    make_out_dir,
    resolve_data,
    validate_data,
)
from hadpsgd.train.stop import EXIT_STOPPED, FLAG

# Errors a user causes (bad flag, file, layout): reported as one line, without a traceback.
USER_ERRORS = (ConfigError, FeatureFileError, FileNotFoundError, comm.TopologyError,
               CheckpointError, ImportError, ValueError)
# Failures whose message says everything: one line, no traceback, exit code 1.
CLEAN_ERRORS = (NonFiniteError, comm.CommTimeoutError)

EXIT_USER_ERROR = 2
"""Bad flag, file or layout: nothing was trained."""


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
    # Every bad input must stop the run here, before a model or output directory exists.
    check_steps(train_set, heldout_set, cfg.train.batch_size, topo.size)
    validate_data([train_set.file, heldout_set.file], topo)
    # Only rank 0's initial values matter (the algorithm broadcasts them), but seeding all
    # ranks keeps single-process runs reproducible too.
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model.preset, train_set.file.feat_dim,
                        train_set.file.num_classes).to(topo.device)
    algo_cls = algorithms.get(cfg.train.algo)
    algo = algo_cls(model, build_optimizer(cfg.optim, model), topo, **algo_cls.options_from(cfg))
    out_dir = make_out_dir(cfg, topo)
    metrics = MetricsWriter(out_dir, enabled=topo.rank == 0, tensorboard=cfg.train.tensorboard)
    # The recipe scales with the batch behind one optimizer update, which the algorithm knows.
    schedule = LRSchedule(cfg.optim.lr, cfg.optim.base_batch,
                          algo.update_batch(cfg.train.batch_size),
                          cfg.optim.warmup_epochs, cfg.optim.anneal)
    opts = LoopOptions(epochs=cfg.train.epochs, batch_size=cfg.train.batch_size,
                       seed=cfg.train.seed, max_steps=cfg.train.max_steps,
                       log_every=cfg.train.log_every, checkpoint_every=cfg.train.checkpoint_every,
                       progress=cfg.train.progress, num_workers=cfg.data.num_workers,
                       control_every=cfg.train.control_every,
                       max_nonfinite=cfg.train.max_nonfinite,
                       keep_checkpoints=cfg.train.keep_checkpoints)
    trainer = Trainer(algo, topo, train_set, heldout_set, schedule, opts, out_dir, metrics,
                      config=to_dict(cfg))
    if cfg.train.resume:
        _resume(trainer, cfg, topo, out_dir)
    if topo.rank == 0:
        print(f"[hadpsgd] comm: {topo.describe()}", flush=True)
        for note in topo.notes:  # a slower path than asked for, and how to get the fast one
            print(f"[hadpsgd] note: {note}", flush=True)
        print(f"[hadpsgd] {cfg.train.algo} on {topo.size} learners ({topo.num_nodes} nodes), "
              f"{cfg.model.preset} BLSTM with {count_parameters(model):,} parameters, "
              f"{len(train_set):,} training chunks, global batch "
              f"{cfg.train.batch_size * topo.size}, peak lr {schedule.peak:g}", flush=True)
    with algo:
        history = trainer.run()
    metrics.close()
    if trainer.stopped_by:
        return trainer
    if topo.rank == 0:
        first, last = history[0], history[-1]
        print(f"[hadpsgd] done in {time.perf_counter() - start:.1f} s: held-out loss "
              f"{first.loss:.4f} (first evaluation) -> {last.loss:.4f} (last), frame accuracy "
              f"{last.accuracy:.4f}\n[hadpsgd] metrics: {metrics.path}\n"
              f"[hadpsgd] checkpoint: {trainer.last_checkpoint}\n"
              f"[hadpsgd] config: {out_dir / 'config.json'}", flush=True)
    return trainer


def _resume(trainer: Trainer, cfg: RunConfig, topo: comm.Topology, out_dir: os.PathLike) -> None:
    """Load the checkpoint named by --resume; rank 0 picks and verifies, everyone loads it."""
    path = None
    if topo.rank == 0:
        if cfg.train.resume == "auto":
            path = latest_checkpoint(trainer.ckpt_dir,
                                     report=lambda msg: print(f"[hadpsgd] {msg}", flush=True))
        else:
            path = cfg.train.resume
            load_checkpoint(path, verify=True)  # fail here, naming it, if it is bad
    path = topo.bcast_object(path, root=0)
    if path is None:
        if topo.rank == 0:
            print(f"[hadpsgd] --resume auto: no complete checkpoint in {trainer.ckpt_dir}, "
                  "starting fresh", flush=True)
        return
    state = load_checkpoint(path, verify=False)  # rank 0 verified the checksums
    old_world, old_algo = state.get("world_size"), state.get("algo", {}).get("name")
    changed = []
    if old_world != topo.size:
        changed.append(f"{old_world} learners (now {topo.size}; same -np {old_world} resumes "
                       "exactly)")
    if old_algo != cfg.train.algo:
        changed.append(f"--algo {old_algo} (now {cfg.train.algo})")
    if changed and not cfg.train.allow_resume_change:
        raise ConfigError(f"checkpoint {path} was written with {' and '.join(changed)}; "
                          "resume it as it was written, or pass --allow-resume-change to carry "
                          "over its model and epoch (not an exact resume)")
    if changed:
        same_opt = state["config"]["optim"]["optimizer"] == cfg.optim.optimizer
        summary = trainer.adopt(state, same_optimizer=same_opt)
        if topo.rank == 0:
            print(f"[hadpsgd] resumed from {path} with a change ({'; '.join(changed)}): "
                  f"{summary}", flush=True)
        return
    trainer.load_state_dict(state)
    if topo.rank == 0:
        print(f"[hadpsgd] resumed from {path} at step {trainer.pos.global_step}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code.

    0: trained to the end. 75: stopped on a signal after writing a checkpoint (run again with
    ``--resume auto``). 2: a bad flag, file or layout, found before training. 1: a failure
    during training; with more than one rank the whole job is aborted so no peer is left
    waiting in a collective.
    """
    cfg = parse_config(argv)
    try:
        # A super-learner is a node; --super-learner-size regroups ranks like emulated nodes.
        rpn = cfg.algo.super_learner_size or cfg.comm.ranks_per_node
        topo = comm.init(rpn, cfg.comm.device, cfg.comm.intra_backend,
                         cfg.comm.hier_algo, cfg.comm.bucket_mb)
    except comm.TopologyError as err:
        print(f"hadpsgd: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    FLAG.install()
    try:
        trainer = train(cfg, topo)
    except BaseException as err:  # noqa: BLE001 - every failure must end every rank
        user = isinstance(err, USER_ERRORS) and not isinstance(err, CLEAN_ERRORS)
        prefix = f"hadpsgd: rank {topo.rank}: error: " if topo.size > 1 else "hadpsgd: error: "
        if not (user or isinstance(err, CLEAN_ERRORS)) or os.environ.get("HADPSGD_DEBUG"):
            traceback.print_exc()
        print(f"{prefix}{err or type(err).__name__}", file=sys.stderr, flush=True)
        code = EXIT_USER_ERROR if user else 1
        if topo.size > 1:
            # The peers may be blocked in a collective this rank will never join.
            topo.abort(code)
        return code
    finally:
        FLAG.uninstall()
    topo.close()
    if trainer.stopped_by:
        return EXIT_STOPPED
    return 0


def _run_as_script() -> int:
    """``python -m hadpsgd.run``: like ``python -m mpi4py``, an escaped exception aborts the job.

    :func:`main` handles everything raised while training; this catches the rest (an error
    while importing or setting up, or a failure in another thread's hook) so that no rank is
    left waiting for a peer that is gone.
    """
    import threading

    def thread_failed(args: threading.ExceptHookArgs) -> None:
        traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback)
        _abort_world(1)

    threading.excepthook = thread_failed
    try:
        return main()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        _abort_world(1)
        return 1


def _abort_world(code: int) -> None:
    from hadpsgd.comm.mpi import abort_job, mpi

    MPI = mpi()  # noqa: N806
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        abort_job(MPI.COMM_WORLD, code)


if __name__ == "__main__":
    sys.exit(_run_as_script())
