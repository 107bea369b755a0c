"""One straggler measurement: every rank trains N steps, rank 0 is ``k`` times slower.

Each rank stops its stopwatch after its own N steps (before ``close()``), so its rate is what
it achieved while training; the aggregate is the sum over ranks. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks._common.timing import frame_loss, seconds_per_step
from hadpsgd import algorithms, comm
from hadpsgd.models import build_model


def main() -> None:
    """Parse the options, train with rank 0 slowed down, print the aggregate frames/s."""
    p = argparse.ArgumentParser()
    p.add_argument("--algo", choices=["ssgd", "adpsgd"], required=True)
    p.add_argument("--slowdown", type=float, default=1.0)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--classes", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()

    topo = comm.init(ranks_per_node=1, device="cpu")  # one learner per super-learner
    torch.manual_seed(0)
    model = build_model(a.preset, 260, a.classes)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    algo = algorithms.build(a.algo, model, opt, topo)
    x = torch.randn(a.batch, 21, 260)
    y = torch.randint(0, a.classes, (a.batch, 21))

    def compute() -> None:
        frame_loss(model, x, y, a.classes).backward()

    compute()  # warm-up
    algo.zero_grad()
    base = seconds_per_step(compute, 1)  # the cost of one step's compute on this rank
    algo.zero_grad()

    def step() -> None:
        compute()
        if topo.rank == 0 and a.slowdown > 1:
            time.sleep((a.slowdown - 1) * base)  # the straggler: k times the compute
        algo.step()
        algo.zero_grad()

    # Every rank's own pace: each stops its clock after its own steps, before close().
    sec = seconds_per_step(step, a.steps, barrier=topo.barrier)
    algo.close()
    rates = topo.allgather_object(a.batch * 21 / sec)
    if topo.rank == 0:
        print(json.dumps({"algo": a.algo, "slowdown": a.slowdown, "ranks": topo.size,
                          "frames_per_s": sum(rates), "per_rank": rates}), flush=True)


if __name__ == "__main__":
    main()
