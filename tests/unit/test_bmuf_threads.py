"""BMUF on learners as threads against a NumPy reference of the paper's equations (bmuf-adam).

The reference (``tests/bmuf_reference.py``, shared with ``test_bmuf_stream.py``) is written
from the paper (Eq. 1-9 for the filter, Eq. 13 and 16-17 for the moments, Algorithm 1 for
Adam's step k), with NumPy versions of torch's SGD-momentum and Adam updates; it does not
import hadpsgd. Here it runs blocking, with one fragment. ``tests/bmuf_suite.py`` runs every
configuration of ``tests/workers/bmuf_common.py`` for 5 blocks and a partial one on float64
models and dumps every rank's state before and after the closing ``finish()`` (after checking
that ``sync()``, which evaluation and checkpoints call, changes nothing), on the in-process
world (:class:`hadpsgd.comm.threads.ThreadJob`): these were four mpirun launches (12 ranks,
each importing torch) and are none now. ``tests/mpi/test_bmuf.py`` runs the 2 x 2 layout under
mpirun once and holds it to these results.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hadpsgd.comm.threads import ThreadJob
from tests.bmuf_reference import Opt, loss_grad, reference
from tests.bmuf_suite import run_suite
from tests.workers.bmuf_common import MAIN, SINGLE, group_batch, init_params

RTOL, ATOL = 1e-5, 1e-9


# ---------------------------------------------------------------------- the runs
def _threads(tmp: Path, n: int, suite: str, groups: list[int], rpn: int) -> Path:
    ThreadJob(n, rpn, timeout=120).run(lambda w: run_suite(w, suite, tmp, groups))
    return tmp


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run per layout, each the whole suite, on learners as threads."""
    mk = tmp_path_factory.mktemp
    return {"flat2": _threads(mk("flat2"), 2, "main", [1, 2], 1),  # N=2, and super-batches
            "flat4": _threads(mk("flat4"), 4, "main", [1], 1),     # N=4
            "hier": _threads(mk("hier"), 4, "main", [1], 2),       # 2 nodes x 2 learners
            "single": _threads(mk("one"), 2, "single", [1], 2)}    # N=1: one node of 2


def _load(runs: dict[str, Path], layout: str, name: str, group: int = 1) -> dict:
    with np.load(runs[layout] / f"{name}-g{group}.npz") as f:
        return dict(f)


def _close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=what)


def _check_against_reference(got: dict, ref: dict, c: dict, ranks_per_super: int) -> None:
    for phase in ("before", "after"):
        r = ref[phase]
        rows = np.arange(got[f"{phase}_local"].shape[0]) // ranks_per_super  # rank -> super
        for key in ["local", "m"] + (["v", "k"] if c["opt"] != "sgd" else []):
            if key not in r:
                continue
            have = got[f"{phase}_{key}"]
            if key == "k":  # the worker dumps one k per rank; the reference one per element
                have = np.repeat(have[:, None], r[key].shape[1], axis=1)
            _close(have, r[key][rows], f"{c['name']} {phase} {key}")
        for g in got[f"{phase}_global"]:
            _close(g, r["global"], f"{c['name']} {phase} global")
    # the comparison is not vacuous: the model moved and the super-learners differ mid-block
    assert not np.allclose(ref["after"]["global"], init_params(), atol=1e-3)
    if ref["before"]["local"].shape[0] > 1:
        assert not np.allclose(ref["before"]["local"][0], ref["before"]["local"][1])


BMUF_CASES = [c for c in MAIN if c["kind"] in ("bmuf", "resume")]
IDS = [c["name"] for c in BMUF_CASES]


@pytest.mark.parametrize("c", BMUF_CASES, ids=IDS)
@pytest.mark.parametrize(("layout", "n_super", "per_super", "ranks_per_super"),
                         [("flat2", 2, 1, 1), ("flat4", 4, 1, 1), ("hier", 2, 2, 2)])
