import numpy as np
import pytest

from hadpsgd.algorithms.gossip import partner


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_rounds_are_matchings_with_symmetric_doubly_stochastic_mixing(n):
    for r in range(6):
        mix = np.zeros((n, n))
        for i in range(n):
            p = partner(i, n, r)
            if p is None:
                mix[i, i] = 1.0
                continue
            assert p != i and partner(p, n, r) == i  # matched: no one waits forever
            assert (p - i) % n in (1, n - 1)  # a ring neighbour
            mix[i, i] = mix[i, p] = 0.5
        assert np.allclose(mix, mix.T)
        assert np.allclose(mix.sum(0), 1) and np.allclose(mix.sum(1), 1)
        sitting = sum(partner(i, n, r) is None for i in range(n))
        assert sitting == n % 2  # only an odd ring leaves one out


@pytest.mark.parametrize("n", [3, 4, 5])
def test_alternating_rounds_mix_to_consensus(n):
    w = np.arange(n, dtype=float)
    for r in range(200):
        new = w.copy()
        for i in range(n):
            p = partner(i, n, r)
            if p is not None:
                new[i] = (w[i] + w[p]) / 2
        w = new
    assert np.allclose(w, (n - 1) / 2)


def test_single_super_learner_has_no_partner():
    assert partner(0, 1, 0) is None
