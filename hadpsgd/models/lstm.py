"""The BLSTM's LSTM module: an ``nn.LSTM`` that runs in the precision the run asked for.

Autocast alone gets the LSTM (~80 % of the model's FLOPs) wrong in three places:

- **CUDA, bf16.** torch's autocast kernel for ``_cudnn_rnn``
  (``aten/src/ATen/cudnn/AutocastRNN.cpp``, ``_cudnn_rnn_cast_reflatten``) casts input,
  weights and states to fp16 whatever dtype autocast was given: a bf16 run would compute its
  LSTM in fp16, with no loss scale to keep small gradients from flushing to zero.
- **CPU, bf16.** CPU autocast hands the fp32 LSTM to oneDNN and casts to bf16 at oneDNN's
  layer (``mkldnn_rnn_layer`` is on autocast's bf16 list) whether or not oneDNN can build a
  bf16 LSTM on this CPU: on one without bf16 support in oneDNN (AVX2 only: no AVX-512) every
  forward ends in "could not create a primitive descriptor for the LSTM forward propagation
  primitive". An LSTM whose input and weights are bf16 outside autocast is given to oneDNN
  only where torch finds that support (``mkldnn_bf16_device_check``), else runs on torch's
  own kernels, the bf16 arithmetic emulated (slow: docs/gpu.md, *bf16 on a CPU*).
- **CPU, fp16.** oneDNN has no fp16 LSTM ("could not create a primitive descriptor"): the
  LSTM runs in fp32, the layers after it in fp16.

So under bf16, on CUDA and CPU alike, autocast is off around the LSTM, and the input and
weights are cast to bf16 explicitly: the weights once per forward, into one new buffer (on
CUDA in the layout cuDNN gives its own flat weights, asked of cuDNN, so it runs them in
place; one cast of their storage where they already lie so:
:mod:`hadpsgd.models.lstm_weights`); the functional LSTM (``torch._VF.lstm``) runs on them,
and the gradients flow back through the cast to the fp32 weights (:func:`cast_lstm`). fp16
on CUDA keeps autocast's fp16 cuDNN LSTM (fp16 has a loss scale).

Whether the bf16 LSTM runs is asked once per LSTM shape and device, on one frame
(:func:`lstm_layout`); where it does not, the LSTM runs in fp32 and a warning says so once.
On CUDA, cuDNN runs a bf16 RNN only where torch was built against cuDNN >= 9.13 and the GPU
is of compute capability 8.0 or later (torch's ``use_cudnn`` in
``aten/src/ATen/native/RNN.cpp``; ``torch.backends.cudnn.is_acceptable`` still names fp16,
fp32 and fp64 only); elsewhere torch would run a bf16 LSTM step by step without cuDNN, so
the frame must reach cuDNN. On CPU the frame's forward and backward must run at all: a
oneDNN (or any other) error there is the fallback to fp32, never the run's end.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import _VF, nn
from torch.nn.utils.rnn import PackedSequence

from hadpsgd.models.lstm_weights import Layout, cast_weights, cudnn_layout, dense_layout

__all__ = ["AutocastLSTM", "Layout", "cast_lstm", "cast_weights", "cudnn_layout", "dense_layout",
           "explicit_dtype", "lstm_layout"]

Hidden = tuple[torch.Tensor, torch.Tensor]
"""An LSTM's ``(h, c)``."""

_CUDNN_NODE = "CudnnRnn"
"""The name of the autograd node of a cuDNN RNN (``CudnnRnnBackward0``)."""
_COPY_WARNING = "contiguous chunk"
"""What cuDNN's weight-copy warning says ("not part of single contiguous chunk of memory")."""


def explicit_dtype(x: torch.Tensor | PackedSequence) -> torch.dtype | None:
    """The dtype the LSTM must run in outside autocast for input ``x``, or None for autocast's.

    bf16 under bf16 autocast on CUDA and CPU, fp32 under fp16 autocast on CPU (see the module
    docstring); None elsewhere.
    """
    data = x.data if isinstance(x, PackedSequence) else x
    kind = data.device.type
    if kind not in ("cpu", "cuda") or not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    if dtype == torch.bfloat16:
        return torch.bfloat16
    if kind == "cpu" and dtype == torch.float16:
        return torch.float32
    return None


