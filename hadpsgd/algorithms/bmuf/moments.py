"""The local optimizer's moment buffers at a BMUF block sync (paper bmuf-adam, Eq. 13-18).

Strategies (``adam_moments``):

- ``corrected``: Eq. 18. The averaged moment ``m_bar`` is compatible with the averaged model,
  but the next block starts ``eta * Delta_n`` further, i.e. ``eta * rho_n`` extra mini-batches
  later; so ``m_init_n = a * m_init_{n-1} + b * m_bar`` with the coefficients of
  :func:`corrected_coefficients`, and Adam's bias-correction step ``k += eta * rho_n``.
- ``average``: Eq. 13, ``m_bar`` (``k`` unchanged).
- ``local``: every super-learner keeps its own buffers (nothing is sent).
- ``reset``: the buffers are zeroed and Adam's ``k`` restarts at 0, so that the bias
  correction of the next steps is that of a fresh Adam (which also starts from zero buffers).

Adam/AdamW buffers are ``exp_avg`` (beta1) and ``exp_avg_sq`` (beta2), with ``k`` =
``state["step"]``. SGD's momentum buffer ``buf = mu * buf + (1 - dampening) * g`` is an
exponential moving average scaled by a constant, and Eq. 14-18 are linear in the buffer, so the
same formulas apply with ``beta = mu`` (there is no ``k``). Other optimizers' state stays local.
"""

from __future__ import annotations

from typing import Any

import torch

STRATEGIES: tuple[str, ...] = ("corrected", "average", "local", "reset")

# (parameter, offset in its dtype's flat buffer), in flat-buffer order.
Layout = dict[torch.dtype, list[tuple[torch.nn.Parameter, int]]]
Slots = list[tuple[torch.nn.Parameter, int]]
"""Some parameters of one dtype, with their offsets in its flat buffer (a BMUF fragment)."""


def corrected_coefficients(beta: float, tau: int, eta_rho: float) -> tuple[float, float]:
    """The coefficients ``(a, b)`` of Eq. 18: ``m_init_n = a * m_init_{n-1} + b * m_bar``.

    Args:
        beta: The buffer's decay (Adam's beta1 or beta2, SGD's momentum), in [0, 1).
        tau: Local steps of the block that just ended.
        eta_rho: ``eta * rho_n``, the mini-batches the block momentum adds.
    """
    bt = beta ** tau
    a = bt * (beta ** eta_rho - 1.0) / (1.0 - bt)
    b = (1.0 - beta ** (tau + eta_rho)) / (1.0 - bt)
    return a, b


def _moment_betas(optimizer: torch.optim.Optimizer) -> tuple[list[str], bool, Any]:
    """What the optimizer keeps as moment buffers.

    Returns:
        The state keys of the buffers, whether ``state["step"]`` is Adam's ``k``, and a
        function ``(param_group, key) -> beta``.
    """
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        def adam_beta(group: dict[str, Any], key: str) -> float:
            return float(group["betas"][0 if key == "exp_avg" else 1])

        return ["exp_avg", "exp_avg_sq"], True, adam_beta
    if isinstance(optimizer, torch.optim.SGD) and any(
            g.get("momentum", 0) for g in optimizer.param_groups):
        return ["momentum_buffer"], False, lambda group, key: float(group["momentum"])
    return [], False, None


