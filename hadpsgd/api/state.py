"""The state :meth:`hadpsgd.Distributed.state_dict` returns, and its checks on loading.

One dict that goes into the user's own checkpoint: the local model, the algorithm's state
(the optimizer's inside it), the sampler's position and, where super-learners part ways
between agreements (BMUF mid-block, fp16's scale per node), each super-learner's own part
(:meth:`~hadpsgd.algorithms.Algorithm.node_state`), keyed by node. The CLI writes those parts
to one file per node (:mod:`hadpsgd.train.shards`); here they are gathered to rank 0 by
each node's on its own ranks by default (a node leader saves its node's file), as the CLI
does, or gathered to rank 0 on request (small models: one file, as with DDP).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hadpsgd.algorithms import Algorithm
from hadpsgd.comm import World

STATE_FORMAT = 1
"""The version of the state's layout."""


def collect(algo: Algorithm, topo: World, sampler: dict[str, Any] | None,
            gather: bool) -> dict[str, Any]:
    """The state of ``algo`` on this rank (collective where there are node parts).

    Args:
        algo: The algorithm (its model and optimizer inside).
        topo: The learners.
        sampler: The sampler's position, if there is one.
        gather: Gather every node's part to rank 0 (node leaders send; the others hold the
            same as their leader).
    """
    node = algo.node_state()  # None on every rank, or on none
    state: dict[str, Any] = {
        "format": STATE_FORMAT, "algo": algo.name,
        "layout": {"size": topo.size, "num_nodes": topo.num_nodes},
        "options": _plain(algo.options),
        "model": compact(algo.model.state_dict()), "algorithm": algo.state_dict(),
        "sampler": sampler,
    }
    if node is not None:
        parts = {topo.node: node}
        if gather and topo.size > 1:
            _gatherable(node)
            sent = topo.gather_object((topo.node, node) if topo.local_rank == 0 else None,
                                      root=0)
            if sent is not None:
                parts = dict(p for p in sent if p is not None)
        state["nodes"] = parts
    return state


GATHER_LIMIT = 1 << 30
"""The largest node part :func:`collect` gathers: the gather pickles every node's part into
one MPI message on rank 0, and MPI counts bytes in a C int (2 GiB; pickling needs a copy)."""


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` (nested dicts, lists and tuples).

    About the size of its ``torch.save`` once its tensors are compact (:func:`compact`).
    """
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _gatherable(node: Any) -> None:
    """Refuse to gather a node part past :data:`GATHER_LIMIT` (every node's is as large).

    Raises:
        ValueError: Naming the size and the sharded state that saves it.
    """
    size = tensor_bytes(node)
    if size > GATHER_LIMIT:
        raise ValueError(f"state_dict(gather=True): each node's part is {size / 2**30:.2f} GiB, "
                         f"too large to gather to rank 0 in one message (at most "
                         f"{GATHER_LIMIT / 2**30:.0f} GiB); call state_dict() (sharded, the "
                         "default) and save each node leader's dict to a file of its own")


def compact(tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` with each tensor that views a larger storage copied into one of its own.

    ``torch.save`` writes a tensor's whole storage, not the part it views. A model's
    parameters are views of the algorithm's flat buffer, and on CUDA the LSTM's weights view
    a second storage of their own (the cuDNN layout's alias of the same memory), so a
    model's state dict saved as it is wrote both whole: 311 MB for ``swb``'s 173 MB. Each
    compact tensor is written once, at its own size.

    Args:
        tensors: A state dict (name -> tensor, or anything else, kept as it is).
    """
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        if (isinstance(value, torch.Tensor)
                and value.untyped_storage().nbytes() > value.numel() * value.element_size()):
            value = value.clone(memory_format=torch.contiguous_format)
        out[name] = value
    return out


def _plain(options: Any) -> dict[str, Any]:
    """The algorithm's options as plain values (what ``torch.load(weights_only=True)`` reads)."""
    plain = (bool, int, float, str, type(None))
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
            if isinstance(getattr(options, f.name), plain)}


def option_changes(state: dict[str, Any], options: Any) -> list[str]:
    """The algorithm's options that differ from the ones ``state`` was saved with, in words.

    A state saved before the options were recorded has none: nothing to compare.
    """
    saved = state.get("options")
    if not isinstance(saved, dict):
        return []
    now = _plain(options)
    return [f"{name}={now[name]!r} (the state has {saved[name]!r})" for name in now
            if name in saved and saved[name] != now[name]]


def node_part(state: Any, algo: str, topo: World) -> dict[str, Any] | None:
    """This rank's node part of ``state`` (None if it has none), after checking ``state``.

    Raises:
        ValueError: For something that is no such state, the state of another algorithm or
            layout, or one without this learner's node part (a non-zero rank's, gathered).
    """
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError("load_state_dict: not a hadpsgd.Distributed state (no 'format' "
                         f"{STATE_FORMAT}); pass what state_dict() returned")
    if state["algo"] != algo:
        raise ValueError(f"load_state_dict: the state is {state['algo']}'s, this is {algo}; "
                         f"make Distributed(..., algo={state['algo']!r})")
    layout = state["layout"]
    if (layout["size"], layout["num_nodes"]) != (topo.size, topo.num_nodes):
        raise ValueError(f"load_state_dict: the state was saved by {layout['size']} learners "
                         f"on {layout['num_nodes']} nodes, this is {topo.size} on "
                         f"{topo.num_nodes}; resume with the same layout")
    nodes = state.get("nodes")
    if nodes is None:
        return None
    if topo.node not in nodes:
        raise ValueError(f"load_state_dict: the state holds the parts of node(s) "
                         f"{sorted(nodes)}, not node {topo.node}'s: load the file node "
                         f"{topo.node}'s leader saved (state_dict() keeps each node's own "
                         "part), or save rank 0's state_dict(gather=True), which holds all")
    return nodes[topo.node]


__all__ = ["GATHER_LIMIT", "STATE_FORMAT", "collect", "compact", "node_part", "option_changes",
           "tensor_bytes"]
