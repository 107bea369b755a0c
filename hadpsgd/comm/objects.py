"""Broadcast of small picklable objects with a deadline (paths, ids, configuration)."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from hadpsgd.comm.deadline import Watchdog


def bcast_object(comm: Any, watchdog: Watchdog, obj: Any, root: int = 0,
                 group: list[int] | None = None) -> Any:
    """Broadcast ``obj`` from ``root`` over ``comm``; every wait has the watchdog's deadline.

    ``group`` lists the world ranks of ``comm`` (for naming a missing one); default: all.
    """
    if comm.Get_size() == 1:
        return obj
    rank = comm.Get_rank()
    payload = pickle.dumps(obj) if rank == root else b""
    length = np.array([len(payload)], dtype=np.int64)
    watchdog.wait(comm.Ibcast(length, root=root), "object broadcast (length)", group)
    data = (np.frombuffer(payload, dtype=np.uint8).copy() if rank == root
            else np.empty(int(length[0]), dtype=np.uint8))
    watchdog.wait(comm.Ibcast(data, root=root), "object broadcast (payload)", group)
    return obj if rank == root else pickle.loads(data.tobytes())