class BlockMoments:
    """Applies one ``adam_moments`` strategy to the optimizer state at every block sync.

    Args:
        optimizer: The local optimizer.
        strategy: ``corrected``, ``average``, ``local`` or ``reset``.
        layout: Where each parameter sits in its dtype's flat buffer.

    Raises:
        ValueError: For an unknown strategy, or Adam with ``amsgrad`` (its running maximum
            has no block-sync treatment) unless the strategy is ``local``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: str, layout: Layout) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"adam_moments must be one of {', '.join(STRATEGIES)}, "
                             f"got {strategy!r}")
        if strategy != "local" and any(g.get("amsgrad") for g in optimizer.param_groups):
            raise ValueError("BMUF cannot filter Adam's amsgrad maximum buffer; use "
                             "adam_moments='local' or amsgrad=False")
        self.optimizer = optimizer
        self.strategy = strategy
        self.layout = layout
        self.keys, self.has_step, self._beta = _moment_betas(optimizer)
        self.init: dict[torch.dtype, list[torch.Tensor]] = {}
        """``corrected`` only: m_init_{n-1} (and v_init_{n-1}) per dtype, one flat tensor each."""
        self.floor_second_moment = False
        """Restore Adam's invariant ``v >= c * m**2`` after a sync (see :meth:`_floor`): on
        for compressed wires, whose rounding can leave a small ``v`` near zero under a
        non-zero ``m`` (a step of ``m / eps``); exact states never violate it."""

    @property
    def sent_keys(self) -> list[str]:
        """The buffers that travel with the parameters in a block sync."""
        return self.keys if self.strategy in ("corrected", "average") else []

    def _state(self, p: torch.Tensor, key: str) -> torch.Tensor | None:
        value = self.optimizer.state.get(p, {}).get(key)
        return value if isinstance(value, torch.Tensor) else None

    def _betas(self) -> dict[int, dict[str, float]]:
        return {id(p): {k: self._beta(g, k) for k in self.keys}
                for g in self.optimizer.param_groups for p in g["params"]}

    def start(self) -> None:
        """BMUF starts (or restarts after warm-up): the current buffers are m_init_0.

        Without warm-up they are zero (the optimizer has no state yet), as in Algorithm 1.
        After warm-up they are the warmed buffers, which are the true start of the first block,
        so that Eq. 17's estimate of the block's mean gradient stays exact.
        """
        if self.strategy != "corrected" or not self.keys:
            return
        self.init = {}
        for dtype, slots in self.layout.items():
            n = sum(p.numel() for p, _ in slots)
            flats = [torch.zeros(n, dtype=dtype, device=slots[0][0].device) for _ in self.keys]
            self.pack(dtype, flats)
            self.init[dtype] = flats

    def reset_optimizer(self) -> None:
        """Zero every moment buffer and Adam's ``k``: the state of a fresh optimizer.

        (A zero SGD momentum buffer steps exactly like a missing one: ``mu * 0 + g = g``.)
        """
        for slots in self.layout.values():
            for p, _ in slots:
                for key in [*self.keys, "step"] if self.has_step else self.keys:
                    state = self._state(p, key)
                    if state is not None:
                        state.zero_()

    def pack(self, dtype: torch.dtype, segments: list[torch.Tensor],
             slots: Slots | None = None, lo: int = 0) -> None:
        """Copy the sent buffers of ``dtype``'s parameters into ``segments`` (one per key).

        A parameter without state yet contributes zeros (what the optimizer would start from).

        Args:
            dtype: Which flat buffer's parameters.
            segments: One flat tensor per sent key.
            slots: Only these parameters (a BMUF fragment; default: all of ``dtype``).
            lo: Where ``segments`` start in the dtype's flat layout.
        """
        for key, seg in zip(self.sent_keys, segments, strict=True):
            for p, off in self.layout[dtype] if slots is None else slots:
                dst = seg[off - lo:off - lo + p.numel()]
                src = self._state(p, key)
                if src is None:
                    dst.zero_()
                else:
                    dst.copy_(src.reshape(-1))

    def snapshot(self, dtype: torch.dtype, slots: Slots, lo: int,
                 numel: int) -> list[torch.Tensor]:
        """Every moment buffer of ``slots`` (sent or not), flat: the local state at a launch."""
        device = slots[0][0].device
        out = []
        for key in self.keys:
            flat = torch.zeros(numel, dtype=dtype, device=device)
            for p, off in slots:
                src = self._state(p, key)
                if src is not None:
                    flat[off - lo:off - lo + p.numel()].copy_(src.reshape(-1))
            out.append(flat)
        return out

    def apply(self, dtype: torch.dtype, bars: list[torch.Tensor], tau: int,
              eta_rho: float, slots: Slots | None = None, lo: int = 0,
              snaps: list[torch.Tensor] | None = None, since: int = 0) -> None:
        """Set ``dtype``'s buffers from the averaged ones (``bars``, one per sent key).

        Args:
            dtype: Which flat buffer's parameters.
            bars: The across-super-learner averages of the sent buffers.
            tau: Local steps of the block that just ended.
            eta_rho: ``eta * rho_n``.
            slots: Only these parameters (a BMUF fragment; default: all of ``dtype``).
            lo: Where ``bars`` and ``snaps`` start in the dtype's flat layout.
            snaps: Overlapped sync: the local buffers when the block ended (one per key of
                :attr:`keys`), ``since`` steps ago. The buffers ran on from them; being
                exponential averages, they are re-based to the filtered start:
                ``m += beta**since * (m_init_n - snap)`` (exactly what the ``since`` steps
                would have made of ``m_init_n``).
            since: Local steps taken since the block ended.
        """
        if self.strategy == "local" or not self.keys:
            return
        slots = self.layout[dtype] if slots is None else slots
        betas = self._betas()
        for i, key in enumerate(self.keys):
            for p, off in slots:
                state = self._state(p, key)
                sl = slice(off - lo, off - lo + p.numel())
                if self.strategy == "reset":
                    new = torch.zeros(p.numel(), dtype=dtype, device=p.device)
                else:
                    new = bars[i][sl]
                if self.strategy == "corrected":
                    a, b = corrected_coefficients(betas[id(p)][key], tau, eta_rho)
                    new = self.init[dtype][i][off:off + p.numel()].mul_(a).add_(new, alpha=b)
                if state is None:
                    continue
                if snaps is None:
                    state.copy_(new.view_as(state))
                    continue
                shift = (new - snaps[i][sl]).mul_(betas[id(p)][key] ** since)
                state.add_(shift.view_as(state))
                if key == "exp_avg_sq":
                    state.clamp_(min=0.0)  # the re-basing's rounding must not make it negative
        if self.floor_second_moment and self.has_step:
            self._floor(slots, betas)

    def _floor(self, slots: Slots, betas: dict[int, dict[str, float]]) -> None:
        """Raise Adam's ``v`` to ``c * m**2`` where it lies below.

        Both are exponential averages of the same gradients, ``m`` of ``g`` and ``v`` of
        ``g**2``; by Cauchy-Schwarz ``m**2 <= v / c`` with ``c = (1 - b2)(1 - b1**2 / b2) /
        (1 - b1)**2`` whenever ``b1**2 < b2``. A state below that bound is impossible for
        Adam itself (a rounding artefact), and it bounds each coordinate's step by
        ``lr / sqrt(c)`` up to the bias correction.
        """
        for p, _ in slots:
            m, v = self._state(p, "exp_avg"), self._state(p, "exp_avg_sq")
            b1, b2 = betas[id(p)]["exp_avg"], betas[id(p)]["exp_avg_sq"]
            if m is None or v is None or b1 * b1 >= b2:
                continue
            c = (1 - b2) * (1 - b1 * b1 / b2) / (1 - b1) ** 2
            torch.maximum(v, m * m * c, out=v)

    def finish(self, eta_rho: float, params: set[int] | None = None, since: int = 0) -> None:
        """After all dtypes: move Adam's bias-correction step ``k`` as the strategy says.

        Args:
            eta_rho: ``eta * rho_n``.
            params: Only the parameters with these ``id`` (a BMUF fragment; default: all).
            since: Local steps taken since the block ended (overlapped sync): ``reset``
                restarts ``k`` at the steps taken from the zeroed buffers.
        """
        if not self.has_step or self.strategy in ("local", "average"):
            return
        for slots in self.layout.values():
            for p, _ in slots:
                step = self._state(p, "step")
                if step is None or (params is not None and id(p) not in params):
                    continue
                if self.strategy == "corrected":
                    step.add_(eta_rho)  # k += eta * rho_n: fractional from here on
                else:
                    step.fill_(since)

    def state_dict(self) -> dict[str, Any]:
        """The ``corrected`` start buffers m_init / v_init (keyed by dtype name)."""
        return {"init": {str(d): [t.clone() for t in ts] for d, ts in self.init.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s buffers (into this process's dtypes and devices)."""
        saved = state.get("init", {})
        self.init = {}
        for dtype, slots in self.layout.items():
            if str(dtype) in saved:
                device = slots[0][0].device
                self.init[dtype] = [t.to(device=device, dtype=dtype).clone()
                                    for t in saved[str(dtype)]]
        if self.strategy == "corrected" and self.keys and set(self.init) != set(self.layout):
            # Saved under another strategy (or before BMUF started): the optimizer's restored
            # buffers are the start of the current block, as at a fresh start.
            self.start()
