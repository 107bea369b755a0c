"""The BLSTM's two LSTM layouts on CUDA (cuDNN): the same function, per-layer gradient release.

Skipped without CUDA. On CPU (tests/unit/test_blstm_layout.py) the layouts are bit-identical;
cuDNN's fused multi-layer kernel and its single-layer calls may round differently, so here
the outputs and gradients agree to float32 tolerance.
"""

import pytest
import torch

from hadpsgd.models.blstm import BLSTM

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def build(per_layer: bool) -> BLSTM:
    torch.manual_seed(0)
    return BLSTM(20, 7, hidden=32, layers=3, proj=16, per_layer=per_layer).cuda()


def test_layouts_are_the_same_function_on_cuda():
    stacked, per_layer = build(False), build(True)
    x = torch.randn(4, 21, 20, device="cuda")
    out_s, out_p = stacked(x), per_layer(x)
    torch.testing.assert_close(out_p, out_s, rtol=1e-4, atol=1e-5)
    out_s.square().mean().backward()
    out_p.square().mean().backward()
    for a, b in zip(stacked.parameters(), per_layer.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-5)


def test_per_layer_releases_the_top_layer_first_on_cuda():
    model = build(True)
    order: list[int] = []
    lstm_params = {id(p): i // 8 for i, p in enumerate(model.lstm.parameters())}
    for p in model.lstm.parameters():
        p.register_post_accumulate_grad_hook(lambda q: order.append(lstm_params[id(q)]))
    model(torch.randn(4, 21, 20, device="cuda")).square().mean().backward()
    torch.cuda.synchronize()
    assert order == sorted(order, reverse=True) and order[0] == 2 and order[-1] == 0


@pytest.mark.parametrize("preset", ["small", "swb"])
def test_per_layer_lstm_on_the_flat_buffer_runs_cudnn_in_place(preset):
    # The algorithms put every parameter in one flat buffer (algorithms.base); each LSTM
    # layer must still see a storage of its own, or cuDNN copies all its weights at every
    # forward and warns "not part of a single contiguous chunk".
    import warnings

    from hadpsgd.comm import FlatBuffer, cudnn_weight_groups
    from hadpsgd.models import build_model

    model = build_model(preset, 260, 64, per_layer=True).cuda()
    groups = cudnn_weight_groups(model)
    flat = FlatBuffer([p for p in model.parameters()], kind="data", own_storage=groups)
    assert flat.aliased == len(groups) == len(model.lstm)
    x = torch.randn(4, 21, 260, device="cuda")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            model(x).logsumexp(-1).mean().backward()
        torch.cuda.synchronize()
    copied = [str(w.message) for w in seen if "contiguous chunk" in str(w.message)]
    assert not copied, copied[0]
