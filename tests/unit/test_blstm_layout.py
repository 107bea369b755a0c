"""The per-layer LSTM stack is the stacked BLSTM, module for module: values, order, function.

The reference is always the stacked model (one multi-layer ``nn.LSTM``) built from the same
seed; the per-layer one must match it exactly, and release each layer's gradients as soon as
backward has passed that layer.
"""

import copy
import functools
import re

import pytest
import torch
from torch import nn

from hadpsgd.config import ConfigError, ModelConfig
from hadpsgd.models import BLSTM, build_model
from hadpsgd.models.presets import per_layer_lstm
from hadpsgd.run import parse_config

IN, CLASSES = 6, 5

# (name, builder): the tiny preset and a 3-layer model whose layers > 0 take 2*hidden inputs.
SIZES = [
    ("tiny", lambda per_layer: build_model("tiny", IN, CLASSES, per_layer=per_layer)),
    ("3x8", lambda per_layer: BLSTM(IN, CLASSES, hidden=8, layers=3, proj=4,
                                    per_layer=per_layer)),
]


def _pair(build, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    stacked = build(False)
    torch.manual_seed(seed)
    per_layer = build(True)
    return stacked, per_layer


def _layer_of(name: str) -> int:
    """The LSTM layer of a stacked parameter name (``lstm.weight_hh_l2_reverse`` -> 2)."""
    m = re.fullmatch(r"lstm\.(?:weight|bias)_(?:ih|hh)_l(\d+)(?:_reverse)?", name)
    assert m, name
    return int(m[1])


def _record(fired: list[int], layer: int, _param: torch.Tensor) -> None:
    fired.append(layer)


@pytest.mark.parametrize(("size", "build"), SIZES)
def test_same_seed_same_parameters_in_the_same_order(size, build):
    stacked, per_layer = _pair(build)
    assert isinstance(stacked.lstm, nn.LSTM) and isinstance(per_layer.lstm, nn.ModuleList)
    a, b = list(stacked.parameters()), list(per_layer.parameters())
    assert len(a) == len(b)
    for (name, p), q in zip(stacked.named_parameters(), b, strict=True):
        assert p.shape == q.shape, name
        assert p.dtype == q.dtype and p.requires_grad == q.requires_grad, name
        assert torch.equal(p, q), name  # includes proj/out: the RNG stream after the LSTM
    # The same scalars: a flat buffer of one layout is a flat buffer of the other.
    flat = torch.cat([p.detach().reshape(-1) for p in a])
    assert torch.equal(flat, torch.cat([q.detach().reshape(-1) for q in b]))


def test_another_seed_gives_other_values():
    # Guards the test above against a per-layer model that ignores the seed in a way that
    # happens to match (e.g. both built from one fixed state).
    _, b0 = _pair(SIZES[1][1], seed=0)
    _, b1 = _pair(SIZES[1][1], seed=1)
    assert not torch.equal(next(b0.parameters()), next(b1.parameters()))


@pytest.mark.parametrize(("size", "build"), SIZES)
def test_same_outputs_and_gradients(size, build):
    stacked, per_layer = _pair(build)
    x = torch.randn(3, 11, IN)
    y = torch.randint(0, CLASSES, (3, 11))
    outs = []
    for model in (stacked, per_layer):
        out = model(x)
        nn.functional.cross_entropy(out.reshape(-1, CLASSES), y.reshape(-1)).backward()
        outs.append(out.detach())
    # On CPU both layouts run the same kernels layer by layer: bit-identical.
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for (name, p), q in zip(stacked.named_parameters(), per_layer.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("size", "build"), SIZES)
def test_same_outputs_in_eval_mode_and_after_deepcopy(size, build):
    stacked, per_layer = _pair(build)
    x = torch.randn(2, 7, IN)
    with torch.no_grad():
        ref = stacked.eval()(x)
        torch.testing.assert_close(per_layer.eval()(x), ref, rtol=0, atol=0)
        twin = copy.deepcopy(per_layer)  # ADPSGD's evaluation model is a deep copy
        torch.testing.assert_close(twin(x), ref, rtol=0, atol=0)
        for p in twin.parameters():  # the copy computes with its own tensors
            p.zero_()
        assert not torch.equal(twin(x), ref)
        torch.testing.assert_close(per_layer(x), ref, rtol=0, atol=0)


def test_gradients_become_ready_layer_by_layer():
    stacked, per_layer = _pair(SIZES[1][1])
    fired: list[int] = []
    # The per-layer parameters in stacked order, so stacked names tell each one's layer.
    for (name, _), p in zip(stacked.named_parameters(), per_layer.parameters(), strict=True):
        if name.startswith("lstm."):
            p.register_post_accumulate_grad_hook(functools.partial(_record, fired,
                                                                   _layer_of(name)))
    per_layer(torch.randn(2, 9, IN)).square().mean().backward()
    assert len(fired) == 3 * 8  # every LSTM tensor, once
    # Top layer first, then the one below, ...: a layer's gradients are all ready before
    # backward produces any of the next lower layer's.
    assert fired == sorted(fired, reverse=True), fired
    assert fired[0] == 2 and fired[-1] == 0


@pytest.mark.parametrize("nested", [False, True])
def test_checkpoints_load_across_layouts(nested):
    # auto resolves by device, so a run checkpointed on a GPU may resume on a CPU.
    stacked, per_layer = _pair(SIZES[1][1])
    if nested:  # as under a wrapper, whose state_dict keys carry a prefix
        stacked, per_layer = nn.Sequential(stacked), nn.Sequential(per_layer)
    sd_stacked, sd_per_layer = stacked.state_dict(), per_layer.state_dict()
    assert list(sd_per_layer) == list(sd_stacked)  # the stacked names, in the stacked order
    for k in sd_stacked:
        assert torch.equal(sd_per_layer[k], sd_stacked[k]), k

    torch.manual_seed(7)  # other values, to see the loads take effect
    other_stacked = BLSTM(IN, CLASSES, hidden=8, layers=3, proj=4)
    torch.manual_seed(7)
    other_per_layer = BLSTM(IN, CLASSES, hidden=8, layers=3, proj=4, per_layer=True)
    if nested:
        other_stacked, other_per_layer = nn.Sequential(other_stacked), nn.Sequential(
            other_per_layer)
    other_per_layer.load_state_dict(sd_stacked)  # strict: every key used, none missing
    other_stacked.load_state_dict(sd_per_layer)
    for (name, p), q, r in zip(stacked.named_parameters(), other_per_layer.parameters(),
                               other_stacked.parameters(), strict=True):
        assert torch.equal(q, p) and torch.equal(r, p), name
    x = torch.randn(2, 5, IN)
    with torch.no_grad():
        torch.testing.assert_close(other_per_layer(x), stacked(x), rtol=0, atol=0)


def test_load_still_reports_wrong_keys():
    per_layer = BLSTM(IN, CLASSES, hidden=8, layers=3, proj=4, per_layer=True)
    sd = per_layer.state_dict()
    del sd["lstm.bias_hh_l1_reverse"]
    with pytest.raises(RuntimeError, match="bias_hh_l0_reverse"):
        per_layer.load_state_dict(sd)


@pytest.mark.parametrize(
    ("layout", "device", "expected"),
    # auto is stacked on CUDA too: per-layer cost +28 % a step on an H100 (docs/gpu.md).
    [("auto", "cpu", False), ("auto", "cuda", False), ("auto", torch.device("cuda", 1), False),
     ("stacked", "cuda", False), ("stacked", "cpu", False),
     ("per-layer", "cpu", True), ("per-layer", "cuda", True)],
)
def test_layout_resolution(layout, device, expected):
    assert per_layer_lstm(layout, device) is expected


def test_config_default_is_auto():
    assert ModelConfig().lstm_layout == "auto"
    assert parse_config(["--lstm-layout", "per-layer"]).model.lstm_layout == "per-layer"
    assert parse_config([]).model.lstm_layout == "auto"


def test_config_refuses_unknown_layout(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--lstm-layout", "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--lstm-layout" in err and "bogus" in err and "per-layer" in err
    # A value that bypasses argparse (a config file, a dict) meets the dataclass's check.
    with pytest.raises(ConfigError, match=r"--lstm-layout 'bogus'.*auto, stacked, per-layer"):
        ModelConfig(lstm_layout="bogus")
