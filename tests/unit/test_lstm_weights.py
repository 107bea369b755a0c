"""One cast of the LSTM weights' storage (hadpsgd.models.lstm_weights; issue 44, item 8(b)).

Where the fp32 weights lie in one storage in the layout the bf16 buffer must have (hadpsgd's
flat parameter buffer gives each LSTM such a storage), the bf16 weights are one cast of that
span forward and one cast of the gradient backward. The reference is the per-weight route
(each weight cast alone, then joined), run on a copy of the module whose weights are separate
tensors: the two must give the same bits, values and gradients, and the one-storage route
must run one cast kernel forward, where the per-weight route runs one per weight.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from hadpsgd.comm.flat import FlatBuffer, cudnn_weight_groups
from hadpsgd.models import BLSTM, cast_lstm
from hadpsgd.models.lstm_weights import Layout, cast_weights, dense_layout, storage_span

BF16 = torch.bfloat16


def _flat_and_loose(seed: int = 0) -> tuple[nn.LSTM, nn.LSTM]:
    """One LSTM whose weights are views of one flat buffer, and a copy with loose weights."""
    torch.manual_seed(seed)
    loose = nn.LSTM(5, 7, 2, batch_first=True, bidirectional=True)
    flat = copy.deepcopy(loose)
    holder = nn.Sequential(nn.Linear(3, 3), flat)  # another parameter before the LSTM's
    FlatBuffer(holder.parameters(), kind="data", own_storage=cudnn_weight_groups(holder))
    FlatBuffer(holder.parameters(), kind="grad")
    return flat, loose


def _flat_casts(fn) -> list[int]:  # noqa: ANN001 - a callable of no arguments
    """The length of each 1-D tensor ``fn`` casts (``aten::_to_copy``), forward and backward.

    Weights are cast flattened; torch's CPU LSTM makes casts of its own in bf16 (of 2-D
    and 3-D tensors, and of the biases, which only the per-weight route casts flat too).
    """
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [e.input_shapes[0][0] for e in prof.events()
            if e.name == "aten::_to_copy" and len(e.input_shapes[0]) == 1]


def test_the_flat_buffer_gives_the_lstm_one_span_and_loose_weights_none() -> None:
    flat, loose = _flat_and_loose()
    layout = dense_layout(flat)
    span = storage_span(flat._flat_weights, layout)  # noqa: SLF001
    assert span is not None and span.numel() == layout.total == sum(
        w.numel() for w in flat._flat_weights)  # noqa: SLF001
    assert span.data_ptr() == flat.weight_ih_l0.data_ptr()
    assert storage_span(loose._flat_weights, dense_layout(loose)) is None  # noqa: SLF001
    # a layout the storage does not follow (a gap the buffer lacks): no span, the old route
    shifted = Layout(tuple(o + 1 for o in layout.offsets), layout.total + 1)
    assert storage_span(flat._flat_weights, shifted) is None  # noqa: SLF001


def test_one_cast_of_the_span_is_the_per_weight_cast_bit_for_bit() -> None:
    flat, loose = _flat_and_loose()
    layout = dense_layout(flat)
    got = cast_weights(flat, BF16, layout)
    want = cast_weights(loose, BF16, layout)
    for g, w, p in zip(got, want, flat._flat_weights, strict=True):  # noqa: SLF001
        assert g.dtype == BF16 and g.shape == p.shape
        assert torch.equal(g, w)
    # one buffer, each weight at its layout's place (cuDNN runs such weights in place)
    base = got[0].data_ptr() - layout.offsets[0] * got[0].element_size()
    for g, off in zip(got, layout.offsets, strict=True):
        assert g.data_ptr() == base + off * g.element_size()


@pytest.mark.parametrize("packed", [False, True])
def test_the_lstm_on_the_span_has_the_per_weight_values_and_gradients(packed: bool) -> None:
    flat, loose = _flat_and_loose(1)
    x = torch.randn(3, 6, 5)
    if packed:
        from torch.nn.utils.rnn import pack_padded_sequence
        inputs = [pack_padded_sequence(x, torch.tensor([6, 4, 2]), batch_first=True)] * 2
    else:
        inputs = [x, x]
    outs = []
    for lstm, inp in zip((flat, loose), inputs, strict=True):
        out, (h, c) = cast_lstm(lstm, inp, BF16)
        data = out.data if packed else out
        (data.float().square().sum() + h.float().sum() + c.float().sum()).backward()
        outs.append(data)
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(flat.parameters(), loose.parameters(), strict=True):
        assert a.grad is not None and a.grad.dtype == torch.float32
        assert torch.equal(a.grad, b.grad) and a.grad.abs().sum() > 0


def test_the_span_route_runs_one_cast_a_direction_where_the_other_runs_one_a_weight() -> None:
    flat, loose = _flat_and_loose(2)
    x = torch.randn(2, 4, 5, dtype=BF16)  # already bf16: the input adds no cast
    hx = tuple(torch.zeros(4, 2, 7, dtype=BF16) for _ in range(2))

    def step(lstm: nn.LSTM) -> None:
        out, _ = cast_lstm(lstm, x, BF16, hx)  # type: ignore[arg-type]
        out.sum().backward()

    total = dense_layout(flat).total
    matrices = [w.numel() for w in flat._flat_weights if w.dim() == 2]  # noqa: SLF001
    span, per_weight = _flat_casts(lambda: step(flat)), _flat_casts(lambda: step(loose))
    assert span.count(total) == 2  # the weights forward, the gradient backward
    assert not set(span) & set(matrices)
    # the other route: each matrix cast forward and its gradient cast backward
    assert sum(n in matrices for n in per_weight) == 2 * len(matrices)


def test_the_blstm_in_training_takes_the_span_route_under_bf16() -> None:
    """The model as hadpsgd trains it (flat buffers), both LSTM layouts: one cast a module."""
    for per_layer in (False, True):
        torch.manual_seed(3)
        model = BLSTM(6, 5, hidden=8, layers=3, proj=4, per_layer=per_layer)
        FlatBuffer(model.parameters(), kind="data", own_storage=cudnn_weight_groups(model))
        lstms = [m for m in model.modules() if isinstance(m, nn.LSTM)]
        for m in lstms:
            assert storage_span(m._flat_weights, dense_layout(m)) is not None  # noqa: SLF001
