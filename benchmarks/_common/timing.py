"""The one step-timing harness of the benchmarks: warm up, line up, read the clock.

Every worker that times something (the comm cases, the training modes, the straggler loop,
the projection's compute step) times it here, so all of them follow the same rules:

- the clock is read only after ``sync`` (CUDA kernels are queued: without waiting for the
  device the clock would stop before the last step's work is done, and start while an
  earlier case's work is still running);
- ranks that must start together pass ``barrier``, called after that ``sync`` and just before
  the clock starts;
- the reduction over ranks (the slowest sets the pace) is left to the caller, which knows its
  communicator.

The training step the workers time (forward, frame cross-entropy, backward, update) is here
too: :func:`training_step`.

torch is imported only inside the functions that need it, so a driver that imports this
module (``lab.projection``) stays quick to start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Step = Callable[[], None]
"""One timed unit: a training step, or one collective."""


def nothing() -> None:
    """Do nothing: the ``sync`` of a CPU device, the ``barrier`` of a lone process."""


def device_sync(device: torch.device | None) -> Callable[[], None]:
    """What waits for ``device``'s queued work: a CUDA synchronize, or :func:`nothing`."""
    if device is None or device.type != "cuda":
        return nothing
    import torch

    return lambda: torch.cuda.synchronize(device)


def warm_up(step: Step, n: int) -> None:
    """Run ``step`` ``n`` times, untimed (lazy allocations, autotuning, first-touch pages)."""
    for _ in range(n):
        step()


def seconds_per_step(step: Step, steps: int, *, warmup: int = 0, sync: Step = nothing,
                     barrier: Step = nothing) -> float:
    """Mean seconds of ``steps`` back-to-back runs of ``step``, after ``warmup`` untimed runs.

    Args:
        step: The timed unit.
        steps: Timed runs (at least 1).
        warmup: Untimed runs first.
        sync: Waits for the device; called before each reading of the clock.
        barrier: Lines the ranks up; called after the first ``sync``, just before the clock
            starts.

    Returns:
        Wall seconds per run on this process (reduce over ranks yourself).
    """
    warm_up(step, warmup)
    sync()
    barrier()
    tic = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - tic) / steps


def step_times(step: Step, steps: int, *, warmup: int = 0,
               sync: Step = nothing) -> list[float]:
    """Seconds of each of ``steps`` runs of ``step``, after ``warmup`` untimed runs.

    For a median: another process on a shared machine can stall any one step, and a mean
    would carry that stall.
    """
    warm_up(step, warmup)
    times = []
    for _ in range(steps):
        sync()
        tic = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - tic)
    return times


def frame_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
               classes: int, precision: str = "fp32") -> torch.Tensor:
    """Cross-entropy over every frame of the sub-sequences ``x`` (batch, frames, features).

    The forward runs under ``precision``'s autocast and the loss from fp32 logits, as
    ``hadpsgd.run``'s loop does.
    """
    from torch.nn import functional as F  # noqa: N812

    from hadpsgd.precision import autocast

    with autocast(precision, x.device):
        logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, classes), y.reshape(-1))


def training_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                  y: torch.Tensor, classes: int, algo: Any = None,
                  precision: str = "fp32") -> Step:
    """One training step on fixed data: forward, loss, backward, update.

    Args:
        model: The model (possibly wrapped, e.g. in DDP, which reduces in ``backward``).
        opt: Its optimizer.
        x: Features, ``(batch, frames, features)``.
        y: Frame labels, ``(batch, frames)``.
        classes: Output classes.
        algo: A hadpsgd algorithm that owns the update (``step``/``zero_grad``), or ``None``
            for the optimizer alone (no communication beyond what the model does itself).
        precision: ``fp32``, ``bf16`` or ``fp16`` (``hadpsgd.precision``). fp16 scales the
            loss: by the algorithm's own loss scale, or without one by
            ``torch.amp.GradScaler`` (what a DDP or plain user runs).

    Returns:
        The step, ready for :func:`seconds_per_step`.
    """
    import torch

    scaler = None
    if precision == "fp16" and algo is None:
        scaler = torch.amp.GradScaler(x.device.type)

    def step() -> None:
        loss = frame_loss(model, x, y, classes, precision)
        if algo is not None:
            (loss * algo.loss_scale).backward()
            algo.step()
            algo.zero_grad()
        elif scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()

    return step
