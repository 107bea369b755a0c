"""``--resume``: the one home of the resume policy (which checkpoint, exact or carried over).

An exact resume needs the checkpoint's world size and algorithm; anything else is refused
unless ``--allow-resume-change``, which carries over the deployable model, the optimizer
state (same optimizer only), and the epoch position: the shards or ADPSGD's pool go on over
the chunks of the interrupted epoch not yet trained (each chunk of the epoch once), at the
checkpoint's global step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hadpsgd.assembly import resume_data
from hadpsgd.assembly.resume_config import allowed, resume_checkpoint
from hadpsgd.cli import ConfigError, flag
from hadpsgd.comm import Topology
from hadpsgd.config import RunConfig
from hadpsgd.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
)
from hadpsgd.train.evaluate import EvalResult
from hadpsgd.train.loop import Position, Trainer
from hadpsgd.train.plan import global_batch_of, trained_chunks
from hadpsgd.train.shards import PART_KEY, load_part
from hadpsgd.train.snapshot import deployed_view


def _say(topo: Topology, msg: str) -> None:
    if topo.rank == 0:
        print(f"[hadpsgd] {msg}", flush=True)


def _find(trainer: Trainer, cfg: RunConfig, topo: Topology) -> str | None:
    """The checkpoint to resume from: rank 0 picks and verifies it, every rank learns it.

    Raises:
        ConfigError: Where ``--resume auto`` finds checkpoints but none is complete: starting
            afresh would silently train another run in their place.
    """
    path, problem = None, None
    if topo.rank == 0:
        if cfg.checkpoint.resume == "auto":
            skipped: list[str] = []
            found = latest_checkpoint(trainer.ckpt_dir, report=skipped.append)
            for line in skipped:
                _say(topo, line)
            path = str(found) if found is not None else None
            if found is None and skipped:
                problem = (
                    f"--resume auto: {trainer.ckpt_dir} holds {len(skipped)} checkpoint(s) and "
                    "none is complete (each is named above), so there is nothing to continue; "
                    "restore one (from a copy), or start the run over with --overwrite (it "
                    "deletes the run's files), or start a new run in another --out-dir")
        else:
            path = cfg.checkpoint.resume
            load_checkpoint(path, verify=True)  # fail here, naming it, if it is bad
    path, problem = topo.bcast_object((path, problem), root=0)
    if problem is not None:
        raise ConfigError(problem)
    return path


def _check_model(path: str, state: dict[str, Any], cfg: RunConfig, trainer: Trainer) -> None:
    """Refuse a checkpoint of another model (preset, or data of other dimensions), by name.

    Raises:
        ConfigError: Naming the checkpoint, what it was written for and the flag to pass.
    """
    saved = state.get("config", {}).get("model", {}).get("preset")
    if saved is not None and saved != cfg.model.preset:
        raise ConfigError(f"checkpoint {path} holds a --preset {saved} model, not the "
                          f"--preset {cfg.model.preset} this run builds: resume with --preset "
                          f"{saved}, or start a new run in another --out-dir")
    mine = trainer.algo.model.state_dict()
    for name, tensor in state.get("model", {}).items():
        if name in mine and tuple(mine[name].shape) != tuple(tensor.shape):
            raise ConfigError(f"checkpoint {path} does not fit this model: {name} is "
                              f"{tuple(tensor.shape)} there and {tuple(mine[name].shape)} "
                              "here (other features or classes in --train); resume with the "
                              "data it was trained on, or start a new run")


def resume(trainer: Trainer, cfg: RunConfig, topo: Topology) -> None:
    """Load the checkpoint named by ``--resume`` into ``trainer`` (every rank alike).

    Raises:
        ConfigError: If the checkpoint was written with another world size or algorithm and
            ``--allow-resume-change`` is not given.
        hadpsgd.train.checkpoint.CheckpointError: If a named checkpoint is bad.
    """
    path = _find(trainer, cfg, topo)
    if path is None:
        _say(topo, f"--resume auto: no checkpoint in {trainer.ckpt_dir} yet, starting "
                   "fresh")
        # An earlier start may have logged steps before it died: they are void from here.
        logged = trainer.metrics.path
        if logged.is_file() and logged.stat().st_size > 0:
            trainer.metrics.resumed_at(0)
        return
    state = load_checkpoint(path, verify=False)  # rank 0 verified the checksums
    _check_model(path, state, cfg, trainer)
    legacy = state.get("node_states")  # gathered into state.pt before parts were sharded
    changed = layout_changes(path, state.get("world_size"),
                             state.get(PART_KEY, len(legacy) if legacy is not None else None),
                             cfg, topo)
    # Allowed by --allow-resume-change (resumed_config refused them otherwise): these change
    # what the saved state means, so it is carried over rather than loaded.
    saved = state.get("config", {})
    old_algo = state.get("algo", {}).get("name")
    if old_algo != cfg.train.algo:
        changed.append(f"--algo {old_algo} (now {cfg.train.algo})")
    for sec, name in (("optim", "optimizer"), ("train", "batch_size"), ("data", "chunk_len")):
        old = saved.get(sec, {}).get(name)
        if old is not None and old != getattr(getattr(cfg, sec), name):
            changed.append(f"{flag(name)} {old} (now {getattr(getattr(cfg, sec), name)})")
    # Other training data under the same path (--allow-resume-change train; refused by
    # build_trainer otherwise): the epoch's order is another one, so carry the model over.
    # Other held-out data changes what is measured, not what is trained: loaded exactly.
    now = trainer.config.get(resume_data.IDENTITY_KEY)
    changed += [f"--{split} data ({what})" for split, what in
                resume_data.data_changes(saved.get(resume_data.IDENTITY_KEY), now or {})
                if split == "train"]
    if changed:
        same_opt = saved.get("optim", {}).get("optimizer") == cfg.optim.optimizer
        summary = adopt(trainer, state, same_optimizer=same_opt)
        trainer.metrics.resumed_at(trainer.pos.global_step)
        _say(topo, f"resumed from {path} with a change ({'; '.join(changed)}): {summary}")
        return
    # Every rank reads its own node's part only: memory does not grow with the nodes.
    trainer.load_state_dict(state, load_part(path, topo.node) if state.get(PART_KEY) else None)
    trainer.metrics.resumed_at(trainer.pos.global_step)
    _say(topo, f"resumed from {path} at step {trainer.pos.global_step}")


def layout_changes(path: str | Path, world: int | None, nodes: int | None, cfg: RunConfig,
                   topo: Topology) -> list[str]:
    """How the checkpoint's layout differs from this job's, in words (empty: it is the same).

    Raises:
        ConfigError: If it differs and ``--allow-resume-change`` does not name ``np``.
    """
    changed = []
    if world is not None and world != topo.size:
        changed.append(f"{world} learners (now {topo.size}; the same -np {world} resumes "
                       "exactly)")
    # Super-learners' own parts (BMUF mid-block: one local state per worker, i.e. node).
    if nodes is not None and nodes != topo.num_nodes:
        changed.append(f"{nodes} super-learners (nodes) each with its own state (now "
                       f"{topo.num_nodes}; the same -np and --ranks-per-node resume exactly)")
    if changed and not {"all", "np"} & allowed(cfg):
        raise ConfigError(f"checkpoint {path} was written with {' and '.join(changed)}; "
                          "resume it as it was written, or pass --allow-resume-change np to "
                          "carry over its model and epoch (not an exact resume)")
    return changed


def check_layout(cfg: RunConfig, topo: Topology) -> None:
    """Refuse a resume at another layout before anything is written (from the manifest).

    Raises:
        ConfigError: As :func:`layout_changes`.
    """
    path = resume_checkpoint(cfg)
    if path is None:
        return
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return  # resume() names the broken checkpoint (or skips it under --resume auto)
    layout_changes(path, manifest.get("world_size"), manifest.get(PART_KEY), cfg, topo)


def adopt(trainer: Trainer, state: dict[str, Any], same_optimizer: bool,
          name_block: bool = True) -> str:
    """Continue from a checkpoint of another world size or algorithm (not exact).

    Takes its deployable model (BMUF's global model), the optimizer state when the optimizer
    is the same kind, the epoch, and the chunks of it trained: the plan (the shards, or
    ADPSGD's pool) goes on over exactly the others, whatever plan and global batch wrote
    the checkpoint (:meth:`~hadpsgd.train.plan.EpochPlan.load_state_dict`), and the global
    steps go on from the checkpoint's; the algorithm's own state starts afresh from the
    weights. Where the deployable model lags the checkpoint's position (BMUF mid-block: the
    global model of the last block sync), the position, the chunks trained and the history
    are those of that model's step (:func:`~hadpsgd.train.snapshot.deployed_view`): the
    block in flight is trained again, and no chunk's progress is lost.

    Args:
        trainer: The trainer to go on in.
        state: The checkpoint's common state, or a failure's snapshot.
        same_optimizer: Whether the optimizer is the state's kind (its state is taken).
        name_block: Whether the summary names the block in flight trained again (a
            failure's line names it from the failure's step instead).

    Returns:
        A one-line summary of what was carried over.
    """
    algo = trainer.algo
    algo.model.load_state_dict(state.get("eval_model") or state["model"])
    kept = ["model"]
    if same_optimizer and "optimizer" in state.get("algo", {}):
        try:
            algo.optimizer.load_state_dict(state["algo"]["optimizer"])
            kept.append("optimizer state")
        except (ValueError, KeyError):
            pass  # a different parameter layout: start the optimizer afresh
    algo.restart_from_model()
    lagged = state["progress"]["global_step"]
    state = deployed_view(state)
    old = Position(**state["progress"])
    old_global = global_batch_of(state) or trainer.opts.batch_size * trainer.topo.size
    new_global = trainer.opts.batch_size * trainer.topo.size
    trainer.history = [EvalResult(**r) for r in state.get("history", [])]
    trainer.pos = Position(old.epoch, old.step_in_epoch, old.global_step)
    trainer.plan.load_state_dict(state, trainer.pos)
    sampler = trainer.sampler
    done = sum(hi - lo for lo, hi in trained_chunks(state, sampler.num_chunks))
    left = len(sampler) - trainer.pos.step_in_epoch
    redo = lagged - old.global_step
    again = (f"; the block in flight (steps {old.global_step + 1}-{lagged}), which its "
             f"global model had not taken in, is trained again" if redo and name_block else "")
    return (f"carried over {', '.join(kept)}{again}; epoch {old.epoch}, {done} of its "
            f"{sampler.num_chunks} chunks trained: the rest in {left} steps of global batch "
            f"{new_global} from step {old.global_step + 1} (was step {old.step_in_epoch} in it "
            f"at global batch {old_global})")
