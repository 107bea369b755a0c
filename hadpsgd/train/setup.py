"""Build the parts of a run from its configuration: data paths, run directory, optimizer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn

from hadpsgd.cli import to_dict
from hadpsgd.comm import Topology
from hadpsgd.config import OptimConfig, RunConfig


def resolve_data(cfg: RunConfig, topo: Topology) -> tuple[Path, Path]:
    """Training and held-out file paths; generates the synthetic default set on first use.

    Rank 0 generates (into a temp dir renamed into place, so an interrupted generation is
    never mistaken for a finished one); the other ranks wait for it under the deadline.

    Raises:
        FileNotFoundError: If a given file does not exist, naming it.
    """
    if cfg.data.train is not None and cfg.data.heldout is not None:
        paths = (Path(cfg.data.train), Path(cfg.data.heldout))
        for flag_name, p in zip(("--train", "--heldout"), paths, strict=True):
            if not p.is_file():
                raise FileNotFoundError(f"{flag_name} {p}: no such file")
        return paths
    from hadpsgd.data import default_dataset

    generated = None
    if topo.rank == 0:
        generated = tuple(str(p) for p in default_dataset())
        print(f"[hadpsgd] synthetic data: {generated[0]}, {generated[1]}", flush=True)
    generated = topo.bcast_object(generated, root=0)
    return Path(generated[0]), Path(generated[1])


def make_out_dir(cfg: RunConfig, topo: Topology) -> Path:
    """Create the run directory (rank 0 picks the default name) and save the resolved config."""
    out = None
    if topo.rank == 0:
        out = Path(cfg.train.out_dir or f"runs/{cfg.train.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
        out.mkdir(parents=True, exist_ok=True)
        resolved = to_dict(cfg)
        resolved["train"]["out_dir"] = str(out)
        resolved["world"] = {"size": topo.size, "num_nodes": topo.num_nodes,
                             "node_sizes": topo.node_sizes, "device": str(topo.device)}
        (out / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
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
