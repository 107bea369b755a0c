"""Which chunks each step trained on: the sampler's record, and the optional trace file.

``HADPSGD_TRACE_CHUNKS=DIR`` makes every rank append one JSON line per step to
``DIR/chunks-rank<r>.jsonl`` (the exact-resume tests compare these): ``step``, the batch's
key (the global step of the shards; a pooled batch's slot, unique in its epoch), ``epoch``,
``chunks`` and ``global_step``, the global step the batch was trained at (what the training
log and ``metrics.jsonl`` count: the tests check that it only goes forward after a resume).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from typing import IO

from hadpsgd import env
from hadpsgd.data import ChunkBatchSampler


class Recorder:
    """A batch sampler that remembers, in order, the batches it handed to the loader.

    The loader may prefetch, so the batch of the step just taken is the oldest handed one.
    """

    def __init__(self, sampler: ChunkBatchSampler) -> None:
        self.sampler = sampler
        self.handed: collections.deque[list[int]] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.sampler:
            self.handed.append(list(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def num_chunks(self) -> int:
        """Chunks in the data set (the sampler's)."""
        return self.sampler.num_chunks


class ChunkTrace:
    """The per-rank trace file of ``HADPSGD_TRACE_CHUNKS`` (a no-op when it is unset)."""

    def __init__(self, rank: int) -> None:
        self._file: IO[str] | None = None
        trace_dir = env.trace_chunks_dir()
        if trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(trace_dir / f"chunks-rank{rank}.jsonl", "a")  # noqa: SIM115

    def write(self, step: int, epoch: int, chunks: list[int],
              global_step: int | None = None) -> None:
        """Record that the batch keyed ``step`` of ``epoch`` trained on ``chunks``.

        Args:
            step: The batch's key (see the module docstring).
            epoch: Its epoch.
            chunks: The chunk indices it trained on.
            global_step: The global step it was trained at, where the caller knows it.
        """
        if self._file is not None:
            rec: dict[str, object] = {"step": step, "epoch": epoch, "chunks": chunks}
            if global_step is not None:
                rec["global_step"] = global_step
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
