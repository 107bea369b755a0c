"""The LSTM in an explicit dtype (hadpsgd.models.lstm), forced on CPU.

On CUDA under bf16 autocast the BLSTM's LSTM runs outside autocast on weights cast to bf16
(autocast's own cuDNN LSTM would run fp16); tests/gpu/test_gpu_model.py checks it there.
Here the same path is forced on CPU: its result is bf16, its gradients reach the fp32
weights, it is the fp32 model to bf16's rounding, both LSTM layouts take it and agree, and
evaluation and the packed batches of ``hadpsgd.forward`` run through it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from hadpsgd.data import ChunkDataset
from hadpsgd.data.synth import SynthSpec, generate
from hadpsgd.forward.chunks import forward_batch
from hadpsgd.models import BLSTM, AutocastLSTM, cast_lstm
from hadpsgd.models import lstm as lstm_mod
from hadpsgd.models.lstm import Layout, cast_weights, dense_layout, explicit_dtype
from hadpsgd.train.evaluate import evaluate
from tests.fakes import OneLearner

BF16 = torch.bfloat16


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """Every AutocastLSTM under CPU autocast takes the explicit bf16 path, as on CUDA; the
    list collects the dtype of each LSTM module's output (a forward hook's view)."""
    monkeypatch.setattr(lstm_mod, "explicit_dtype",
                        lambda x: BF16 if torch.is_autocast_enabled("cpu") else None)
    seen: list[torch.dtype] = []

    def hook(_: nn.Module, __: object, out: tuple) -> None:
        data = out[0].data if hasattr(out[0], "batch_sizes") else out[0]
        seen.append(data.dtype)

    handle = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: hook(m, i, o) if isinstance(m, AutocastLSTM) else None)
    yield seen
    handle.remove()


def _pair() -> tuple[BLSTM, BLSTM]:
    torch.manual_seed(0)
    stacked = BLSTM(6, 5, hidden=8, layers=3, proj=4)
    torch.manual_seed(0)
    return stacked, BLSTM(6, 5, hidden=8, layers=3, proj=4, per_layer=True)


def test_cast_lstm_is_bf16_and_its_gradients_reach_the_fp32_weights() -> None:
    torch.manual_seed(0)
    lstm = nn.LSTM(6, 8, 2, batch_first=True, bidirectional=True)
    x = torch.randn(3, 7, 6)
    out, (h, c) = cast_lstm(lstm, x, BF16)
    assert out.dtype == h.dtype == c.dtype == BF16
    out.float().square().sum().backward()
    half = [p.grad.clone() for p in lstm.parameters()]
    lstm.zero_grad()
    ref, _ = lstm(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out.float(), ref, rtol=0.02, atol=0.01)
    for p, g in zip(lstm.parameters(), half, strict=True):
        assert g.dtype == torch.float32 and g.abs().sum() > 0
        torch.testing.assert_close(g, p.grad, rtol=0.05, atol=0.05)


def test_cast_lstm_in_fp32_is_the_module_tensor_packed_and_with_states() -> None:
    torch.manual_seed(1)
    lstm = nn.LSTM(6, 8, 2, batch_first=True, bidirectional=True)
    x = torch.randn(3, 5, 6)
    hx = (torch.randn(4, 3, 8), torch.randn(4, 3, 8))
    packed = pack_padded_sequence(x, torch.tensor([5, 2, 4]), batch_first=True,
                                  enforce_sorted=False)
    for inp, state in ((x, None), (x, hx), (packed, None), (packed, hx)):
        got, (h, c) = cast_lstm(lstm, inp, torch.float32, state)
        ref, (rh, rc) = lstm(inp, state)
        torch.testing.assert_close(getattr(got, "data", got), getattr(ref, "data", ref))
        torch.testing.assert_close((h, c), (rh, rc))
    with pytest.raises(ValueError, match="3-D"):
        cast_lstm(lstm, x[0], torch.float32)


def test_cast_weights_lie_where_the_layout_says_in_one_buffer() -> None:
    # A layout like cuDNN's: matrices first, biases after, a gap, padding at the end.
    lstm = nn.LSTM(3, 2, 1, batch_first=True)  # w_ih [8, 3], w_hh [8, 2], b_ih [8], b_hh [8]
    layout = Layout(offsets=(0, 24, 45, 53), total=64)
    weights = cast_weights(lstm, BF16, layout)
    base = weights[0].untyped_storage().data_ptr()
    assert weights[0].untyped_storage().nbytes() == 64 * 2  # what cuDNN's check reads
    for w, p, offset in zip(weights, lstm._flat_weights, layout.offsets, strict=True):
        assert w.untyped_storage().data_ptr() == base and w.is_contiguous()
        assert (w.data_ptr() - base) // 2 == offset
        assert torch.equal(w, p.detach().to(BF16))
    sum(w.float().sum() for w in weights).backward()
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in lstm.parameters())
    assert dense_layout(lstm) == Layout((0, 24, 40, 48), 56)


def test_both_layouts_take_the_path_and_agree(forced: list[torch.dtype]) -> None:
    stacked, per_layer = _pair()
    x = torch.randn(2, 9, 6)
    ref = stacked(x)
    forced.clear()
    outs = []
    for model in (stacked, per_layer):
        with torch.autocast("cpu", dtype=BF16):
            out = model(x)
        assert out.dtype == BF16
        out.float().logsumexp(-1).sum().backward()
        outs.append(out.float())
    assert forced == [BF16] + [BF16] * 3  # one stacked module, then three layers
    torch.testing.assert_close(outs[1], outs[0])
    torch.testing.assert_close(outs[0], ref, rtol=0.05, atol=0.05)
    for (name, a), b in zip(stacked.named_parameters(), per_layer.parameters(), strict=True):
        assert a.grad.dtype == b.grad.dtype == torch.float32, name
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_evaluation_and_packed_forward_take_the_path(forced: list[torch.dtype],
                                                     tmp_path: Path) -> None:
    _, heldout = generate(tmp_path, SynthSpec(feat_dim=6, num_classes=5, train_utts=2,
                                              heldout_utts=4, min_len=9, max_len=30))
    stacked, _ = _pair()
    full = evaluate(stacked, ChunkDataset(heldout, 8), OneLearner(), batch_size=3)
    assert set(forced) == {torch.float32}  # fp32: no autocast, the module as it is
    forced.clear()
    half = evaluate(stacked, ChunkDataset(heldout, 8), OneLearner(), batch_size=3,
                    precision="bf16")
    assert forced and set(forced) == {BF16}
    assert abs(half.loss - full.loss) < 0.02 * full.loss
    forced.clear()
    utts = [torch.randn(n, 6) for n in (7, 3, 11)]
    got = forward_batch(stacked, utts, "whole", precision="bf16")  # one packed batch
    assert forced == [BF16]
    ref = forward_batch(stacked, utts, "whole", precision="fp32")
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == torch.float32  # the log-softmax is fp32 whatever the LSTM ran in
        torch.testing.assert_close(g, r, rtol=0.05, atol=0.05)


def test_autocast_alone_decides_elsewhere() -> None:
    x = torch.randn(2, 3, 6)
    assert explicit_dtype(x) is None
    with torch.autocast("cpu", dtype=BF16):
        assert explicit_dtype(x) is None  # oneDNN runs CPU autocast's bf16 LSTM itself
    with torch.autocast("cpu", dtype=torch.float16):
        assert explicit_dtype(x) == torch.float32  # oneDNN has no fp16 LSTM
    torch.manual_seed(0)
    model = BLSTM(6, 5, hidden=8, layers=2, proj=4)
    with torch.autocast("cpu", dtype=torch.float16):
        assert model.run_lstm(x).dtype == torch.float32 and model(x).dtype == torch.float16


def test_a_gpu_without_bf16_lstm_warns_once_and_runs_fp32(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lstm_mod, "_probe", lambda lstm, dtype: (None, "no cuDNN bf16 here"))
    monkeypatch.setattr(lstm_mod, "_CUDA_LAYOUTS", {})
    monkeypatch.setattr(lstm_mod, "_warned", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for size in (4, 4, 5):  # two shapes: asked twice, told once
            assert lstm_mod.cuda_layout(nn.LSTM(size, 3, batch_first=True), BF16) is None
    assert len(lstm_mod._CUDA_LAYOUTS) == 2
    assert len(seen) == 1 and "runs in fp32" in str(seen[0].message)
    assert "no cuDNN bf16 here" in str(seen[0].message)
