"""The graph that is exported: raw features in, per-frame scores out, as ``hadpsgd.forward``.

``hadpsgd.forward`` normalises features with the training set's global statistics
(``norm/mean``, ``norm/std``) before the BLSTM, takes the log-softmax in fp32 and, with
priors, subtracts their logarithm. The exported graph does the same in one module, so a user
feeds it features as they were before that normalisation (as the training file stores them)
and gets what forward writes for one utterance in ``--context whole``:

    features [batch, time, feat_dim] float32
      -> (features - mean) / std                  (when statistics are baked in)
      -> BLSTM -> projection -> output layer
      -> log_softmax                              (log-posteriors)
      -> - log(priors)                            (pseudo-log-likelihoods, with priors)

Every sequence of a batch is read whole, so a batch holds sequences of one length: padding
would be read by the backward direction of every frame before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hadpsgd.data import Priors
from hadpsgd.forward import LoadedModel, forward_utterance

INPUT_NAME = "features"
"""The exported graph's input: ``[batch, time, feat_dim]`` float32 raw features."""


@dataclass(frozen=True)
class Scores:
    """What the exported graph computes around the checkpoint's BLSTM."""

    mean: np.ndarray | None
    """The normalisation's mean ``[feat_dim]`` baked into the graph, or None (no norm)."""
    std: np.ndarray | None
    """The normalisation's standard deviation ``[feat_dim]``, or None."""
    priors: Priors | None
    """The class priors subtracted in the log domain, or None (log-posteriors)."""
    prior_scale: float = 1.0
    """Their exponent, as forward's ``--prior-scale``: ``log p(s|x) - prior_scale log p(s)``."""

    @property
    def output_name(self) -> str:
        """The exported graph's output: ``log_posteriors`` or ``log_likelihoods``."""
        return "log_likelihoods" if self.priors is not None else "log_posteriors"

    def log_priors(self) -> torch.Tensor | None:
        """The priors' logarithm as forward takes it (float32), or None."""
        if self.priors is None:
            return None
        return torch.as_tensor(self.priors.scaled_log(self.prior_scale), dtype=torch.float32)


class Deployable(nn.Module):
    """The checkpoint's BLSTM between the normalisation and the scores (module docstring).

    The LSTM is a plain ``nn.LSTM`` holding the checkpoint's weights: the BLSTM's own LSTM
    picks its precision in Python under autocast (:mod:`hadpsgd.models.lstm`), which neither
    TorchScript nor the ONNX exporter should see; exported, it always runs in fp32.
    """

    # Constants of the compiled graph: TorchScript drops the branches they turn off.
    __constants__ = ["normalise", "with_priors"]

    def __init__(self, loaded: LoadedModel, scores: Scores) -> None:
        super().__init__()
        model = loaded.model
        source = model.lstm
        self.lstm = nn.LSTM(source.input_size, source.hidden_size, source.num_layers,
                            batch_first=True, bidirectional=True)
        self.lstm.load_state_dict(source.state_dict())
        self.proj = nn.Linear(model.proj.in_features, model.proj.out_features)
        self.proj.load_state_dict(model.proj.state_dict())
        self.out = nn.Linear(model.out.in_features, model.out.out_features)
        self.out.load_state_dict(model.out.state_dict())
        self.normalise = scores.mean is not None
        self.with_priors = scores.priors is not None
        # Unused buffers stay empty: a graph without normalisation holds no statistics.
        empty = torch.zeros(0)
        self.register_buffer("mean", torch.as_tensor(scores.mean, dtype=torch.float32)
                             if scores.mean is not None else empty)
        self.register_buffer("std", torch.as_tensor(scores.std, dtype=torch.float32)
                             if scores.std is not None else empty)
        log_priors = scores.log_priors()
        self.register_buffer("log_priors", log_priors if log_priors is not None else empty)
        self.eval()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Per-frame scores ``[batch, time, classes]`` of raw ``[batch, time, feat_dim]``."""
        x = features
        if self.normalise:
            # As forward: subtract, then divide (not a multiplication by 1 / std, which would
            # round differently).
            x = (x - self.mean) / self.std
        hidden, _ = self.lstm(x)
        scores = torch.log_softmax(self.out(self.proj(hidden)), dim=-1)
        if self.with_priors:
            scores = scores - self.log_priors
        return scores


@torch.no_grad()
def reference(loaded: LoadedModel, scores: Scores, feats: np.ndarray) -> np.ndarray:
    """What ``hadpsgd.forward`` computes for each sequence of ``feats`` (the check's truth).

    Normalised in NumPy as forward normalises a Kaldi table, one sequence at a time through
    forward's own :func:`~hadpsgd.forward.forward_utterance` (whole context, fp32) on the
    checkpoint's own BLSTM, the log-priors subtracted as forward subtracts them.

    Args:
        loaded: The checkpoint's model (on the CPU).
        scores: The normalisation and priors the export bakes in.
        feats: ``[batch, time, feat_dim]`` float32 raw features.

    Returns:
        ``[batch, time, classes]`` float32.
    """
    log_priors = scores.log_priors()
    out = []
    for seq in feats:
        if scores.mean is not None and scores.std is not None:
            seq = (seq - scores.mean) / scores.std
        row = forward_utterance(loaded.model, torch.from_numpy(np.ascontiguousarray(seq)))
        out.append(row - log_priors if log_priors is not None else row)
    return torch.stack(out).numpy()
