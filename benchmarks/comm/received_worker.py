"""Bytes each learner sends and receives across super-learners per exchange, by algorithm.

Run by :mod:`benchmarks.comm.received` under mpirun, every rank its own super-learner
(``HADPSGD_RANKS_PER_NODE=1``). For each configuration it builds the algorithm through the
registry on the same model, trains a few steps on random data, and reads the algorithm's own
counters (:meth:`~hadpsgd.algorithms.base.Algorithm.internode_bytes`, what the ``train``
records of ``metrics.jsonl`` carry): SSGD fp32 per step, BMUF per block sync (``tau`` 1, so a
step is a sync; ``hadpsgd.run``'s SGD recipe, so the model's progress travels and the
momentum buffer stays local) for each ``--wire``, ADPSGD per gossip exchange. Rank 0 prints
one JSON line per configuration with the largest figure of any rank (a learner's worst case).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from hadpsgd import comm
from hadpsgd.algorithms import build
from hadpsgd.models import build_model

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "ssgd fp32": ("ssgd", {}),
    "bmuf fp32": ("bmuf", {"wire": "fp32"}),
    "bmuf int8": ("bmuf", {"wire": "int8"}),
    "bmuf int4": ("bmuf", {"wire": "int4"}),
    "bmuf topk 1/16": ("bmuf", {"wire": "topk", "topk_fraction": 1 / 16}),
    "bmuf topk 1/64": ("bmuf", {"wire": "topk", "topk_fraction": 1 / 64}),
    "adpsgd fp32": ("adpsgd", {}),
}
"""Configuration name -> (algorithm, its options)."""


def measure(name: str, a: argparse.Namespace, topo: comm.Topology) -> dict[str, Any]:
    """Train ``a.steps`` steps of configuration ``name``; its bytes per exchange on this rank."""
    algo_name, options = CONFIGS[name]
    if algo_name == "bmuf":  # hadpsgd.run's SGD recipe: the momentum buffer stays local
        options = {**options, "sync_period": 1, "adam_moments": "local"}
    torch.manual_seed(0)
    model = build_model(a.preset, a.feat_dim, a.classes)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    algo = build(algo_name, model, opt, topo, **options)
    gen = torch.Generator().manual_seed(topo.rank)
    # ADPSGD's gossip pairs whoever is ready: step on (bounded) until this leader exchanged
    # once, so a count per exchange exists on a loaded machine too.
    more = 20 * a.steps if algo_name == "adpsgd" else 0
    for step in range(a.steps + more):
        if step >= a.steps and (algo.thread is None or algo.thread.exchanges > 0):
            break
        x = torch.randn(a.batch, a.chunk_len, a.feat_dim, generator=gen)
        y = torch.randint(0, a.classes, (a.batch, a.chunk_len), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, a.classes), y.reshape(-1))
        loss.backward()
        algo.step()
        algo.zero_grad()
    sent, received = algo.internode_bytes()
    if algo_name == "adpsgd":
        algo.close()  # the gossip thread's last exchange ends here: count it
        sent, received = algo.internode_bytes()
        events = max(1, algo.thread.exchanges if algo.thread is not None else 0)
    else:
        events = a.steps
        algo.close()
    params = sum(p.numel() for p in model.parameters())
    return {"config": name, "sent": sent / events, "received": received / events,
            "events": events, "params": params}


def main() -> None:
    """Every configuration on this rank; rank 0 prints one JSON line each."""
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--feat-dim", type=int, default=260)
    p.add_argument("--classes", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--chunk-len", type=int, default=11)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    a = p.parse_args()
    topo = comm.init(device="cpu")
    for name in a.configs:
        row = measure(name, a, topo)
        rows = topo.allgather_object(row)
        if topo.rank == 0:
            print(json.dumps({**row, "learners": topo.size, "nodes": topo.num_nodes,
                              "sent": max(r["sent"] for r in rows),
                              "received": max(r["received"] for r in rows),
                              "received_min": min(r["received"] for r in rows)}), flush=True)
    topo.close()


if __name__ == "__main__":
    main()