def test_matches_numpy_reference(runs, c, layout, n_super, per_super, ranks_per_super):
    got = _load(runs, layout, c["name"])
    _check_against_reference(got, reference(c, n_super, per_super), c, ranks_per_super)
    assert got["num_syncs"] == 6  # 5 full blocks and the partial one closed by finish()
    assert got["sync_noop"]  # evaluation/checkpoint sync() left the block running


@pytest.mark.parametrize("c", BMUF_CASES, ids=IDS)
def test_hierarchical_2x2_equals_flat_fed_super_batches(runs, c):
    hier, flat = _load(runs, "hier", c["name"]), _load(runs, "flat2", c["name"], group=2)
    for key in hier:
        if key.startswith(("before_", "after_")):
            rows = np.arange(hier[key].shape[0]) // 2  # rank -> node = flat rank
            _close(hier[key], flat[key][rows], f"{c['name']} {key}")
    # and both against the reference fed the same super-batches
    _check_against_reference(flat, reference(c, 2, 2), c, 1)


@pytest.mark.parametrize("layout", ["flat2", "flat4", "hier", "single"])
def test_replicas_identical_after_every_sync(runs, layout):
    for c in MAIN if layout != "single" else SINGLE:
        got = _load(runs, layout, c["name"])
        assert got["replicas_ok"], (layout, c["name"])
        assert got["node_ok"], (layout, c["name"])
        for key in ("after_local", "after_global"):
            assert all(np.array_equal(r, got[key][0]) for r in got[key]), (layout, key)


@pytest.mark.parametrize("layout", ["flat2", "flat4", "hier"])
def test_eta0_zeta1_tau1_sgd_equals_ssgd(runs, layout):
    got = _load(runs, layout, "ssgd-equiv")
    _close(got["after_local"], got["ssgd"], "BMUF eta=0 zeta=1 tau=1 vs SSGD")


@pytest.mark.parametrize("name", ["pavg-sgd", "pavg-adam-local"])
@pytest.mark.parametrize(("layout", "n"), [("flat2", 2), ("flat4", 4)])
def test_eta0_zeta1_is_periodic_model_averaging(runs, name, layout, n):
    c = next(x for x in MAIN if x["name"] == name)
    opts = [Opt(c, init_params().size) for _ in range(n)]
    local = [init_params() for _ in range(n)]
    for t in range(1, c["steps"] + 1):
        local = [o.step(p, loss_grad(p, *group_batch(j, 1, t)))
                 for j, (o, p) in enumerate(zip(opts, local, strict=True))]
        if t % c["tau"] == 0 or t == c["steps"]:
            local = [np.mean(local, axis=0)] * n
    got = _load(runs, layout, name)
    _close(got["after_local"], np.stack(local), name)


@pytest.mark.parametrize("c", SINGLE, ids=[c["name"] for c in SINGLE])
def test_one_super_learner_default_eta_is_plain_adam(runs, c):
    got = _load(runs, "single", c["name"])
    for phase in ("before", "after"):
        for row in range(2):
            _close(got[f"{phase}_local"][row], got["plain"], f"{phase} params")
            _close(got[f"{phase}_m"][row], got["plain_m"], f"{phase} m")
            _close(got[f"{phase}_v"][row], got["plain_v"], f"{phase} v")
        # the global model is theta_n of the last sync: it equals plain Adam once synced
        _close(got["after_global"][row], got["plain"], "global")
    assert float(got["after_k"][0]) == c["steps"]  # eta = 1 - 1/1 = 0: k is not moved
    _check_against_reference(got, reference(c, 1, 2), c, 2)


@pytest.mark.parametrize("layout", ["flat2", "hier"])
@pytest.mark.parametrize("name", ["resume-adam", "resume-sgd"])
def test_mid_block_resume_is_bit_exact(runs, layout, name):
    got = _load(runs, layout, name)
    keys = [k[len("resume_a_"):] for k in got if k.startswith("resume_a_")]
    assert "local" in keys and "global" in keys and "m" in keys
    for k in keys:
        assert np.array_equal(got[f"resume_a_{k}"], got[f"resume_b_{k}"]), (name, k)
