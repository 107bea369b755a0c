"""One measurement of training frames/s: plain PyTorch, or hadpsgd SSGD on every MPI rank.

Run by ``benchmarks/train_throughput.py``; prints one JSON line (rank 0 for the MPI case).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn import functional as F  # noqa: N812

from hadpsgd.models import build_model


def measure(step_fn, steps: int, warmup: int) -> float:
    """Seconds per step, after ``warmup`` untimed steps."""
    for _ in range(warmup):
        step_fn()
    tic = time.perf_counter()
    for _ in range(steps):
        step_fn()
    return (time.perf_counter() - tic) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "ssgd"], required=True)
    p.add_argument("--preset", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chunk-len", type=int, default=21)
    p.add_argument("--feat-dim", type=int, default=260)
    a = p.parse_args()

    torch.manual_seed(0)
    model = build_model(a.preset, a.feat_dim, a.classes)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(a.batch, a.chunk_len, a.feat_dim)
    y = torch.randint(0, a.classes, (a.batch, a.chunk_len))
    rank, size, algo = 0, 1, None
    if a.mode == "ssgd":
        from hadpsgd import comm
        from hadpsgd.algorithms import SSGD

        topo = comm.init(device="cpu")
        rank, size = topo.rank, topo.size
        algo = SSGD(model, opt, topo)

    def step() -> None:
        loss = F.cross_entropy(model(x).reshape(-1, a.classes), y.reshape(-1))
        loss.backward()
        if algo is None:
            opt.step()
            opt.zero_grad()
        else:
            algo.step()
            algo.zero_grad()

    sec = measure(step, a.steps, a.warmup)
    if algo is not None:
        # The slowest rank sets the pace of a synchronous job.
        sec = max(algo.topo.allgather_object(sec))
        algo.close()
    if rank == 0:
        print(json.dumps({"mode": a.mode, "preset": a.preset, "ranks": size,
                          "batch_per_rank": a.batch, "sec_per_step": sec,
                          "threads_per_rank": torch.get_num_threads(),
                          "frames_per_s": a.batch * a.chunk_len * size / sec}), flush=True)


if __name__ == "__main__":
    main()
