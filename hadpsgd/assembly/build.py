"""Build the parts of a run from its configuration: data, model, algorithm, loop.

Everything a user can get wrong (flags, files, layout) is checked here, before a model or an
output directory exists; :func:`build_trainer` is the whole assembly ``run.py`` calls. The
training loop (:mod:`hadpsgd.train`) takes the built parts and knows no flags.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hadpsgd import faults
from hadpsgd.algorithms import Algorithm
from hadpsgd.api import Distributed
from hadpsgd.assembly import provenance, resume_data, rundir
from hadpsgd.assembly.data import load_data
from hadpsgd.assembly.resume_config import allowed, flatten, resume_checkpoint, saved_config
from hadpsgd.assembly.runlock import RunDirBusy, RunDirUnwritable, lock_run
from hadpsgd.cli import ConfigError, flag, to_dict
from hadpsgd.comm import Topology
from hadpsgd.comm.faulty import FaultyWorld, Injection
from hadpsgd.config import OptimConfig, RunConfig
from hadpsgd.data import PRIORS_FILE, priors_of, save_priors
from hadpsgd.models import build_model
from hadpsgd.models.presets import per_layer_lstm
from hadpsgd.precision import set_tf32
from hadpsgd.train.loop import LoopOptions, Trainer
from hadpsgd.train.metrics import MetricsWriter
from hadpsgd.train.schedule import LRSchedule

_SEEDED_INIT = threading.Lock()
"""Held while a learner seeds torch's (process-wide) generator and draws its initial model."""


def loop_options(cfg: RunConfig) -> LoopOptions:
    """The loop's view of the configuration: each field from the section that holds it."""
    sections = (cfg.train, cfg.checkpoint, cfg.failure, cfg.precision, cfg.data)
    values = {}
    for f in dataclasses.fields(LoopOptions):
        section = next(sec for sec in sections if hasattr(sec, f.name))
        values[f.name] = getattr(section, f.name)
    return LoopOptions(**values)


def build_trainer(cfg: RunConfig, topo: Topology) -> Trainer:
    """Data, model, optimizer, algorithm, run directory, metrics and LR recipe, in a Trainer.

    Raises:
        FeatureFileError, ConfigError, ValueError: For bad input, before anything is written.
    """
    # Each phase is named in a peer's deadline error (a rank frozen or stuck in it).
    with topo.startup("option agreement"):
        check_same_config(cfg, topo)
    if cfg.train.cuda_graph and topo.device.type != "cuda":  # before the run directory
        raise ConfigError(f"--cuda-graph needs a CUDA device, and this learner runs on "
                          f"{topo.device}: drop --cuda-graph, or run on a GPU (--device cuda)")
    with topo.startup("run directory check"):
        check_out_dir(cfg, topo)
    with topo.startup("data checks"):
        faults.startup("startup-data", topo.rank)  # a rank frozen or stuck here (tests)
        train_set, heldout_set = load_data(cfg, topo)
        data_identity = resume_data.identity(train_set.file, heldout_set.file)
        if topo.size > 1:  # a host's own copy of the files may be stale or partial
            resume_data.check_same_data(topo.allgather_object(data_identity), list(topo.hosts))
        if cfg.checkpoint.resume is not None:  # the same paths may hold other data by now
            path = resume_checkpoint(cfg)
            resume_data.check_resume_data(path, saved_config(path) if path else None,
                                          data_identity, allowed(cfg))
    set_tf32(topo.device, cfg.precision.tf32)
    with topo.startup("model broadcast"):
        faults.startup("startup-model", topo.rank)
        # Only rank 0's initial values matter (the algorithm broadcasts them), but seeding all
        # ranks keeps single-process runs reproducible too. torch's generator is the
        # process's: learners that are threads of one process (the in-process world) seed and
        # draw one at a time, so rank 0's model is the seed's there too.
        with _SEEDED_INIT:
            torch.manual_seed(cfg.train.seed)
            model = build_model(cfg.model.preset, train_set.file.feat_dim,
                                train_set.file.num_classes,
                                per_layer=per_layer_lstm(cfg.model.lstm_layout, topo.device)
                                ).to(topo.device)
        # HADPSGD_FAULT's faults in the gossip thread go in at the world's face (the pair
        # channel's exchanges), not as hooks in the algorithm.
        world, clock = gossip_faults(topo)
        dist = build_distributed(cfg, model, build_optimizer(cfg.optim, model), world)
    algo = dist.algorithm
    clock.append(algo)
    with topo.startup("run directory"):
        out_dir = make_out_dir(cfg, topo, train_set.file.path)
    metrics = MetricsWriter(out_dir, enabled=topo.rank == 0, tensorboard=cfg.train.tensorboard)
    # The recipe scales with the batch behind one optimizer update, which the algorithm knows.
    schedule = LRSchedule(cfg.optim.lr, cfg.optim.base_batch,
                          algo.update_batch(cfg.train.batch_size),
                          cfg.optim.warmup_epochs, cfg.optim.anneal, cfg.optim.gradual_warmup)
    return Trainer(dist, topo, train_set, heldout_set, schedule, loop_options(cfg), out_dir,
                   metrics, config={**to_dict(cfg), resume_data.IDENTITY_KEY: data_identity})


