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
