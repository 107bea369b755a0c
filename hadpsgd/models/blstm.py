"""The Switchboard BLSTM acoustic model (h-adpsgd paper, section 5.2)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from hadpsgd.models.lstm import AutocastLSTM

# One parameter of a stacked nn.LSTM (``weight_ih_l3_reverse``) and of a layer of the
# per-layer stack (``3.weight_ih_l0_reverse``), relative to the ``lstm.`` prefix.
_STACKED_NAME = re.compile(r"(weight_ih|weight_hh|bias_ih|bias_hh)_l(\d+)(_reverse)?")
_PER_LAYER_NAME = re.compile(r"(\d+)\.(weight_ih|weight_hh|bias_ih|bias_hh)_l0(_reverse)?")


class BLSTM(nn.Module):
    """Stacked bidirectional LSTM, a linear bottleneck projection and a frame classifier.

    The paper's model is 6 layers x 512 cells per direction, a 256-unit projection and a
    32,000-way softmax over context-dependent HMM states; the presets in
    :mod:`hadpsgd.models.presets` scale it down for tests and CPU runs.

    The LSTM stack has two layouts computing the same function from the same parameters:
    one multi-layer ``nn.LSTM`` (``per_layer=False``) or a ``nn.ModuleList`` of single-layer
    bidirectional ones (``per_layer=True``). On CUDA the multi-layer LSTM is one fused cuDNN
    call, hence one autograd node: every layer's gradient (~80 % of the model's) becomes ready
    only when backward leaves that node, at its very end, so buckets of gradients cannot be
    reduced while backward still runs. Per layer, each layer's gradients are ready as soon as
    backward has passed it. Both layouts draw the same initial values from the same seed,
    yield ``parameters()`` in the same order and shapes (so flat buffers and optimizer state
    line up), and write and read ``state_dict()`` under the stacked names
    (``lstm.weight_ih_l1``), so a checkpoint of one layout loads into the other.

    Each LSTM module is an :class:`~hadpsgd.models.lstm.AutocastLSTM`: under bf16 autocast it
    runs in bf16 outside autocast (autocast's own would run cuDNN's LSTM in fp16, or ask
    oneDNN for a bf16 LSTM it cannot build on a CPU without bf16 support), under fp16
    autocast on CPU in fp32 (oneDNN has no fp16 LSTM); the projection and output layer
    follow autocast.

    Args:
        input_dim: Feature dimension per frame (260 for the paper's fused features).
        num_classes: Number of output classes (CD states).
        hidden: LSTM cells per direction.
        layers: Number of stacked bidirectional layers.
        proj: Width of the linear projection between the LSTM stack and the output layer.
        per_layer: Build the LSTM stack as single-layer modules (see above).
    """

    def __init__(
        self, input_dim: int, num_classes: int, hidden: int = 512, layers: int = 6,
        proj: int = 256, per_layer: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("input_dim", input_dim), ("num_classes", num_classes),
                            ("hidden", hidden), ("layers", layers), ("proj", proj)):
            if value < 1:
                raise ValueError(f"BLSTM: {name} must be >= 1, got {value}")
        self.input_dim = input_dim
        self.num_classes = num_classes
        self.per_layer = per_layer
        # Always initialise the stacked LSTM: the per-layer stack takes over its tensors, so
        # both layouts start from the same values and leave the RNG where proj/out expect it.
        stacked = AutocastLSTM(
            input_size=input_dim, hidden_size=hidden, num_layers=layers,
            batch_first=True, bidirectional=True,
        )
        self.lstm: nn.Module = _split_layers(stacked) if per_layer else stacked
        self.proj = nn.Linear(2 * hidden, proj)
        self.out = nn.Linear(proj, num_classes)
        # Checkpoints use the stacked names whatever the layout (see the class docstring).
        # The private registrations exist in every torch this project supports (>= 2.1).
        self._register_state_dict_hook(_to_stacked_names)
        self._register_load_state_dict_pre_hook(_to_own_names, with_module=True)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Frame logits for a batch of sub-sequences.

        Args:
            feats: ``[batch, time, input_dim]`` float features.

        Returns:
            ``[batch, time, num_classes]`` unnormalised log-probabilities.
        """
        hidden = self.run_lstm(feats)
        # The paper's projection is linear (a bottleneck), not followed by a nonlinearity.
        return self.out(self.proj(hidden))

    def run_lstm(self, x: torch.Tensor | PackedSequence) -> torch.Tensor | PackedSequence:
        """The LSTM stack's output for ``x`` (either layout), of ``x``'s kind.

        Args:
            x: ``[batch, time, input_dim]`` features, or a ``PackedSequence`` of them (the
                forward pass for decoding runs whole utterances packed).

        Returns:
            ``[batch, time, 2 * hidden]`` (or packed) in the precision the LSTM ran in: bf16
            under bf16 autocast (fp32 where the bf16 LSTM cannot run), fp32 under CPU fp16
            autocast (:mod:`hadpsgd.models.lstm`).
        """
        if self.per_layer:
            hidden = x
            for layer in self.lstm:  # type: ignore[attr-defined]
                hidden, _ = layer(hidden)
            return hidden
        hidden, _ = self.lstm(x)
        return hidden

    def graph_stages(self) -> list[nn.Module]:
        """The forward as modules called in a chain, each on the last one's output.

        Each LSTM layer (the stacked LSTM as one where it is stacked), then the projection
        and the output layer: ``--cuda-graph`` captures a graph pair per stage, so a layer's
        gradients reach their reduction while backward replays the layers below it
        (:mod:`hadpsgd.train.graphs`). The modules hold this model's parameters (the same
        tensors) and are not its submodules.
        """
        layers = list(self.lstm) if self.per_layer else [self.lstm]  # type: ignore[arg-type]
        return [_Output(layer) for layer in layers] + [nn.Sequential(self.proj, self.out)]


class _Output(nn.Module):
    """An LSTM module's output sequence alone (not its final states): a chainable stage."""

    def __init__(self, lstm: nn.Module) -> None:
        super().__init__()
        self.lstm = lstm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The output of ``lstm`` on ``x``."""
        return self.lstm(x)[0]


def _split_layers(stacked: AutocastLSTM) -> nn.ModuleList:
    """Single-layer bidirectional LSTMs holding ``stacked``'s parameters (the same tensors).

    The layers are built on the meta device, which allocates nothing and draws no random
    numbers, then given the stacked LSTM's ``Parameter`` objects; iterating them yields those
    in the stacked order (``weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0``, the same
    four ``_reverse``, then layer 1, ...).
    """
    layers = nn.ModuleList()
    for i in range(stacked.num_layers):
        layer = AutocastLSTM(
            input_size=stacked.input_size if i == 0 else 2 * stacked.hidden_size,
            hidden_size=stacked.hidden_size, num_layers=1, batch_first=True,
            bidirectional=True, device="meta",
        )
        for name in layer._flat_weights_names:
            # RNNBase.__setattr__ also updates the list of weights forward() passes on.
            setattr(layer, name, getattr(stacked, name.replace("_l0", f"_l{i}", 1)))
        layers.append(layer)
    return layers


def _rename(state_dict: dict[str, Any], prefix: str, rename: Any) -> None:
    """Rename ``state_dict``'s keys under ``prefix + 'lstm.'`` in place, keeping their order."""
    head = prefix + "lstm."
    keys = [k for k in state_dict if k.startswith(prefix)]
    if not any(k.startswith(head) for k in keys):
        return
    items = [(k, state_dict.pop(k)) for k in keys]
    for key, value in items:
        if key.startswith(head):
            key = head + rename(key[len(head):])
        state_dict[key] = value


def _stacked_name(name: str) -> str:
    """``3.weight_ih_l0_reverse`` -> ``weight_ih_l3_reverse``; other names are kept."""
    m = _PER_LAYER_NAME.fullmatch(name)
    return f"{m[2]}_l{m[1]}{m[3] or ''}" if m else name


def _per_layer_name(name: str) -> str:
    """``weight_ih_l3_reverse`` -> ``3.weight_ih_l0_reverse``; other names are kept."""
    m = _STACKED_NAME.fullmatch(name)
    return f"{m[2]}.{m[1]}_l0{m[3] or ''}" if m else name


def _to_stacked_names(module: BLSTM, state_dict: dict[str, Any], prefix: str,
                      local_metadata: Any) -> None:
    """State-dict hook: a per-layer model saves its LSTM under the stacked names."""
    if module.per_layer:
        _rename(state_dict, prefix, _stacked_name)


def _to_own_names(module: BLSTM, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load pre-hook: accept either layout's names and load them into this one's modules."""
    _rename(state_dict, prefix, _per_layer_name if module.per_layer else _stacked_name)
