"""``hadpsgd.run`` under ``torch.profiler``: a chrome trace of two steady training steps.

Run by :mod:`benchmarks.training.gpu_grid` (under ``mpirun -np 1``)::

    python -m benchmarks.training.gpu_grid_profile --trace T.json --skip 10 -- <hadpsgd.run args>

It runs :func:`hadpsgd.run.main` in this process, the user's command itself, with
:meth:`hadpsgd.train.Trainer.train_step` wrapped so that the profiler's schedule advances
after every step: ``--skip`` steps unrecorded (start-up, cuDNN's first calls), one as the
profiler's warm-up, then two recorded. The step returns the loss read from the device (one
synchronisation a step), so each recorded step holds its own kernels. ``--max-steps`` must
leave at least ``skip + 3`` steps.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch


def main(argv: list[str] | None = None) -> int:
    """Profile two steps of ``hadpsgd.run``; its exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", required=True, help="where the chrome trace goes")
    p.add_argument("--skip", type=int, default=10, help="steps before the profiled ones")
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then hadpsgd.run's flags")
    a = p.parse_args(argv)
    run_args = a.run_args[1:] if a.run_args[:1] == ["--"] else a.run_args

    from torch.profiler import ProfilerActivity, profile, schedule

    from hadpsgd import run
    from hadpsgd.train import Trainer

    device = run_args[run_args.index("--device") + 1] if "--device" in run_args[:-1] else ""
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and device != "cpu":
        acts.append(ProfilerActivity.CUDA)
    prof = profile(activities=acts,
                   schedule=schedule(wait=a.skip, warmup=1, active=2, repeat=1),
                   on_trace_ready=lambda pr: pr.export_chrome_trace(a.trace))
    original = Trainer.train_step

    def train_step(self: Trainer, *args: Any, **kw: Any) -> float:
        value = original(self, *args, **kw)
        prof.step()
        return value

    # A wrapper, not a change to the loop: only this process's class is touched.
    Trainer.train_step = train_step  # type: ignore[method-assign]
    prof.start()
    try:
        return run.main(run_args)
    finally:
        prof.stop()
        Trainer.train_step = original  # type: ignore[method-assign]


if __name__ == "__main__":
    raise SystemExit(main())
