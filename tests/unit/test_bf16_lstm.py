"""The LSTM in an explicit dtype (hadpsgd.models.lstm), on CPU.

Under bf16 autocast the BLSTM's LSTM runs outside autocast on weights cast to bf16, on CUDA
(autocast's own cuDNN LSTM would run fp16; tests/gpu/test_gpu_model.py checks it there) and
on CPU (autocast's oneDNN LSTM cannot be built on a CPU without bf16 support in oneDNN).
Here, on CPU: its result is bf16, its gradients reach the fp32 weights, it is the fp32 model
to bf16's rounding, both LSTM layouts take it and agree, and evaluation and the packed
batches of ``hadpsgd.forward`` run through it; where the bf16 LSTM cannot run (the probe
fails, forced here on any CPU) the LSTM runs in fp32 with one warning; and with oneDNN
capped at AVX2 (``ONEDNN_MAX_CPU_ISA``, a CPU without native bf16) it runs in bf16.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
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
def lstm_dtypes() -> list[torch.dtype]:
    """The dtype of each AutocastLSTM module's output (a forward hook's view)."""
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


def test_both_layouts_take_the_path_and_agree(lstm_dtypes: list[torch.dtype]) -> None:
    stacked, per_layer = _pair()
    x = torch.randn(2, 9, 6)
    ref = stacked(x)
    lstm_dtypes.clear()
    outs = []
    for model in (stacked, per_layer):
        with torch.autocast("cpu", dtype=BF16):
            out = model(x)
        assert out.dtype == BF16
        out.float().logsumexp(-1).sum().backward()
        outs.append(out.float())
    assert lstm_dtypes == [BF16] + [BF16] * 3  # one stacked module, then three layers
    torch.testing.assert_close(outs[1], outs[0])
    torch.testing.assert_close(outs[0], ref, rtol=0.05, atol=0.05)
    for (name, a), b in zip(stacked.named_parameters(), per_layer.parameters(), strict=True):
        assert a.grad.dtype == b.grad.dtype == torch.float32, name
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_evaluation_and_packed_forward_take_the_path(lstm_dtypes: list[torch.dtype],
                                                     tmp_path: Path) -> None:
    _, heldout = generate(tmp_path, SynthSpec(feat_dim=6, num_classes=5, train_utts=2,
                                              heldout_utts=4, min_len=9, max_len=30))
    stacked, _ = _pair()
    full = evaluate(stacked, ChunkDataset(heldout, 8), OneLearner(), batch_size=3)
    assert set(lstm_dtypes) == {torch.float32}  # fp32: no autocast, the module as it is
    lstm_dtypes.clear()
    half = evaluate(stacked, ChunkDataset(heldout, 8), OneLearner(), batch_size=3,
                    precision="bf16")
    assert lstm_dtypes and set(lstm_dtypes) == {BF16}
    assert abs(half.loss - full.loss) < 0.02 * full.loss
    lstm_dtypes.clear()
    utts = [torch.randn(n, 6) for n in (7, 3, 11)]
    got = forward_batch(stacked, utts, "whole", precision="bf16")  # one packed batch
    assert lstm_dtypes == [BF16]
    ref = forward_batch(stacked, utts, "whole", precision="fp32")
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == torch.float32  # the log-softmax is fp32 whatever the LSTM ran in
        torch.testing.assert_close(g, r, rtol=0.05, atol=0.05)


def test_the_lstm_leaves_autocast_under_bf16_and_cpu_fp16() -> None:
    x = torch.randn(2, 3, 6)
    assert explicit_dtype(x) is None
    with torch.autocast("cpu", dtype=BF16):
        assert explicit_dtype(x) == BF16  # oneDNN cannot build autocast's on every CPU
    with torch.autocast("cpu", dtype=torch.float16):
        assert explicit_dtype(x) == torch.float32  # oneDNN has no fp16 LSTM
    torch.manual_seed(0)
    model = BLSTM(6, 5, hidden=8, layers=2, proj=4)
    with torch.autocast("cpu", dtype=torch.float16):
        assert model.run_lstm(x).dtype == torch.float32 and model(x).dtype == torch.float16


def test_a_device_without_bf16_lstm_warns_once_and_runs_fp32(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lstm_mod, "_probe", lambda lstm, dtype: (None, "no cuDNN bf16 here"))
    monkeypatch.setattr(lstm_mod, "_LAYOUTS", {})
    monkeypatch.setattr(lstm_mod, "_warned", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for size in (4, 4, 5):  # two shapes: asked twice, told once
            assert lstm_mod.lstm_layout(nn.LSTM(size, 3, batch_first=True), BF16) is None
    assert len(lstm_mod._LAYOUTS) == 2
    assert len(seen) == 1 and "runs in fp32" in str(seen[0].message)
    assert "no cuDNN bf16 here" in str(seen[0].message)


@pytest.mark.parametrize("context", ["grad", "no_grad", "inference_mode"])
def test_the_cpu_probe_runs_and_leaves_gradients_and_mode_as_they_were(
        monkeypatch: pytest.MonkeyPatch, context: str) -> None:
    # The probe runs at the first bf16 forward: in training, or in an evaluation under
    # no_grad or inference_mode (a user's), whose tensors cannot be saved for backward.
    lstm = nn.LSTM(6, 8, 2, batch_first=True, bidirectional=True)
    contexts = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
                "inference_mode": torch.inference_mode}
    for training in (True, False):
        lstm.train(training)
        monkeypatch.setattr(lstm_mod, "_LAYOUTS", {})
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback to fp32
            with contexts[context](), torch.autocast("cpu", dtype=BF16):
                assert lstm_mod.lstm_layout(lstm, BF16) == dense_layout(lstm)
        assert lstm.training is training
        assert all(p.grad is None for p in lstm.parameters())


_ONEDNN_ERROR = ("could not create a primitive descriptor for the LSTM forward propagation "
                 "primitive")


class _NoBF16LSTM:
    """``torch._VF`` as on a CPU whose oneDNN cannot build a bf16 LSTM: ``lstm`` raises
    oneDNN's error for bf16 input and runs the real one for any other."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch._VF, name)

    def lstm(self, data: torch.Tensor, *args: object) -> object:
        if data.dtype == BF16:
            raise RuntimeError(_ONEDNN_ERROR)
        return torch._VF.lstm(data, *args)


