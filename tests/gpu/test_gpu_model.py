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


# --precision bf16 on CUDA: the LSTM runs in bf16 (hadpsgd.models.lstm), not in the fp16 that
# torch's autocast kernel for cuDNN's RNN casts to whatever dtype autocast was given.

def _cudnn_runs_bf16_lstm() -> bool:
    """Whether torch runs a bf16 LSTM on cuDNN here: torch >= 2.10 (its ``use_cudnn`` for
    RNNs), built against cuDNN >= 9.13, on a GPU of compute capability 8.0 or later."""
    from torch.torch_version import TorchVersion

    built = torch._C._cudnn.getCompileVersion() if torch.backends.cudnn.is_available() else ()
    return (TorchVersion(torch.__version__) >= "2.10" and tuple(built) >= (9, 13, 0)
            and torch.cuda.get_device_capability() >= (8, 0))


def _lstm_output_dtypes(model: BLSTM, precision: str, x: torch.Tensor
                        ) -> tuple[list[torch.dtype], torch.Tensor, list[str]]:
    """The dtype of every LSTM module's output (a forward hook's view) in one forward and
    backward under ``precision``'s autocast, the output, and the warnings printed."""
    import warnings

    from hadpsgd.models import AutocastLSTM
    from hadpsgd.precision import autocast

    seen: list[torch.dtype] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out[0].dtype))
             for m in model.modules() if isinstance(m, AutocastLSTM)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with autocast(precision, x.device):
            out = model(x)
        out.float().logsumexp(-1).mean().backward()
        torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    return seen, out, [str(w.message) for w in caught]


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_lstm_runs_in_the_precision_asked_on_cuda(precision, per_layer):
    model = build(per_layer)
    seen, out, said = _lstm_output_dtypes(model, precision, torch.randn(4, 21, 20, device="cuda"))
    assert len(seen) == (3 if per_layer else 1)
    if precision == "fp16":
        expected = torch.float16  # autocast's own fp16 cuDNN LSTM: fp16 has a loss scale
    elif _cudnn_runs_bf16_lstm():
        expected = torch.bfloat16
    else:  # torch or the GPU cannot: fp32, said once
        expected = torch.float32
        assert any("runs in fp32" in s for s in said), said
    assert set(seen) == {expected}, seen
    assert out.dtype == (torch.bfloat16 if precision == "bf16" else torch.float16)
    assert not [s for s in said if "contiguous chunk" in s]  # cuDNN copied no weights
    for name, p in model.named_parameters():  # gradients reach the fp32 master weights
        assert p.dtype == p.grad.dtype == torch.float32 and p.grad.isfinite().all(), name


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per-layer"])
def test_the_bf16_lstm_is_the_fp32_model_to_bf16_rounding_on_cuda(per_layer):
    x = torch.randn(4, 21, 20, device="cuda")
    ref_model, model = build(per_layer), build(per_layer)
    ref = ref_model(x)
    ref.logsumexp(-1).mean().backward()
    _, out, _ = _lstm_output_dtypes(model, "bf16", x)
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0.1, atol=2e-3, msg=name)


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("preset", ["small", "swb"])
def test_the_bf16_lstm_on_the_flat_buffer_copies_no_weights(preset, per_layer):
    # As training runs it: the fp32 weights in the algorithms' flat buffer, cuDNN's layout.
    from hadpsgd.comm import FlatBuffer, cudnn_weight_groups
    from hadpsgd.models import build_model

    model = build_model(preset, 260, 64, per_layer=per_layer).cuda()
    FlatBuffer(list(model.parameters()), kind="data", own_storage=cudnn_weight_groups(model))
    x = torch.randn(4, 21, 260, device="cuda")
    for _ in range(2):
        seen, _, said = _lstm_output_dtypes(model, "bf16", x)
        assert not [s for s in said if "contiguous chunk" in s], said
    if _cudnn_runs_bf16_lstm():
        assert set(seen) == {torch.bfloat16}


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per-layer"])
def test_the_bf16_weights_are_one_cast_of_the_flat_buffer_on_cuda(per_layer, monkeypatch):
    # Issue 44, item 8(b): on the flat buffer in cuDNN's order, the bf16 weights of each LSTM
    # module are one cast of its span (hadpsgd.models.lstm_weights), with the per-weight
    # route's values and gradients, and cuDNN still runs them in place.
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    from hadpsgd.comm import FlatBuffer, cudnn_weight_groups
    from hadpsgd.models import build_model, lstm_weights
    from hadpsgd.models.lstm import lstm_layout

    if not _cudnn_runs_bf16_lstm():
        pytest.skip("torch or this GPU runs no bf16 LSTM on cuDNN")
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = build_model("swb", 260, 64, per_layer=per_layer).cuda()
        FlatBuffer(list(model.parameters()), kind="data", own_storage=cudnn_weight_groups(model))
        FlatBuffer(list(model.parameters()), kind="grad")
        models.append(model)
    lstms = [m for m in models[0].modules() if isinstance(m, nn.LSTM)]
    totals = []
    for m in lstms:
        layout = lstm_layout(m, torch.bfloat16)
        assert layout is not None
        assert lstm_weights.storage_span(m._flat_weights, layout) is not None, layout
        totals.append(layout.total)
    x = torch.randn(4, 21, 260, device="cuda")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _, out, said = _lstm_output_dtypes(models[0], "bf16", x)
    assert not [s for s in said if "contiguous chunk" in s], said
    flat_casts = [e.input_shapes[0][0] for e in prof.events()
                  if e.name == "aten::_to_copy" and len(e.input_shapes[0]) == 1]
    assert sorted(n for n in flat_casts if n in totals) == sorted(totals * 2), flat_casts
    monkeypatch.setattr(lstm_weights, "storage_span", lambda *_: None)
    _, ref, _ = _lstm_output_dtypes(models[1], "bf16", x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
