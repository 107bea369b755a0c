"""Mixed precision without processes: the loss scale's rule, autocast, evaluation, flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hadpsgd.algorithms import SSGD
from hadpsgd.algorithms.scaler import MIN_SCALE, LossScaler
from hadpsgd.config import parse_config
from hadpsgd.data import ChunkDataset
from hadpsgd.data.synth import SynthSpec, generate
from hadpsgd.models import build_model
from hadpsgd.precision import autocast, check_precision
from hadpsgd.train.evaluate import evaluate
from tests.fakes import OneLearner


def test_loss_scale_follows_the_papers_rule() -> None:
    """Micikevicius et al. (2018), 3.2: an overflow skips the step and halves the scale;
    N steps without one double it. Written out by hand for N = 3 from a scale of 8."""
    scaler = LossScaler(init_scale=8.0, growth_interval=3)
    verdicts = [True, True, True, False, True, False, False, True, True, True, True]
    expected = [8, 8, 16, 8, 8, 4, 2, 2, 2, 4, 4]
    seen = []
    for finite in verdicts:
        scaler.update(finite)
        seen.append(scaler.scale)
    assert seen == expected
    assert scaler.overflow_steps == 3 and scaler.good_steps == 1


def test_an_overflow_at_the_floor_is_not_the_scales_search() -> None:
    scaler = LossScaler(init_scale=4.0)
    assert [scaler.update(False) for _ in range(3)] == [True, True, False]  # 4, 2, then 1
    assert scaler.scale == MIN_SCALE / 2


def test_loss_scale_state_is_plain_data_and_round_trips() -> None:
    a = LossScaler(growth_interval=5)
    for finite in (False, True, True):
        a.update(finite)
    state = a.state_dict()
    assert all(isinstance(v, (int, float)) for v in state.values())
    b = LossScaler(growth_interval=5)
    b.load_state_dict(state)
    assert (b.scale, b.good_steps, b.overflow_steps) == (2.0**15, 2, 1)


@pytest.mark.parametrize("bad", [{"init_scale": 0.0}, {"init_scale": float("inf")},
                                 {"growth_interval": 0}, {"backoff_factor": 1.0}])
def test_loss_scaler_refuses_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        LossScaler(**bad)


def test_fp16_algorithm_unscales_before_the_update() -> None:
    """An fp16 step with the loss scaled by S updates the weights as the unscaled fp32
    gradient would (SGD without momentum: w - lr * g), to fp16's rounding of the forward."""
    torch.manual_seed(0)
    ref = build_model("tiny", 6, 5)
    model = build_model("tiny", 6, 5)
    model.load_state_dict(ref.state_dict())
    x, y = torch.randn(3, 7, 6), torch.randint(0, 5, (3 * 7,))
    algos = []
    for m, precision in ((ref, "fp32"), (model, "fp16")):
        algo = SSGD(m, torch.optim.SGD(m.parameters(), lr=0.1), OneLearner(),
                    precision=precision, overlap="off")
        with autocast(precision, torch.device("cpu")):
            logits = m(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 5), y)
        (loss * algo.loss_scale).backward()
        result = algo.step(loss.detach())
        assert result.finite and not result.skipped and not result.overflow
        algos.append(algo)
    assert algos[1].loss_scale == 2.0**16 and algos[0].loss_scale == 1.0
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=2e-3, atol=2e-4)


def test_fp16_overflow_skips_and_halves() -> None:
    torch.manual_seed(0)
    model = build_model("tiny", 6, 5)
    before = [p.detach().clone() for p in model.parameters()]
    algo = SSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), OneLearner(),
                precision="fp16", overlap="off")
    with autocast("fp16", torch.device("cpu")):
        logits = model(torch.randn(3, 7, 6))
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 5),
                                             torch.randint(0, 5, (21,)))
    (loss * 2.0**60).backward()  # far past fp16's 65504
    result = algo.step(loss.detach())
    assert result.skipped and result.overflow and not result.finite
    assert algo.loss_scale == 2.0**15 and algo.metrics()["overflow_steps"] == 1.0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32),
                                                  ("bf16", torch.bfloat16),
                                                  ("fp16", torch.float16)])
def test_the_forward_runs_in_the_precision_asked(precision: str, dtype: torch.dtype) -> None:
    # CPU fp16: oneDNN has no fp16 LSTM; the LSTM runs in fp32 and the layers after it fp16.
    model = build_model("tiny", 6, 5)
    with autocast(precision, torch.device("cpu")):
        assert model(torch.randn(2, 4, 6)).dtype == dtype


def test_unknown_precision_is_named() -> None:
    with pytest.raises(ValueError, match="--precision must be one of fp32, bf16, fp16"):
        check_precision("fp8")


def test_flags_reach_the_configuration() -> None:
    cfg = parse_config(["--precision", "bf16", "--grad-wire", "bf16", "--tf32"])
    assert (cfg.precision.precision, cfg.comm.grad_wire, cfg.precision.tf32) == \
        ("bf16", "bf16", True)
    with pytest.raises(SystemExit):
        parse_config(["--precision", "fp8"])
    with pytest.raises(SystemExit):
        parse_config(["--grad-wire", "int8"])


def test_evaluation_under_bf16_keeps_fp32_totals(tmp_path: Path) -> None:
    """The same model evaluated in bf16 gives the fp32 figures to bf16's rounding, and every
    frame is counted exactly (the totals are float64, not bf16)."""
    _, heldout = generate(tmp_path, SynthSpec(feat_dim=12, num_classes=5, train_utts=2,
                                              heldout_utts=7, min_len=9, max_len=40))
    ds = ChunkDataset(heldout, chunk_len=8, expected_feat_dim=12)
    torch.manual_seed(0)
    model = build_model("tiny", 12, 5)
    full = evaluate(model, ds, OneLearner(), batch_size=3)
    half = evaluate(model, ds, OneLearner(), batch_size=3, precision="bf16")
    assert half.frames == full.frames == ds.file.num_frames
    assert abs(half.loss - full.loss) < 0.02 * full.loss
    assert abs(half.accuracy - full.accuracy) < 0.05
