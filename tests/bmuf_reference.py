"""BMUF in NumPy, written from the papers' equations and the design's description, not the code.

One reference for every BMUF test (``tests/unit/test_bmuf_threads.py``,
``tests/mpi/test_bmuf_stream.py``): the blocking filter of the BMUF-Adam paper (Eq. 1-9 for
the model, Eq. 13 and 16-17 for the moments, Algorithm 1 for Adam's step k) is the delayed,
fragmented filter of docs/design.md ("BMUF: overlapped and streaming syncs") with one
fragment and no delay.

Every fragment of the model (whole parameters) has its own block schedule, staggered through
the period (fragment f of F ends its first block after ``(f + 1) * tau // F`` steps, then every
tau); at the end of a fragment's block its super-learners' local models and moments are
averaged; blocking, the filter is applied at once; overlapped, it is applied when the
fragment's next block ends, and the local state is then re-based: ``x += theta_init_n -
x_at_block_end``, ``m += beta**d (m_init_n - m_at_block_end)`` after ``d`` steps, ``reset``
restarts Adam's k at ``d``. With no delay (d = 0) the re-basing sets the start point and the
filtered moments, as the paper does. It imports NumPy and the tests' tiny model only.
"""

from __future__ import annotations

import numpy as np

from tests.workers.bmuf_common import group_batch, init_params, unflatten


