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
  the block in flight at the failure is retrained: the data position goes back to the
  step of the snapshot's global model (the last block sync), so that the chunks no model
  took in are trained again by the survivors.
  A super-learner that loses a member leaves as a whole (its local model is one node's, and
  BMUF needs nodes of equal size); the others keep their node groups.
- **ADPSGD / H-ADPSGD** go on from each survivor's own replica as it is at the failure
  (nothing is rolled back: the learners never agreed on a common state, and need not). The
  ring re-forms among the survivors' super-learners; an H-ADPSGD super-learner that lost a
  member leaves as a whole, as in BMUF. A gossip exchange with the dead learner that did not
  complete is not applied (the delta is computed only from a completed swap); one that
  completed is a valid average with the dead learner's last model and stays.

SSGD and BMUF go on at the new global batch right after the chunks the snapshot had
trained (``adopt``: a chunk offset into the epoch's order; BMUF's: those its global model
took in), so the interrupted epoch trains every chunk exactly once. ADPSGD's survivors pool
the slots each trained since the last meeting and hand out the slots none of them trained
next (:func:`~hadpsgd.train.pooled.reorder`): the dead learner's slots go back to the pool
(counted in the failure record as ``returned_slots``), and no survivor's slot is trained
twice.
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
from hadpsgd.cli import ConfigError
from hadpsgd.comm import frozen, ulfm
from hadpsgd.config import RunConfig
from hadpsgd.train.loop import Trainer
from hadpsgd.train.pooled import PooledPlan, reorder
from hadpsgd.train.snapshot import deployed_view, learner_state


class LeftTheJob(RuntimeError):
    """This learner's super-learner lost a member and left (BMUF); the others go on.

    Attributes:
        stops: No learner goes on (every super-learner lost a member): the job has failed.
        say: Whether this learner prints the line (one of the leavers, where all leave).
    """

    def __init__(self, message: str, stops: bool = False, say: bool = True) -> None:
        super().__init__(message)
        self.stops = stops
        self.say = say


class NotEnoughLearners(RuntimeError):
    """Fewer learners survived than ``--min-learners``: the job stops, its state checkpointed.

    Attributes:
        say: Whether this learner prints the line (the survivors' rank 0).
    """

    def __init__(self, message: str, say: bool) -> None:
        super().__init__(message)
        self.say = say


def check_backend(topo: comm.Topology) -> None:
    """Refuse an intra-node collective that a failure cannot interrupt (``continue``).

    A learner's death fails its peers' MPI operations (ULFM), which the survivors revoke
    and shrink past; a torch.distributed collective knows nothing of it. With NCCL inside a
    node the dead learner's node-mates stay in a kernel that never ends and nothing can
    abort it before the shrink: the job dies at the watchdog. With gloo they wait for
    ``HADPSGD_TIMEOUT``. Through MPI the same collective fails at once and the run goes on.

    The same holds between super-learners that share a host, where a host link carries the
    cross-node leg (NCCL on GPUs: the block average, ADPSGD's sync, the gossip swap and the
    side channel's twin): flat ADPSGD or BMUF with one learner a node puts every exchange of
    the host's learners there, and a dead learner leaves its host-mates in its kernel.

    Raises:
        ConfigError: Naming the backend, the node's ranks and the fix, on every rank alike
            (the backends and the host link are agreed at start-up).
    """
    link = topo.reducer.host_link
    if link is not None:
        raise ConfigError(
            f"--on-failure continue cannot go on through a failure with {link.name} between "
            f"the super-learners of one host (the host link, {link.hosts} "
            f"host{'s' if link.hosts > 1 else ''}): a dead learner leaves its host-mates in a "
            f"{link.name} collective that nothing aborts before the survivors shrink the "
            "world. Set HADPSGD_HOST_LINK=0 (MPI then carries every leg between "
            "super-learners and its failure mitigation ends the collective at once), or "
            "drop --on-failure continue")
    if topo.intra_backend not in ("nccl", "gloo") or max(topo.node_sizes) == 1:
        return
    stuck = ("an NCCL kernel that never ends (nothing aborts it before the survivors "
             "shrink the world), and the job dies at the watchdog" if topo.intra_backend ==
             "nccl" else "a gloo collective until HADPSGD_TIMEOUT")
    raise ConfigError(
        f"--on-failure continue cannot go on through a failure with {topo.intra_backend} "
        f"inside a node (nodes of {max(topo.node_sizes)} learners): a dead learner leaves "
        f"its node-mates in {stuck}. Use --intra-backend mpi (device tensors are then "
        "staged through host memory and reduced by MPI, whose failure mitigation ends the "
        "collective at once), or drop --on-failure continue")


