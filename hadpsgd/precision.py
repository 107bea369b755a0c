"""Numeric precision of a run: ``--precision fp32|bf16|fp16`` and ``--tf32``.

What runs in which precision (docs/gpu.md has the table):

- **Master weights, optimizer and algorithm state** are fp32 in every mode: the flat
  parameter and gradient buffers, Adam's moments, BMUF's global model, Delta and moment
  estimates, ADPSGD's replicas and gossip deltas.
- **bf16 / fp16**: the forward pass (LSTM, projection, output layer) runs under
  ``torch.autocast``; the logits are cast to fp32 before the log-softmax and the loss, so the
  softmax over the classes and the loss's sum are fp32 (as autocast itself does for
  ``cross_entropy`` on CUDA). Backward follows autocast's casts; parameter gradients arrive
  in fp32 (the parameters' dtype). fp16 adds a dynamic loss scale
  (:mod:`hadpsgd.algorithms.scaler`); bf16 has fp32's range and needs none.
- **Evaluation** runs under the same autocast; its totals are accumulated in float64.
- **TF32**: off unless ``--tf32``, so ``fp32`` means IEEE fp32 on a GPU too (matmuls at
  ``highest`` precision and cuDNN's LSTM without tensor-core TF32, whose default in torch is
  on): fp32 is the reference bf16 is compared with. ``--tf32`` turns both on, for fp32 speed.
- **The LSTM** (:mod:`hadpsgd.models.lstm`), where autocast alone gets it wrong: under
  **bf16** the LSTM runs outside autocast on weights and input cast to bf16 explicitly, on
  CUDA and CPU alike. On CUDA torch's autocast would run cuDNN's LSTM in fp16 (its
  ``_cudnn_rnn`` kernel casts to fp16 whatever autocast's dtype); on CPU it would ask oneDNN
  for a bf16 LSTM, which oneDNN cannot build on a CPU without bf16 support (AVX2 only: "could
  not create a primitive descriptor"), while an explicitly bf16 LSTM runs there on torch's
  own kernels, the bf16 arithmetic emulated (about 7x fp32's step time; docs/gpu.md).
  Whether the bf16 LSTM runs is tried once per LSTM shape on one frame; where it does not
  (torch built against cuDNN < 9.13, a GPU before compute capability 8.0, a CPU whose oneDNN
  fails) it runs in fp32, and a warning says so once. Under **fp16 on CPU** oneDNN has no fp16 LSTM,
  so the LSTM stack runs in fp32 and the projection and output layer in fp16; CPU fp16
  exists for tests of the loss scale. CPU users want fp32, or bf16 on a CPU with native bf16
  (AVX512-BF16 or AMX). fp16 on CUDA is autocast's fp16 cuDNN LSTM.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""The values of ``--precision``."""

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The autocast dtype of each mixed precision."""


def check_precision(precision: str) -> None:
    """Raise ``ValueError`` unless ``precision`` is one of :data:`PRECISIONS`."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got "
                         f"{precision!r}")


def autocast(precision: str, device: torch.device, cache: bool = True
             ) -> contextlib.AbstractContextManager:
    """The context the forward pass and the loss run in: autocast, or nothing for fp32.

    ``cache=False`` keeps no casts of the weights across calls, as a CUDA graph's capture
    needs (a cast made outside the graph would be read stale inside it).
    """
    check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision],
                          cache_enabled=cache)


def set_tf32(device: torch.device, allow: bool) -> None:
    """TF32 for fp32 matmuls and cuDNN (the LSTM) on ``device`` (a CUDA device), or neither.

    Process-wide torch settings; nothing is done on CPU, where TF32 does not exist.
    """
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow


__all__ = ["AUTOCAST_DTYPES", "PRECISIONS", "autocast", "check_precision", "set_tf32"]
