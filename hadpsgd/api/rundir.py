"""What an API run leaves behind: the CLI's run directory for a script's own loop.

``hadpsgd.Distributed(..., run_dir=DIR)`` writes what ``python -m hadpsgd.run`` writes into
its ``--out-dir`` for :mod:`hadpsgd.plot` and a user's own tools to read:

- ``config.json``: the algorithm and its resolved options, the optimizer's kind and
  hyper-parameters, the shared options and the world (``train.algo`` and ``world.size`` as
  the CLI's, so ``python -m hadpsgd.plot DIR`` titles it alike);
- ``metrics.jsonl``: a ``train`` record every ``log_every`` steps with the CLI's names
  (``loss``, ``lr``, ``steps_per_s``, ``wire_bytes``, ``internode_bytes``, ... from
  :meth:`hadpsgd.Distributed.metrics`: the same names under every algorithm), an ``eval``
  record for each :meth:`hadpsgd.Distributed.record_eval`, and a ``resume`` record where a
  state was loaded (or where a script started again in the directory of an earlier run), so
  that the plot keeps the second telling of steps trained twice; a ``failure`` record where
  a failure ended the job as rank 0 saw it (its own error, a peer's deadline, a peer that
  left: ``error``, ``exit_code``, ``stopped: the job ended``; the plot marks it). A failure
  that rank 0 never sees (MPI ends the job from another rank first, or rank 0 itself is
  killed) leaves the records up to it and no ``failure`` record.

Rank 0 writes; the other ranks write nothing. The loss is rank 0's own (the CLI's is the
mean of every learner's, which an asynchronous algorithm cannot agree on at any step without
a barrier the API does not impose); the record says so (``loss_of``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hadpsgd.api.options import OptionError
from hadpsgd.comm import World

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: numbers, strings, booleans, lists; anything else as text."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def optimizer_settings(optimizer: Any) -> dict[str, Any]:
    """The first parameter group's hyper-parameters (``lr``, ``betas``, ...), as JSON holds."""
    groups = getattr(optimizer, "param_groups", [])
    first = groups[0] if groups else {}
    return {k: _plain(v) for k, v in first.items() if k != "params"}


def drop_torn_tail(path: Path) -> None:
    """Cut a record that a killed run left half-written at the end of ``path``.

    Records are whole lines, each flushed on its own; a last line without its newline is a
    write the run did not finish. Appending after it would glue the next record onto it.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with path.open("rb+") as fh:
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return
        # Find the last newline from the end, in blocks (records are short).
        pos = size
        while pos > 0:
            start = max(0, pos - 4096)
            fh.seek(start)
            block = fh.read(pos - start)
            cut = block.rfind(b"\n")
            if cut >= 0:
                fh.truncate(start + cut + 1)
                return
            pos = start
        fh.truncate(0)


class RunDirectory:
    """The run directory of a :class:`hadpsgd.Distributed` (rank 0 writes it).

    Args:
        path: The directory (made with its parents if missing).
        topo: The learners (only rank 0 writes).
        config: What ``config.json`` holds (``train.algo`` and ``world.size`` among it).
        log_every: Steps between ``train`` records (``> 0``).

    Raises:
        OptionError: If ``log_every`` is not a positive integer, or ``path`` is a file (naming
            the keyword and the fix), on every rank alike before any file is written.
    """

    def __init__(self, path: str | Path, topo: World, config: dict[str, Any],
                 log_every: int) -> None:
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise OptionError("log_every", f"log_every must be a positive integer (steps "
                                           f"between training records), got {log_every!r}")
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise OptionError("run_dir", f"run_dir {self.path} is a file; give a directory for "
                                         "the run's config.json and metrics.jsonl")
        self.log_every = log_every
        self.enabled = topo.rank == 0
        self._fh: Any = None
        self._tic, self._window = time.perf_counter(), 0
        if not self.enabled:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        metrics = self.path / METRICS_FILE
        drop_torn_tail(metrics)  # a script killed mid-write: the next record starts clean
        earlier = metrics.is_file() and metrics.stat().st_size > 0
        (self.path / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str) + "\n",
                                             encoding="utf-8")
        self._fh = metrics.open("a", encoding="utf-8")
        if earlier:  # a script started again here: its steps replace the earlier run's
            self.write("resume", 0, note="a new start in this run directory")

    def write(self, kind: str, step: int, **values: Any) -> None:
        """Append one record (rank 0; flushed, so a run that dies keeps every line)."""
        if self._fh is None:
            return
        record = {"kind": kind, "step": step, "time": round(time.time(), 3),
                  **{k: _plain(v) for k, v in values.items()}}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def stepped(self, step: int, loss: float, lr: float | None,
                figures: Callable[[], dict[str, float]]) -> None:
        """One more step; every ``log_every`` steps a ``train`` record (rank 0).

        ``figures`` is called only for a record (the algorithm's byte counts and rates).
        """
        self._window += 1
        if not self.enabled or step % self.log_every:
            return
        now = time.perf_counter()
        rate = self._window / max(now - self._tic, 1e-9)
        self._tic, self._window = now, 0
        loss_value = loss if math.isfinite(loss) else None  # NaN: the step had no loss
        self.write("train", step, loss=loss_value, loss_of="rank 0", lr=lr,
                   steps_per_s=round(rate, 3), **figures())

    def resumed(self, step: int) -> None:
        """A state of ``step`` was loaded: the records after it are the earlier telling."""
        self.write("resume", step)

    def close(self) -> None:
        """Close ``metrics.jsonl`` (the records are already on disk)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def api_config(algo: str, options: Any, optimizer: Any, kind: str, topo: World,
               shared: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of an API run: the CLI's keys where they mean the same."""
    opts = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else {}
    return {"api": True,
            "train": {"algo": algo},
            "algo_options": {k: _plain(v) for k, v in opts.items()},
            "optimizer": {"kind": kind, **optimizer_settings(optimizer)},
            "shared": {k: _plain(v) for k, v in shared.items()},
            "world": {"size": topo.size, "nodes": topo.num_nodes,
                      "ranks_per_node": topo.local_size}}


__all__ = ["CONFIG_FILE", "METRICS_FILE", "RunDirectory", "api_config", "drop_torn_tail",
           "optimizer_settings"]