def cast_lstm(lstm: nn.LSTM, x: torch.Tensor | PackedSequence, dtype: torch.dtype,
              hx: Hidden | None = None, layout: Layout | None = None,
              ) -> tuple[torch.Tensor | PackedSequence, Hidden]:
    """``lstm(x, hx)`` computed in ``dtype``: input, states and weights cast to it.

    Runs on any device (the model takes it under bf16, on CUDA and CPU alike). Call it
    outside autocast, which would cast again. The result is ``dtype``; the gradients of
    ``lstm``'s parameters arrive in their own dtype.

    Args:
        lstm: An LSTM without projections.
        x: Batched input (``[batch, time, features]`` if ``batch_first``) or a
            ``PackedSequence``.
        dtype: The dtype to compute in.
        hx: Initial ``(h, c)``; zeros if None.
        layout: Where the cast weights lie in their buffer: :func:`cudnn_layout` for cuDNN
            to run them in place; one after another if None.

    Raises:
        ValueError: For an LSTM with projections or unbatched input.
    """
    if lstm.proj_size:
        raise ValueError("cast_lstm: LSTMs with projections (proj_size > 0) are not supported")
    weights = cast_weights(lstm, dtype, layout or dense_layout(lstm))
    packed = isinstance(x, PackedSequence)
    if packed:
        data, batch_sizes, sorted_idx, unsorted_idx = x
        batch = int(batch_sizes[0])
    else:
        data = x  # type: ignore[assignment]
        if data.dim() != 3:
            raise ValueError(f"cast_lstm: expected batched 3-D input, got {data.dim()}-D")
        batch = data.shape[0 if lstm.batch_first else 1]
    data = data.to(dtype)
    if hx is None:
        shape = (lstm.num_layers * (2 if lstm.bidirectional else 1), batch, lstm.hidden_size)
        hx = (data.new_zeros(shape), data.new_zeros(shape))
    else:
        hx = (hx[0].to(dtype), hx[1].to(dtype))
        if packed and sorted_idx is not None:  # as nn.LSTM: states follow the sorted batch
            hx = (hx[0].index_select(1, sorted_idx), hx[1].index_select(1, sorted_idx))
    if not packed:
        out, h, c = _VF.lstm(data, hx, weights, lstm.bias, lstm.num_layers,
                             float(lstm.dropout), lstm.training, lstm.bidirectional,
                             lstm.batch_first)
        return out, (h, c)
    out, h, c = _VF.lstm(data, batch_sizes, hx, weights, lstm.bias, lstm.num_layers,
                         float(lstm.dropout), lstm.training, lstm.bidirectional)
    if unsorted_idx is not None:
        h, c = h.index_select(1, unsorted_idx), c.index_select(1, unsorted_idx)
    return PackedSequence(out, batch_sizes, sorted_idx, unsorted_idx), (h, c)


