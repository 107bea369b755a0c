"""Metrics sinks: a JSONL file (always) and TensorBoard (optional), written by rank 0 only."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hadpsgd.api.rundir import drop_torn_tail


class MetricsWriter:
    """Appends one JSON object per record to ``metrics.jsonl``; mirrors scalars to TensorBoard.

    Args:
        out_dir: Run directory.
        enabled: False on ranks other than 0: every call is then a no-op.
        tensorboard: Also write TensorBoard events under ``out_dir/tb``.

    Raises:
        ImportError: If ``tensorboard`` is requested but not installed, with the fix.
    """

    def __init__(self, out_dir: Path, enabled: bool = True, tensorboard: bool = False) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb: Any = None
        self._fh = None
        if not enabled:
            return
        drop_torn_tail(self.path)
        self._fh = self.path.open("a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError(
                    "--tensorboard needs the tensorboard package: pip install 'hadpsgd[tb]'"
                ) from err
            self._tb_dir = str(Path(out_dir) / "tb")
            self._tb = SummaryWriter(log_dir=self._tb_dir)

    def write(self, kind: str, step: int, **values: Any) -> None:
        """Record ``values`` of ``kind`` (``train``, ``eval``, ...) at global ``step``."""
        if not self.enabled or self._fh is None:
            return
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        self._fh.write(json.dumps(record) + "\n")
        # Flushed per record: a run that dies keeps every line written before.
        self._fh.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def resumed_at(self, step: int) -> None:
        """A resume from the checkpoint of ``step``: later records of the earlier run are void.

        A ``resume`` record marks the place in ``metrics.jsonl``; TensorBoard's events after
        ``step`` are purged, so its curves do not zig-zag over the steps trained twice.
        """
        self.write("resume", step)
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(log_dir=self._tb_dir, purge_step=step + 1)

    def close(self) -> None:
        """Flush and close the sinks."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` back as a list of records.

    A half-written last line (a run killed mid-write) is left out; a damaged line elsewhere
    raises ``ValueError`` naming its line number.
    """
    with Path(path).open(encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    records = []
    last = len(lines) - 1
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as err:
            if number == last:  # no newline after it: the write was cut short
                break
            raise ValueError(f"{path}: line {number + 1} is not a JSON record ({err})") from None
    return records
