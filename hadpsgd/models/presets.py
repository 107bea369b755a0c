"""Named sizes of the BLSTM: the paper's ``swb`` and smaller ones for tests and CPU sweeps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hadpsgd.models.blstm import BLSTM


@dataclass(frozen=True)
class Preset:
    """Layer sizes of one BLSTM preset."""

    hidden: int
    """LSTM cells per direction."""
    layers: int
    """Stacked bidirectional LSTM layers."""
    proj: int
    """Width of the linear projection before the output layer."""


PRESETS: dict[str, Preset] = {
    # The paper's model: ~43.15 M parameters with 260 inputs and 32,000 classes.
    "swb": Preset(hidden=512, layers=6, proj=256),
    # A CPU-friendly model that still has the shape of the real one (stacked, bidirectional).
    "small": Preset(hidden=128, layers=2, proj=64),
    # For unit and multi-rank tests: a few thousand parameters, a step takes milliseconds.
    "tiny": Preset(hidden=16, layers=1, proj=16),
}


def build_model(preset: str, input_dim: int, num_classes: int,
                per_layer: bool = False) -> BLSTM:
    """Build a BLSTM from a preset name; input and output sizes come from the data.

    Args:
        preset: One of :data:`PRESETS` (``swb``, ``small``, ``tiny``).
        input_dim: Feature dimension of the data file.
        num_classes: Number of classes of the data file.
        per_layer: Build the LSTM stack as single-layer modules, the same model whose
            gradients become ready layer by layer on CUDA (see :class:`BLSTM` and
            :func:`per_layer_lstm`).

    Raises:
        ValueError: If ``preset`` is unknown; the message lists the known ones.
    """
    if preset not in PRESETS:
        raise ValueError(
            f"unknown model preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}"
        )
    p = PRESETS[preset]
    return BLSTM(input_dim, num_classes, hidden=p.hidden, layers=p.layers, proj=p.proj,
                 per_layer=per_layer)


LSTM_LAYOUTS: tuple[str, ...] = ("auto", "stacked", "per-layer")
"""Values of ``--lstm-layout``: how the BLSTM's LSTM stack is built (the same model)."""


def per_layer_lstm(layout: str, device: torch.device | str) -> bool:
    """Whether ``layout`` builds the LSTM stack per layer on ``device``.

    ``auto`` is stacked on every device. On CUDA the per-layer stack lets each layer's
    gradients be reduced while backward still runs (cuDNN's fused multi-layer LSTM releases
    them all at its end), but it cost 28 % more per step on one H100 (``swb``, batch 16:
    36.4 against 28.4 ms, docs/gpu.md) while one node's allreduce it could hide took under
    1 ms; on CPU the LSTM is computed layer by layer anyway. ``per-layer`` stays for runs
    whose gradient reduction is slow enough to hide (several nodes); ``device`` is kept for
    such a rule once it is measured.

    Raises:
        ValueError: If ``layout`` is not one of :data:`LSTM_LAYOUTS`.
    """
    if layout not in LSTM_LAYOUTS:
        raise ValueError(f"unknown LSTM layout {layout!r}; choose one of "
                         f"{', '.join(LSTM_LAYOUTS)}")
    torch.device(device)  # a bad device is an error whatever the layout
    return layout == "per-layer"


def count_parameters(model: BLSTM) -> int:
    """Number of trainable scalars in ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