def gossip_faults(topo: Topology) -> tuple[Any, list[Algorithm]]:
    """``topo``, or a world that injects ``HADPSGD_FAULT``'s faults at the gossip's exchanges.

    ``raise-gossip`` (an exception in the gossip thread) goes in through a
    :class:`~hadpsgd.comm.faulty.FaultyWorld` at the pair channel's ``exchange``.

    Returns:
        The world to build the algorithm on, and a list to append the algorithm to once
        built: the faults fire by its step count (the step about to be taken), as the
        other points of ``HADPSGD_FAULT`` do.
    """
    built: list[Algorithm] = []
    if not any(f.at == "gossip" for f in faults.plan()):
        return topo, built

    def hit() -> None:
        faults.hit("gossip", topo.rank, built[0].steps if built else 0)

    return FaultyWorld(topo, [Injection("exchange", when=lambda: True, action=hit)]), built


def check_same_config(cfg: RunConfig, topo: Topology) -> None:
    """Refuse ranks started with different options (an MPMD command line, per-rank scripts).

    Each rank parses its own command line, so ``mpirun -np 1 python -m hadpsgd.run ... :
    -np 1 python -m hadpsgd.run ... --lr 0.9`` would train rank 1 at another rate while
    ``config.json`` records rank 0's. The resolved options are compared once, at start-up.

    Raises:
        ConfigError: On every rank alike, naming each option that differs from rank 0's.
    """
    if topo.size == 1:
        return
    every = topo.allgather_object(flatten(to_dict(cfg)))
    differ = []
    for rank, mine in enumerate(every[1:], start=1):
        for name in sorted(set(mine) | set(every[0])):
            if mine.get(name) != every[0].get(name):
                differ.append(f"rank {rank} has {flag(name)} {mine.get(name)} (rank 0 has "
                              f"{every[0].get(name)})")
    if differ:
        shown = "; ".join(differ[:6]) + ("; ..." if len(differ) > 6 else "")
        raise ConfigError(f"the ranks were started with different options: {shown}; start "
                          "every rank with the same hadpsgd.run flags and --config")


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
        # A fresh start where a run is stops here, before it writes even the lock file; any
        # start that may go on (a resume, --overwrite) takes the lock first, so a live run
        # there is named (and two fresh starts racing into an empty directory meet below).
        problem = rundir.start_problem(out, cfg.checkpoint.resume, cfg.checkpoint.overwrite)
        # Writable before the lock: the lock file is the first thing written there.
        problem = problem or rundir.writable_problem(out)
        problem = problem or (_lock_problem(out) if out.is_dir() else None)
    problem = topo.bcast_object(problem, root=0)
    if problem is not None:
        raise ConfigError(problem)


def _lock_problem(out: Path) -> str | None:
    """Take the run directory's lock (rank 0): why not, or None (a no-lock note is said)."""
    try:
        note = lock_run(out, " ".join(sys.argv))
    except (RunDirBusy, RunDirUnwritable) as err:  # said by every rank (rank 0's raise alone
        return str(err)  # would leave the others waiting, or blaming it as a lost learner)
    if note:
        print(f"[hadpsgd] note: {note}", flush=True)
    return None


