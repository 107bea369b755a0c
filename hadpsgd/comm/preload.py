"""Imports a run will make anyway, made in a background thread while MPI starts.

The first ``torch.optim`` optimizer a process builds imports ``torch._dynamo`` (its
``Optimizer`` wraps ``step`` with dynamo's graph breaks): about 1 s of pure Python on this
2-core machine, the largest single part of ``hadpsgd.run``'s start-up after ``import torch``
(a profile of ``--preset tiny --max-steps 1``: 1.14 s of its 1.2 s of "data, model and
algorithm" were ``torch.optim.SGD.__init__``). ``MPI_Init`` meanwhile mostly waits for the
other ranks and the runtime with the GIL released (:func:`hadpsgd.comm.startup.init_thread`),
so the import runs beside it (:func:`hadpsgd.comm.init`, for ``hadpsgd.run`` and
``hadpsgd.init()`` alike). The caller joins the thread before it imports anything else:
two threads importing at once could meet in each other's module locks, which Python resolves
by handing one of them a partly initialised module.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence

MODULES: tuple[str, ...] = ("torch._dynamo",)
"""What the thread imports: what every run imports later, and what costs the most."""


class Preload:
    """A daemon thread importing ``modules``; :meth:`join` waits for it (and keeps no error).

    An import that fails here is left for the caller's own import to raise where it belongs,
    with its usual traceback.
    """

    def __init__(self, modules: Sequence[str] = MODULES) -> None:
        self._modules = tuple(modules)
        self._thread = threading.Thread(target=self._run, name="hadpsgd-preload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for name in self._modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the caller's own import raises it properly
                return

    def join(self) -> None:
        """Wait until the imports are done (before the caller imports anything itself)."""
        self._thread.join()


__all__ = ["MODULES", "Preload"]
