"""Named sizes of the BLSTM: the paper's ``swb`` and smaller ones for tests and CPU sweeps."""

from __future__ import annotations

from dataclasses import dataclass

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


def build_model(preset: str, input_dim: int, num_classes: int) -> BLSTM:
    """Build a BLSTM from a preset name; input and output sizes come from the data.

    Args:
        preset: One of :data:`PRESETS` (``swb``, ``small``, ``tiny``).
        input_dim: Feature dimension of the data file.
        num_classes: Number of classes of the data file.

    Raises:
        ValueError: If ``preset`` is unknown; the message lists the known ones.
    """
    if preset not in PRESETS:
        raise ValueError(
            f"unknown model preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}"
        )
    p = PRESETS[preset]
    return BLSTM(input_dim, num_classes, hidden=p.hidden, layers=p.layers, proj=p.proj)


def count_parameters(model: BLSTM) -> int:
    """Number of trainable scalars in ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