def test_a_cpu_whose_bf16_lstm_fails_runs_it_in_fp32_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, lstm_dtypes: list[torch.dtype], tmp_path: Path) -> None:
    # The failing case forced on any CPU: every bf16 LSTM raises oneDNN's error, the probe's
    # one frame included; a training step, evaluation and a packed forward still run.
    monkeypatch.setattr(lstm_mod, "_VF", _NoBF16LSTM())
    monkeypatch.setattr(lstm_mod, "_LAYOUTS", {})
    monkeypatch.setattr(lstm_mod, "_warned", False)
    _, heldout = generate(tmp_path, SynthSpec(feat_dim=6, num_classes=5, train_utts=2,
                                              heldout_utts=4, min_len=9, max_len=30))
    stacked, per_layer = _pair()
    x = torch.randn(2, 9, 6)
    ref = stacked(x)
    ref.logsumexp(-1).sum().backward()
    want = [p.grad.clone() for p in stacked.parameters()]
    stacked.zero_grad()
    lstm_dtypes.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for model in (stacked, per_layer):
            with torch.autocast("cpu", dtype=BF16):
                out = model(x)
            assert out.dtype == BF16  # the projection and output layer stay bf16
            out.float().logsumexp(-1).sum().backward()
            torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
        evaluate(stacked, ChunkDataset(heldout, 8), OneLearner(), batch_size=3,
                 precision="bf16")
        forward_batch(stacked, [torch.randn(n, 6) for n in (7, 3)], "whole",
                      precision="bf16")
    assert lstm_dtypes and set(lstm_dtypes) == {torch.float32}  # every LSTM module ran fp32
    assert len(seen) == 1, [str(w.message) for w in seen]
    assert seen[0].category is RuntimeWarning and seen[0].filename == lstm_mod.__file__
    message = str(seen[0].message)
    assert "runs in fp32" in message and _ONEDNN_ERROR in message and "\n" not in message
    assert all(v is None for v in lstm_mod._LAYOUTS.values())
    for p, g in zip(stacked.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0.05, atol=0.05)


# Run in a fresh interpreter: oneDNN reads ONEDNN_MAX_CPU_ISA once, at its first use.
_CAPPED = """
import warnings
import torch
from torch import nn
from hadpsgd.models import BLSTM
if torch.ops.mkldnn._is_mkldnn_bf16_supported():
    raise SystemExit("NATIVE")
try:  # what the issue saw: torch's CPU autocast LSTM on oneDNN (printed, not asserted)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nn.LSTM(6, 8, batch_first=True)(torch.randn(2, 3, 6))
    print("autocast LSTM: ran")
except RuntimeError as err:
    print("autocast LSTM:", str(err).splitlines()[0])
warnings.simplefilter("error", RuntimeWarning)  # a fallback to fp32 fails the test
torch.manual_seed(0)
model = BLSTM(6, 5, hidden=8, layers=2, proj=4)
x = torch.randn(2, 9, 6)
with torch.autocast("cpu", dtype=torch.bfloat16):
    lstm_dtype, out = model.run_lstm(x).dtype, model(x)
out.float().sum().backward()
model.eval()
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    evaluated = model.run_lstm(x).dtype
print("OK", lstm_dtype, evaluated, model.proj.weight.grad.dtype)
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="ONEDNN_MAX_CPU_ISA=AVX2 names an x86 ISA")
def test_bf16_runs_in_bf16_with_onednn_capped_at_avx2() -> None:
    # As on a CPU without native bf16 (AVX2, no AVX-512): oneDNN has no bf16 there, and
    # torch's autocast LSTM ended every bf16 run in oneDNN's error (issue 42).
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    res = subprocess.run([sys.executable, "-c", _CAPPED], env=env, capture_output=True,
                         text=True, timeout=300, check=False,
                         cwd=Path(__file__).resolve().parents[2])
    if res.returncode and "NATIVE" in res.stderr:
        pytest.skip("ONEDNN_MAX_CPU_ISA did not take oneDNN's bf16 away")
    print(res.stdout)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "OK torch.bfloat16 torch.bfloat16 torch.float32" in res.stdout