def make_out_dir(cfg: RunConfig, topo: Topology, train_path: Path | None = None) -> Path:
    """Create the run directory and save the resolved config with this start's provenance.

    Rank 0 picks the default name and writes; with ``train_path`` (the training file) it
    also writes the class priors of its labels (``priors.json``, :mod:`hadpsgd.data.priors`)
    at a fresh start, or when a resumed run has none yet, for decoding.

    Raises:
        ConfigError: On every rank, where another run holds the directory or rank 0 could
            not write it (a full disk), naming it and the way on.
    """
    out, problem = None, None
    if topo.rank == 0:
        out = Path(cfg.train.out_dir or f"runs/{cfg.train.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
        out.mkdir(parents=True, exist_ok=True)
        # Held since check_out_dir where the directory was there; taken now where it is new
        # (two starts racing to make it: the second is refused before writing anything).
        problem = _lock_problem(out)
    problem = topo.bcast_object(problem, root=0)
    if problem is not None:
        raise ConfigError(problem)
    written: tuple[str | None, str | None] = (None, None)
    if topo.rank == 0:
        assert out is not None
        try:
            _write_run_files(cfg, topo, out, train_path)
            written = (str(out), None)
        except OSError as err:  # a full disk: rank 0's alone, said by every rank (exit 2)
            written = (str(out), f"the run directory {out} could not be written "
                                 f"({err.strerror or err}: {err.filename or out}); free space "
                                 "there or fix its permissions, or use another --out-dir, "
                                 "then start again (nothing was trained, no checkpoint was "
                                 "touched)")
    name, problem = topo.bcast_object(written, root=0)
    if problem is not None:
        raise ConfigError(problem)
    return Path(name)


def _write_run_files(cfg: RunConfig, topo: Topology, out: Path,
                     train_path: Path | None) -> None:
    """Rank 0: ``--overwrite``'s clearing, ``config.json`` and ``priors.json`` in ``out``.

    Raises:
        OSError: As a write fails (the caller says it on every rank).
    """
    if cfg.checkpoint.overwrite:
        removed = rundir.clear_run(out)
        if removed:
            print(f"[hadpsgd] --overwrite: deleted {', '.join(removed)} of the run in "
                  f"{out}", flush=True)
    resolved = to_dict(cfg)
    resolved["train"]["out_dir"] = str(out)
    resolved["world"] = {"size": topo.size, "num_nodes": topo.num_nodes,
                         "node_sizes": topo.node_sizes, "device": str(topo.device)}
    changed = provenance.write_config(out / "config.json", resolved,
                                      provenance.entry(topo, cfg.checkpoint.resume))
    if changed and cfg.checkpoint.resume is not None:
        print(f"[hadpsgd] note: this resume runs other software than the run's previous "
              f"start ({'; '.join(changed)}); it goes on, but its steps may differ in the "
              "last bits from an uninterrupted run", flush=True)
    if train_path is not None and (cfg.checkpoint.resume is None
                                   or not (out / PRIORS_FILE).exists()):
        save_priors(priors_of(train_path), out / PRIORS_FILE)


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


def build_distributed(cfg: RunConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                      topo: Topology) -> Distributed:
    """``model`` and ``optimizer`` under ``--algo``'s algorithm, through the public API.

    The CLI is one client of :class:`hadpsgd.Distributed`, as a user's own loop is: the same
    object, built from the run's validated options instead of keywords.
    """
    return Distributed(model, optimizer, cfg.train.algo, topology=topo, **algorithm_kwargs(cfg))


def build_algorithm(cfg: RunConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                    topo: Topology) -> Algorithm:
    """The algorithm ``--algo`` names, with its own options and the shared ones."""
    return build_distributed(cfg, model, optimizer, topo).algorithm


def algorithm_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The constructor keywords of ``--algo``'s algorithm, read from a ``RunConfig``.

    Its own options are the object the configuration built and validated
    (:meth:`RunConfig.algo_options`), handed on as it is; the shared ones come from the
    optimizer and communication sections.
    """
    return {"options": cfg.algo_options(), "max_grad_norm": cfg.optim.max_grad_norm,
            "overlap": cfg.comm.overlap, "grad_bucket_mb": cfg.comm.grad_bucket_mb,
            "precision": cfg.precision.precision, "grad_wire": cfg.comm.grad_wire}
