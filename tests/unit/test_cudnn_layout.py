"""Each LSTM's weights get a storage of their own inside the flat parameter buffer.

cuDNN runs an LSTM on its weights in place only when they lie in one storage that starts at
the first weight (it reads the storage from offset 0); otherwise it copies every weight at
every forward. The flat buffer of the algorithms must give each LSTM module of the per-layer
BLSTM (the CUDA default) such a storage, on the same memory as the buffer.
"""

import torch

from hadpsgd.comm import FlatBuffer, cudnn_weight_groups
from hadpsgd.models import build_model


def _storage_start(p: torch.Tensor) -> int:
    return p.untyped_storage().data_ptr()


def test_every_lstm_layer_gets_its_own_storage_on_the_flat_buffer():
    model = build_model("small", 20, 7, per_layer=True)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    groups = cudnn_weight_groups(model)
    assert len(groups) == 2 and all(len(g) == 8 for g in groups)  # 2 layers x 2 directions
    flat = FlatBuffer(params, kind="data", own_storage=groups)
    assert flat.aliased == 2
    buf = flat.buffers[torch.float32]
    for group in groups:
        first = group[0]
        # The storage starts at the first weight (offset 0) and holds exactly the group.
        assert first.storage_offset() == 0
        assert _storage_start(first) == first.data_ptr()
        assert first.untyped_storage().nbytes() == sum(p.numel() for p in group) * 4
        addr = first.data_ptr()
        for p in group:  # consecutive, in the module's order, inside the flat buffer
            assert _storage_start(p) == _storage_start(first)
            assert p.data_ptr() == addr
            assert buf.data_ptr() <= addr < buf.data_ptr() + buf.numel() * 4
            addr += p.numel() * 4
    # Same values, and the buffer and the parameters are one memory both ways.
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)
    buf.add_(1.0)
    assert all(torch.equal(p, b + 1) for p, b in zip(params, before, strict=True))
    with torch.no_grad():
        groups[1][3].zero_()
    pos = next(i for i, p in enumerate(params) if p is groups[1][3])
    lo = sum(p.numel() for p in params[:pos])
    assert torch.count_nonzero(buf[lo:lo + groups[1][3].numel()]) == 0


def test_the_model_computes_the_same_through_the_aliased_weights():
    torch.manual_seed(0)
    model = build_model("small", 20, 7, per_layer=True)
    x = torch.randn(3, 21, 20)
    ref = model(x).detach()
    params = [p for p in model.parameters() if p.requires_grad]
    FlatBuffer(params, kind="data", own_storage=cudnn_weight_groups(model))
    assert torch.equal(model(x), ref)
    model(x).sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)


def test_a_group_is_laid_out_in_its_own_order():
    # cuDNN 9 wants an LSTM's matrices first and its biases after them: the group's order,
    # not the module's, decides the layout (and FlatBuffer.params reports it).
    model = build_model("tiny", 6, 3, per_layer=False)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = cudnn_weight_groups(model)[0]
    cudnn_like = [w for w in weights if w.dim() == 2] + [w for w in weights if w.dim() == 1]
    flat = FlatBuffer(params, kind="data", own_storage=[cudnn_like])
    assert flat.aliased == 1
    assert flat.params[:len(cudnn_like)] == cudnn_like
    assert flat.params[len(cudnn_like):] == params[len(weights):]  # the rest as it was
    addr = cudnn_like[0].data_ptr()
    for w in cudnn_like:
        assert w.data_ptr() == addr and _storage_start(w) == cudnn_like[0].data_ptr()
        addr += w.numel() * 4


def test_a_group_with_a_frozen_member_is_left_alone():
    model = build_model("tiny", 6, 3, per_layer=False)
    group = cudnn_weight_groups(model)[0]
    group[1].requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    flat = FlatBuffer(params, kind="data", own_storage=[group])
    assert flat.aliased == 0 and flat.params == params
    buf = flat.buffers[torch.float32]
    assert all(_storage_start(p) == buf.data_ptr() for p in params)
