"""How an epoch hands out its batches and where its learners meet: the loop's *plan*.

The training loop (:class:`hadpsgd.train.loop.Trainer`) is written once; what differs between
the synchronous algorithms (SSGD, BMUF: every learner takes its own deterministic shard, and
all take the same global step together) and the asynchronous one (ADPSGD across super-learners:
batches come from one shared pool at each learner's own pace) is an :class:`EpochPlan` the loop
asks for

- its next *segment* of batches (an iterator over the loader): the sharded plan has one per
  epoch, cut at ``--checkpoint-every`` boundaries and ``--max-steps``; the pooled plan one per
  stretch between meetings;
- where each batch stands (its global step and its key in the chunk trace);
- what a control point is (the sharded plan: the blocking agreement of
  :meth:`Trainer.agree`; the pooled plan: news posted to shared counters, no collective);
- its meetings at the end of a segment (the pooled plan's collective: where the pool stands,
  each learner's figures, then the blocking agreement).

The cadence (log, control, checkpoint, end of epoch) is the loop's alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from hadpsgd.data import ChunkBatchSampler
from hadpsgd.train.progress import Progress

Agree = Callable[[Any, "Progress | None"], bool]
"""The loop's blocking agreement (:meth:`Trainer.agree`): True to stop now."""


class EpochPlan:
    """The sharded plan (SSGD, BMUF) and the base of the pooled one.

    Args:
        sampler: The batch sampler the loop's loader draws from.
        opts: The loop's options (``checkpoint_every``, ``max_steps``).
        agree: The loop's blocking agreement (see :data:`Agree`).
    """

    meets = False
    """Whether the learners meet (a collective) at the end of each segment."""

    def __init__(self, sampler: ChunkBatchSampler, opts: Any, agree: Agree) -> None:
        self.sampler = sampler
        self.opts = opts
        self.agree = agree
        self._batches: Iterator[Any] | None = None

    # ------------------------------------------------------------------ epoch
    def begin(self, pos: Any) -> None:
        """Start the epoch at ``pos`` (its data order)."""
        self.sampler.set_epoch(pos.epoch, start_step=pos.step_in_epoch)
        self._batches = None

    def segment(self, pos: Any, loader: Any) -> Iterator[Any] | None:
        """The batches of the next segment, or None when the epoch has none left."""
        if self.epoch_over(pos):
            return None
        if self._batches is None:
            # One iterator for the whole epoch, made at its first segment (after the loop's
            # start_epoch: loader workers hand out batches as soon as it exists): a segment
            # ends at a checkpoint boundary and the next goes on from the same iterator.
            self._batches = iter(loader)
        return self._batches

    def locate(self, pos: Any) -> tuple[int, int]:
        """The global step of the batch just handed out, and its key in the chunk trace."""
        step = pos.global_step + 1
        return step, step

    def current_step(self, pos: Any) -> int:
        """The global step this learner is at (the sharded plan: the position's)."""
        return pos.global_step

    def stepped(self, pos: Any, loss: float) -> int:
        """A batch was trained: advance; returns what the log and control cadence counts.

        The sharded plan counts global steps (every learner takes each one together).
        """
        pos.step_in_epoch += 1
        pos.global_step += 1
        return pos.global_step

    def control(self, loss: float, log: bool, progress: Progress, pos: Any, lr: float) -> bool:
        """A control point (every ``--control-every`` / ``--log-every``); True to stop now."""
        return self.agree(loss, progress if log else None)

    def segment_over(self, pos: Any) -> bool:
        """Whether the segment ends after this step: ``--max-steps`` or a checkpoint boundary.

        A last step of the run ends it (the loop then finishes, evaluates and writes the final
        checkpoint: a ``--checkpoint-every`` checkpoint here would come before that).
        """
        done = self.opts.max_steps
        return bool(done and pos.global_step >= done) or self.at_checkpoint(pos)

    def meet(self, pos: Any) -> bool:
        """The learners' meeting at the end of a segment; True to stop (the sharded: none)."""
        return False

    def epoch_over(self, pos: Any) -> bool:
        """Whether every step of the epoch was taken."""
        return pos.step_in_epoch >= len(self.sampler)

    def at_checkpoint(self, pos: Any) -> bool:
        """Whether the segment ended on a ``--checkpoint-every`` boundary."""
        every = self.opts.checkpoint_every
        return bool(every) and pos.global_step % every == 0

    def end_epoch(self) -> None:
        """The epoch is over (its evaluation and checkpoint follow)."""
        self._batches = None
        self.sampler.set_offset(0)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs of the plan beyond the position.

        The chunk offset of an epoch that went on at another global batch; nothing otherwise.
        """
        return {"chunk_offset": self.sampler.offset} if self.sampler.offset else {}

    def load_state_dict(self, state: dict[str, Any], pos: Any) -> None:
        """Restore :meth:`state_dict` (``state`` is the whole checkpoint)."""
        self.sampler.set_offset(int(state.get("chunk_offset", 0)))

    def close(self) -> None:
        """Release what the plan holds (collective for the pooled plan)."""
