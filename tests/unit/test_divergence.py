"""The divergence guard without processes: the reference, the patience, held-out, resume."""

import math

import pytest

from hadpsgd.train.control import DivergedError, DivergenceGuard, NonFiniteError


def test_first_loss_is_the_reference_and_patience_counts_in_a_row():
    g = DivergenceGuard(4.0, patience=3)
    g.training(2.0, 10)
    assert g.start == 2.0
    for step, loss in ((20, 9.0), (30, 9.0), (40, 1.0), (50, 9.0), (60, 9.0)):
        g.training(loss, step)  # two over, one back under, two over: never three in a row
    with pytest.raises(DivergedError, match=r"training loss 9 at step 70 \(3 control"):
        g.training(9.0, 70)


def test_heldout_over_the_limit_stops_at_once_and_names_the_fix():
    g = DivergenceGuard(5.0, hint="BMUF hint. ")
    g.heldout(1e6, 5)  # no reference yet: nothing to compare with
    g.training(3.0, 10)
    g.heldout(14.9, 100)
    with pytest.raises(DivergedError) as err:
        g.heldout(2289.0, 294)
    msg = str(err.value)
    assert "held-out loss 2289 after step 294" in msg and "763x" in msg
    assert "--max-loss-ratio 5" in msg and "BMUF hint. " in msg and "--lr" in msg
    assert isinstance(err.value, NonFiniteError)  # the run's exit code 4 (diverged)


def test_disabled_and_nonfinite_losses_are_ignored():
    g = DivergenceGuard(0.0)
    for step in range(10):
        g.training(10.0 ** step, step)
        g.heldout(10.0 ** step, step)
    g = DivergenceGuard(2.0)
    g.training(math.nan, 1)
    assert g.start is None  # a NaN is the non-finite guard's business, not a reference
    g.training(1.0, 2)
    for step in range(3, 10):
        g.training(math.inf, step)


def test_state_round_trip_keeps_reference_and_count():
    g = DivergenceGuard(2.0)
    g.training(1.0, 1)
    g.training(5.0, 2)
    h = DivergenceGuard(2.0)
    h.load_state_dict(g.state_dict())
    assert (h.start, h.over) == (1.0, 1)
    h.training(5.0, 3)
    with pytest.raises(DivergedError):
        h.training(5.0, 4)
    fresh = DivergenceGuard(2.0)
    fresh.load_state_dict({})  # a checkpoint from before the guard existed
    assert fresh.start is None and fresh.over == 0


def test_given_reference_is_fixed_and_named():
    g = DivergenceGuard(5.0, reference=math.log(31), what="the loss of a uniform guess (ln 31)")
    g.training(0.5, 10)  # a low first loss does not become the reference
    g.load_state_dict({"start": 0.1, "over": 0})  # nor does an older checkpoint's
    assert g.start == pytest.approx(3.434, abs=1e-3)
    g.heldout(17.0, 20)  # 4.95x: under the limit
    with pytest.raises(DivergedError, match=r"held-out loss 45 after step 30 is 13.1x the "
                                            r"loss of a uniform guess \(ln 31\)"):
        g.heldout(45.0, 30)


@pytest.mark.parametrize("ratio", [5.0, 0.0])
def test_a_nonfinite_heldout_loss_is_divergence_even_without_a_reference(ratio):
    """Evaluation skips nothing: a NaN held-out loss is a model that is no longer finite."""
    g = DivergenceGuard(ratio, hint="H. ")
    for loss in (math.nan, math.inf):
        with pytest.raises(DivergedError, match="held-out loss after step 7 is") as err:
            g.heldout(loss, 7)
        assert "no longer finite" in str(err.value) and "H. " in str(err.value)
