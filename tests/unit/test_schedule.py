import math

import pytest

from hadpsgd.train.schedule import LRSchedule


def test_paper_example():
    # h-adpsgd section 3: base 0.1 at batch 256, global batch 2560, 10 warm-up epochs.
    s = LRSchedule(base_lr=0.1, base_batch=256, global_batch=2560, warmup_epochs=10)
    assert s.peak == pytest.approx(1.0)
    assert [s.lr(e) for e in range(10)] == pytest.approx([0.1 * (e + 1) for e in range(10)])
    assert s.lr(10) == pytest.approx(1.0 / math.sqrt(2))
    assert s.lr(11) == pytest.approx(0.5)
    for e in range(10, 16):
        assert s.lr(e + 1) / s.lr(e) == pytest.approx(1 / math.sqrt(2))


def test_linear_scaling_and_no_warmup():
    s = LRSchedule(base_lr=0.2, base_batch=128, global_batch=512, warmup_epochs=0, anneal=0.5)
    assert s.lr(0) == pytest.approx(0.8)
    assert s.lr(1) == pytest.approx(0.4)
    assert s.lr(3) == pytest.approx(0.1)


def test_rate_never_exceeds_peak_and_is_positive():
    s = LRSchedule(base_lr=0.05, base_batch=64, global_batch=96, warmup_epochs=3)
    rates = [s.lr(e) for e in range(20)]
    assert max(rates) == pytest.approx(s.peak)
    assert all(r > 0 for r in rates)
    with pytest.raises(ValueError):
        s.lr(-1)


def test_gradual_start_climbs_from_the_base_rate_through_the_first_epoch():
    # Goyal et al. 2017: at k times the base batch, start at the base batch's rate and rise
    # linearly to k times it. Here k = 4, one warm-up epoch: 0.5 at the first step, 2.0 at
    # the epoch's end, halfway 1.25; the second epoch is the schedule's own (annealed) rate.
    s = LRSchedule(base_lr=0.5, base_batch=128, global_batch=512, warmup_epochs=1)
    assert s.climbs
    assert s.lr_at(0, 0.0) == pytest.approx(0.5)
    assert s.lr_at(0, 0.5) == pytest.approx(1.25)
    assert s.lr_at(0, 1.0) == pytest.approx(2.0)
    assert s.lr_at(1, 0.0) == pytest.approx(2.0 / math.sqrt(2))
    assert s.lr_at(1, 0.7) == pytest.approx(2.0 / math.sqrt(2))
    rates = [s.lr_at(0, f / 10) for f in range(11)]
    assert rates == sorted(rates)  # never a step back


@pytest.mark.parametrize("kwargs", [
    {"global_batch": 128, "warmup_epochs": 1},  # the base batch: the base rate throughout
    {"global_batch": 64, "warmup_epochs": 1},  # below it: its own, smaller rate
    {"global_batch": 512, "warmup_epochs": 4},  # the paper's staircase starts at the base
    {"global_batch": 512, "warmup_epochs": 0},  # warm-up disabled: the peak from step one
    {"global_batch": 512, "warmup_epochs": 1, "gradual": False},  # asked not to
])
def test_no_climb_where_the_first_epoch_is_not_above_the_base_rate(kwargs):
    s = LRSchedule(base_lr=0.5, base_batch=128, **kwargs)
    assert not s.climbs
    for epoch in range(3):
        assert s.lr_at(epoch, 0.0) == s.lr_at(epoch, 0.9) == s.lr(epoch)
