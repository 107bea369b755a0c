"""Where an LSTM's weights lie in one buffer, and their cast to the dtype it runs in.

The bf16 LSTM (:mod:`hadpsgd.models.lstm`) runs on a bf16 copy of its fp32 weights made at
every forward, laid out as cuDNN lays out its own flat weights so cuDNN runs them in place.
Where the fp32 weights already lie in one storage in that layout (hadpsgd's flat parameter
buffer gives each LSTM a storage of its own in cuDNN's order on CUDA and the module's order
on CPU: :func:`hadpsgd.comm.flat.cudnn_weight_groups`), the copy is one cast of that span of
the storage, and its backward one cast of the gradient: two kernels a step for each LSTM
module. Otherwise each weight is cast on its own and the pieces are joined (``cat``), and the
backward splits the gradient and casts each piece: about four kernels a weight, ~50 a step
for ``swb``'s stacked LSTM (issue 44, item 8(b)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Layout:
    """Where an LSTM's weights lie in one buffer, in elements.

    Attributes:
        offsets: The start of each weight, in the module's ``_flat_weights`` order.
        total: The buffer's length (cuDNN's may end in padding).
    """

    offsets: tuple[int, ...]
    total: int


def dense_layout(lstm: nn.LSTM) -> Layout:
    """The weights one after another in the module's order (enough off cuDNN)."""
    offsets, end = [], 0
    for w in lstm._flat_weights:  # noqa: SLF001 - the weights torch's LSTM runs on
        offsets.append(end)
        end += w.numel()
    return Layout(tuple(offsets), end)


def cudnn_layout(lstm: nn.LSTM, dtype: torch.dtype) -> Layout:
    """Where cuDNN puts ``lstm``'s weights (a CUDA module) in its flat buffer of ``dtype``.

    Asked of cuDNN itself: it flattens copies of the weights, and each copy's place in the
    buffer it returns is read back (cuDNN 9 puts every matrix first, then the biases).

    Raises:
        RuntimeError: If cuDNN cannot flatten weights of ``dtype``, or left them elsewhere.
    """
    from torch.backends.cudnn import rnn as cudnn_rnn

    copies = [w.detach().to(dtype, copy=True) for w in lstm._flat_weights]  # noqa: SLF001
    with torch.no_grad(), torch.cuda.device_of(copies[0]):
        buf = torch._cudnn_rnn_flatten_weight(  # sets each copy to its view in the buffer
            copies, 4 if lstm.bias else 2, lstm.input_size, cudnn_rnn.get_cudnn_mode("LSTM"),
            lstm.hidden_size, lstm.proj_size, lstm.num_layers, lstm.batch_first,
            bool(lstm.bidirectional))
    base, size = buf.untyped_storage().data_ptr(), buf.element_size()
    offsets = tuple((w.data_ptr() - base) // size for w in copies)
    spans = sorted((o, o + w.numel()) for o, w in zip(offsets, copies, strict=True))
    if (any(w.untyped_storage().data_ptr() != base for w in copies)
            or any(a[1] > b[0] for a, b in zip(spans, spans[1:], strict=False))
            or spans[0][0] < 0 or spans[-1][1] > buf.numel()):
        raise RuntimeError("cuDNN left the LSTM's weights outside its flat buffer")
    return Layout(offsets, buf.numel())


def storage_span(weights: list[torch.Tensor], layout: Layout) -> torch.Tensor | None:
    """The 1-D span of the weights' one storage that ``layout`` describes, or None.

    Not None only when every weight is a contiguous view of one storage, all of one dtype,
    each at ``layout``'s offset from a common start, the whole of ``layout.total`` inside the
    storage: then a cast of the span is the cast weights, each at its place. The span is
    detached: :class:`_CastSpan` carries the gradients to the weights themselves.
    """
    first = weights[0]
    storage = first.untyped_storage()
    if any(w.dtype != first.dtype or w.device != first.device or not w.is_contiguous()
           or w.untyped_storage().data_ptr() != storage.data_ptr() for w in weights):
        return None
    start = first.storage_offset() - layout.offsets[0]
    if start < 0 or (start + layout.total) * first.element_size() > storage.nbytes():
        return None
    if any(w.storage_offset() - start != off
           for w, off in zip(weights, layout.offsets, strict=True)):
        return None
    span = first.new_empty(0)
    span.set_(storage, start, (layout.total,))  # type: ignore[call-overload]
    return span.detach()


class _CastSpan(torch.autograd.Function):
    """One cast of a storage span forward, one cast of the gradient backward.

    ``forward(span, dtype, layout, *weights)``: the weights take no part in the arithmetic
    (the span is their memory); they are inputs so the graph reaches them, and each gets its
    slice of the one cast gradient, a view, in its own shape.
    """

    @staticmethod
    def forward(ctx: Any, span: torch.Tensor, dtype: torch.dtype, layout: Layout,
                *weights: torch.Tensor) -> torch.Tensor:
        ctx.layout = layout
        ctx.shapes = [w.shape for w in weights]
        ctx.source = span.dtype
        return span.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        full = grad.to(ctx.source)
        parts = [full[off:off + shape.numel()].view(shape)
                 for off, shape in zip(ctx.layout.offsets, ctx.shapes, strict=True)]
        return (None, None, None, *parts)


def _pieces(numels: list[int], layout: Layout) -> tuple[list[int], list[int | None]]:
    """``layout`` cut into pieces in buffer order: their sizes, and what each one holds.

    Returns ``(sizes, owner)``: ``owner[j]`` is the index of the weight piece ``j`` is, or None
    for a gap (``layout``'s padding, between weights or at the end).
    """
    sizes: list[int] = []
    owner: list[int | None] = []
    end = 0
    for i in sorted(range(len(numels)), key=layout.offsets.__getitem__):
        if layout.offsets[i] > end:
            sizes.append(layout.offsets[i] - end)
            owner.append(None)
        sizes.append(numels[i])
        owner.append(i)
        end = layout.offsets[i] + numels[i]
    if layout.total > end:
        sizes.append(layout.total - end)
        owner.append(None)
    return sizes, owner


def cast_weights(lstm: nn.LSTM, dtype: torch.dtype, layout: Layout) -> list[torch.Tensor]:
    """``lstm``'s weights in ``dtype``, each a view of one new buffer laid out as ``layout``.

    Differentiable: gradients reach the fp32 weights. Where the weights lie in one storage
    as ``layout`` puts them (:func:`storage_span`), the buffer is one cast of that span;
    else one ``cat`` of each weight's cast cut by one ``split`` (whose backward is one ``cat``
    too, not a zero-filled buffer per weight), gaps of ``layout`` zeros.
    """
    weights = lstm._flat_weights  # noqa: SLF001
    sizes, owner = _pieces([w.numel() for w in weights], layout)
    span = storage_span(weights, layout)
    if span is not None:
        buf = _CastSpan.apply(span, dtype, layout, *weights)
    else:
        buf = torch.cat([weights[0].new_zeros(n, dtype=dtype) if i is None
                         else weights[i].reshape(-1).to(dtype)
                         for n, i in zip(sizes, owner, strict=True)])
    # Cut by one split, not a slice a weight: a slice's backward is a zeroed buffer of the
    # whole span and an add into it for every weight (~100 kernels a step for swb, measured
    # on an H200); a split's is one cat.
    parts = dict(zip(owner, buf.split(sizes), strict=True))
    return [parts[i].view(w.shape) for i, w in enumerate(weights)]
