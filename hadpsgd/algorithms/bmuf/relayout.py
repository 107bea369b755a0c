"""BMUF's flat state in another process's flat-buffer order, by parameter name.

BMUF keeps theta, theta_init, Delta, the moments' start buffers and a super-learner's local
model as flat tensors, one per dtype, in the order of the algorithm's flat parameter buffer.
That order is the device's: on CUDA each LSTM's weights lie in cuDNN's layout (every
matrix, then the biases), on CPU in the module's order. A checkpoint written on one and
resumed on the other (or by a model whose parameters come in another order) would load
every flat tensor permuted, without an error. So every BMUF state records where each
parameter lies (:meth:`hadpsgd.algorithms.Algorithm.flat_layout`: name, dtype, offset,
size, in buffer order, under the model's state-dict names, which are the stacked LSTM's in
either ``--lstm-layout``), and a state whose order is not this process's is moved here,
parameter by parameter, before it is loaded.

What is packed by position rather than by parameter (an overlapped mean in flight, several
fragments' packs, a compressed wire's rounding errors) is not moved: such a state is
refused, naming the way out.
"""

from __future__ import annotations

from typing import Any

import torch

FlatLayout = list[list[Any]]
"""``[[name, dtype name, offset, numel], ...]`` in flat-buffer order."""


def moves(saved: FlatLayout, now: FlatLayout) -> dict[str, list[tuple[int, int, int]]]:
    """Per dtype name, the ``(saved offset, offset now, numel)`` of every parameter.

    Raises:
        ValueError: If the two layouts do not hold the same parameters (another model).
    """
    before = {(str(n), str(d)): (int(o), int(k)) for n, d, o, k in saved}
    after = {(str(n), str(d)): (int(o), int(k)) for n, d, o, k in now}
    if set(before) != set(after) or any(before[x][1] != after[x][1] for x in after):
        differ = sorted({n for n, _ in set(before) ^ set(after)}
                        | {n for (n, d) in after if (n, d) in before
                           and before[(n, d)][1] != after[(n, d)][1]})
        raise ValueError("the checkpoint's BMUF state is of another model: its parameters "
                         f"differ in {', '.join(differ[:5])}; resume the model it was written "
                         "for")
    out: dict[str, list[tuple[int, int, int]]] = {}
    for (name, dtype), (off, numel) in after.items():
        out.setdefault(dtype, []).append((before[(name, dtype)][0], off, numel))
    return out


def permute(t: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """``t`` (one dtype's flat tensor in the saved order) in the order now."""
    out = torch.empty_like(t)
    for src, dst, n in spans:
        out[dst:dst + n] = t[src:src + n]
    return out


def _flat(d: dict[str, Any], plan: dict[str, list[tuple[int, int, int]]]) -> dict[str, Any]:
    return {k: (permute(v, plan[k]) if k in plan and isinstance(v, torch.Tensor) else v)
            for k, v in d.items()}


def relayout_state(b: dict[str, Any], saved: FlatLayout, now: FlatLayout) -> dict[str, Any]:
    """BMUF's ``state["bmuf"]`` written in layout ``saved``, in layout ``now``.

    Raises:
        ValueError: For another model, or a state packed by position (a mean in flight,
            several fragments), naming what to do.
    """
    plan = moves(saved, now)
    if b.get("pending") or len(b.get("fragments") or []) > 1:
        raise ValueError(
            "the checkpoint's BMUF state was written in another flat-buffer order (the other "
            "kind of device, or another parameter order) with a block mean in flight or "
            "several --bmuf-fragments, which are packed by position: resume it on the kind "
            "of device that wrote it (its model entry loads anywhere, by name)")
    out = dict(b)
    for key in ("global_model", "start_point", "delta"):
        out[key] = _flat(b[key], plan)
    moments = dict(b.get("moments", {}))
    moments["init"] = {k: [permute(t, plan[k]) for t in ts] if k in plan else ts
                       for k, ts in moments.get("init", {}).items()}
    out["moments"] = moments
    return out


def relayout_node(state: dict[str, Any], saved: FlatLayout, now: FlatLayout) -> dict[str, Any]:
    """A super-learner's part (:meth:`BMUF.node_state`) written in layout ``saved``, now.

    Raises:
        ValueError: For a part packed by position (an overlapped mean's snapshots, a
            compressed wire's rounding errors).
    """
    if "params" not in state:
        return state
    if state.get("snaps") or state.get("wire"):
        raise ValueError(
            "the checkpoint's BMUF node part was written in another flat-buffer order with "
            "an overlapped mean or a compressed wire (--bmuf-overlap, --wire), which are "
            "packed by position: resume it on the kind of device that wrote it")
    return {**state, "params": _flat(state["params"], moves(saved, now))}


__all__ = ["FlatLayout", "moves", "permute", "relayout_node", "relayout_state"]