def min_learners(cfg: RunConfig, started: int) -> int:
    """``--min-learners`` as a count: itself (>= 1), or that fraction of ``started``."""
    value = cfg.failure.min_learners
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
        NotEnoughLearners: Below ``--min-learners``, after a checkpoint of the survivors'
            state.
        LeftTheJob: This learner's super-learner lost a member and leaves (BMUF, H-ADPSGD).
        hadpsgd.comm.ulfm.PeerError: A learner's own error, not a death, started it.
    """
    t0 = time.monotonic()
    ulfm.hold_if_ending()  # this very process is ending for its own error (another thread)
    ulfm.revoke(topo.communicators())
    _quietly(trainer.algo.close)  # background threads see the revoked channels and end
    old_hosts = list(topo.hosts)
    frozen.kill_noted(topo)  # a frozen learner on this host that a peer found at its deadline
    world, gone_now = ulfm.shrink(topo.comm, timeout=topo.timeout)
    # A learner's own error (it revoked the world and joined the shrink to say so) ends
    # every learner with its message: only a dead or frozen learner is gone through.
    ulfm.own_errors(world, topo.launch_ranks[topo.rank], topo.hosts[topo.rank], None)
    frozen.kill_gone(topo, gone_now)  # one the detector found frozen would hold up mpirun
    gone = [topo.launch_ranks[r] for r in gone_now]  # processes keep their launch ranks
    lost = ", ".join(f"rank {topo.launch_ranks[r]} ({old_hosts[r]})" for r in gone_now)
    # BMUF, H-ADPSGD: a super-learner that lost a member leaves as a whole (its local model
    # is one node's, and both need nodes of equal size); SSGD keeps every survivor.
    damaged = any(r in gone_now for r in topo.node_ranks)
    leaves = cfg.train.algo != "ssgd" and damaged and topo.num_nodes > 1
    need = min_learners(cfg, started)
    staying = ulfm.count(world, not leaves)
    first = world.Get_rank() == 0
    world = ulfm.keep(world, not leaves)
    if world is None and staying == 0:
        # Every super-learner lost a member (the soak, round 3: 2 nodes of 2, a learner of
        # each killed): nobody is left to go on, so the job has failed, said once.
        raise LeftTheJob(f"learner(s) {lost} failed and every super-learner lost a member: "
                         "none can go on (BMUF and H-ADPSGD need whole nodes), so the job "
                         "stops; resume from its last checkpoint with --resume auto "
                         "--allow-resume-change np", stops=True, say=first)
    if world is None:
        then = ("go on" if staying >= need else f"are fewer than --min-learners {need}: they "
                "checkpoint their state and stop")
        raise LeftTheJob(f"rank {topo.launch_ranks[topo.rank]}: super-learner {topo.node} "
                         f"lost learner(s) {lost} and leaves the job as a whole; the other "
                         f"{staying} learners {then}")
    pooled = trainer.plan.meets  # ADPSGD's pool: each learner at its own pace
    failed_at = trainer.plan.current_step(trainer.pos)
    if pooled:
        # Each survivor's replica as it is; the data from the first slot nobody trained.
        snapshot = learner_state(trainer)
        start, order, trained = _pooled_position(world, trainer)
        # The learners step at their own pace: the failure is at the furthest survivor's step
        # (the record the plot marks, and the log line, say this one).
        failed_at = step = -ulfm.agree_min(world, -failed_at)
    else:
        assert trainer.snapshots is not None
        step = ulfm.agree_min(world, trainer.snapshots.latest_step)
        snapshot = trainer.snapshots.at(step)
    _quietly(trainer.metrics.close)
    release_runs()  # the new rank 0 takes the run directory's lock (maybe another process)
    options = cfg.algo_options()
    new = comm.init(options.ranks_per_node() or cfg.comm.ranks_per_node, cfg.comm.device,
                    cfg.comm.intra_backend, cfg.comm.hier_algo, cfg.comm.bucket_mb, base=world,
                    node_hint=topo.node if topo.emulated else None)
    ulfm.watch(new)
    continued = _continuing(cfg)
    rebuilt = build_trainer(continued, new)
    if pooled:
        rebuilt.keep_the_pool()  # adopted in the pool's slots, even on one super-learner
    summary = adopt(rebuilt, snapshot, same_optimizer=True, name_block=False)
    # The bytes that crossed the links before the failure count in the run's (its last line).
    rebuilt.algo.carry_bytes(trainer.algo)
    extra: dict[str, Any] = {}
    if pooled:
        summary, returned = _place_pooled(rebuilt, trainer.plan.epoch_base, start, order,
                                          trained)
        # The survivors' steps go on after the failure's, never back past its record.
        rebuilt.pos.global_step = max(rebuilt.pos.global_step, failed_at)
        extra["returned_slots"] = returned
        where = (f"from their own replicas; {returned} slot(s) taken but trained by no "
                 "survivor go back to the data pool")
    else:
        # BMUF mid-block: the snapshot's global model is of the last block sync, and the
        # data position goes back there (adopt): the block in flight is retrained.
        model_step = deployed_view(snapshot)["progress"]["global_step"]
        block = (f", whose global model is of step {model_step}: the block in flight (steps "
                 f"{model_step + 1}-{failed_at}) is retrained" if model_step < step else "")
        where = (f"from the control point at step {step}{block} ({failed_at - model_step} "
                 "steps retrained)")
        # The step the survivors' data went back to (the soak's chunk accounting reads it).
        extra["model_step"] = model_step
    if new.size < need:
        extra["stopped"] = f"below --min-learners {need}"
    rebuilt.metrics.write("failure", step, learners=new.size, lost=gone,
                          hosts=[old_hosts[r] for r in gone_now],
                          recovery_s=round(time.monotonic() - t0, 3), **extra)
    if new.size < need:
        _stop(rebuilt, f"learner(s) {lost} failed at step {failed_at}; {new.size} survive, "
                       f"fewer than --min-learners {need}: stopping", started)
    if new.rank == 0:
        print(f"[hadpsgd] failure: learner(s) {lost} gone at step {failed_at}; {new.size} "
              f"learners go on ({new.num_nodes} nodes, global batch "
              f"{cfg.train.batch_size * new.size}) {where}, after "
              f"{time.monotonic() - t0:.2f} s: {summary}", file=sys.stdout, flush=True)
    return new, rebuilt


def _stop(trainer: Trainer, why: str, started: int) -> None:
    """Below ``--min-learners``: checkpoint the survivors' state and stop (collective).

    The survivors hold a state every one of them agreed on (the snapshot adopted by
    ``trainer``, or ADPSGD's replicas): written as a checkpoint of the survivors' world, a
    resume goes on from there instead of from an older checkpoint, or from nothing.

    Raises:
        NotEnoughLearners: Always, naming the checkpoint and the resume.
    """
    step = trainer.pos.global_step
    with trainer.algo:  # closed after the checkpoint: ADPSGD's average is a collective
        path = trainer.checkpoint()
    trainer.close()
    trainer.metrics.close()
    what = ("their replicas' average as they were at the failure" if trainer.plan.meets
            else "the control point every survivor agreed on")
    size = trainer.topo.size
    raise NotEnoughLearners(
        f"{why}. Their state at step {step} ({what}) is checkpoint {path}: continue with "
        f"--resume auto --allow-resume-change np, at -np {size} now or at -np {started} once "
        "the lost learners' hosts are back", say=trainer.topo.rank == 0)


def _pooled_position(world: Any, trainer: Trainer) -> tuple[int, list[int] | None, set[int]]:
    """What the survivors know of ADPSGD's data pool (collective over ``world``).

    Returns:
        The last meeting's first untrained ticket, the epoch's ticket order, and the slots
        the survivors trained since that meeting.
    """
    plan = trainer.plan
    assert isinstance(plan, PooledPlan)
    every = ulfm.allgather_object(world, (plan.pool_next, list(plan.trained)))
    return (min(s for s, _ in every), plan.order, {slot for _, slots in every for slot in slots})


def _place_pooled(trainer: Trainer, epoch_base: int, start: int, order: list[int] | None,
                  trained: set[int]) -> tuple[str, int]:
    """Position the rebuilt run's pool in the interrupted epoch (see :func:`reorder`).

    ``epoch_base`` is the global step the epoch started at; a global step is one slot per
    node, so the survivors' steps count from the slots trained, at the new node count.

    Returns:
        A summary, and the number of slots the dead learner(s) had taken since the last
        meeting that go back to the pool.
    """
    trainer.keep_the_pool()  # one super-learner left: still the pool's order this epoch
    pos, plan = trainer.pos, trainer.plan
    slots = plan.pooled.slots
    new_order, first = reorder(order, start, trained, slots)
    plan.order, plan.pool_next = new_order, first
    pos.step_in_epoch = first // trainer.topo.num_nodes  # a global step: a slot per node
    pos.global_step = epoch_base + pos.step_in_epoch
    # The dead learner's slots: untrained ones among the tickets the survivors went past.
    tickets = list(order) if order is not None else list(range(slots))
    last = max((i for i, s in enumerate(tickets) if s in trained), default=start - 1)
    returned = sum(1 for s in tickets[start:last + 1] if s not in trained)
    return (f"carried over each learner's own replica and optimizer state; epoch {pos.epoch}, "
            f"{first} of {slots} slots trained"), returned


def _continuing(cfg: RunConfig) -> RunConfig:
    """``cfg`` for the rebuilt run: the same run directory, continued, not started afresh."""
    import copy

    cont = copy.copy(cfg)
    cont.checkpoint = copy.copy(cfg.checkpoint)  # the caller's configuration stays as it was
    cont.checkpoint.resume = "auto"  # the directory holds this very run: no "run exists" refusal
    cont.checkpoint.overwrite = False
    return cont


def _quietly(fn: Any) -> None:
    """Call ``fn``; what fails there fails because of the dead peer, and is moot now."""
    try:
        fn()
    except Exception:  # noqa: BLE001, S110 - a revoked channel's error on the way out
        pass