def _ran_cudnn(out: torch.Tensor) -> bool:
    """Whether cuDNN computed ``out`` (a node of its RNN in ``out``'s autograd graph)."""
    todo, seen = [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if _CUDNN_NODE in fn.name():
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


_LAYOUTS: dict[tuple[Any, ...], Layout | None] = {}
_warned = False


def lstm_layout(lstm: nn.LSTM, dtype: torch.dtype) -> Layout | None:
    """Where :func:`cast_lstm` puts ``lstm``'s weights in ``dtype``, or None if it cannot run.

    Asked once per shape and device (the module docstring): on CUDA the cuDNN layout
    (:func:`cudnn_layout`), then one frame through :func:`cast_lstm`, which must reach
    cuDNN's RNN and run the weights in place (no copy warning); on CPU the dense layout
    (:func:`dense_layout`), then one frame's forward and backward, training and inference,
    which must run. The first None warns, once in the process, that the LSTM runs in fp32.
    """
    global _warned
    w = lstm.weight_ih_l0
    key = (w.device, dtype, lstm.input_size, lstm.hidden_size, lstm.num_layers,
           lstm.bidirectional, lstm.bias)
    if key not in _LAYOUTS:
        layout, why = _probe(lstm, dtype)
        _LAYOUTS[key] = layout
        if layout is None and not _warned:
            _warned = True
            # stacklevel 2: the forward's line, in hadpsgd, which the run's log prints as
            # one line of its own (hadpsgd.run's warning format), not torch's module code.
            warnings.warn(f"the LSTM runs in fp32 under {dtype} autocast on {w.device}: {why} "
                          f"(the layers after it run in {dtype})", RuntimeWarning, stacklevel=2)
    return _LAYOUTS[key]


def _probe(lstm: nn.LSTM, dtype: torch.dtype) -> tuple[Layout | None, str]:
    """:func:`lstm_layout`'s question, and why not where the answer is None."""
    if lstm.weight_ih_l0.is_cuda:
        return _probe_cuda(lstm, dtype)
    layout = dense_layout(lstm)
    try:
        _run_frame(lstm, dtype, layout)
    except (RuntimeError, NotImplementedError) as err:  # oneDNN: "could not create a ..."
        return None, f"torch cannot run a {dtype} LSTM on this CPU ({_first_line(err)})"
    return layout, ""


def _run_frame(lstm: nn.LSTM, dtype: torch.dtype, layout: Layout) -> None:
    """One frame through :func:`cast_lstm`, as in training and as in evaluation.

    Forward and backward in training mode, then forward in eval mode without a graph: oneDNN
    builds other primitives for each. The gradients are returned by ``autograd.grad``, not
    accumulated: the weights' ``.grad`` stays as it was.
    """
    device = lstm.weight_ih_l0.device
    was_training = lstm.training
    try:
        with (torch.inference_mode(False), torch.enable_grad(),
              torch.autocast(device.type, enabled=False)):
            x = _one_frame(lstm, dtype)
            lstm.train(True)
            out, _ = cast_lstm(lstm, x, dtype, layout=layout)
            inputs = [x, *(w for w in lstm._flat_weights if w.requires_grad)]  # noqa: SLF001
            torch.autograd.grad(out.float().sum(), inputs)  # type: ignore[union-attr]
            lstm.train(False)
            with torch.no_grad():
                cast_lstm(lstm, x.detach(), dtype, layout=layout)
    finally:
        lstm.train(was_training)


def _one_frame(lstm: nn.LSTM, dtype: torch.dtype) -> torch.Tensor:
    """A probe's input: one frame of zeros in ``dtype`` that requires grad.

    Made where the probe's ``inference_mode(False)`` holds: made inside an evaluation's
    ``inference_mode``, it could not be saved for backward, and the probe would fail for
    that reason instead of the device's.
    """
    return torch.zeros(1, 1, lstm.input_size, dtype=dtype, device=lstm.weight_ih_l0.device,
                       requires_grad=True)


def _probe_cuda(lstm: nn.LSTM, dtype: torch.dtype) -> tuple[Layout | None, str]:
    """:func:`_probe` on CUDA: the bf16 LSTM must run on cuDNN, its weights in place."""
    if not (torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled):
        return None, "cuDNN is not available or is disabled (torch.backends.cudnn.enabled)"
    try:
        layout = cudnn_layout(lstm, dtype)
    except (RuntimeError, NotImplementedError) as err:
        return None, f"cuDNN does not lay out {dtype} LSTM weights ({_first_line(err)})"
    with (torch.inference_mode(False), torch.enable_grad(),
          warnings.catch_warnings(record=True) as seen):
        warnings.simplefilter("always")
        x = _one_frame(lstm, dtype)  # requires grad: a graph to read, whatever the weights
        try:
            out, _ = cast_lstm(lstm, x, dtype, layout=layout)
        except (RuntimeError, NotImplementedError) as err:  # older torch: no bf16 LSTM cell
            return None, f"torch cannot run a {dtype} LSTM here ({_first_line(err)})"
    if not _ran_cudnn(out):  # type: ignore[arg-type]
        return None, (f"torch does not run a {dtype} LSTM on cuDNN here (it needs a build "
                      "against cuDNN >= 9.13 and a GPU of compute capability 8.0 or later)")
    if any(_COPY_WARNING in str(w.message) for w in seen):
        return None, f"cuDNN does not take the {dtype} weights in place"
    return layout, ""


def _first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (torch's errors run to many)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


class AutocastLSTM(nn.LSTM):
    """An ``nn.LSTM`` that runs in the precision autocast means (the module docstring).

    The same module in every other respect: parameters, names, initial values, state dict.
    """

    def forward(self, input: Any, hx: Any = None) -> Any:
        """``nn.LSTM.forward``, in bf16 under bf16 autocast, fp32 on CPU under fp16 autocast."""
        dtype = explicit_dtype(input)
        if dtype is None:
            return super().forward(input, hx)
        data = input.data if isinstance(input, PackedSequence) else input
        with torch.autocast(data.device.type, enabled=False):
            if dtype != torch.float32:
                layout = lstm_layout(self, dtype)
                if layout is not None:
                    return cast_lstm(self, input, dtype, hx, layout)
            return super().forward(_to(input, torch.float32),
                                   None if hx is None else (hx[0].float(), hx[1].float()))


def _to(x: torch.Tensor | PackedSequence, dtype: torch.dtype) -> torch.Tensor | PackedSequence:
    """``x`` in ``dtype`` (a ``PackedSequence``'s data)."""
    if isinstance(x, PackedSequence):
        return PackedSequence(x.data.to(dtype), x.batch_sizes, x.sorted_indices,
                              x.unsorted_indices)
    return x.to(dtype)
