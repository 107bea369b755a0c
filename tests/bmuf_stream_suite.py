"""BMUF with overlapped, fragmented and compressed block syncs, as one function of a world.

:func:`run_stream` runs every configuration of ``bmuf_common.STREAM`` and rank 0 writes
``OUT_DIR/<name>.npz``: every rank's local parameters, moments and Adam's ``k`` per element,
the global model, before and after ``finish()``; the fragments' element ranges; the in-run
checks (node members identical after every step, every replica identical after
``finish()``, ``sync()`` a no-op, a mid-run resume through ``state_dict``/``node_state`` bit
exact); whether the means ran in a background thread; and the bytes sent across nodes.
``tests/workers/bmuf_stream.py`` runs it under mpirun (MPI's side channel),
``tests/mpi/test_bmuf_stream.py`` also on learners as threads (the thread world's, which
runs the same codes: :mod:`hadpsgd.comm.thread_links`).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from hadpsgd.algorithms import BMUF
from hadpsgd.comm import World
from tests.workers.bmuf_common import STREAM, group_batch, init_params, unflatten

KEYS = {"sgd": {"m": "momentum_buffer"}, "adam": {"m": "exp_avg", "v": "exp_avg_sq"},
        "adamw": {"m": "exp_avg", "v": "exp_avg_sq"}}
"""The moment buffers, by the reference's names (``tests/bmuf_reference.py``)."""


def make(topo: World, c: dict,
         theta: np.ndarray) -> tuple[torch.nn.Module, torch.optim.Optimizer, BMUF]:
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 3)).double()
    with torch.no_grad():
        for p, v in zip(model.parameters(), unflatten(theta), strict=True):
            p.copy_(torch.from_numpy(v))
    if c["opt"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=c["lr"], momentum=c["momentum"],
                              weight_decay=c["wd"])
    else:
        cls = torch.optim.Adam if c["opt"] == "adam" else torch.optim.AdamW
        opt = cls(model.parameters(), lr=c["lr"], betas=(c["b1"], c["b2"]),
                  weight_decay=c["wd"])
    algo = BMUF(model, opt, topo, sync_period=c["tau"], block_momentum=c["eta"],
                block_lr=c["zeta"], nesterov=c["nesterov"], adam_moments=c["moments"],
                warmup_steps=c["warmup"], warmup_moments=c["warmup_moments"],
                warmup_lr=c["warmup_lr"],
                block_overlap=c["overlap"], fragments=c["fragments"], wire=c["wire"])
    return model, opt, algo


def train_step(topo: World, model: torch.nn.Module, algo: BMUF, t: int) -> None:
    x, y = group_batch(topo.rank, 1, t)
    torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    algo.step()
    algo.zero_grad()


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def state(c: dict, model: torch.nn.Module, opt: torch.optim.Optimizer, key: str) -> np.ndarray:
    parts = []
    for p in model.parameters():
        s = opt.state[p].get(key)
        if key == "step":
            parts.append(torch.full((p.numel(),), float(s) if s is not None else 0.0,
                                    dtype=torch.float64))
        else:
            parts.append(s.reshape(-1) if s is not None
                         else torch.zeros(p.numel(), dtype=torch.float64))
    return torch.cat(parts).numpy().copy()


def snapshot(topo: World, c: dict, model: torch.nn.Module, opt: torch.optim.Optimizer,
             algo: BMUF) -> dict:
    snap = {"local": flat(model)}
    for name, key in KEYS[c["opt"]].items():
        snap[name] = state(c, model, opt, key)
    if c["opt"] != "sgd":
        snap["k"] = state(c, model, opt, "step")
    with algo.evaluation_parameters() as m:
        snap["global"] = flat(m)
    gathered = topo.allgather_object(snap)
    return {k: np.stack([g[k] for g in gathered]) for k in snap}


def run(topo: World, c: dict) -> dict[str, np.ndarray]:
    model, opt, algo = make(topo, c, init_params())
    res: dict[str, np.ndarray] = {}
    digests = []
    stop = c["steps"] if c["kind"] != "resume" else c["warmup"] + 2 * c["tau"] + 1
    for t in range(1, stop + 1):
        train_step(topo, model, algo, t)
        digests.append(flat(model).tobytes())
    if c["kind"] == "resume":
        # Mid-run, with a mean in flight: through torch.save into a fresh model, optimizer and
        # BMUF (other initial values); both go on to the end and must agree bit for bit.
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "algo": algo.state_dict(),
                    "node": algo.node_state()}, buf)
        saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        model2, opt2, algo2 = make(topo, c, init_params() + 1.0)
        model2.load_state_dict(saved["model"])
        algo2.load_state_dict(saved["algo"])
        if saved["node"] is not None:
            algo2.load_node_state(saved["node"])
        for t in range(stop + 1, c["steps"] + 1):
            train_step(topo, model, algo, t)
            train_step(topo, model2, algo2, t)
        for tag, (m_, o_, a_) in {"a": (model, opt, algo), "b": (model2, opt2, algo2)}.items():
            a_.finish()
            for k, v in snapshot(topo, c, m_, o_, a_).items():
                res[f"resume_{tag}_{k}"] = v
        algo2.close()
        algo.close()
        return res
    res.update({f"before_{k}": v for k, v in snapshot(topo, c, model, opt, algo).items()})
    algo.sync()
    again = snapshot(topo, c, model, opt, algo)
    res["sync_noop"] = np.array(all(np.array_equal(v, res[f"before_{k}"])
                                    for k, v in again.items()))
    algo.finish()
    res.update({f"after_{k}": v for k, v in snapshot(topo, c, model, opt, algo).items()})
    gathered = topo.allgather_object((topo.node, digests))
    res["node_ok"] = np.array(all(g[1] == h[1] for g in gathered for h in gathered
                                  if g[0] == h[0]))
    res["frag_bounds"] = np.array([f.spans[torch.float64] for f in algo.fragments])
    res["background"] = np.array(algo.exchange.side is not None and algo.exchange.side.background)
    res["wire_bytes"] = np.array(algo.metrics()["wire_bytes"])
    res["num_syncs"] = np.array(algo.num_syncs)
    algo.close()
    return res


def run_stream(topo: World, out_dir: Path) -> None:
    """Every configuration of ``STREAM`` on ``topo``; rank 0 writes the results."""
    for c in STREAM:
        result = run(topo, c)
        if topo.rank == 0:
            np.savez(out_dir / f"{c['name']}.npz", **result)
    topo.barrier()
