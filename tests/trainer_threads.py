"""The main command's trainer on learners as threads, and every learner's end state.

``train_on_threads(flags, size)`` assembles a run as ``python -m hadpsgd.run`` does
(``parse_config``, the algorithm's layout, ``build_trainer``), trains it to its end on a
:class:`~hadpsgd.comm.threads.ThreadJob` of ``size`` learners, and returns each learner's
:func:`end_state`. ``tests/workers/precision_run.py`` returns the same states under mpirun,
so a check written against them runs on either world. What only processes show (the
command's own endings, kills, hangs, MPI) stays under mpirun.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from hadpsgd import faults
from hadpsgd.assembly import build_trainer, check_layout, resume, resumed_config
from hadpsgd.comm import World
from hadpsgd.comm.threads import ThreadJob, ThreadWorld
from hadpsgd.config import parse_config
from hadpsgd.train import Trainer


def digest(model: torch.nn.Module) -> str:
    """A short hash of the model's parameters (equal hashes: bit-identical replicas)."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def end_state(trainer: Trainer, topo: World, history: list[Any]) -> dict[str, Any]:
    """This learner's end state: its node, digests of its local and evaluated parameters
    (BMUF's global model), its loss scale, overflow and skipped steps, gradient wire bytes,
    last held-out loss and the non-finite steps it saw."""
    algo = trainer.algo
    with algo.evaluation_parameters() as model:
        evaluated = digest(model)
    return {"rank": topo.rank, "node": topo.node, "local": digest(algo.model),
            "evaluated": evaluated, "loss_scale": algo.loss_scale,
            "overflow_steps": algo.scaler.overflow_steps if algo.scaler else 0,
            "skipped_steps": algo.skipped_steps, "grad_wire_bytes": algo.gradsync.wire_bytes,
            "heldout_loss": history[-1].loss, "nonfinite": len(trainer.nonfinite)}


def train(trainer: Trainer, topo: World) -> dict[str, Any]:
    """Train ``trainer`` to its end, close it, and return :func:`end_state`."""
    with trainer.algo:
        history = trainer.run()
    trainer.close()
    trainer.metrics.close()
    return end_state(trainer, topo, history)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the length of the block, as a launch's ``env=``.

    The fault plan (``HADPSGD_FAULT``) is read once a process, so it is read afresh on
    entry and forgotten on exit.
    """
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    faults._PLAN = None  # noqa: SLF001 - the process-wide plan, reread for this job
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        faults._PLAN = None  # noqa: SLF001


def by_node(every: list[dict[str, Any]], key: str) -> dict[int, set[Any]]:
    """``key``'s values among each node's learners."""
    out: dict[int, set[Any]] = {}
    for s in every:
        out.setdefault(s["node"], set()).add(s[key])
    return out


def check_bf16_replicas(layout: str, every: list[dict[str, Any]]) -> None:
    """After a bf16 run: learners that share every step's gradient hold the same bits (the
    world for SSGD, a super-learner for BMUF and H-ADPSGD), BMUF's global model is the same
    everywhere, the held-out loss is finite, and no step was scaled or skipped (bf16 has
    fp32's range). ``layout`` is ssgd, bmuf, adpsgd (one learner a node) or hadpsgd."""
    assert all(math.isfinite(s["heldout_loss"]) for s in every), every
    assert all(len(d) == 1 for d in by_node(every, "local").values()), every
    if layout == "ssgd":
        assert len({s["local"] for s in every}) == 1, every
    if layout == "bmuf":
        assert len({s["evaluated"] for s in every}) == 1, every
    if layout == "adpsgd":  # each learner its own super-learner: gossip, no shared gradient
        assert len({s["local"] for s in every}) == len(every), every
    assert all(s["loss_scale"] == 1.0 and s["skipped_steps"] == 0 for s in every), every


def train_on_threads(flags: list[str], size: int, fault: str | None = None,
                     env: dict[str, str] | None = None,
                     timeout: float = 120.0) -> list[dict[str, Any]]:
    """Train the run ``flags`` describe on ``size`` learners as threads; their end states.

    As ``python -m hadpsgd.run``: a resume (``--resume``) takes its run's configuration and
    is refused at another layout before anything is built, then loads its checkpoint. Nodes
    are as the run asks (``--ranks-per-node``, ``--super-learner-size``); without either, one
    node of every learner (one host, as ``comm.init`` finds it). ``fault`` is a
    ``HADPSGD_FAULT`` spec, ``env`` more of the environment, both for this run only.
    """
    cfg, _ = resumed_config(parse_config(flags))
    per_node = cfg.algo_options().ranks_per_node() or cfg.comm.ranks_per_node or size

    def learner(world: ThreadWorld) -> dict[str, Any]:
        if cfg.checkpoint.resume:
            check_layout(cfg, world)
        trainer = build_trainer(cfg, world)
        if cfg.checkpoint.resume:
            resume(trainer, cfg, world)
        return train(trainer, world)

    with environment({**(env or {}), **({"HADPSGD_FAULT": fault} if fault else {})}):
        return ThreadJob(size, per_node, timeout).run(learner)
