"""How a chunk-trained BLSTM sees a whole utterance: in one pass, or in overlapping windows.

Training unrolls the BLSTM over chunks of ``chunk_len`` frames (21 in the paper) and never
carries a state from one chunk to the next, so the model has only ever seen sequences of
that length. Two ways to run it on a whole utterance of ``L`` frames:

``whole``
    The utterance in one forward pass: every frame sees all of its left and right context.

``chunks``
    Windows of ``W = chunk_len`` frames with ``O = overlap`` frames of context on each side;
    each window keeps its centre ``S = W - 2 O`` frames, so every frame is taken from
    exactly one window. Block ``k`` keeps frames ``[k S, k S + S)`` from the window starting at
    ``k S - O``, moved inside the utterance where it would stick out (the first windows have
    no left context, the last ones keep their tail from a full window of the last ``W``
    frames). With ``O = 0`` these are exactly the chunks held-out evaluation cuts
    (:class:`hadpsgd.data.ChunkDataset`: whole chunks, and each tail in a chunk of the last
    ``W`` frames). An utterance shorter than ``W`` is one window of its own length (the
    evaluation pads it with zeros instead, which the backward direction reads first).

In ``whole`` mode several utterances run as one packed batch (:func:`forward_batch`): the
same layers as :meth:`hadpsgd.models.BLSTM.forward`, on a ``PackedSequence``, so no frame
sees another utterance's frames or padding, and the result equals one utterance at a time
within float32 rounding. One utterance gives the LSTM one row of work per time step: on one
CPU thread a batch of 32 was only ~1.2 times as fast, but with two threads on a busy
machine 9 times, and a GPU, which one row leaves nearly idle, gains the most.

The output is the log-softmax over the classes, computed in fp32 from the logits whatever the
autocast precision.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

from hadpsgd.models import BLSTM
from hadpsgd.precision import autocast

CONTEXTS = ("whole", "chunks")
"""The values of ``--context``."""

MAX_WINDOWS = 256
"""Windows per forward call in ``chunks`` mode (bounds the memory of a long utterance)."""
MAX_BATCH = 64
"""Utterances per packed batch in ``whole`` mode."""
BATCH_BYTES = 512 << 20
"""Bound on a packed batch's padded fp32 logits (``utterances x longest x classes``)."""


def check_windows(chunk_len: int, overlap: int) -> None:
    """Raise ``ValueError`` naming the flags if the windows keep no frame."""
    if chunk_len < 1:
        raise ValueError(f"--chunk-len must be >= 1, got {chunk_len}")
    if overlap < 0 or 2 * overlap >= chunk_len:
        raise ValueError(f"--chunk-overlap {overlap} leaves no centre frame of a --chunk-len "
                         f"{chunk_len} window: it needs 0 <= 2 * overlap < chunk-len (at most "
                         f"{(chunk_len - 1) // 2}), or a longer --chunk-len")


def window_plan(length: int, chunk_len: int, overlap: int) -> tuple[np.ndarray, np.ndarray,
                                                                     np.ndarray]:
    """The windows of an utterance of ``length`` >= ``chunk_len`` frames (module docstring).

    Returns:
        ``(win_start, keep_start, keep_stop)``, int64 per window: the window covers
        ``[win_start, win_start + chunk_len)`` and keeps ``[keep_start, keep_stop)``; the kept
        ranges tile ``[0, length)`` in order.
    """
    check_windows(chunk_len, overlap)
    step = chunk_len - 2 * overlap
    keep_start = np.arange(0, length, step, dtype=np.int64)
    keep_stop = np.minimum(keep_start + step, length)
    win_start = np.clip(keep_start - overlap, 0, max(length - chunk_len, 0))
    return win_start, keep_start, keep_stop


