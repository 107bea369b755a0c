"""Sharded checkpoints: every super-learner's own part written by its node leader.

Where super-learners part ways between agreements (BMUF mid-block, an overlapped or
compressed block sync, fp16's per-node loss scale) each needs its own state to resume
exactly. Gathering those to rank 0 does not scale: swb BMUF-Adam holds ~0.5-0.9 GB per
super-learner, one pickled gather past 2 GiB overflows MPI's int counts (the PyPI wheels have
no large-count routines), and below that rank 0 would hold N of them. So each node leader
writes its own part, ``node-NNNNN.pt``, into the checkpoint's temporary directory; rank 0
learns only each part's size and checksum, writes the common ``state.pt`` and a manifest that
lists and checksums every part, and renames the directory into place. ``latest`` moves only
after that rename, so a checkpoint is complete with all of its parts or is not there at all;
rank 0's memory does not grow with the number of nodes, on writing or on resuming (every rank
reads its own node's part only).

The run directory must be one every host sees (a shared file system), as it must for
``--resume`` already; a leader that cannot see the temporary directory says so by name.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hadpsgd import faults
from hadpsgd.comm import World
from hadpsgd.train.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    has_room,
    save_checkpoint,
    staging_dir,
    write_error,
    write_file,
)

PART_KEY = "node_parts"
"""The key of ``state.pt`` that holds how many node parts the checkpoint has."""


def part_name(node: int) -> str:
    """The file name of node ``node``'s part inside a checkpoint directory."""
    return f"node-{node:05d}.pt"


def _write_part(tmp: Path, path: Path, node: int, obj: Any) -> tuple[dict[str, Any] | None,
                                                                     str | None]:
    """Write node ``node``'s part into ``tmp``: (its manifest entry, None) or (None, why)."""
    if not tmp.is_dir():
        return None, (f"checkpoint {path.name}: node {node}'s leader cannot see the temporary "
                      f"directory {tmp} that rank 0 made; --out-dir must be on a file system "
                      "every host shares (as --resume needs too): point --out-dir there")
    target = tmp / part_name(node)
    try:
        has_room(target, obj)
        return write_file(target, {"node": node, "state": obj}), None
    except CheckpointWriteError as err:
        return None, f"node {node}: {err}"
    except (OSError, RuntimeError) as err:
        failed = write_error(err, path, obj)
        if failed is None:
            raise
        return None, f"node {node}: {failed}"


def write_sharded(topo: World, path: Path, state_of: Callable[[int | None], dict[str, Any]],
                  node_state: Any, keep: int, meta: dict[str, Any],
                  on_phase: Callable[[str], None] | None = None, keep_best: int = 0) -> None:
    """Write checkpoint ``path`` from every rank (collective); rank 0 publishes it.

    Args:
        topo: The run's topology.
        path: The checkpoint directory.
        state_of: Rank 0's common state, given the number of node parts (None: no parts).
        node_state: This rank's :meth:`Algorithm.node_state` (None on every rank, or on none).
        keep: Keep the newest ``keep`` checkpoints (0: all).
        meta: Extra manifest fields.
        on_phase: The fault-injection hook (rank 0's phases, see ``save_checkpoint``).
        keep_best: Pruning spares the ``keep_best`` best by held-out loss (``save_checkpoint``).

    Raises:
        CheckpointWriteError: On rank 0, naming the node and what failed; the previous
            checkpoints are intact (the peers are then ended by the caller's abort).
    """
    step = int(meta.get("step", 0))
    if node_state is None:
        if topo.rank == 0:
            save_checkpoint(state_of(None), path, keep=keep, meta=meta, on_phase=on_phase,
                            keep_best=keep_best)
        return
    made: tuple[str | None, str | None] = (None, None)
    if topo.rank == 0:
        try:
            made = (str(staging_dir(path)), None)
        except CheckpointWriteError as err:
            made = (None, str(err))
    tmp_name, problem = topo.bcast_object(made, root=0)
    entry: dict[str, Any] | None = None
    if tmp_name is not None and topo.local_rank == 0:
        entry, problem = _write_part(Path(tmp_name), Path(path), topo.node, node_state)
        if faults.active():
            faults.hit("ckpt-part", topo.rank, step)  # a leader dies with its part written
    # Only sizes and checksums travel: a few hundred bytes a node, whatever the model.
    gathered = topo.gather_object((topo.node, entry, problem) if topo.local_rank == 0
                                  else None)
    if topo.rank != 0:
        return
    assert gathered is not None
    leaders = [g for g in gathered if g is not None]
    problems = [why for _, _, why in leaders if why]
    if tmp_name is None or problems:
        if tmp_name is not None:
            shutil.rmtree(tmp_name, ignore_errors=True)
        raise CheckpointWriteError("; ".join(dict.fromkeys(problems or [str(problem)])))
    parts = {part_name(node): e for node, e, _ in sorted(leaders, key=lambda g: g[0])}
    save_checkpoint(state_of(topo.num_nodes), path, keep=keep,
                    meta={**meta, PART_KEY: topo.num_nodes}, on_phase=on_phase,
                    staged=Path(tmp_name), parts=parts, keep_best=keep_best)


def load_part(path: Path, node: int) -> Any:
    """Node ``node``'s own part of checkpoint ``path`` (read by every rank of that node).

    Only plain data is unpickled (``weights_only=True``), as for ``state.pt``; the checksums
    were verified when the checkpoint was picked.

    Raises:
        CheckpointError: If the part is missing or unreadable, naming it.
    """
    target = Path(path) / part_name(node)
    try:
        part = torch.load(target, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {target.name}: it was written by "
                              "fewer nodes; resume it with the --ranks-per-node and -np it was "
                              "written with") from None
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"checkpoint {path}: {target.name} could not be read ({err})"
                              ) from err
    if not isinstance(part, dict) or part.get("node") != node or "state" not in part:
        raise CheckpointError(f"checkpoint {path}: {target.name} is not node {node}'s part")
    return part["state"]
