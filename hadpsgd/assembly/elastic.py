"""``--on-failure continue``: the survivors of a failure drop the dead and go on.

A learner dies (SIGKILL, a crash, an OOM kill; or freezes, where the runtime's heartbeat
detector is on). Under ``mpirun --with-ft ulfm`` every survivor's next operation that
involves it fails with ``MPI_ERR_PROC_FAILED`` within a fraction of a second. Then, on every
survivor (:func:`recover`):

1. revoke every communicator it uses, so that no survivor waits for one that has given up;
2. shrink the world to the survivors (ULFM's fault-tolerant agreement on who is gone); below
   ``--min-learners`` the job stops as it would have without this option;
3. agree on the newest control point every survivor has a snapshot of
   (:mod:`hadpsgd.train.snapshot`);
4. rebuild the topology on the survivors' world and the run on it (the same configuration,
   the same run directory), and adopt that snapshot as a resume at another world size
   adopts a checkpoint: the deployable model, the optimizer's state and the position, scaled
   to the new global batch;
5. go on training. Checkpoints go on, recording the new world.

What each algorithm does with the new world:

- **SSGD** keeps the per-learner batch: the global batch shrinks with the world, and the
  learning rate follows the recipe's linear scaling (``lr x global batch / --base-batch``),
  as a run started at that size would. The replicas are identical at a control point, so
  nothing is lost but the steps since it.
- **BMUF** restarts its blocks from the global model at the snapshot, among the survivors'
  super-learners, with the block momentum of the new worker count (1 - 1/N' by default);
  the block in flight at the failure is dropped (its local steps are retrained).
  A super-learner that loses a member leaves as a whole (its local model is one node's, and
  BMUF needs nodes of equal size); the others keep their node groups.
- **ADPSGD / H-ADPSGD** are not built for this yet: their learners agree only at meetings, so
  there is no recent state every survivor holds; they stop at a failure (bounded in time).

The data position is scaled to the new global batch (``adopt``): in the interrupted epoch,
every chunk is trained at least once, and fewer than one new global batch of chunks twice.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from hadpsgd import comm
from hadpsgd.assembly.build import build_trainer
from hadpsgd.assembly.resume import adopt
from hadpsgd.assembly.runlock import release_runs
from hadpsgd.comm import ulfm
from hadpsgd.config import RunConfig
from hadpsgd.train.loop import Trainer


class LeftTheJob(RuntimeError):
    """This learner's super-learner lost a member and left (BMUF); the others go on."""


class NotEnoughLearners(RuntimeError):
    """Fewer learners survived than ``--min-learners``: the job stops as without the option."""


def min_learners(cfg: RunConfig, started: int) -> int:
    """``--min-learners`` as a count: itself (>= 1), or that fraction of ``started``."""
    value = cfg.train.min_learners
    return int(value) if value >= 1 else max(1, math.ceil(value * started))


def recover(cfg: RunConfig, topo: comm.Topology, trainer: Trainer, err: BaseException,
            started: int) -> tuple[comm.Topology, Trainer]:
    """Drop the dead learners and rebuild the run among the survivors (collective).

    Args:
        cfg: The run's configuration.
        topo: The topology the failure happened in.
        trainer: The trainer it happened in (its snapshots are read).
        err: The failure (an ``MPI_ERR_PROC_FAILED`` or ``MPI_ERR_REVOKED``).
        started: The number of learners the job started with.

    Returns:
        The survivors' topology and trainer, positioned at the agreed snapshot.

    Raises:
        NotEnoughLearners: Below ``--min-learners``.
    """
    t0 = time.monotonic()
    ulfm.revoke(topo.communicators())
    _quietly(trainer.algo.close)  # background threads see the revoked channels and end
    old_hosts = list(topo.hosts)
    world, gone_now = ulfm.shrink(topo.comm)
    gone = [topo.launch_ranks[r] for r in gone_now]  # processes keep their launch ranks
    lost = ", ".join(f"rank {topo.launch_ranks[r]} ({old_hosts[r]})" for r in gone_now)
    # BMUF: a super-learner that lost a member leaves as a whole (its local model is one
    # node's, and BMUF needs nodes of equal size); SSGD keeps every survivor.
    damaged = any(r in gone_now for r in topo.node_ranks)
    leaves = cfg.train.algo == "bmuf" and damaged and topo.num_nodes > 1
    world = ulfm.keep(world, not leaves)
    if world is None:
        raise LeftTheJob(f"rank {topo.launch_ranks[topo.rank]}: super-learner {topo.node} "
                         f"lost learner(s) {lost} and leaves the job as a whole; the other "
                         "super-learners go on")
    survivors = world.Get_size()
    need = min_learners(cfg, started)
    if survivors < need:
        raise NotEnoughLearners(
            f"learner(s) {lost} failed ({err}); {survivors} survive, fewer than --min-learners "
            f"{need}: stopping. Resume from the last checkpoint with --resume auto (at "
            "another -np: --allow-resume-change np)")
    assert trainer.snapshots is not None
    step = ulfm.agree_min(world, trainer.snapshots.latest_step)
    snapshot = trainer.snapshots.at(step)
    _quietly(trainer.metrics.close)
    release_runs()  # the new rank 0 takes the run directory's lock (maybe another process)
    options = cfg.algo_options()
    new = comm.init(options.ranks_per_node() or cfg.comm.ranks_per_node, cfg.comm.device,
                    cfg.comm.intra_backend, cfg.comm.hier_algo, cfg.comm.bucket_mb, base=world,
                    node_hint=topo.node if topo.emulated else None)
    continued = _continuing(cfg)
    rebuilt = build_trainer(continued, new)
    summary = adopt(rebuilt, snapshot, same_optimizer=True)
    rebuilt.metrics.write("failure", step, learners=new.size, lost=gone,
                          hosts=[old_hosts[r] for r in gone_now],
                          recovery_s=round(time.monotonic() - t0, 3))
    if new.rank == 0:
        print(f"[hadpsgd] failure: learner(s) {lost} gone at step "
              f"{trainer.pos.global_step}; {new.size} learners go on ({new.num_nodes} nodes, "
              f"global batch {cfg.train.batch_size * new.size}) from the control point at "
              f"step {step} ({trainer.pos.global_step - step} steps retrained), after "
              f"{time.monotonic() - t0:.2f} s: {summary}", file=sys.stdout, flush=True)
    return new, rebuilt


def _continuing(cfg: RunConfig) -> RunConfig:
    """``cfg`` for the rebuilt run: the same run directory, continued, not started afresh."""
    import copy

    cont = copy.copy(cfg)
    cont.train = copy.copy(cfg.train)
    cont.train.resume = "auto"  # the directory holds this very run: no "run exists" refusal
    cont.train.overwrite = False
    return cont


def _quietly(fn: Any) -> None:
    """Call ``fn``; what fails there fails because of the dead peer, and is moot now."""
    try:
        fn()
    except Exception:  # noqa: BLE001, S110 - a revoked channel's error on the way out
        pass