def _log_probs(model: nn.Module, feats: torch.Tensor, precision: str) -> torch.Tensor:
    with autocast(precision, feats.device):
        logits = model(feats)
    return F.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def forward_utterance(model: nn.Module, feats: torch.Tensor, context: str = "whole",
                      chunk_len: int = 21, overlap: int = 0,
                      precision: str = "fp32") -> torch.Tensor:
    """Log-posteriors ``[L, classes]`` (fp32) of one utterance's frames ``[L, D]``.

    Args:
        model: The BLSTM, in evaluation mode, on ``feats``'s device.
        feats: The utterance's features.
        context: ``whole`` or ``chunks`` (module docstring).
        chunk_len: Window length in ``chunks`` mode.
        overlap: Context frames on each side of a window's kept centre.
        precision: ``fp32`` or ``bf16`` (autocast of the forward; the softmax is fp32).
    """
    length = feats.shape[0]
    if length == 0:
        return torch.zeros(0, model.num_classes, device=feats.device)
    if context == "whole" or length <= chunk_len:
        return _log_probs(model, feats[None], precision)[0]
    if context != "chunks":
        raise ValueError(f"--context must be one of {', '.join(CONTEXTS)}, got {context!r}")
    _, keep_start, keep_stop = window_plan(length, chunk_len, overlap)
    step = chunk_len - 2 * overlap
    # window_plan's starts, made on the device: a copy from host memory would wait for it.
    starts = (torch.arange(0, length, step, device=feats.device) - overlap).clamp_(
        0, max(length - chunk_len, 0))
    positions = torch.arange(chunk_len, device=feats.device)
    out = torch.empty(length, model.num_classes, device=feats.device)
    for lo in range(0, len(starts), MAX_WINDOWS):
        hi = min(lo + MAX_WINDOWS, len(starts))
        windows = feats[starts[lo:hi, None] + positions]  # [n, W, D], gathered in one copy
        probs = _log_probs(model, windows, precision)
        # Frame t is kept by window t // step, at its position t - win_start there.
        t = torch.arange(int(keep_start[lo]), int(keep_stop[hi - 1]), device=feats.device)
        window = t // step
        out[t] = probs[window - lo, t - starts[window]]
    return out


def batches(items: Iterable[tuple[str, np.ndarray]], num_classes: int
            ) -> Iterator[list[tuple[str, np.ndarray]]]:
    """Consecutive utterances in groups for :func:`forward_batch`, in input order.

    A group holds at most :data:`MAX_BATCH` utterances, and its padded logits
    (``count x longest x classes`` fp32) at most :data:`BATCH_BYTES` (one longer utterance
    always makes a group of its own).
    """
    frames = max(1, BATCH_BYTES // (4 * num_classes))
    group: list[tuple[str, np.ndarray]] = []
    longest = 0
    for item in items:
        length = len(item[1])
        if group and (len(group) == MAX_BATCH
                      or (len(group) + 1) * max(longest, length) > frames):
            yield group
            group, longest = [], 0
        group.append(item)
        longest = max(longest, length)
    if group:
        yield group


def _packed_log_probs(model: BLSTM, utts: list[torch.Tensor], precision: str
                      ) -> list[torch.Tensor]:
    """:func:`_log_probs` of several utterances of any lengths (> 0) in one packed batch."""
    lengths = torch.tensor([len(u) for u in utts])
    with autocast(precision, utts[0].device):
        hidden: object = pack_padded_sequence(pad_sequence(utts, batch_first=True), lengths,
                                              batch_first=True, enforce_sorted=False)
        # BLSTM.forward's layers (either LSTM layout, in the same precision), packed.
        hidden = model.run_lstm(hidden)  # type: ignore[arg-type]
        padded, _ = pad_packed_sequence(hidden, batch_first=True)  # type: ignore[arg-type]
        logits = model.out(model.proj(padded))
    probs = F.log_softmax(logits.float(), dim=-1)
    return [probs[i, :n] for i, n in enumerate(lengths.tolist())]


@torch.no_grad()
def forward_batch(model: BLSTM, utts: list[torch.Tensor], context: str = "whole",
                  chunk_len: int = 21, overlap: int = 0,
                  precision: str = "fp32") -> list[torch.Tensor]:
    """:func:`forward_utterance` of each of ``utts``; ``whole`` runs them as one packed batch."""
    if context != "whole" or len(utts) == 1:
        return [forward_utterance(model, u, context, chunk_len, overlap, precision)
                for u in utts]
    out: list[torch.Tensor | None] = [None] * len(utts)
    busy = [i for i, u in enumerate(utts) if len(u) > 0]
    for i in set(range(len(utts))) - set(busy):
        out[i] = torch.zeros(0, model.num_classes, device=utts[i].device)
    if busy:
        for i, probs in zip(busy, _packed_log_probs(model, [utts[i] for i in busy], precision),
                            strict=True):
            out[i] = probs
    return out  # type: ignore[return-value] - every entry is set
