"""Broadcast, gather and allgather of picklable objects with a deadline.

Paths, labels, checkpoint parts: anything small enough to pickle in one message. Tensors
travel as host tensors (:func:`to_host`): a pickled CUDA tensor would be unpickled onto the
*receiver's* GPU of the same index, making a CUDA context on every GPU of rank 0's host and
holding every rank's copy there (BMUF's checkpoint gathers each node's model and optimizer
state).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

from hadpsgd.comm.deadline import Watchdog


def to_host(obj: Any) -> Any:
    """``obj`` with every tensor inside it (dicts, lists, tuples) a detached host tensor.

    Host tensors are kept as they are (no copy); device tensors are copied to host memory.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_host(v) for v in obj]
    if isinstance(obj, tuple):
        items = [to_host(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(to_host(obj))


def bcast_object(comm: Any, watchdog: Watchdog, obj: Any, root: int = 0,
                 group: list[int] | None = None) -> Any:
    """Broadcast ``obj`` from ``root`` over ``comm``; every wait has the watchdog's deadline.

    ``group`` lists the world ranks of ``comm`` (for naming a missing one); default: all.
    """
    if comm.Get_size() == 1:
        return obj
    rank = comm.Get_rank()
    payload = _pickle(obj) if rank == root else b""
    length = np.array([len(payload)], dtype=np.int64)
    watchdog.wait(comm.Ibcast(length, root=root), "object broadcast (length)", group)
    data = (np.frombuffer(payload, dtype=np.uint8).copy() if rank == root
            else np.empty(int(length[0]), dtype=np.uint8))
    watchdog.wait(comm.Ibcast(data, root=root), "object broadcast (payload)", group)
    return obj if rank == root else pickle.loads(data.tobytes())


def gather_object(comm: Any, watchdog: Watchdog, obj: Any, root: int = 0,
                  group: list[int] | None = None) -> list[Any] | None:
    """Gather a picklable object from every rank of ``comm`` onto ``root``, in rank order.

    Returns:
        The list on ``root``; None elsewhere.
    """
    size = comm.Get_size()
    if size == 1:
        return [obj]
    payload = np.frombuffer(_pickle(obj), dtype=np.uint8)
    is_root = comm.Get_rank() == root
    lengths = np.empty(size, dtype=np.int64)
    watchdog.wait(comm.Igather(np.array([payload.size], dtype=np.int64), lengths, root=root),
                  "object gather (lengths)", group)
    out = np.empty(int(lengths.sum()) if is_root else 0, dtype=np.uint8)
    watchdog.wait(comm.Igatherv(payload, [out, lengths] if is_root else None, root=root),
                  "object gather (payload)", group)
    if not is_root:
        return None
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [pickle.loads(out[bounds[i]:bounds[i + 1]].tobytes()) for i in range(size)]


def allgather_object(comm: Any, watchdog: Watchdog, obj: Any,
                     group: list[int] | None = None) -> list[Any]:
    """Gather a picklable object from every rank of ``comm`` onto every rank, in rank order."""
    size = comm.Get_size()
    if size == 1:
        return [obj]
    payload = np.frombuffer(_pickle(obj), dtype=np.uint8)
    lengths = np.empty(size, dtype=np.int64)
    watchdog.wait(comm.Iallgather(np.array([payload.size], dtype=np.int64), lengths),
                  "object allgather (lengths)", group)
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    watchdog.wait(comm.Iallgatherv(payload, [out, lengths]), "object allgather (payload)",
                  group)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [pickle.loads(out[bounds[i]:bounds[i + 1]].tobytes()) for i in range(size)]


def every_rank_failed(comm: Any, message: str, wait_s: float) -> list[str] | None:
    """Every rank's ``message`` if every rank of ``comm`` calls this within ``wait_s``.

    For an error before training (a bad flag, a run directory in use): every rank usually
    finds it alike, and can then say it once and exit cleanly instead of aborting the job.
    ``comm`` is a communicator used for nothing else, so that a rank that went on elsewhere
    (and never comes) leaves no collective mismatched: the caller then aborts as usual.

    Returns:
        The messages by rank, or None if some rank did not come within ``wait_s``.
    """
    import time

    request = comm.Ibarrier()
    end = time.monotonic() + wait_s
    while not request.Test():
        if time.monotonic() > end:
            return None  # the barrier stays pending: the job is about to be aborted
        time.sleep(0.005)
    return comm.allgather(message)


def disagreements(every: list[dict[str, Any]]) -> str:
    """What the ranks' own settings disagree on, as the error to say; ``""`` if nothing.

    ``every`` holds one dict of settings a rank, by rank (an ``allgather_object``). The
    error names the setting, rank 0's value and the ranks with another (their environments
    or command lines differ: an MPMD launch, a per-rank script).
    """
    for key, value in every[0].items():
        others = {r: s.get(key) for r, s in enumerate(every) if s.get(key) != value}
        if others:
            shown = ", ".join(f"rank {r} {v!r}" for r, v in list(others.items())[:4])
            more = f" and {len(others) - 4} more" if len(others) > 4 else ""
            return (f"the ranks disagree on {key}: rank 0 has {value!r}, {shown}{more}; "
                    "start every rank with the same options and HADPSGD_* environment")
    return ""