def loss_grad(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Gradient of mean((tanh(x W1^T + b1) W2^T + b2 - y)^2) w.r.t. the flat parameters."""
    w1, b1, w2, b2 = unflatten(theta)
    h = np.tanh(x @ w1.T + b1)
    d_out = 2.0 * (h @ w2.T + b2 - y) / y.size
    d_z = (d_out @ w2) * (1.0 - h * h)
    return np.concatenate([(d_z.T @ x).ravel(), d_z.sum(0), (d_out.T @ h).ravel(),
                           d_out.sum(0)])


class Opt:
    """torch's SGD (momentum, Nesterov) and Adam/AdamW (eps 1e-8), Adam's k per element.

    SGD: ``g += wd*p; buf = mu*buf + g`` (``buf = g`` at first); ``p -= lr*(g + mu*buf | buf)``.
    Adam: Algorithm 1, lines 3-8, with a fractional step ``k`` (one per element: each
    fragment moves its own). ``beta`` names the moment buffers (``m``, and ``v`` for Adam).
    """

    def __init__(self, c: dict, n: int) -> None:
        self.c = c
        if c["opt"] == "sgd":
            self.beta = {"m": c["momentum"]} if c["momentum"] else {}
            self.state: dict[str, np.ndarray] = {}  # no buffer until the first step
        else:
            self.beta = {"m": c["b1"], "v": c["b2"]}
            self.state = {"m": np.zeros(n), "v": np.zeros(n)}
        self.k = np.zeros(n)

    def moment(self, key: str, n: int) -> np.ndarray:
        """Buffer ``key`` (zeros where the optimizer has none yet)."""
        return self.state.get(key, np.zeros(n))

    def step(self, p: np.ndarray, g: np.ndarray, rate: float = 1.0) -> np.ndarray:
        """One update at ``rate`` times the configured learning rate."""
        c, s = {**self.c, "lr": self.c["lr"] * rate}, self.state
        if c["opt"] == "sgd":
            g = g + c["wd"] * p
            if c["momentum"]:
                s["m"] = g.copy() if "m" not in s else c["momentum"] * s["m"] + g
                g = g + c["momentum"] * s["m"] if c["sgd_nesterov"] else s["m"]
            return p - c["lr"] * g
        self.k = self.k + 1
        if c["opt"] == "adamw":
            p = p * (1 - c["lr"] * c["wd"])
        else:
            g = g + c["wd"] * p
        b1, b2 = c["b1"], c["b2"]
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        m_hat, v_hat = s["m"] / (1 - b1 ** self.k), s["v"] / (1 - b2 ** self.k)
        return p - c["lr"] * m_hat / (np.sqrt(v_hat) + 1e-8)


def reference(c: dict, n_super: int, per: int = 1,
              bounds: list[tuple[int, int]] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """BMUF over ``n_super`` super-learners of ``per`` learners, fragments ``bounds``.

    Super-learner ``j`` is fed the concatenated batches of virtual learners ``j*per ..
    (j+1)*per - 1``. ``bounds`` are the fragments' element ranges (default: one fragment,
    the whole model); ``c["overlap"]`` applies each average one block late.

    Returns:
        ``before`` and ``after`` the closing sync (``finish()``): ``local`` (per
        super-learner), ``global`` (theta_n), the moment buffers ``m`` (and ``v``) and, for
        Adam, ``k`` per element.
    """
    n = init_params().size
    bounds = bounds or [(0, n)]
    eta = 1 - 1 / n_super if c["eta"] is None else c["eta"]
    zeta, tau, frags = c["zeta"], c["tau"], len(bounds)
    opts = [Opt(c, n) for _ in range(n_super)]
    x = [init_params() for _ in range(n_super)]

    def grad(j: int, t: int) -> np.ndarray:
        return loss_grad(x[j], *group_batch(j * per, per, t))

    # Synchronous SGD over all learners: at the workers' rate, or (``world``) at the rate
    # scaled to the world's batch, n_super super-learners' batches.
    rate = n_super if c["warmup_lr"] == "world" else 1.0
    for t in range(1, c["warmup"] + 1):
        g = np.mean([grad(j, t) for j in range(n_super)], axis=0)
        x = [o.step(p, g, rate) for o, p in zip(opts, x, strict=True)]
    if c["warmup"] and c["warmup_moments"] == "reset":  # a fresh optimizer when BMUF starts
        opts = [Opt(c, n) for _ in range(n_super)]
    theta, start, delta = x[0].copy(), x[0].copy(), np.zeros(n)
    m_init = {key: opts[0].moment(key, n).copy() for key in opts[0].beta}
    rho, steps, syncs = [0.0] * frags, [0] * frags, [0] * frags
    pending: list[dict | None] = [None] * frags

    def launch(f: int) -> None:
        sl = slice(*bounds[f])
        pending[f] = {"tau": steps[f], "d": 0, "x": [xi[sl].copy() for xi in x],
                      "m": {k: [o.moment(k, n)[sl].copy() for o in opts] for k in opts[0].beta}}
        steps[f] = 0

    def apply(f: int) -> None:
        p, sl = pending[f], slice(*bounds[f])
        rho_prev = rho[f]
        rho[f] = eta * rho[f] + p["tau"]                                         # Eq. 4
        # The start point lies eta * rho mini-batches beyond theta_bar: Nesterov's
        # theta_bar + eta * Delta_n (Eq. 9) adds eta * rho_n, the classical
        # theta_bar + eta * Delta_{n-1} (Eq. 6) adds eta * rho_{n-1}.
        er = eta * (rho[f] if c["nesterov"] else rho_prev)
        bar = np.mean(p["x"], axis=0)
        delta[sl] = eta * delta[sl] + zeta * (bar - start[sl])                   # Eq. 1
        theta[sl] = theta[sl] + delta[sl]                                        # Eq. 2
        start[sl] = theta[sl] + eta * delta[sl] if c["nesterov"] else theta[sl]  # Eq. 7 / 5
        for j in range(n_super):
            x[j][sl] = start[sl] + (x[j][sl] - p["x"][j])      # re-based (d = 0: the start)
        for key, beta in opts[0].beta.items():
            m_bar = np.mean(p["m"][key], axis=0)                                 # Eq. 13
            if c["moments"] == "average":
                new = m_bar
            elif c["moments"] == "corrected":
                prev, s = m_init[key][sl], p["tau"]
                e_g = (m_bar - beta ** s * prev) / (1 - beta ** s)                   # Eq. 17
                new = beta ** (s + er) * prev + (1 - beta ** (s + er)) * e_g        # Eq. 16
                m_init[key][sl] = new
            elif c["moments"] == "reset":
                new = np.zeros(bounds[f][1] - bounds[f][0])
            else:
                continue
            for j, o in enumerate(opts):
                o.state[key] = o.moment(key, n)
                o.state[key][sl] += beta ** p["d"] * (new - p["m"][key][j])
                if key == "v":
                    o.state[key][sl] = np.maximum(o.state[key][sl], 0.0)
        for o in opts:
            if c["opt"] != "sgd" and c["moments"] == "corrected":
                o.k[sl] += er                                        # Algorithm 1, line 16
            elif c["opt"] != "sgd" and c["moments"] == "reset":
                o.k[sl] = p["d"]
        syncs[f] += 1
        pending[f] = None

    for t in range(c["warmup"] + 1, c["steps"] + 1):
        x = [o.step(x[j], grad(j, t)) for j, o in enumerate(opts)]
        for f in range(frags):
            steps[f] += 1
            if pending[f] is not None:
                pending[f]["d"] += 1
            first = syncs[f] == 0 and pending[f] is None
            if steps[f] == ((f + 1) * tau // frags if first else tau):
                if pending[f] is not None:
                    apply(f)
                launch(f)
                if not c["overlap"]:
                    apply(f)

    def snap() -> dict[str, np.ndarray]:
        out = {"local": np.stack(x), "global": theta.copy()}
        for key in opts[0].beta:
            out[key] = np.stack([o.moment(key, n) for o in opts])
        if c["opt"] != "sgd":
            out["k"] = np.stack([o.k for o in opts])
        return out

    before = snap()
    assert any(steps), "the configuration must end with a partial block"
    for f in range(frags):  # finish(): what is in flight, then the partial blocks at once
        if pending[f] is not None:
            apply(f)
        if steps[f] > 0:
            launch(f)
            apply(f)
    return {"before": before, "after": snap()}
