"""The Switchboard BLSTM acoustic model (h-adpsgd paper, section 5.2)."""

from __future__ import annotations

import torch
from torch import nn


class BLSTM(nn.Module):
    """Stacked bidirectional LSTM, a linear bottleneck projection and a frame classifier.

    The paper's model is 6 layers x 512 cells per direction, a 256-unit projection and a
    32,000-way softmax over context-dependent HMM states; the presets in
    :mod:`hadpsgd.models.presets` scale it down for tests and CPU runs.

    Args:
        input_dim: Feature dimension per frame (260 for the paper's fused features).
        num_classes: Number of output classes (CD states).
        hidden: LSTM cells per direction.
        layers: Number of stacked bidirectional layers.
        proj: Width of the linear projection between the LSTM stack and the output layer.
    """

    def __init__(
        self, input_dim: int, num_classes: int, hidden: int = 512, layers: int = 6, proj: int = 256
    ) -> None:
        super().__init__()
        for name, value in (("input_dim", input_dim), ("num_classes", num_classes),
                            ("hidden", hidden), ("layers", layers), ("proj", proj)):
            if value < 1:
                raise ValueError(f"BLSTM: {name} must be >= 1, got {value}")
        self.input_dim = input_dim
        self.num_classes = num_classes
        self.lstm = nn.LSTM(
            input_size=input_dim, hidden_size=hidden, num_layers=layers,
            batch_first=True, bidirectional=True,
        )
        self.proj = nn.Linear(2 * hidden, proj)
        self.out = nn.Linear(proj, num_classes)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Frame logits for a batch of sub-sequences.

        Args:
            feats: ``[batch, time, input_dim]`` float features.

        Returns:
            ``[batch, time, num_classes]`` unnormalised log-probabilities.
        """
        hidden, _ = self.lstm(feats)
        # The paper's projection is linear (a bottleneck), not followed by a nonlinearity.
        return self.out(self.proj(hidden))
