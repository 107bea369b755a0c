"""BMUF's reference suite as one function of a world (the MPI one or threads).

Runs every configuration of ``tests/workers/bmuf_common.py``'s suite for 5 blocks and a
partial one on float64 models and returns (rank 0) or writes every rank's state before and
after the closing ``finish()``, with the in-run checks (replicas identical right after every
sync, node members identical after every step, bit-exact resume, ``sync()`` a no-op).
``tests/unit/test_bmuf_threads.py`` runs it on learners as threads (no launch);
``tests/workers/bmuf_ref.py`` under mpirun, where ``tests/mpi/test_bmuf.py`` holds the two to
the same results.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import torch

from hadpsgd.algorithms import BMUF, SSGD
from hadpsgd.comm import World
from tests.workers.bmuf_common import SUITES, group_batch, init_params, unflatten


def make_model(theta: np.ndarray) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 3)).double()
    with torch.no_grad():
        for p, v in zip(model.parameters(), unflatten(theta), strict=True):
            p.copy_(torch.from_numpy(v))
    return model


def make_opt(c: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    if c["opt"] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=c["lr"], momentum=c["momentum"],
                               nesterov=bool(c["sgd_nesterov"]), weight_decay=c["wd"])
    cls = torch.optim.Adam if c["opt"] == "adam" else torch.optim.AdamW
    return cls(model.parameters(), lr=c["lr"], betas=(c["b1"], c["b2"]), weight_decay=c["wd"])


def make_bmuf(topo: World, c: dict, model: torch.nn.Module, opt: torch.optim.Optimizer) -> BMUF:
    return BMUF(model, opt, topo, sync_period=c["tau"], block_momentum=c["eta"],
                block_lr=c["zeta"], nesterov=c["nesterov"], adam_moments=c["moments"],
                warmup_steps=c["warmup"], warmup_moments=c["warmup_moments"],
                warmup_lr=c["warmup_lr"])


def train_step(topo: World, model: torch.nn.Module, algo, group: int, t: int) -> None:
    x, y = group_batch(topo.rank * group, group, t)
    out = model(torch.from_numpy(x))
    torch.nn.functional.mse_loss(out, torch.from_numpy(y)).backward()
    algo.step()
    algo.zero_grad()


def flat_params(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer, key: str) -> np.ndarray:
    parts = [opt.state[p][key].reshape(-1) if key in opt.state[p] else torch.zeros(p.numel())
             for p in model.parameters()]
    return torch.cat(parts).numpy().copy()


MOMENT_KEYS = {"sgd": ["momentum_buffer"], "adam": ["exp_avg", "exp_avg_sq"],
               "adamw": ["exp_avg", "exp_avg_sq"]}


def digest(*arrays: np.ndarray) -> str:
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()


def snapshot(topo: World, c: dict, model: torch.nn.Module, opt: torch.optim.Optimizer,
             algo) -> dict:
    snap = {"local": flat_params(model)}
    if c["opt"] == "sgd":
        snap["m"] = flat_state(model, opt, "momentum_buffer")
    else:
        snap["m"] = flat_state(model, opt, "exp_avg")
        snap["v"] = flat_state(model, opt, "exp_avg_sq")
        snap["k"] = np.array(float(opt.state[next(iter(model.parameters()))]["step"]))
    with algo.evaluation_parameters() as m:
        snap["global"] = flat_params(m)
    gathered = topo.allgather_object(snap)
    return {k: np.stack([g[k] for g in gathered]) for k in snap}


def run(topo: World, c: dict, group: int) -> dict[str, np.ndarray]:
    model = make_model(init_params())
    opt = make_opt(c, model)
    algo = make_bmuf(topo, c, model, opt)
    res: dict[str, np.ndarray] = {}
    # Digests are collected locally and gathered once at the end: a collective per step would
    # dominate the run time when ranks outnumber cores.
    step_digests, sync_digests = [], []
    stop = c["steps"] if c["kind"] != "resume" else c["warmup"] + 2 * c["tau"] + 1
    for t in range(1, stop + 1):
        syncs = algo.num_syncs
        train_step(topo, model, algo, group, t)
        local = flat_params(model)
        step_digests.append(digest(local))
        if algo.num_syncs != syncs:  # right after a block sync: every replica identical
            moments = [flat_state(model, opt, k) for k in MOMENT_KEYS[c["opt"]]]
            if c["opt"] != "sgd":  # Adam's k
                moments.append(np.array(float(opt.state[model[0].weight]["step"])))
            if c["moments"] == "local":
                moments = []  # kept per super-learner by design
            with algo.evaluation_parameters() as m:
                sync_digests.append(digest(local, flat_params(m), *moments))
    gathered = topo.allgather_object((topo.node, step_digests, sync_digests))
    replicas_ok = all(g[2] == gathered[0][2] for g in gathered) and len(gathered[0][2]) > 0
    node_ok = all(g[1] == h[1] for g in gathered for h in gathered if g[0] == h[0])
    if c["kind"] == "resume":
        # Mid-block: the state goes through torch.save into a fresh model/optimizer/BMUF whose
        # own initial values differ, then both continue to the end; they must agree bit for bit.
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "algo": algo.state_dict()}, buf)
        state = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        model2 = make_model(init_params() + 1.0)
        opt2 = make_opt(c, model2)
        algo2 = make_bmuf(topo, c, model2, opt2)
        model2.load_state_dict(state["model"])
        algo2.load_state_dict(state["algo"])
        for t in range(stop + 1, c["steps"] + 1):
            train_step(topo, model, algo, group, t)
            train_step(topo, model2, algo2, group, t)
        for name, (m_, o_, a_) in {"a": (model, opt, algo), "b": (model2, opt2, algo2)}.items():
            for k, v in snapshot(topo, c, m_, o_, a_).items():
                res[f"resume_{name}_{k}"] = v
    res.update({f"before_{k}": v for k, v in snapshot(topo, c, model, opt, algo).items()})
    algo.sync()  # what evaluation and checkpoints call: it must not end the block
    again = snapshot(topo, c, model, opt, algo)
    res["sync_noop"] = np.array(all(np.array_equal(v, res[f"before_{k}"])
                                    for k, v in again.items()))
    algo.finish()  # the end of training closes the partial block
    res.update({f"after_{k}": v for k, v in snapshot(topo, c, model, opt, algo).items()})
    res["replicas_ok"] = np.array(replicas_ok)
    res["node_ok"] = np.array(node_ok)
    res["num_syncs"] = np.array(algo.num_syncs)
    if c["kind"] == "ssgd":  # the same data with SSGD, for the degenerate-case comparison
        m2 = make_model(init_params())
        s = SSGD(m2, make_opt(c, m2), topo)
        for t in range(1, c["steps"] + 1):
            train_step(topo, m2, s, group, t)
        res["ssgd"] = np.stack(topo.allgather_object(flat_params(m2)))
    if c["kind"] == "plain" and topo.rank == 0:  # plain Adam on the node's super-batch
        m2 = make_model(init_params())
        o2 = make_opt(c, m2)
        for t in range(1, c["steps"] + 1):
            x, y = group_batch(0, group * topo.local_size, t)
            torch.nn.functional.mse_loss(m2(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            o2.step()
            o2.zero_grad()
        res["plain"] = flat_params(m2)
        res["plain_m"] = flat_state(m2, o2, "exp_avg")
        res["plain_v"] = flat_state(m2, o2, "exp_avg_sq")
    algo.close()
    return res


def run_suite(topo: World, suite: str, out_dir: Path, groups: list[int]) -> None:
    """Every configuration of ``suite`` for every group size (rank 0 writes the npz files)."""
    for group in groups:
        for c in SUITES[suite]:
            result = run(topo, c, group)
            if topo.rank == 0:
                np.savez(out_dir / f"{c['name']}-g{group}.npz", **result)
