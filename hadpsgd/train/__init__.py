"""Training: the loop, the LR recipe, evaluation, checkpoints and metrics."""

from hadpsgd.train.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from hadpsgd.train.evaluate import EvalResult, evaluate
from hadpsgd.train.loop import LoopOptions, Position, Trainer
from hadpsgd.train.metrics import MetricsWriter, read_metrics
from hadpsgd.train.schedule import LRSchedule, set_lr

__all__ = ["EvalResult", "LRSchedule", "LoopOptions", "MetricsWriter", "Position", "Trainer",
           "checkpoint_path", "evaluate", "latest_checkpoint", "load_checkpoint",
           "read_metrics", "save_checkpoint", "set_lr"]
