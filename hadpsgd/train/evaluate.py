"""Held-out evaluation: frame cross-entropy and accuracy over every held-out frame.

Where the data names its silence classes, also the accuracy over the speech frames alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from hadpsgd.comm import World
from hadpsgd.data import ChunkBatchSampler, ChunkDataset, make_loader
from hadpsgd.data.loader import IGNORE
from hadpsgd.precision import autocast


@dataclass(frozen=True)
class EvalResult:
    """Held-out metrics summed over all learners' shards."""

    loss: float
    """Mean frame cross-entropy (nats)."""
    accuracy: float
    """Fraction of frames whose arg-max class is the label."""
    frames: int
    """Frames evaluated: every frame of the held-out set, once."""
    speech_accuracy: float | None = None
    """Frame accuracy over the frames whose label is not silence; ``None`` when the held-out
    file names no silence classes (its ``silence_classes`` attribute). Silence is easy and
    can be a quarter of the frames, so frame accuracy alone hides differences on speech."""
    speech_frames: int = 0
    """Frames counted in :attr:`speech_accuracy`."""


@torch.no_grad()
def evaluate(model: nn.Module, dataset: ChunkDataset, topo: World,
             batch_size: int = 64, precision: str = "fp32") -> EvalResult:
    """Evaluate ``model`` on every frame of ``dataset``, its chunks split across learners.

    Each frame is labelled in exactly one chunk (an utterance's tail in a chunk of its last
    frames, see :class:`hadpsgd.data.ChunkDataset`); positions labelled ``IGNORE`` do not
    count. The shards are summed with one allreduce, so the result is exact and identical on
    every rank whatever the number of learners. The forward runs under the training's
    autocast (``precision``, :mod:`hadpsgd.precision`); the loss is computed from fp32
    logits and the totals accumulate in float64.
    """
    was_training = model.training
    model.eval()
    sampler = ChunkBatchSampler(len(dataset), batch_size, topo.rank, topo.size, seed=0,
                                shuffle=False, drop_last=False)
    # float64 sums so the result does not depend on how chunks were split across ranks.
    # They accumulate where the model runs and are read once at the end: reading each
    # batch's figures (float(...), a boolean mask's sum) was four host syncs per batch.
    on_gpu = topo.device.type == "cuda"
    # loss, correct, counted, correct on speech, speech frames
    sums = torch.zeros(5, dtype=torch.float64, device=topo.device)
    silence = torch.tensor(dataset.file.silence_classes, dtype=torch.long, device=topo.device)
    for feats, labels in make_loader(dataset, sampler, pin_memory=on_gpu):
        if labels.numel() == 0:
            continue
        with autocast(precision, topo.device):
            logits = model(feats.to(topo.device, non_blocking=True))
        logits = logits.float()
        labels = labels.to(topo.device, non_blocking=True)
        flat, target = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        counted = target != IGNORE
        sums[0] += F.cross_entropy(flat, target, ignore_index=IGNORE,
                                   reduction="sum").double()
        correct = (flat.argmax(-1) == target) & counted
        sums[1] += correct.sum()
        sums[2] += counted.sum()
        if len(silence):
            speech = counted & ~torch.isin(target, silence)
            sums[3] += (correct & speech).sum()
            sums[4] += speech.sum()
    totals = sums.cpu()  # the one host sync of the evaluation
    topo.allreduce_(totals, op="sum")
    model.train(was_training)
    frames = int(totals[2])
    if frames == 0:
        raise ValueError(
            f"held-out set {dataset.file.path} has no chunk of {dataset.chunk_len} frames; "
            "use longer utterances or a smaller --chunk-len"
        )
    speech = int(totals[4])
    return EvalResult(loss=float(totals[0]) / frames, accuracy=float(totals[1]) / frames,
                      frames=frames,
                      speech_accuracy=float(totals[3]) / speech if speech else None,
                      speech_frames=speech)


def speech_note(result: EvalResult) -> str:
    """``", on speech frames 0.6123"`` for the log lines, or ``""`` without silence classes."""
    if result.speech_accuracy is None:
        return ""
    return f", on speech frames {result.speech_accuracy:.4f}"
