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

Either plan loads either plan's state (:func:`trained_chunks`): a checkpoint written at
another world size, global batch, pool slot or plan goes on after exactly the chunks of the
interrupted epoch it had trained, wherever in the epoch's order they lie, and its global
steps go on from the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hadpsgd.data import ChunkBatchSampler
from hadpsgd.data.sampler import Ranges, as_ranges, range_positions, untrained
from hadpsgd.train.progress import Progress

Agree = Callable[[Any, "Progress | None"], bool]
"""The loop's blocking agreement (:meth:`Trainer.agree`): True to stop now."""

CHUNK_OFFSET = "chunk_offset"
"""State key: the chunks trained before the epoch's step 0 where they are a prefix."""
CHUNK_TRAINED = "chunk_trained"
"""State key: ``[lo, hi)`` ranges of those chunks where they are not a prefix."""
POOL_NEXT = "pool_next"
"""State key of the pooled plan: its tickets below this were trained."""
POOL_ORDER = "pool_order"
"""State key of the pooled plan: the slot each ticket hands out, where not the ticket."""
POOL_SLOT = "pool_slot"
"""State key of the pooled plan: the chunks of one slot (a super-learner's batches)."""


def carried_chunks(state: dict[str, Any]) -> Ranges:
    """The chunks ``state``'s epoch had trained before its plan's step 0 (its sampler's)."""
    if CHUNK_TRAINED in state:
        return [(int(lo), int(hi)) for lo, hi in state[CHUNK_TRAINED]]
    offset = int(state.get(CHUNK_OFFSET, 0))
    return [(0, offset)] if offset else []


def global_batch_of(state: dict[str, Any]) -> int | None:
    """The global batch of the run that wrote ``state`` (None: not recorded)."""
    world = state.get("world_size")
    batch = state.get("config", {}).get("train", {}).get("batch_size")
    return int(world) * int(batch) if world and batch else None


def pool_slot_of(state: dict[str, Any]) -> int | None:
    """The chunks of one pool slot in the run that wrote ``state`` (None: not pooled).

    Checkpoints written before :data:`POOL_SLOT` was recorded: the batch of each member of a
    super-learner, from the run's recorded world.
    """
    if POOL_NEXT not in state:
        return None
    if POOL_SLOT in state:
        return int(state[POOL_SLOT])
    config = state.get("config", {})
    world = config.get("world", {})
    per_node = int(world.get("size", 1)) // max(1, int(world.get("num_nodes", 1)))
    return per_node * int(config.get("train", {}).get("batch_size", 1))


def trained_chunks(state: dict[str, Any], num_chunks: int) -> Ranges:
    """Every position of the interrupted epoch's chunk order that ``state`` had trained.

    Of either plan's state: the chunks carried into the epoch's step 0 (:func:`carried_chunks`),
    then the sharded plan's ``step_in_epoch`` steps of its global batch over the rest, or the
    pooled plan's tickets below :data:`POOL_NEXT`, each a slot of :data:`POOL_SLOT` chunks of
    the rest, in :data:`POOL_ORDER`. A state whose run trained a whole epoch's slots or steps
    never leaves a position twice, and positions past the data set (other data) are dropped.

    Args:
        state: A checkpoint's common state, or a failure's snapshot.
        num_chunks: The chunks of the data set now.

    Returns:
        The trained positions, as sorted disjoint ``[lo, hi)`` ranges.
    """
    carried = carried_chunks(state)
    rest = untrained(carried, num_chunks)
    slot = pool_slot_of(state)
    if slot is not None:
        order = state.get(POOL_ORDER)
        tickets = np.arange(int(state[POOL_NEXT]), dtype=np.int64)
        if order is not None:
            mapped = np.asarray(order, dtype=np.int64)
            inside = tickets < mapped.size  # a ticket past the order hands out itself
            tickets[inside] = mapped[tickets[inside]]
        index = (tickets[:, None] * slot + np.arange(slot, dtype=np.int64)).ravel()
    else:
        steps = int(state.get("progress", {}).get("step_in_epoch", 0))
        index = np.arange(steps * (global_batch_of(state) or 0), dtype=np.int64)
    index = index[index < rest.size]
    return as_ranges(np.concatenate([range_positions(carried), rest[index]]))


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

        The chunks trained before the step 0 of an epoch that went on at another global batch
        or plan (a prefix of its order as an offset, anything else as ranges); nothing
        otherwise.
        """
        trained = self.sampler.trained
        if not trained:
            return {}
        if len(trained) == 1 and trained[0][0] == 0:
            return {CHUNK_OFFSET: self.sampler.offset}  # as checkpoints have always had it
        return {CHUNK_TRAINED: [[lo, hi] for lo, hi in trained]}

    def load_state_dict(self, state: dict[str, Any], pos: Any) -> None:
        """Restore :meth:`state_dict`, or go on from another plan's or global batch's state.

        ``state`` is the whole checkpoint (or a failure's snapshot) and ``pos`` its position.
        Written by this plan at this global batch, the epoch's steps go on as they were;
        otherwise (another world size, ``--batch-size``, or the pooled plan) they start
        afresh after exactly the chunks the state had trained (:meth:`carry`).
        """
        same = global_batch_of(state) in (None, self.sampler.global_batch)
        if POOL_NEXT in state or not same:
            self.carry(state, pos)
        else:
            self.sampler.set_trained(carried_chunks(state))

    def carry(self, state: dict[str, Any], pos: Any) -> None:
        """Go on from ``state``: its trained chunks are the epoch's, the steps start afresh.

        ``pos`` keeps its epoch and global step, so the steps after it only go forward; its
        step in the epoch counts this plan's steps over the chunks left (0 now).
        """
        self.sampler.set_trained(trained_chunks(state, self.sampler.num_chunks))
        pos.step_in_epoch = 0

    def control_bytes(self) -> int:
        """Bytes this rank's data plan carried across nodes so far (none: the shards are local)."""
        return 0

    def close(self) -> None:
        """Release what the plan holds (collective for the pooled plan)."""
