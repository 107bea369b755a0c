"""Shared by the BMUF worker and its tests: the tiny model, its data, and the run configurations.

Plain NumPy only (no hadpsgd import), so the tests' reference can use it without the package.
The model is a 6-5-3 tanh MLP with a mean-squared-error loss; learner ``v``'s batch at step
``t`` is a pure function of ``(v, t)``, so any layout can be fed the same super-batches.
"""

from __future__ import annotations

import numpy as np

SEED = 2024
IN, HID, OUT, BATCH = 6, 5, 3, 4
SHAPES = [(HID, IN), (HID,), (OUT, HID), (OUT,)]  # torch order: W1, b1, W2, b2
NUM_PARAMS = sum(int(np.prod(s)) for s in SHAPES)


def init_params() -> np.ndarray:
    """The initial model as one flat float64 vector (torch parameter order)."""
    return 0.5 * np.random.default_rng([SEED, 7]).standard_normal(NUM_PARAMS)


def unflatten(theta: np.ndarray) -> list[np.ndarray]:
    out, off = [], 0
    for s in SHAPES:
        n = int(np.prod(s))
        out.append(theta[off:off + n].reshape(s))
        off += n
    return out


def learner_batch(v: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Virtual learner ``v``'s batch at (1-based) step ``t``."""
    teacher = np.random.default_rng([SEED, 999])
    a = teacher.standard_normal((HID, IN))
    c = teacher.standard_normal((OUT, HID))
    g = np.random.default_rng([SEED, v, t])
    x = g.standard_normal((BATCH, IN))
    y = np.tanh(x @ a.T) @ c.T + 0.1 * g.standard_normal((BATCH, OUT))
    return x, y


def group_batch(first: int, count: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """The concatenated batches of virtual learners ``first .. first+count-1``."""
    parts = [learner_batch(v, t) for v in range(first, first + count)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def cfg(name: str, opt: str = "adam", moments: str = "corrected", nesterov: bool = True,
        tau: int = 3, eta: float | None = None, zeta: float = 1.0, warmup: int = 0,
        warmup_moments: str = "keep", warmup_lr: str = "worker", kind: str = "bmuf",
        overlap: bool = False, fragments: int = 1, wire: str = "fp32", **opt_kw: float) -> dict:
    """One run: ``warmup + 5 * tau + max(1, tau - 1)`` steps (5 blocks and a partial one).

    The worker then calls ``sync()`` (which must change nothing) and ``finish()``, which
    closes the partial block.
    """
    defaults = {"adam": {"lr": 0.02, "b1": 0.5, "b2": 0.99, "wd": 0.0},
                "adamw": {"lr": 0.02, "b1": 0.9, "b2": 0.99, "wd": 0.1},
                "sgd": {"lr": 0.05, "momentum": 0.9, "sgd_nesterov": 0.0, "wd": 0.0}}[opt]
    return {"name": name, "opt": opt, "moments": moments, "nesterov": nesterov, "tau": tau,
            "eta": eta, "zeta": zeta, "warmup": warmup, "warmup_moments": warmup_moments,
            "warmup_lr": warmup_lr, "kind": kind, "overlap": overlap, "fragments": fragments,
            "wire": wire,
            "steps": warmup + 5 * tau + max(1, tau - 1), **defaults, **opt_kw}


MAIN = [
    cfg("adam-corrected-nbm"),
    cfg("adam-corrected-cbm", nesterov=False),
    cfg("adam-average-nbm", moments="average"),
    cfg("adam-local-nbm", moments="local"),
    cfg("adam-reset-nbm", moments="reset"),
    cfg("adam-corrected-warmup", warmup=4, tau=4),
    cfg("adam-corrected-warmup-reset", warmup=4, tau=4, warmup_moments="reset"),
    cfg("adam-corrected-warmup-world", warmup=4, tau=4, warmup_lr="world"),
    cfg("sgd-corrected-warmup-reset", opt="sgd", warmup=3, warmup_moments="reset"),
    cfg("adamw-corrected-eta-zeta", opt="adamw", eta=0.6, zeta=0.8),
    cfg("sgd-corrected-nbm", opt="sgd"),
    cfg("sgd-corrected-cbm", opt="sgd", nesterov=False),
    cfg("sgd-average-nbm", opt="sgd", moments="average", sgd_nesterov=1.0),
    cfg("sgd-local-cbm", opt="sgd", moments="local", nesterov=False, eta=0.5, zeta=1.2),
    cfg("sgd-reset-nbm", opt="sgd", moments="reset"),
    cfg("sgd-nomomentum-nbm", opt="sgd", momentum=0.0, tau=2),
    # Degenerate cases.
    cfg("pavg-sgd", opt="sgd", momentum=0.0, eta=0.0, zeta=1.0, nesterov=False),
    cfg("pavg-adam-local", moments="local", eta=0.0, zeta=1.0),
    cfg("ssgd-equiv", opt="sgd", moments="corrected", tau=1, eta=0.0, zeta=1.0, kind="ssgd"),
    cfg("resume-adam", kind="resume"),
    cfg("resume-sgd", opt="sgd", moments="average", nesterov=False, kind="resume"),
]
SINGLE = [cfg("adam-corrected-single", kind="plain"), cfg("adam-average-single",
                                                          moments="average", kind="plain")]
# Overlapped (one block late, re-based), fragmented (streaming) and compressed block syncs.
STREAM = [
    cfg("ov-adam-corrected-nbm", tau=4, overlap=True),
    cfg("ov-adam-corrected-cbm", tau=4, overlap=True, nesterov=False),
    cfg("fr3-adam-corrected-nbm", tau=4, fragments=3),
    cfg("ov-fr2-adam-corrected-nbm", tau=4, overlap=True, fragments=2),
    cfg("ov-fr2-adamw-average", opt="adamw", moments="average", tau=4, overlap=True,
        fragments=2),
    cfg("ov-sgd-reset-nbm", opt="sgd", moments="reset", tau=3, overlap=True),
    cfg("ov-adam-reset-warmup", moments="reset", tau=3, overlap=True, warmup=2),
    cfg("ov-fr2-resume", tau=4, overlap=True, fragments=2, kind="resume"),
    cfg("int8-ov-fr2-resume", tau=4, overlap=True, fragments=2, wire="int8", kind="resume"),
    cfg("int8-adam-corrected", tau=4, wire="int8"),
    cfg("bf16-ov-adam-corrected", tau=4, overlap=True, wire="bf16"),
    cfg("int8-ov-fr2-sgd-plain", opt="sgd", momentum=0.0, tau=3, overlap=True, fragments=2,
        wire="int8"),  # no moment buffers at all
]
SUITES = {"main": MAIN, "single": SINGLE, "stream": STREAM}
